"""The one root of spotguard's errors, and its two branches.

Every error spotguard raises derives from :class:`SpotguardError`, so ``except SpotguardError`` catches
them all. Public errors keep their historical standard base too (``SpotguardDiskFull`` is still an
``OSError``, ``SpotguardMismatch`` a ``ValueError``, ``RankFailed`` a ``RuntimeError``), so no existing
``except`` clause changes meaning.

- :class:`TransientError`: trying again later may succeed (a 503, a reset connection, a peer not up yet).
- :class:`FatalError`: trying again cannot help until something is fixed (a bad config, a denied
  permission, a corrupt checkpoint); the message says what.
"""

from __future__ import annotations


class SpotguardError(Exception):
    """Root of every error spotguard raises."""


class TransientError(SpotguardError):
    """A failure that may pass: retry within the deadline."""


class FatalError(SpotguardError):
    """A failure that retrying cannot fix."""


class ConfigError(FatalError, ValueError):
    """A bad setting (a config key, a flag, an argument of the trainer hook). ``str()`` is the one
    line the CLI prints: the key, then what to fix."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key
