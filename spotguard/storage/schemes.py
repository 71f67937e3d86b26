"""The scheme registry: everything the rest of spotguard knows about a kind of bucket URL.

One entry per scheme (``s3``, ``gs``, ``file``) says which class opens it (imported only when a URL
of its kind is opened, so the trainer hook stays free of storage SDKs), which of the daemon's
settings it takes, how its URLs must look, what to install for it and which permission each
operation needs. ``config`` checks bucket URLs and builds store options from it, the CLI tells a
bucket URL from a local path by it and ``doctor`` takes its hints from it: a new store is its own
module plus one :func:`register` call.

Example::

    register(Scheme(name="mem", opener="my_package.memstore:MemoryStorage", example="mem://name/prefix"))
    storage = open_storage("mem://scratch/run1")
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any
from urllib.parse import ParseResult, urlparse

from spotguard.errors import ConfigError
from spotguard.storage.base import CHECKSUM_MODES, Storage

#: The operations a permission hint is given for (what ``doctor`` tries on the bucket).
OPERATIONS = ("put", "stat", "list", "delete")


def _needs_bucket(url: ParseResult) -> str | None:
    return None if url.netloc else "names no bucket"


@dataclass(frozen=True)
class Scheme:
    """What spotguard knows about one kind of bucket URL."""

    name: str  # the URL scheme, without "://"
    #: "module:Class" (imported at the first open) or the class itself; called as ``opener(url, **options)``.
    opener: str | Callable[..., Storage]
    example: str  # a URL to show in messages: "s3://bucket/prefix"
    #: The daemon's store settings this scheme's class takes, as its keyword names
    #: (``max_concurrency``, ``checksum``); the others are not passed.
    options: frozenset[str] = frozenset()
    #: The ``checksum`` modes that mean something for this store, and why others do not.
    checksum_modes: tuple[str, ...] = CHECKSUM_MODES
    checksum_note: str = ""
    #: A problem with a parsed URL of this scheme ("names no bucket"), or None.
    check_url: Callable[[ParseResult], str | None] = _needs_bucket
    extra: str | None = None  # the pip extra holding its SDK: spotguard[aws]
    permission_hints: Mapping[str, str] = field(default_factory=dict)  # by OPERATIONS

    @property
    def install_hint(self) -> str:
        return f"pip install 'spotguard[{self.extra}]'" if self.extra else ""

    def open(self, url: str, **options: Any) -> Storage:
        opener = self.opener
        if isinstance(opener, str):
            module, _, name = opener.partition(":")
            opener = getattr(importlib.import_module(module), name)
        return opener(url, **{key: value for key, value in options.items() if key in self.options})


_SCHEMES: dict[str, Scheme] = {}
#: The registered schemes by name (read-only view; change it with register/unregister).
SCHEMES: Mapping[str, Scheme] = MappingProxyType(_SCHEMES)


def register(scheme: Scheme) -> None:
    """Add (or replace) a scheme."""
    _SCHEMES[scheme.name] = scheme


def unregister(name: str) -> None:
    _SCHEMES.pop(name, None)


def scheme_of(url: str) -> Scheme | None:
    """The registered scheme of ``url``, or None (a local path, an unknown scheme)."""
    return _SCHEMES.get(urlparse(url).scheme)


def _examples() -> str:
    names = [f"{scheme.name}://" for scheme in _SCHEMES.values()]
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else "".join(names)


def check_bucket_url(url: str, *, key: str = "bucket") -> str:
    """``url`` if a registered scheme opens it; else a :class:`~spotguard.errors.ConfigError`
    naming ``key``."""
    scheme = scheme_of(url)
    if scheme is None:
        raise ConfigError(key, f"{url!r} must start with {_examples()}")
    problem = scheme.check_url(urlparse(url))
    if problem:
        raise ConfigError(key, f"{url!r} {problem}")
    return url


def open_storage(url: str, **options: Any) -> Storage:
    """The store for ``url``: ``options`` are the daemon's store settings (keyword names as in
    :attr:`Scheme.options`); each scheme takes the ones it knows."""
    scheme = scheme_of(url)
    if scheme is None:
        raise ValueError(f"{url!r}: unknown scheme; use {_examples()}")
    return scheme.open(url, **options)


def _file_url(url: ParseResult) -> str | None:
    return None if not url.netloc and url.path.startswith("/") else "must be file:///absolute/path"


register(
    Scheme(
        name="s3",
        opener="spotguard.storage.s3:S3Storage",
        example="s3://bucket/prefix",
        options=frozenset({"max_concurrency", "checksum"}),
        extra="aws",
        permission_hints={
            "put": "allow s3:PutObject (and multipart: s3:AbortMultipartUpload) on the bucket's objects",
            "stat": "allow s3:GetObject on the bucket's objects",
            "list": "allow s3:ListBucket on the bucket (and s3:ListBucketMultipartUploads)",
            "delete": "allow s3:DeleteObject on the bucket's objects (retention deletes old checkpoints)",
        },
    )
)
register(
    Scheme(
        name="gs",
        opener="spotguard.storage.gcs:GcsStorage",
        example="gs://bucket/prefix",
        options=frozenset({"max_concurrency"}),
        checksum_modes=("auto", "crc32c"),
        checksum_note="gs:// always verifies CRC32C (use auto)",
        extra="gcp",
        permission_hints={
            "put": "grant storage.objects.create (roles/storage.objectUser) on the bucket",
            "stat": "grant storage.objects.get on the bucket",
            "list": "grant storage.objects.list on the bucket",
            "delete": "grant storage.objects.delete on the bucket (retention deletes old checkpoints)",
        },
    )
)
register(
    Scheme(
        name="file",
        opener="spotguard.storage.file:FileStorage",
        example="file:///shared/dir",
        check_url=_file_url,
        permission_hints={
            "put": "make the directory writable by the daemon's user",
            "stat": "make the directory readable by the daemon's user",
            "list": "make the directory readable by the daemon's user",
            "delete": "make the directory writable by the daemon's user",
        },
    )
)
