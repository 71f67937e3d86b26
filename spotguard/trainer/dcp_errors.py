"""DCP's failures as errors the rest of spotguard can act on.

DCP agrees on a failure itself and raises ``CheckpointException`` on every rank. That is a
``BaseException``: no ``except Exception`` sees it, so a full disk in a periodic save ended the
training run, the daemon was never told the save failed, and the partial directory stayed. It also
carries each rank's error as a copy made by pickling, which drops the cause: a full disk shows up as
``RuntimeError: unexpected pos`` from ``torch.save``'s zip writer, and a writer thread's own error
is only printed. So the file system under DCP's writer keeps the first full-disk error of this
rank, and :func:`dcp_errors` raises this rank's own error (that one first), or
:class:`FailedElsewhere` on a rank whose part went well.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

from spotguard.safefile import SaveCancelled
from spotguard.space import disk_full_behind
from spotguard.trainer import dist


class WatchedFileSystem(FileSystem):
    """DCP's own file system, watched: it keeps the first full-disk error raised under any of its
    streams (:attr:`full`) and, with ``cancel``, its streams drop every write once that is set and
    note it (:attr:`cancelled`). Dropped, not refused: an error in one of DCP's writer threads is
    only printed (a traceback per thread at every cancellation), and DCP's remaining writes cost
    nothing; the caller then cancels the save, and the ranks agree on it
    (:func:`spotguard.trainer.dist.agree_ok`)."""

    def __init__(self, cancel: threading.Event | None = None) -> None:
        super().__init__()
        self.full: OSError | None = None
        self.cancel = cancel
        self.cancelled = False  # a write here was dropped for ``cancel``: the files are not the state

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
        try:
            if self.cancel is None or "w" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
            else:
                with _CancellableWriter(io.FileIO(path, mode), self.cancel, self) as stream:
                    yield stream
        except Exception as exc:
            self.full = self.full or disk_full_behind(exc)
            raise


class _CancellableWriter(io.BufferedWriter):
    """A file DCP writes, which drops each write once its file system's ``cancel`` is set: a periodic
    save pre-empted by an urgent one stops writing within one of DCP's writes (a tensor, at most)."""

    def __init__(self, raw: io.FileIO, cancel: threading.Event, watched: WatchedFileSystem) -> None:
        super().__init__(raw)
        self._cancel = cancel
        self._watched = watched

    def write(self, data: Any) -> int:
        if self._cancel.is_set():
            self._watched.cancelled = True
            return memoryview(data).nbytes
        return super().write(data)


def watch_writes(writer: FileSystemWriter, cancel: threading.Event | None = None) -> WatchedFileSystem:
    """Put a :class:`WatchedFileSystem` under ``writer`` (DCP keeps its file system in ``fs``)."""
    watched = WatchedFileSystem(cancel)
    writer.fs = watched
    return watched


@contextmanager
def dcp_errors(watched: WatchedFileSystem | None = None) -> Iterator[None]:
    """Turn DCP's ``CheckpointException`` into this rank's own error: the full disk ``watched`` saw, else
    the copy DCP kept of this rank's error, else :class:`dist.FailedElsewhere`."""
    try:
        yield
    except CheckpointException as exc:
        if watched is not None and watched.full is not None:
            raise watched.full from None
        if watched is not None and watched.cancelled:
            raise SaveCancelled("save cancelled") from None
        failed = sorted(exc.failures)
        own = exc.failures.get(dist.rank())
        if own is not None and isinstance(own[0], Exception):
            raise own[0] from None
        raise dist.FailedElsewhere(f"DCP failed on rank(s) {', '.join(map(str, failed))}") from None
