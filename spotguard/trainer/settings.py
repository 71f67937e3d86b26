"""The trainer hook's own settings: arguments, else ``SPOTGUARD_*`` in the environment, else defaults.

The hook resolves them here, in the trainer package, so that importing it pulls in nothing of the
daemon's configuration; ``spotguard.config`` (the composition root) takes the same names from here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from spotguard.storage.schemes import check_bucket_url

#: Where the daemon listens unless told otherwise (systemd's RuntimeDirectory).
DEFAULT_SOCKET = Path("/run/spotguard/spotguard.sock")
CHECKPOINT_DIR_ENV = "SPOTGUARD_CHECKPOINT_DIR"
BUCKET_ENV = "SPOTGUARD_BUCKET"
SOCKET_ENV = "SPOTGUARD_SOCKET"


@dataclass(frozen=True)
class TrainerSettings:
    """Where the hook keeps checkpoints, which bucket it may resume from, and where the daemon listens."""

    checkpoint_dir: Path | None  # None: ask the daemon for its root
    bucket: str | None
    socket: Path

    @classmethod
    def from_env(
        cls,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        bucket: str | None = None,
        socket: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> TrainerSettings:
        """Explicit argument > ``$SPOTGUARD_CHECKPOINT_DIR`` / ``$SPOTGUARD_BUCKET`` / ``$SPOTGUARD_SOCKET`` > default.

        A bucket URL no store opens raises :class:`~spotguard.errors.ConfigError` (a ``ValueError``).
        """
        env = os.environ if env is None else env
        root = checkpoint_dir if checkpoint_dir is not None else env.get(CHECKPOINT_DIR_ENV)
        bucket = bucket if bucket is not None else (env.get(BUCKET_ENV) or None)
        if bucket is not None:
            check_bucket_url(bucket, key="bucket")
        # An empty variable is an unset one, as for the other two (Path('') would be the working directory).
        sock = socket if socket is not None else (env.get(SOCKET_ENV) or str(DEFAULT_SOCKET))
        return cls(
            checkpoint_dir=Path(root).expanduser().absolute() if root else None,
            bucket=bucket,
            socket=Path(sock),
        )


class GuardOptions(TypedDict, total=False):
    """The keyword arguments of :class:`spotguard.Guard`, as the framework callbacks take them too."""

    checkpoint_dir: str | os.PathLike[str] | None
    bucket: str | None
    socket: str | os.PathLike[str] | None
    every_steps: int | None
    every_seconds: float | None
    keep: int
    handle_sigterm: bool
    daemon_wait: float
    write_threads: int | None
