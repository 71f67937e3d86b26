"""One error root: every exception class spotguard defines derives from ``SpotguardError``.

The public errors keep their historical standard bases as well, so a user's ``except OSError`` or
``except ValueError`` still catches what it caught before.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import spotguard
from spotguard.errors import FatalError, SpotguardError, TransientError

# Modules that import a framework (Lightning, transformers) at import time: their errors are checked
# through the names they share with the trainer package.
FRAMEWORK_MODULES = ("spotguard.integrations.lightning", "spotguard.integrations.transformers")


def spotguard_modules() -> list[str]:
    names = [
        info.name
        for info in pkgutil.walk_packages(spotguard.__path__, prefix="spotguard.")
        if info.name not in FRAMEWORK_MODULES and not info.name.endswith("__main__")
    ]
    return sorted(names)


def exception_classes() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for name in spotguard_modules():
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == name
                and not attr.startswith("_")
            ):
                found[f"{name}.{attr}"] = value
    return found


def test_every_error_spotguard_defines_derives_from_the_root() -> None:
    classes = exception_classes()
    assert len(classes) > 10  # the walk found the package's errors
    outside = sorted(name for name, cls in classes.items() if not issubclass(cls, SpotguardError))
    assert outside == []


@pytest.mark.parametrize(
    ("public", "standard_base"),
    [
        ("spotguard.space.SpotguardDiskFull", OSError),
        ("spotguard.trainer.contents.SpotguardMismatch", ValueError),
        ("spotguard.trainer.dist.RankFailed", RuntimeError),
        ("spotguard.config.ConfigError", ValueError),
        ("spotguard.protocol.ProtocolError", ValueError),
        ("spotguard.manifest.ManifestError", ValueError),
    ],
)
def test_public_errors_keep_their_standard_base(public: str, standard_base: type[BaseException]) -> None:
    module_name, _, attr = public.rpartition(".")
    cls = getattr(importlib.import_module(module_name), attr)
    assert issubclass(cls, SpotguardError)
    assert issubclass(cls, standard_base)


def test_the_branches_are_distinct() -> None:
    assert not issubclass(TransientError, FatalError)
    assert not issubclass(FatalError, TransientError)
    assert issubclass(TransientError, SpotguardError) and issubclass(FatalError, SpotguardError)
