"""A new storage backend is one module: this test module defines and registers an in-memory store and a
``mem://`` scheme, touching nothing else.

The store implements the required methods, declares one capability (streaming) and sends its large
files through the shared part engine (``initiate`` / ``put_part`` / ``complete`` / ``abort``). A real
in-process daemon, opened from ``bucket = "mem://…"`` through the scheme registry, uploads what a real
``Guard`` saves; ``spotguard verify`` passes on it; a fresh trainer on an empty disk resumes from it,
bit for bit.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from spotguard import Guard
from spotguard.cli import main as cli_main
from spotguard.config import DaemonConfig
from spotguard.crc32c import crc32c_of_bytes
from spotguard.daemon.app import Daemon
from spotguard.errors import ConfigError
from spotguard.harness import wait_for
from spotguard.manifest import MANIFEST
from spotguard.safefile import read_nofollow
from spotguard.storage import (
    Capability,
    ObjectExists,
    ObjectInfo,
    ObjectNotFound,
    Scheme,
    Storage,
    StorageError,
    StoreDefaults,
    open_storage,
    register,
    unregister,
)
from spotguard.storage.base import Progress, Sink, read_exactly
from spotguard.storage.stream import PartStream, StreamPool, send_file
from tests.daemonthread import DaemonThread

WAIT = 30.0
PART = 1 << 20  # small parts, so a checkpoint of a few MiB goes in several

# --- the store: everything a backend module holds --------------------------------------------------


@dataclass
class Bucket:
    objects: dict[str, bytes]
    lock: threading.Lock
    parts_sent: int = 0  # across every upload: shows the part engine ran
    uploads_open: int = 0  # multipart uploads initiated and neither completed nor aborted


class MemoryStorage(StoreDefaults):
    """``mem://name/prefix``: a dict per bucket name, shared by every instance in the process."""

    capabilities: ClassVar[frozenset[Capability]] = frozenset({Capability.STREAMING})
    buckets: ClassVar[dict[str, Bucket]] = {}

    def __init__(self, url: str, *, max_concurrency: int = 4) -> None:
        self.url = url
        name, _, prefix = url.removeprefix("mem://").partition("/")
        self.prefix = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
        self.bucket = self.buckets.setdefault(name, Bucket({}, threading.Lock()))
        self._pool = StreamPool(max_concurrency, "mem-part")

    def _full(self, key: str) -> str:
        if not key or key.startswith("/"):
            raise ValueError(f"key must be relative and non-empty: {key!r}")
        return self.prefix + key

    def put_file(self, local: Path, key: str, *, crc32c: str, progress: Progress | None = None) -> None:
        size = local.stat().st_size
        plan = [(n + 1, offset, min(PART, size - offset)) for n, offset in enumerate(range(0, size, PART))]
        upload = lambda fd: MemoryUpload(self, self._full(key), size, fd)  # noqa: E731
        send_file(local, size, crc32c, what=f"mem: {key}", plan=plan, pool=self._pool.get(), initiate=upload)
        if progress:
            progress(size)

    def begin_stream(self, key: str, size: int, fd: int, *, progress: Progress | None = None) -> PartStream | None:
        if size < 2 * PART:
            return None
        plan = [(n + 1, offset, min(PART, size - offset)) for n, offset in enumerate(range(0, size, PART))]
        upload = lambda: MemoryUpload(self, self._full(key), size, fd)  # noqa: E731
        return PartStream(f"mem: {key}", size, plan, self._pool.get(), upload, progress=progress)

    def get_file(self, key: str, local: Path) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(self.read_bytes(key))

    def read_range(self, key: str, offset: int, length: int, sink: Sink) -> None:
        sink.write(self.read_bytes(key)[offset : offset + length])

    def put_bytes_if_absent(self, key: str, data: bytes, *, crc32c: str) -> None:
        if crc32c_of_bytes(data) != crc32c:
            raise StorageError(f"mem: {key}: the bytes are not {crc32c}")
        with self.bucket.lock:
            if self._full(key) in self.bucket.objects:
                raise ObjectExists(f"mem: {key}")
            self.bucket.objects[self._full(key)] = data

    def read_bytes(self, key: str) -> bytes:
        with self.bucket.lock:
            data = self.bucket.objects.get(self._full(key))
        if data is None:
            raise ObjectNotFound(f"mem: {key}")
        return data

    def stat(self, key: str) -> ObjectInfo | None:
        with self.bucket.lock:
            data = self.bucket.objects.get(self._full(key))
        return None if data is None else ObjectInfo(key, len(data), crc32c_of_bytes(data), datetime.now(UTC))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        with self.bucket.lock:
            items = sorted(self.bucket.objects.items())
        for full, data in items:
            if full.startswith(self.prefix + prefix):
                yield ObjectInfo(full[len(self.prefix) :], len(data), None, datetime.now(UTC))

    def delete(self, keys: Iterable[str]) -> None:
        with self.bucket.lock:
            for key in keys:
                self.bucket.objects.pop(self._full(key), None)

    def is_transient(self, exc: BaseException) -> bool:
        return False

    def close(self) -> None:
        self._pool.close()


class MemoryUpload:
    """One multipart upload: parts kept apart until ``complete`` joins them into the object."""

    def __init__(self, store: MemoryStorage, full: str, size: int, fd: int) -> None:
        self.store, self.full, self.size, self.fd = store, full, size, fd
        self.parts: dict[int, bytes] = {}
        with store.bucket.lock:
            store.bucket.uploads_open += 1

    def put_part(self, number: int, offset: int, length: int) -> tuple[int, Any]:
        data = read_exactly(self.fd, offset, length, f"mem: {self.full}")
        with self.store.bucket.lock:
            self.parts[number] = data
            self.store.bucket.parts_sent += 1
        return int(crc32c_of_bytes(data), 16), number

    def complete(self, tokens: list[Any], crc: int) -> None:
        data = b"".join(self.parts[number] for number in tokens)
        if len(data) != self.size:
            raise StorageError(f"mem: {self.full}: {len(data)} bytes joined, {self.size} expected")
        with self.store.bucket.lock:
            self.store.bucket.objects[self.full] = data
            self.store.bucket.uploads_open -= 1

    def abort(self) -> None:
        with self.store.bucket.lock:
            self.parts.clear()
            self.store.bucket.uploads_open -= 1


MEM = Scheme(name="mem", opener=MemoryStorage, example="mem://name/prefix", options=frozenset({"max_concurrency"}))


# --- the test ----------------------------------------------------------------------------------------


@pytest.fixture
def mem_scheme() -> Iterator[None]:
    register(MEM)
    try:
        yield
    finally:
        unregister("mem")
        MemoryStorage.buckets.clear()


class MemoryDaemon(DaemonThread):
    """The daemon, its store opened from the config's URL by the registry."""

    def __init__(self, config: DaemonConfig) -> None:
        super().__init__(config, wait=WAIT)
        assert config.bucket is not None
        self.storage: Storage = open_storage(config.bucket, **config.storage_options())

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Daemon]:
        yield Daemon(self.config, provider="none", storage=self.storage)


def _state(seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "model": {"weight": torch.randn(1024, 1024, generator=generator), "bias": torch.randn(16, generator=generator)},
        "progress": {"step": seed},
    }


def test_a_store_registered_from_one_module_saves_uploads_verifies_and_restores(
    tmp_path: Path, mem_scheme: None, capsys: pytest.CaptureFixture[str]
) -> None:
    url = "mem://checkpoints/run1"
    config = DaemonConfig(
        bucket=url,
        provider="none",
        socket=tmp_path / "daemon.sock",
        checkpoint_dir=tmp_path / "nvme",
        state_dir=tmp_path / "state",
    )
    assert config.storage_options() == {"max_concurrency": config.upload_concurrency}
    bucket = MemoryStorage.buckets.setdefault("checkpoints", Bucket({}, threading.Lock()))
    state = _state(7)

    with MemoryDaemon(config) as running:
        assert isinstance(running.storage, MemoryStorage)
        guard = Guard(checkpoint_dir=config.checkpoint_dir, socket=config.socket, handle_sigterm=False)
        try:
            wait_for(guard.client.welcomed.is_set, WAIT, "the trainer to be welcomed")
            path = guard.save(state, 7)
            manifest_key = f"run1/{path.name}/{MANIFEST}"
            wait_for(lambda: manifest_key in bucket.objects, WAIT, "the checkpoint's commit in mem://")
        finally:
            guard.close()

    # Every file in the bucket is the file on disk; the 4 MiB weight went in parts, none left open.
    for local in path.rglob("*"):
        if local.is_file():
            assert bucket.objects[f"run1/{path.name}/{local.relative_to(path).as_posix()}"] == read_nofollow(local)
    assert bucket.parts_sent >= 4
    assert bucket.uploads_open == 0

    capsys.readouterr()
    assert cli_main(["verify", url]) == 0
    assert f"{path.name}: ok" in capsys.readouterr().out

    fresh = Guard(checkpoint_dir=tmp_path / "fresh-nvme", bucket=url, socket=tmp_path / "no-daemon.sock")
    try:
        restored = _state(0)
        assert fresh.resume(restored) == 7
    finally:
        fresh.close()
    assert torch.equal(restored["model"]["weight"], state["model"]["weight"])
    assert torch.equal(restored["model"]["bias"], state["model"]["bias"])
    assert restored["progress"] == {"step": 7}


def test_an_unregistered_scheme_is_refused_with_the_registered_ones_named() -> None:
    with pytest.raises(ConfigError, match=r"must start with s3://, gs:// or file://"):
        DaemonConfig(bucket="mem://checkpoints/run1")
