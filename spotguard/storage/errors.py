"""What a store raises: one branch of spotguard's error root, with a transient twig worth retrying."""

from __future__ import annotations

from spotguard.errors import SpotguardError, TransientError


class StorageError(SpotguardError):
    """An operation on the bucket failed for good (after retries, or fatally)."""


class TransientStorageError(StorageError, TransientError):
    """Worth retrying: 503 SlowDown, 500, throttling, a reset connection."""


class ObjectNotFound(StorageError):
    pass


class ChecksumMismatch(StorageError):
    """The store accepted the bytes but answered a checksum that does not match them.

    Not transient: the same store computes the same wrong value for the same bytes, so sending
    them again changes nothing. ``sent`` and ``answered`` are the CRC32Cs, as hex."""

    def __init__(self, message: str, *, sent: str, answered: str) -> None:
        super().__init__(message)
        self.sent = sent
        self.answered = answered


class ObjectExists(StorageError):
    """A conditional create found the key already written (by another writer, or by an earlier
    attempt of ours whose answer was lost): nothing was overwritten."""
