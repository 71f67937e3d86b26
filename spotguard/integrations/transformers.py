"""``SpotguardCallback`` for the Hugging Face ``Trainer``: one line survives a spot interruption.

>>> from spotguard.integrations.transformers import SpotguardCallback
>>> cb = SpotguardCallback(bucket="s3://b/run1")          # checkpoints live in TrainingArguments.output_dir
>>> trainer = transformers.Trainer(model=model, args=args, callbacks=[cb], ...)
>>> trainer.train(resume_from_checkpoint=cb.resume_path(args.output_dir))

At the end of an optimizer step (``on_step_end``) where a notice arrived (daemon ``checkpoint-now``,
SIGTERM) or a periodic save is due (``every_steps``/``every_seconds``), the callback asks the Trainer
to save (``control.should_save``). The Trainer writes its own ``checkpoint-N/`` (model, optimizer,
scheduler, RNG states, ``trainer_state.json``) into ``output_dir``; in ``on_save`` the callback moves it
into a fresh spotguard step directory, ``<output_dir>/step-NNNNNNNNN/checkpoint-N/``, records every
file in ``manifest.json``, commits it last and tells the daemon, which uploads it. Where nodes have
disks of their own, each node's leader moves what the Trainer wrote on its disk (its processes' RNG
states, its shards under FSDP) and each node commits its share. A hard notice then
sets ``control.should_training_stop``. ``resume_path(output_dir)`` returns that ``checkpoint-N``
folder of the newest *complete* checkpoint (manifest valid, CRC32C checked), downloading it from the
bucket when ``output_dir`` has none. ``transformers.trainer_utils.get_last_checkpoint`` only looks
for the newest ``checkpoint-N`` name, and picks one a killed process left half-written.

Between step boundaries. A notice is also looked for before the first step (``on_train_begin``) and
at every evaluation batch inside ``train`` (``on_prediction_step``, and ``on_evaluate``). The model does
not change during evaluation, so the callback asks the Trainer to save the last completed step
(``state.global_step``) and to stop; the Trainer writes it as soon as the evaluation returns. The
Trainer's evaluation loop consults no ``TrainerControl`` flag, so an evaluation cannot be cut short
from a callback: keep one evaluation well inside the notice window (GCP gives 30 s), or call
``guard.should_checkpoint`` yourself in a loop of your own. A notice before the first step is
acknowledged there and answered after the first step (the Trainer saves only after a step).

The Trainer's own saves (``save_steps``) stay where the Trainer puts them and are not committed; run
the daemon with ``--checkpoint-dir`` set to ``output_dir`` so that it uploads what the callback commits.

Exact resume holds with the Trainer's defaults: ``accelerator_config.use_seedable_sampler=True``
(the default) makes each epoch's order a function of the seed and the epoch; the Trainer skips the
batches already trained in the interrupted epoch and restores the RNG states after fetching the
first batch, so dropout continues where it stopped. ``ignore_data_skip=True`` or a sampler that draws
from the global RNG without the seedable wrapper breaks it mid-epoch.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Unpack

import transformers

from spotguard.integrations.common import ResumeAnswer, check_ranks_resume_alike, checked_options, resume_for
from spotguard.notice import EXIT_STOPPED
from spotguard.trainer.external import AlreadyCommitted
from spotguard.trainer.settings import GuardOptions

if TYPE_CHECKING:
    from spotguard.trainer.guard import Guard

logger = logging.getLogger("spotguard.integrations")

FRAMEWORK = "transformers"
_PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR


class SpotguardCallback(transformers.TrainerCallback):
    """Checkpoint a Hugging Face ``Trainer`` run when the VM is about to go away; resume it exactly.

    >>> cb = SpotguardCallback(bucket="s3://b/run1", every_steps=500)
    >>> trainer = transformers.Trainer(model=model, args=args, callbacks=[cb], train_dataset=ds)
    >>> trainer.train(resume_from_checkpoint=cb.resume_path(args.output_dir))

    Takes the keyword arguments of :class:`spotguard.Guard`; the checkpoint root is ``checkpoint_dir``
    when given, else ``TrainingArguments.output_dir``.
    """

    def __init__(self, **options: Unpack[GuardOptions]) -> None:
        self.checkpoint_dir = options.get("checkpoint_dir")
        self._guard_options = checked_options(options)
        self.guard: Guard | None = None
        self.last_saved: Path | None = None  # the step directory of the last committed checkpoint
        # ``sys.exit(callback.exit_code)`` after training: EXIT_STOPPED once a hard notice stopped it.
        self.exit_code = 0
        self._save_step: int | None = None  # the step this callback asked the Trainer to save
        self._resumed: ResumeAnswer = None  # what resume_path() found, compared across ranks at train begin

    # --- resume ------------------------------------------------------------------------------

    def resume_path(self, output_dir: str | os.PathLike[str] | None = None, model: Any = None) -> str | None:
        """``resume_from_checkpoint`` for ``trainer.train``: the newest complete ``checkpoint-N`` folder, or None.

        Fetches it from the bucket into the root when the root has none. Given the model
        (``cb.resume_path(args.output_dir, model=trainer.model)``), first compares it with what the
        checkpoint's manifest records and raises :class:`~spotguard.SpotguardMismatch` on a mismatch,
        before anything is fetched. The optimizer is not checked: the Trainer creates it only inside
        ``train()``. The Trainer loads the checkpoint itself, so there is no ``strict=False`` here.
        """
        live = {"model": model} if model is not None else None
        found, self._resumed = resume_for(self._guard_options, FRAMEWORK, live, self._root(output_dir))
        return str(found) if found is not None else None

    def _root(self, output_dir: str | os.PathLike[str] | None) -> str | os.PathLike[str]:
        root = self.checkpoint_dir if self.checkpoint_dir is not None else output_dir
        if root is None:
            raise ValueError("SpotguardCallback needs a checkpoint root: pass output_dir (or checkpoint_dir=)")
        return root

    # --- lifetime ----------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if getattr(args, "save_only_model", False):
            logger.warning(
                "spotguard: save_only_model=True leaves the optimizer, scheduler and RNG states out of "
                "checkpoints; a resumed run will not continue where it stopped"
            )
        if self.guard is None:
            from spotguard.trainer.guard import Guard

            # Before the first step, which is the first collective a disagreement would hang in.
            check_ranks_resume_alike(self._resumed)
            # Built here: the Trainer has set up torch.distributed, so the Guard knows its rank.
            options = self._guard_options.copy()
            options["checkpoint_dir"] = self._root(args.output_dir)
            self.guard = Guard(**options)
        # A notice already here (told when the hook connected): the daemon hears that it was seen.
        self.guard.should_checkpoint(state.global_step, periodic=False)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.guard is not None:
            self.guard.close()
            self.guard = None

    # --- the step boundary -------------------------------------------------------------------

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.guard is not None and self.guard.should_checkpoint(state.global_step):
            self._save_step = state.global_step
            control.should_save = True  # the Trainer writes checkpoint-N, then calls on_save
            if self.guard.save_reason() != "periodic":
                # No evaluation against a deadline; and after one, save_strategy="best" sets should_save
                # to whether the metric improved, which dropped the notice's checkpoint.
                control.should_evaluate = False

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._save_after_evaluation(state, control)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._save_after_evaluation(state, control)

    def _save_after_evaluation(self, state: Any, control: Any) -> None:
        # Every rank evaluates the same number of batches, so the agreement inside holds.
        if self.guard is not None and self.guard.should_checkpoint(state.global_step, periodic=False):
            # The weights are those of the last completed step; _maybe_log_save_evaluate saves
            # right after the evaluation returns, then on_save commits it and stops training.
            self._save_step = state.global_step
            control.should_save = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        guard = self.guard
        step = state.global_step
        if guard is None or self._save_step != step:
            return  # the Trainer's own periodic save: left where the Trainer keeps it
        self._save_step = None
        # Where Trainer._save_checkpoint wrote it (hyperparameter search runs are not supported).
        written = Path(args.output_dir) / f"{_PREFIX}-{step}"
        relpath = written.name
        try:
            live = {"model": kwargs["model"]} if kwargs.get("model") is not None else None
            with guard.external_save(step, {"framework": FRAMEWORK, "resume": relpath}, live) as step_dir:
                # Each disk's leader takes what the Trainer wrote there: rank 0's disk holds the model;
                # where nodes have disks of their own, another's holds its processes' RNG states (and
                # shards, under FSDP), which would otherwise be missing from the checkpoint and left
                # behind in output_dir at every save.
                if guard.node_leader and written.is_dir():
                    _take(written, step_dir / relpath, keep=_same_dir(state.best_model_checkpoint, written))
                elif guard.rank == 0:
                    # Raised inside the commit, so every rank hears of it instead of waiting for rank 0.
                    raise FileNotFoundError(f"spotguard: the Trainer's checkpoint {written} is not where it should be")
        except AlreadyCommitted as exc:
            step_dir = exc.step_dir
        if guard.last_checkpoint == step_dir:  # else a periodic save the full disk skipped (logged)
            self.last_saved = step_dir
        if guard.stop_requested:
            control.should_training_stop = True
            self.exit_code = EXIT_STOPPED


def _same_dir(path: str | None, written: Path) -> bool:
    return path is not None and Path(path).resolve() == written.resolve()


def _take(written: Path, destination: Path, *, keep: bool) -> None:
    """The Trainer's checkpoint into the step directory: a rename when output_dir is the root (the
    usual case), nothing copied. ``keep``: the Trainer still points at it (its best model, which
    load_best_model_at_end loads): linked file by file (copied across filesystems) and left in place."""
    if not keep:
        shutil.move(written, destination)
        return

    def link(source: str, target: str) -> None:
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)

    shutil.copytree(written, destination, copy_function=link)
