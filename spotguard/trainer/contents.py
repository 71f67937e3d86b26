"""What a checkpoint holds, recorded in its manifest, and the check of it against the live state.

The manifest's ``contents`` describes every state entry without any tensor data::

    "contents": {
     "versions": {"spotguard": "0.1.0", "format": "spotguard/1", "torch": "2.13.0"},
     "world_size": 1,
     "entries": {
      "model": {"kind": "module", "class": "torch.nn.modules.linear.Linear",
                "keys": {"weight": "float32[2,3]", "bias": "float32[2]"}},
      "optimizer": {"kind": "optimizer", "class": "torch.optim.adamw.AdamW", "groups": [2],
                    "keys": {"param.0": "float32[2,3]", "param.1": "float32[2]"}},
      "counter": {"kind": "tensor", "keys": {"": "float32[4]"}},
      "scheduler": {"kind": "object", "class": "torch.optim.lr_scheduler.StepLR"},
      "epoch": {"kind": "value", "class": "int"}}}

``Guard.resume`` compares it with the live state before it fetches or loads a byte, so a state that
does not fit fails with one :class:`SpotguardMismatch` and stays as it was.

What is compared, and why only that:

- a module's (and a tensor's) flattened ``state_dict`` keys, with shape and dtype: ``load_state_dict``
  would copy the matching tensors before raising on the first bad one, or cast a dtype silently;
- an optimizer's class, parameter-group layout (groups, parameters per group) and the shape and
  dtype of each parameter it steps (``param.N``, in the order its state is keyed by): its state is
  created lazily at the first step, so a fresh optimizer's state keys say nothing, and
  ``load_state_dict`` accepts another class or state for parameters of another shape without a word;
- any other object's class (a scheduler, a loader): their state keys legitimately change while
  training runs (a loader mid-epoch has state a fresh one has not);
- plain values are replaced as they are, so nothing about them is compared.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from spotguard.manifest import FORMAT, Manifest, ManifestFormatError
from spotguard.trainer.state import StateError, entry_file
from spotguard.version import __version__

SHOWN = 10  # differences listed in the error; the rest are counted


@dataclass(frozen=True)
class Difference:
    """One way the checkpoint and the live state disagree."""

    entry: str  # the state key
    key: str  # the flattened state_dict key, or what of the entry differs ("class", "param_groups", "entry")
    saved: str
    live: str

    def __str__(self) -> str:
        return f"{self.entry}: {self.key}: saved {self.saved}, live {self.live}"

    def to_json(self) -> dict[str, str]:
        return {"entry": self.entry, "key": self.key, "saved": self.saved, "live": self.live}


class SpotguardMismatch(StateError):
    """The state to resume into does not match the checkpoint; nothing was fetched or loaded.

    ``differences`` lists every one (entry, key, saved, live); the message shows the first ten.
    """

    def __init__(self, checkpoint: str, differences: list[Difference]) -> None:
        self.checkpoint = checkpoint
        self.differences = differences
        lines = [str(difference) for difference in differences[:SHOWN]]
        if len(differences) > SHOWN:
            lines.append(f"... and {len(differences) - SHOWN} more")
        super().__init__(
            f"{checkpoint} does not match the state to resume into ({len(differences)} difference(s)); "
            "nothing was loaded. Resume into the state the run saved, or pass strict=False to load what "
            "matches:\n  " + "\n  ".join(lines)
        )


@dataclass
class ResumeReport:
    """What ``Guard.resume(state, strict=False)`` loaded and what it left as it was."""

    checkpoint: str
    step: int
    checked: bool  # False for a checkpoint written before its contents were recorded
    differences: list[Difference] = field(default_factory=list)
    skipped_entries: list[str] = field(default_factory=list)  # left as they were
    skipped_keys: dict[str, list[str]] = field(default_factory=dict)  # entry -> keys not loaded into it

    @property
    def complete(self) -> bool:
        return not self.differences

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint,
            "step": self.step,
            "checked": self.checked,
            "differences": [difference.to_json() for difference in self.differences],
            "skipped_entries": self.skipped_entries,
            "skipped_keys": self.skipped_keys,
        }


# --- describing ---------------------------------------------------------------------------------


def class_name(value: Any) -> str:
    cls = type(value)
    return f"{cls.__module__}.{cls.__qualname__}"


def tensor_spec(tensor: torch.Tensor) -> str:
    """``float32[16,8]``: dtype and (global, for a DTensor) shape in one short string."""
    return f"{str(tensor.dtype).removeprefix('torch.')}[{','.join(str(n) for n in tensor.shape)}]"


def flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """Flattened keys of a state_dict (``layer.0.weight``) with a tensor's spec or a plain value's type."""
    if isinstance(value, torch.Tensor):
        return {prefix: tensor_spec(value)}
    if isinstance(value, Mapping):
        flat: dict[str, str] = {}
        for key, item in value.items():
            flat.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: type(value).__name__}


def describe_entry(value: Any, *, shapes: bool = True) -> dict[str, Any]:
    """One entry's description. Without ``shapes`` a module or optimizer is described by its class and
    layout only: under ``torch.distributed`` a module's ``state_dict()`` may be a collective (FSDP's
    full state dict gathers every parameter) and an optimizer's parameters may be local shards whose
    shapes change when the checkpoint is resharded."""
    if isinstance(value, torch.nn.Module):
        module: dict[str, Any] = {"kind": "module", "class": class_name(value)}
        return {**module, "keys": flatten(value.state_dict())} if shapes else module
    if isinstance(value, torch.optim.Optimizer):
        groups = [len(group["params"]) for group in value.param_groups]
        described: dict[str, Any] = {"kind": "optimizer", "class": class_name(value), "groups": groups}
        if not shapes:
            return described
        # The parameters it steps, in the order its state is keyed by: its state must fit them.
        params = [param for group in value.param_groups for param in group["params"]]
        return {**described, "keys": {f"param.{index}": tensor_spec(param) for index, param in enumerate(params)}}
    if isinstance(value, torch.Tensor):
        return {"kind": "tensor", "keys": {"": tensor_spec(value)}}
    if hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
        return {"kind": "object", "class": class_name(value)}
    return {"kind": "value", "class": type(value).__name__}


def describe_state(state: Mapping[str, Any], world_size: int) -> dict[str, Any]:
    """The manifest's ``contents`` for ``state``: no tensor data, one short line per tensor key.

    With several ranks, modules and optimizers are described without shapes (see
    :func:`describe_entry`); a sharded save adds the model's keys from what DCP saved.
    """
    shapes = world_size == 1
    return {
        "versions": {"spotguard": __version__, "format": FORMAT, "torch": torch.__version__},
        "world_size": world_size,
        "entries": {key: describe_entry(value, shapes=shapes) for key, value in state.items()},
    }


# --- comparing ----------------------------------------------------------------------------------


def _kind_text(described: Mapping[str, Any]) -> str:
    return str(described.get("class") or described["kind"])


def _compare_entry(entry: str, saved: Mapping[str, Any], live: Mapping[str, Any]) -> list[Difference]:
    if saved.get("kind") != live["kind"]:
        saved_text, live_text = f"{saved.get('kind')} {_kind_text(saved)}", f"{live['kind']} {_kind_text(live)}"
        return [Difference(entry, "entry", saved_text, live_text)]
    kind = live["kind"]
    differences = []
    if kind in ("optimizer", "object") and saved.get("class") != live["class"]:
        differences.append(Difference(entry, "class", str(saved.get("class")), live["class"]))
    if kind == "optimizer" and list(saved.get("groups") or []) != live["groups"]:
        differences.append(
            Difference(entry, "param_groups", _groups_text(saved.get("groups") or []), _groups_text(live["groups"]))
        )
    if kind in ("module", "tensor", "optimizer") and "keys" in saved:  # not recorded with several ranks
        saved_keys: Mapping[str, str] = saved["keys"]
        live_keys: Mapping[str, str] = live["keys"]
        for key in live_keys:
            if key not in saved_keys:
                differences.append(Difference(entry, key, "missing", live_keys[key]))
            elif saved_keys[key] != live_keys[key] and "[" in live_keys[key]:
                differences.append(Difference(entry, key, saved_keys[key], live_keys[key]))
        unexpected = [key for key in saved_keys if key not in live_keys]
        differences.extend(Difference(entry, key, saved_keys[key], "missing") for key in unexpected)
    return differences


def _groups_text(groups: list[int]) -> str:
    return f"{len(groups)} group(s) of {', '.join(str(n) for n in groups) or 'no'} parameter(s)"


def compare(manifest: Manifest, live: Mapping[str, Mapping[str, Any]], *, per_rank: bool) -> list[Difference]:
    """Differences between a checkpoint and the live state (each entry as :func:`describe_entry` says).

    Entries the checkpoint lacks are found from its file list, so even checkpoints written before
    ``contents`` existed get that much checked; the rest needs ``contents``.
    """
    saved_entries: Mapping[str, Any] | None = (manifest.contents or {}).get("entries")
    differences = []
    for entry, described in live.items():
        saved = saved_entries.get(entry) if saved_entries is not None else None
        if saved is not None:
            differences.extend(_compare_entry(entry, saved, described))
        elif saved_entries is not None or not _has_files(manifest, entry, per_rank):
            differences.append(Difference(entry, "entry", "absent", f"{described['kind']} {_kind_text(described)}"))
    return differences


def make_report(
    name: str, manifest: Manifest, differences: list[Difference], live: Mapping[str, Mapping[str, Any]]
) -> ResumeReport:
    """What a non-strict resume leaves out: whole entries whose kind, class or layout differ (and
    tensors that do not fit), else a module's keys that do not fit (the rest of it loads)."""
    report = ResumeReport(name, manifest.step, checked=manifest.contents is not None, differences=differences)
    for difference in differences:
        kind = live[difference.entry]["kind"]
        whole = difference.key in ("entry", "class", "param_groups") or kind in ("tensor", "optimizer")
        if whole and difference.entry not in report.skipped_entries:
            report.skipped_entries.append(difference.entry)
    for difference in differences:
        if difference.entry not in report.skipped_entries:
            report.skipped_keys.setdefault(difference.entry, []).append(difference.key)
    return report


def refuse_newer_format(read: Callable[..., object], *args: Any) -> None:
    """Raise if the manifest ``read(*args)`` returns is of a newer format; other problems are not this one's."""
    try:
        read(*args)
    except ManifestFormatError:
        raise
    except Exception:  # a missing or broken manifest: an incomplete checkpoint, skipped as before
        return


def _has_files(manifest: Manifest, entry: str, per_rank: bool) -> bool:
    if entry in (manifest.meta.get("model"), *(manifest.meta.get("optimizers") or [])):
        return True  # in the sharded (DCP) files
    names = [entry_file(entry)] if not per_rank else [entry_file(entry, r) for r in range(manifest.world_size)]
    return any(name in manifest.files for name in names)
