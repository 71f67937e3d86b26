"""Checkpoints written the real way (``CheckpointWriter``) for tests that need one on disk."""

from __future__ import annotations

from pathlib import Path

from spotguard.localstore import CheckpointWriter


def write_checkpoint(root: Path, step: int, files: dict[str, bytes], reason: str = "periodic") -> Path:
    """A committed checkpoint of ``files`` (relative path -> bytes) under ``root``; its directory."""
    writer = CheckpointWriter(root, step, reason=reason)
    writer.prepare()
    for name, data in files.items():
        writer.write_bytes(name, data)
    writer.commit()
    return writer.dir
