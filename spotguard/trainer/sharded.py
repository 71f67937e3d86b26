"""Sharded checkpoints under ``torch.distributed`` with ``torch.distributed.checkpoint`` (DCP).

The model and its optimizers go through DCP: each rank writes its own shards
(``__<rank>_0.distcp``) into the step directory and rank 0 writes DCP's
``.metadata``. ``get_state_dict``/``set_state_dict`` make this work for DDP,
FSDP and DTensor state alike, and let a checkpoint saved by N ranks load into
M ranks (DCP reshards on load). Everything else in ``state`` (data loaders,
schedulers, plain values) and the RNG states are per-rank files
(``<key>.rank<R>.pt``), because they differ between ranks.

Every rank reports size and CRC32C of the files it wrote; rank 0 gathers them
and commits one manifest for the whole job.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable, Collection, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.futures import Future

from spotguard.crc32c import crc32c_of_files
from spotguard.localstore import CheckpointWriter
from spotguard.manifest import FileEntry, Manifest, write_part
from spotguard.safefile import SaveCancelled
from spotguard.trainer import dist
from spotguard.trainer.contents import flatten
from spotguard.trainer.dcp_errors import dcp_errors, watch_writes
from spotguard.trainer.state import (
    DCP_LAYOUT,
    RNG_KEY,
    Payloads,
    Stager,
    StateError,
    apply_saved,
    entry_file,
    restore_rng,
    write_payloads,
)
from spotguard.trainer.writer import ParallelWriter

logger = logging.getLogger("spotguard.trainer")

LAYOUT = DCP_LAYOUT
OPTIMIZERS_KEY = "__optimizers__"


def _parts(state: Mapping[str, Any]) -> tuple[str | None, list[str], list[str]]:
    """(the model's key, the optimizers' keys, the keys saved per rank)."""
    models = [key for key, value in state.items() if isinstance(value, torch.nn.Module)]
    optimizers = [key for key, value in state.items() if isinstance(value, torch.optim.Optimizer)]
    if len(models) > 1:
        raise StateError(
            f"distributed checkpoints take one model in state (found {', '.join(models)}): "
            "wrap them in one nn.Module or nn.ModuleDict"
        )
    model = models[0] if models else None
    if model is None:
        optimizers = []
    rest = [key for key in state if key != model and key not in optimizers]
    return model, optimizers, rest


def describe_dcp_model(state: Mapping[str, Any], described: MutableMapping[str, Any]) -> None:
    """The model's keys as DCP saves them (no DDP ``module.`` prefix, global shapes), in place of the
    plain ``state_dict`` ones: a checkpoint of a DDP job then compares equal with one process's model."""
    model, _, _ = _parts(state)
    if model is not None:
        described[model] = {**described[model], "keys": flatten(get_model_state_dict(state[model]))}


def _tree(state: Mapping[str, Any], model: str | None, optimizers: list[str]) -> dict[str, Any]:
    if model is None:
        return {}
    model_state, optim_state = get_state_dict(state[model], [state[key] for key in optimizers])
    tree: dict[str, Any] = {model: model_state}
    if optimizers:
        tree[OPTIMIZERS_KEY] = optim_state
    return tree


def _tensor_count(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return 1
    if isinstance(value, Mapping):
        return sum(_tensor_count(item) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(_tensor_count(item) for item in value)
    return 0


@dataclasses.dataclass(frozen=True)
class ShardedState:
    """A state as a sharded checkpoint writes it: the model's and optimizers' tree, which DCP writes,
    and the rest with the RNG states, which go in per-rank files. Live (an urgent save, written from
    the training's own tensors) or staged (a periodic one, copied into host memory first)."""

    model: str | None
    optimizers: list[str]
    per_rank_keys: list[str]
    tree: dict[str, Any]
    per_rank: Mapping[str, Any]
    fresh_optimizers: list[str] = dataclasses.field(default_factory=list)  # never stepped when saved


def split_state(state: Mapping[str, Any]) -> ShardedState:
    """``state`` as :func:`save_sharded` writes it (the model's ``get_state_dict``, a collective under FSDP).

    ``get_state_dict`` gives an optimizer that never stepped a state by stepping it once with zero
    gradients and lr 0 (Adam's step count 1, its moments zero): a save before the first step (a notice
    that early) changed training, and every run resumed from it, by one step of bias correction. Such
    an optimizer is left as it was, and the checkpoint says so (its ``fresh_optimizers``)."""
    model, optimizers, rest = _parts(state)
    per_rank = Payloads({key: state[key] for key in rest})
    fresh = [key for key in optimizers if not state[key].state]
    tree = _tree(state, model, optimizers)
    for key in fresh:
        state[key].state.clear()  # the tree keeps what DCP writes; the live optimizer is fresh again
    return ShardedState(model, optimizers, rest, tree, per_rank, fresh)


class ShardedStager:
    """Copies a :class:`ShardedState` into host memory reused from one save to the next: the tree as
    DCP's ``async_save`` stages it (DTensor and sharded tensors keep their placement), the per-rank
    payloads with the single-process :class:`Stager`. Only this copy blocks training."""

    def __init__(self, payloads: Stager) -> None:
        self._payloads = payloads
        # Pinned host buffers where CUDA is, as the payloads' are; a synchronous copy: the training's
        # next step may change every tensor.
        self._tree = DefaultStager(StagingOptions(torch.cuda.is_available(), False, False, False))

    def stage(self, live: ShardedState) -> ShardedState:
        tree = self._tree.stage(live.tree)
        assert isinstance(tree, dict), "a synchronous stager returns the staged tree"
        return dataclasses.replace(live, tree=tree, per_rank=self._payloads.stage(live.per_rank))


def save_sharded(
    writer: CheckpointWriter,
    state: Mapping[str, Any] | ShardedState,
    *,
    announce: Callable[[str, FileEntry], None],
    threads: int = 1,
    parallel: ParallelWriter | None = None,
) -> bool:
    """Write this rank's part of a sharded checkpoint; rank 0 then commits the manifest.

    Collective (on the thread's group: :func:`spotguard.trainer.dist.on_group`): every rank must call
    it for the same step. ``state``: the live state, or one :class:`ShardedStager` staged. Returns
    whether this rank leads its node (the lowest rank writing to this disk): the leader tells the
    node's daemon. With several nodes the leader first commits the node's share locally
    (``part-<node>.json``).

    DCP writes this rank's tensors with ``threads`` threads, one file each
    (``__<rank>_0.distcp`` .. ``__<rank>_<threads-1>.distcp``, balanced by size); every one of them
    is in the manifest. DCP's ``per_thread_copy_ahead`` applies only to one thread with CUDA.
    The other entries go through ``parallel`` (the caller's writer, whose staging buffers are kept
    across saves; a fresh one with ``write_threads()`` threads when None).
    """
    # Every rank hears of a rank whose write failed, instead of waiting for it in the gather below.
    with dist.settled(f"writing {writer.dir.name}", writer.root):
        sharded = state if isinstance(state, ShardedState) else split_state(state)
        mine = _write_dcp(writer, sharded.tree, announce, threads)
        write_payloads(
            writer,
            sharded.per_rank,
            rank=dist.rank(),
            on_file=lambda name: announce(name, writer.files[name]),
            parallel=parallel,
        )
        mine.update(writer.files)
    shares, leader = _share_by_node(writer, mine)
    if dist.rank() == 0:
        for _, entries in shares:
            writer.files.update(entries)
        writer.meta.update(
            layout=LAYOUT,
            model=sharded.model,
            optimizers=sharded.optimizers,
            fresh_optimizers=sharded.fresh_optimizers,
            per_rank=sharded.per_rank_keys,
            world_size=dist.world_size(),
            nodes=len(dict.fromkeys(key for key, _ in shares)),
        )
        if writer.contents is not None and sharded.model is not None:
            writer.contents["entries"][sharded.model]["keys"] = flatten(sharded.tree[sharded.model])
    return dist.rank() == leader


def _write_dcp(
    writer: CheckpointWriter, tree: dict[str, Any], announce: Callable[[str, FileEntry], None], threads: int
) -> dict[str, FileEntry]:
    """DCP writes this rank's shards of ``tree``; returns (and announces) this rank's files of them."""
    rank = dist.rank()
    if tree:
        # No more threads than tensors: DCP writes one file per thread, an empty one for an idle thread.
        thread_count = max(1, min(threads, _tensor_count(tree)))
        dcp_writer = dcp.FileSystemWriter(writer.dir, sync_files=True, overwrite=False, thread_count=thread_count)
        watched = watch_writes(dcp_writer, writer.cancel)
        with dcp_errors(watched):
            dcp.save(tree, storage_writer=dcp_writer, process_group=dist.group_of_this_thread())
        if watched.cancelled:  # its writes were dropped: the files are not the state
            raise SaveCancelled(f"{writer.dir.name}: save cancelled")
    # On another node's disk the directory exists only once DCP (or the first file) made it.
    paths = sorted(writer.dir.iterdir()) if writer.dir.is_dir() else []
    written = [p for p in paths if p.name.startswith(f"__{rank}_") or (rank == 0 and p.name == ".metadata")]
    mine: dict[str, FileEntry] = {}
    for path, crc in zip(written, crc32c_of_files(written, threads), strict=True):
        mine[path.name] = FileEntry(size=path.stat().st_size, crc32c=crc)
        announce(path.name, mine[path.name])
    return mine


def _share_by_node(writer: CheckpointWriter, mine: dict[str, FileEntry]) -> tuple[list[dist.NodeShare], int]:
    """Gather every rank's files, and the lowest rank of this node (its leader). With several nodes
    the leader commits the node's share locally (``part-<node>.json``). Collective."""
    # A node is the set of ranks writing to one local disk: same host, same checkpoint root.
    node_key = dist.node_key(writer.root)
    shares: list[dist.NodeShare] = dist.all_gather((node_key, mine))
    nodes = list(dict.fromkeys(key for key, _ in shares))  # in order of their lowest rank
    node = nodes.index(node_key)
    leader = [key for key, _ in shares].index(node_key)
    with dist.settled(f"committing this node's share of {writer.dir.name}"):
        if len(nodes) > 1 and dist.rank() == leader:
            node_files = {name: entry for key, entries in shares if key == node_key for name, entry in entries.items()}
            write_part(writer.dir, node, len(nodes), node_files)
    return shares, leader


class _ThreadedReader(dcp.FileSystemReader):
    """DCP's ``FileSystemReader`` reads one file after another (it has no ``thread_count``): this one
    reads up to ``threads`` files at once, each through DCP's own ``read_data`` with a plan of that
    file's items only. A checkpoint written with N threads per rank has N files per rank to spread."""

    def __init__(self, path: Path, threads: int) -> None:
        super().__init__(path)
        self.threads = threads

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        if self.threads <= 1 or len(by_file) <= 1:
            return super().read_data(plan, planner)
        read_file = super().read_data
        with ThreadPoolExecutor(min(self.threads, len(by_file))) as pool:
            parts = [
                pool.submit(read_file, dataclasses.replace(plan, items=items), planner) for items in by_file.values()
            ]
            for part in parts:
                part.result().wait()
        done: Future[None] = Future()
        done.set_result(None)
        return done


def load_sharded(
    step_dir: Path,
    manifest: Manifest,
    state: MutableMapping[str, Any],
    *,
    skip_entries: Collection[str] = (),
    skip_keys: Mapping[str, Collection[str]] | None = None,
    threads: int = 1,
) -> None:
    """Load a sharded checkpoint into this rank's ``state``, resharding if the world size changed.

    ``skip_entries`` are left as they are; ``skip_keys`` (the model's keys that do not fit) are left
    out and the rest of the model loads non-strictly. Every rank must pass the same ones. ``threads``
    read DCP's files in parallel.
    """
    rank = dist.rank()
    model, optimizers, rest = _parts(state)
    saved_optimizers = manifest.meta.get("optimizers") or []
    if model in skip_entries:
        model, optimizers = None, []
    optimizers = [key for key in optimizers if key not in skip_entries]
    rest = [key for key in rest if key not in skip_entries]
    if model is not None and (model != manifest.meta.get("model") or not set(optimizers) <= set(saved_optimizers)):
        raise StateError(
            f"{step_dir.name} holds model {manifest.meta.get('model')!r} with optimizers "
            f"{saved_optimizers}; state has {model!r} with {optimizers}"
        )
    tree = _tree(state, model, optimizers)
    if tree and model is not None:
        left_out = set((skip_keys or {}).get(model, ()))
        if left_out:
            tree[model] = {key: value for key, value in tree[model].items() if key not in left_out}
        with warnings.catch_warnings():
            # Loading a sharded checkpoint into one process is a feature here, not an accident.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            with dcp_errors():
                dcp.load(tree, storage_reader=_ThreadedReader(step_dir, threads))
        set_state_dict(
            state[model],
            [state[key] for key in optimizers],
            model_state_dict=tree[model],
            optim_state_dict=tree.get(OPTIMIZERS_KEY, {}),
            options=StateDictOptions(strict=not left_out),
        )
        for key in set(optimizers) & set(manifest.meta.get("fresh_optimizers") or []):
            state[key].state.clear()  # saved before its first step: fresh, as it was (split_state)
    for key in [*rest, RNG_KEY]:
        name = entry_file(key, rank)
        if name not in manifest.files:
            _per_rank_fallback(step_dir, manifest, state, key)
            continue
        _load_entry(step_dir / name, state, key)


def _per_rank_fallback(step_dir: Path, manifest: Manifest, state: MutableMapping[str, Any], key: str) -> None:
    """This rank did not exist in the saving job (resharded to more ranks)."""
    rank = dist.rank()
    if key == RNG_KEY:
        logger.warning("spotguard: rank %d has no RNG state in %s; keeping its own", rank, step_dir.name)
        return
    if hasattr(state.get(key), "sampler"):
        logger.warning(
            "spotguard: rank %d has no %r state in %s: the loader starts its epoch afresh", rank, key, step_dir.name
        )
        return
    source = entry_file(key, 0)
    if source not in manifest.files:
        raise StateError(f"{step_dir.name} has no entry {key!r}; resume with the state keys the run saved")
    _load_entry(step_dir / source, state, key)  # schedulers and plain values are the same on every rank


def _load_entry(path: Path, state: MutableMapping[str, Any], key: str) -> None:
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if key == RNG_KEY:
        restore_rng(saved)
        return
    apply_saved(state, key, saved)
