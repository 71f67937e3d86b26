"""Module pairs that once imported each other stay one-way.

Each module is imported in a fresh interpreter (what it pulls in at import time), and its source is read for
imports anywhere in it, function bodies and ``TYPE_CHECKING`` blocks included (what it pulls in later).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import spotguard

PACKAGE = Path(spotguard.__file__).parent

# (importer, modules it must never import): the second of each once imported the first back.
ONE_WAY = [
    ("spotguard.demo", ["spotguard.cli"]),
    ("spotguard.harness", ["spotguard.demo", "spotguard.cli"]),
    ("spotguard.doctor", ["spotguard.cli"]),
    ("spotguard.control", ["spotguard.cli", "spotguard.demo", "spotguard.doctor"]),
    ("spotguard.daemon.metrics", ["spotguard.daemon.app"]),
    ("spotguard.daemon.webhook", ["spotguard.daemon.app"]),
    ("spotguard.daemon.events", ["spotguard.daemon.app"]),
    ("spotguard.emulate.common", ["spotguard.emulate.aws", "spotguard.emulate.gcp", "spotguard.emulate.azure"]),
    # The emulators restate their cloud's wire protocol on their own: a wrong constant must not agree with itself.
    ("spotguard.emulate.aws", ["spotguard.providers.aws"]),
    ("spotguard.emulate.gcp", ["spotguard.providers.gcp"]),
    ("spotguard.emulate.azure", ["spotguard.providers.azure"]),
]


def _source_of(module: str) -> Path:
    return PACKAGE.parent / (module.replace(".", "/") + ".py")


def _imported_names(module: str) -> set[str]:
    """Every module named by an import statement in ``module``'s source, wherever it stands."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(_source_of(module).read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _loaded_after_import(module: str) -> set[str]:
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(result.stdout))


@pytest.mark.parametrize(("module", "forbidden"), ONE_WAY, ids=[module for module, _ in ONE_WAY])
def test_module_does_not_import_its_former_partner(module: str, forbidden: list[str]) -> None:
    loaded = _loaded_after_import(module)
    named = _imported_names(module)
    for other in forbidden:
        assert other not in loaded, f"importing {module} loads {other}"
        assert other not in named, f"{module} imports {other} somewhere in its source"


PEER_TIER = sorted(f"spotguard.peer.{path.stem}" for path in (PACKAGE / "peer").glob("*.py") if path.stem != "__init__")


@pytest.mark.parametrize("module", PEER_TIER)
def test_the_peer_tier_sits_below_the_daemon_and_config(module: str) -> None:
    """The daemon wires the peer tier; the peer tier takes plain values and never reaches back up."""
    assert "spotguard.peer.receiver" in PEER_TIER  # the glob found the package
    above = ("spotguard.daemon", "spotguard.config")
    loaded = sorted(name for name in _loaded_after_import(module) if name.startswith(above))
    named = sorted(name for name in _imported_names(module) if name.startswith(above))
    assert loaded == [] and named == [], f"{module} reaches above itself: {loaded or named}"


def test_the_other_direction_still_works() -> None:
    """The one-way arrows are real: the dispatcher reaches the commands, the daemon its observers."""
    assert "spotguard.control" in _imported_names("spotguard.cli")
    assert "spotguard.daemon.events" in _imported_names("spotguard.daemon.metrics")
    assert "spotguard.providers.registry" in _imported_names("spotguard.emulate.registry")


def test_the_provider_registry_loads_no_http_client() -> None:
    """The config (which the trainer side imports) reads the registry: the clouds' modules load on demand."""
    loaded = _loaded_after_import("spotguard.providers.registry")
    assert "aiohttp" not in loaded and "spotguard.providers.aws" not in loaded
