"""Turning a ``state`` dict into checkpoint files and back, RNG states included.

Each entry of ``state`` becomes one file, ``<key>.pt`` (``<key>.rank<R>.pt``
for per-rank entries under ``torch.distributed``), so that a finished file
can be uploaded while the next is written. The files are ``torch.save``
archives written by several threads (:mod:`spotguard.trainer.writer`). Everything is stored so that it
loads with ``torch.load(weights_only=True)``: tensors and primitives only.
"""

from __future__ import annotations

import copy
import random
import re
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from spotguard.errors import FatalError
from spotguard.localstore import CheckpointWriter
from spotguard.manifest import Manifest
from spotguard.trainer.threads import write_threads
from spotguard.trainer.writer import OnRange, ParallelWriter

RNG_KEY = "_rng"
# manifest.meta["layout"] of a sharded checkpoint (spotguard.trainer.sharded, written through DCP).
DCP_LAYOUT = "dcp"
_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


class StateError(FatalError, ValueError):
    """``state`` holds something spotguard cannot save or restore; the message says what to change."""


def entry_file(key: str, rank: int | None = None) -> str:
    return f"{key}.pt" if rank is None else f"{key}.rank{rank}.pt"


def check_state(state: Mapping[str, Any]) -> None:
    for key, value in state.items():
        if not isinstance(key, str) or not _KEY.match(key) or key == RNG_KEY:
            raise StateError(f"state key {key!r}: use letters, digits, '_', '.', '-' (it becomes a file name)")
        if type(value).__name__ == "DataLoader" and not hasattr(value, "state_dict"):
            raise StateError(
                f"state[{key!r}] is a torch DataLoader, which has no state to save: use "
                "torchdata.stateful_dataloader.StatefulDataLoader to resume mid-epoch"
            )
        warn_if_loader_draws_global_rng(key, value)
        warn_if_sampler_empties_a_resumed_epoch(key, value)


def warn_if_loader_draws_global_rng(key: str, value: Any) -> None:
    """Warn about the one way an exact resume silently goes wrong with a shuffling loader.

    Creating a DataLoader iterator draws a base seed from the *global* torch RNG unless the
    loader has its own ``generator``; a shuffling sampler without its own generator draws
    from it too. A resumed run restores the global RNG and then calls ``iter(loader)``, so it
    is one draw off the uninterrupted run and dropout diverges. ``shuffle=True`` with the
    loader's ``generator`` gives the sampler that same generator; the loader's seed and the
    sampler's order then come from one stream, and a resumed run draws from it in another
    order than the uninterrupted one: the rest of the epoch comes in another order.
    """
    if not hasattr(value, "state_dict") or not hasattr(value, "sampler") or not hasattr(value, "generator"):
        return
    sampler = value.sampler
    shuffles = type(sampler).__name__ == "RandomSampler"
    own = getattr(sampler, "generator", None) if shuffles else None
    if value.generator is None or (shuffles and own is None):
        problem = (
            "the loader (or its RandomSampler) has no generator of its own, so creating its iterator "
            "draws from the global torch RNG"
        )
    elif shuffles and own is value.generator:
        problem = (
            "the loader's RandomSampler shares the loader's generator (shuffle=True with generator=...), "
            "so a resumed run draws the loader's seed and the sampler's order from it in another order"
        )
    else:
        return
    warnings.warn(
        f"state[{key!r}]: {problem}, and a resumed run will not match an uninterrupted one. Pass "
        "generator=torch.Generator().manual_seed(s1) to the loader and "
        "sampler=torchdata.stateful_dataloader.sampler.RandomSampler(ds, "
        "generator=torch.Generator().manual_seed(s2)) to it: two generators of its own.",
        stacklevel=4,
    )


def warn_if_sampler_empties_a_resumed_epoch(key: str, value: Any) -> None:
    """Warn about torchdata's ``StatefulDistributedSampler``: a state it saved at an epoch's last batch
    resumes into an empty epoch (spotguard/trainer/samplers.py says why), so the resumed run goes on
    one epoch of data behind. Its subclass in spotguard does not."""
    if type(getattr(value, "sampler", None)).__name__ == "StatefulDistributedSampler":
        warnings.warn(
            f"state[{key!r}]: torchdata's StatefulDistributedSampler resumes a checkpoint taken at an "
            "epoch's last batch into an empty epoch, and the run goes on an epoch of data behind an "
            "uninterrupted one. Use spotguard.trainer.samplers.ResumableDistributedSampler (the same "
            "arguments), which starts the next epoch whole there.",
            stacklevel=4,
        )


# --- RNG states as primitives ----------------------------------------------------------------


def capture_rng() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    states: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    try:
        import numpy as np
    except ImportError:  # numpy is optional
        pass
    else:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        states["numpy"] = {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = [state.cpu() for state in torch.cuda.get_rng_state_all()]
    return states


def restore_rng(states: Mapping[str, Any]) -> None:
    python = states["python"]
    random.setstate((python["version"], tuple(python["state"]), python["gauss"]))
    torch.set_rng_state(states["torch"])
    if "numpy" in states:
        import numpy as np

        saved = states["numpy"]
        np.random.set_state(
            (
                saved["kind"],
                saved["keys"].numpy().astype(np.uint32),
                saved["pos"],
                saved["has_gauss"],
                saved["cached_gaussian"],
            )
        )
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


# --- save / load --------------------------------------------------------------------------


def _payload(value: Any) -> Any:
    return value.state_dict() if hasattr(value, "state_dict") else value


class Payloads(Mapping[str, Any]):
    """What goes into the files: every entry's ``state_dict()`` (or the value itself), then the RNG
    states, each produced only when it is read. An urgent save takes the next ``state_dict()`` only
    while the pieces before it are being written, so the first file is complete (and uploading) before
    the last entry is even read. Tensors are the
    live ones; :class:`Stager` copies them when training must go on meanwhile."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.state = state

    def __getitem__(self, key: str) -> Any:
        return capture_rng() if key == RNG_KEY else _payload(self.state[key])

    def __iter__(self) -> Iterator[str]:
        yield from self.state
        yield RNG_KEY

    def __len__(self) -> int:
        return len(self.state) + 1


class Stager:
    """Copies payloads into host buffers that are reused from one save to the next.

    Only this copy blocks training during a periodic save; the files are written from the
    copy in the background. Buffers for CUDA tensors are pinned, so the device-to-host copy
    runs at full bandwidth; reusing them avoids allocating (and pinning) gigabytes per save.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._used: set[tuple[Any, ...]] = set()

    def stage(self, payloads: Mapping[str, Any]) -> dict[str, Any]:
        self._used = set()
        staged = {key: self._copy(value, (key,)) for key, value in payloads.items()}
        if any(buffer.is_pinned() for buffer in self._buffers.values()):
            torch.cuda.synchronize()  # the non-blocking copies must land before training goes on
        for path in set(self._buffers) - self._used:
            del self._buffers[path]  # the state changed shape: drop buffers nobody uses now
        return staged

    def _copy(self, value: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(value, torch.Tensor):
            buffer = self._buffers.get(path)
            if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                pin = value.is_cuda and torch.cuda.is_available()
                buffer = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=pin)
                self._buffers[path] = buffer
            self._used.add(path)
            buffer.copy_(value.detach(), non_blocking=value.is_cuda)
            return buffer
        if isinstance(value, dict):
            return type(value)((k, self._copy(v, (*path, k))) for k, v in value.items())
        if isinstance(value, list | tuple):
            copied = [self._copy(v, (*path, i)) for i, v in enumerate(value)]
            return copied if isinstance(value, list) else tuple(copied)
        return copy.deepcopy(value)


def is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def estimate_bytes(payloads: Mapping[str, Any]) -> int:
    """About how many bytes ``payloads`` take on disk: every tensor's storage once (``torch.save``
    writes a view's whole storage), plus a margin for pickled structure. Other objects count only
    in that margin; a write that still runs out of room is handled where it fails."""
    storages: dict[tuple[int, str], int] = {}

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            storages[(storage.data_ptr(), str(value.device))] = storage.nbytes()
        elif isinstance(value, Mapping):
            for item in value.values():
                walk(item)
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item)

    for key in payloads:
        walk(payloads[key])
    tensors = sum(storages.values())
    return tensors + tensors // 100 + (64 << 10) * max(1, len(payloads))


def write_payloads(
    writer: CheckpointWriter,
    payloads: Mapping[str, Any],
    *,
    rank: int | None = None,
    on_file: Callable[[str], None] | None = None,
    on_range: OnRange | None = None,
    parallel: ParallelWriter | None = None,
) -> list[str]:
    """One file per entry (``<key>.pt``, or ``<key>.rank<R>.pt``), written by ``parallel`` (by default
    a :class:`ParallelWriter` with :func:`~spotguard.trainer.threads.write_threads`); returns the names written."""
    parallel = parallel or ParallelWriter(write_threads())
    names = {key: entry_file(key, rank) for key in payloads}
    return parallel.write(writer, payloads, names, on_file=on_file, on_range=on_range)


def read_state(
    step_dir: Path,
    manifest: Manifest,
    state: MutableMapping[str, Any],
    *,
    rank: int | None = None,
    skip_entries: Collection[str] = (),
    skip_keys: Mapping[str, Collection[str]] | None = None,
    threads: int = 1,
) -> None:
    """Load every entry of ``state`` from ``step_dir``, then the RNG states (last, so that nothing
    done while loading draws from a restored generator). Entries in ``skip_entries`` are left as they
    are; ``skip_keys`` (entry -> keys) are left out of a module's ``load_state_dict``.

    Every file is opened (and unpickled) before anything in ``state`` changes; then up to ``threads``
    entries are put back at once, each by its own ``load_state_dict`` (or copy): the bytes come out of
    the page cache through page faults on the mapped files, which one thread cannot keep up with.
    """
    loaded: dict[str, Any] = {}
    keys = [key for key in state if key not in skip_entries]
    for key in [*keys, RNG_KEY]:
        name = entry_file(key, rank)
        if name not in manifest.files:
            raise StateError(
                f"{step_dir.name} has no entry {key!r} (it holds {', '.join(sorted(manifest.files))}); "
                "resume with the same state keys the run saved"
            )
        try:
            # mmap: tensors are read straight from the page cache into their destination (one copy,
            # not two: 1 GiB loads in place ~5x faster). Checkpoint files are never rewritten or
            # truncated, only unlinked, so a tensor kept as loaded stays valid (private mapping).
            loaded[key] = torch.load(step_dir / name, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # torch raises many kinds of errors for one root cause
            raise StateError(
                f"{step_dir.name}/{name} cannot be loaded with weights_only=True ({exc}); keep state to "
                "tensors, primitives and objects with state_dict()/load_state_dict()"
            ) from exc

    def apply(key: str) -> None:
        apply_saved(state, key, loaded[key], (skip_keys or {}).get(key, ()))

    if threads <= 1 or len(keys) <= 1:
        for key in keys:
            apply(key)
    else:
        with ThreadPoolExecutor(min(threads, len(keys))) as pool:
            for _ in pool.map(apply, keys):  # re-raises the first entry that failed, once all are done
                pass
    restore_rng(loaded[RNG_KEY])


def apply_saved(state: MutableMapping[str, Any], key: str, saved: Any, skip: Collection[str] = ()) -> None:
    """Put one loaded entry back: through ``load_state_dict``, into a same-shaped tensor in place, or as is.

    With ``skip`` (keys of a module's state_dict that do not fit it) the rest is loaded non-strictly.
    """
    value = state[key]
    if skip and isinstance(value, torch.nn.Module):
        value.load_state_dict({k: v for k, v in saved.items() if k not in skip}, strict=False)
    elif hasattr(value, "load_state_dict"):
        value.load_state_dict(saved)
    elif isinstance(value, torch.Tensor) and isinstance(saved, torch.Tensor) and value.shape == saved.shape:
        with torch.no_grad():
            value.copy_(saved)
    else:
        state[key] = saved
