"""spotguard: keep training alive across spot/preemptible VM interruptions.

``from spotguard import Guard`` gives the trainer hook. The import is lazy so
that the daemon (which imports this package too) never loads torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spotguard.notice import EXIT_STOPPED
from spotguard.version import __version__

__all__ = ["EXIT_STOPPED", "Guard", "SpotguardDiskFull", "SpotguardMismatch", "__version__"]

if TYPE_CHECKING:
    from spotguard.space import SpotguardDiskFull
    from spotguard.trainer.contents import SpotguardMismatch
    from spotguard.trainer.guard import Guard


def __getattr__(name: str) -> Any:
    if name == "Guard":
        from spotguard.trainer.guard import Guard

        return Guard
    if name == "SpotguardMismatch":
        from spotguard.trainer.contents import SpotguardMismatch

        return SpotguardMismatch
    if name == "SpotguardDiskFull":  # stdlib only: no torch
        from spotguard.space import SpotguardDiskFull

        return SpotguardDiskFull
    raise AttributeError(f"module 'spotguard' has no attribute {name!r}")
