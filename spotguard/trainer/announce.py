"""Telling the daemon how big the state is, before the first save: its deadline plan needs the size.

A job's first notice often comes before it ever saved; without a number the daemon's plan would count
with zero bytes. The hook measures the state it was given (at ``resume``, at each save, through
``Guard.announce_state``) and, because an optimizer like Adam creates its state only at the first
step, again from the remembered state at ``should_checkpoint`` at most every ``REMEASURE_S`` seconds.

Measuring is cheap and copies nothing: the untyped storages of the tensors the state holds are summed,
each storage once. Modules and optimizers are read through their parameters, buffers and ``state``
(references), never through ``state_dict()``: an FSDP module's ``state_dict()`` gathers across ranks
(a rank that measured alone would hang the others), and a loader's may talk to its workers. Other
objects (schedulers, loaders, plain values) are small and count in a margin only. A DTensor or a
ShardedTensor counts its local shard, and the state is then ``sharded`` (this rank's share), as it is
with a module wrapped by FSDP's first version (its flat parameters hold the rank's shard).

The size goes in the hello of every (re)connection and, when it changes by more than
``CHANGE_FRACTION``, in a ``state-size`` message (at most one per ``MIN_INTERVAL_S``; a change held
back goes at the next chance). Measuring never raises into the training loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from spotguard.trainer.client import DaemonClient

logger = logging.getLogger("spotguard.trainer")

REMEASURE_S = 30.0  # wall seconds between measurements of the remembered state at should_checkpoint
MIN_INTERVAL_S = 5.0  # at most one state-size message per this many seconds
CHANGE_FRACTION = 0.05  # a size that moved by less is not told again
_MARGIN_PER_ENTRY = 64 << 10  # pickled structure and small objects, per state entry (as estimate_bytes counts)


@dataclass(frozen=True)
class StateSize:
    bytes: int
    sharded: bool  # some tensor is a DTensor/ShardedTensor: bytes are this rank's share


def _local_tensors(value: torch.Tensor) -> tuple[list[torch.Tensor], bool]:
    """The tensors that hold ``value``'s bytes on this rank, and whether it is a rank's share."""
    if callable(getattr(value, "to_local", None)):  # DTensor: to_local() is a view, no copy
        return [value.to_local()], True  # type: ignore[attr-defined]
    if callable(getattr(value, "local_shards", None)):  # ShardedTensor
        return [shard.tensor for shard in value.local_shards()], True  # type: ignore[attr-defined]
    return [value], False


def _fsdp1(value: Any) -> bool:
    """A module wrapped by FSDP (the first one): its flat parameters are plain tensors, yet each holds
    only this rank's shard."""
    return isinstance(value, torch.nn.Module) and any(
        type(module).__name__ == "FullyShardedDataParallel" for module in value.modules()
    )


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, torch.nn.Module):
        yield from value.parameters()
        yield from value.buffers()
    elif isinstance(value, torch.optim.Optimizer):
        for per_param in value.state.values():
            yield from _tensors(per_param)
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)


def measure_state(state: Mapping[str, Any]) -> StateSize:
    """About how many bytes ``state`` takes in a checkpoint on this rank; see the module docstring.

    >>> measure_state({"w": torch.zeros(1024)}).bytes >= 4096
    True
    """
    storages: dict[tuple[int, str], int] = {}
    sharded = any(_fsdp1(value) for value in state.values())
    with torch.no_grad():  # a DTensor's to_local() must not record autograd history
        for value in state.values():
            for tensor in _tensors(value):
                local, share = _local_tensors(tensor)
                sharded = sharded or share
                for part in local:
                    storage = part.untyped_storage()
                    storages[(storage.data_ptr(), str(part.device))] = storage.nbytes()
    tensors = sum(storages.values())
    return StateSize(tensors + tensors // 100 + _MARGIN_PER_ENTRY * max(1, len(state)), sharded)


class SizeAnnouncer:
    """Measures the remembered state when asked and tells ``client`` what changed; see the module docstring."""

    def __init__(self, client: DaemonClient, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.remeasure_s = REMEASURE_S
        self.min_interval_s = MIN_INTERVAL_S
        self._clock = clock
        self._state: Mapping[str, Any] | None = None
        self._measured_at: float | None = None
        self._told: StateSize | None = None  # the last size the daemon heard
        self._told_at: float | None = None
        self._held: StateSize | None = None  # a change not told yet (too soon after the last)
        self._failed = False

    def remember(self, state: Mapping[str, Any]) -> None:
        """Keep a reference to ``state`` (no copy) and measure it now."""
        self._state = state
        self._measure()

    def poll(self) -> None:
        """At a step boundary: tell a change held back, and re-measure once ``remeasure_s`` passed."""
        now = self._clock()
        if self._state is not None and (self._measured_at is None or now - self._measured_at >= self.remeasure_s):
            self._measure()
        elif self._held is not None:
            self._tell(self._held)

    def _measure(self) -> None:
        if self._state is None:
            return
        self._measured_at = self._clock()
        try:
            size = measure_state(self._state)
        except Exception as exc:  # a state we cannot read must never cost a training step
            if not self._failed:
                logger.debug("spotguard: measuring the state's size failed; the daemon plans without it: %s", exc)
            self._failed = True
            return
        self._tell(size)

    def _tell(self, size: StateSize) -> None:
        told = self._told
        unchanged = told is not None and told.sharded == size.sharded
        if unchanged and told is not None and abs(size.bytes - told.bytes) <= CHANGE_FRACTION * told.bytes:
            self._held = None
            return
        now = self._clock()
        if self._told_at is not None and now - self._told_at < self.min_interval_s:
            self._held = size
            return
        self._held = None
        self._told, self._told_at = size, now
        # Later connections say it in their hello; the one up now (or the next) gets the message.
        self.client.update_hello(state_bytes=size.bytes, sharded=size.sharded)
        self.client.send("state-size", bytes=size.bytes, sharded=size.sharded)
