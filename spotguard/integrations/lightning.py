"""``SpotguardCallback`` for Lightning: one line in an existing ``Trainer`` survives a spot interruption.

>>> from spotguard.integrations.lightning import SpotguardCallback
>>> cb = SpotguardCallback(checkpoint_dir="/nvme/ckpt", bucket="s3://b/run1")   # Guard's keyword arguments
>>> trainer = lightning.Trainer(callbacks=[cb], ...)
>>> trainer.fit(model, datamodule=dm, ckpt_path=cb.resume_path())             # None: start from scratch

At an optimizer-step boundary (``on_train_batch_end``) where a notice arrived (daemon ``checkpoint-now``,
SIGTERM) or a periodic save is due (``every_steps``/``every_seconds``), every rank calls
``trainer.save_checkpoint`` into a fresh ``<root>/step-NNNNNNNNN/lightning.ckpt``; rank 0 records the
files in ``manifest.json``, commits it last, and the daemon uploads it. A hard notice then sets
``trainer.should_stop``. Under DDP only rank 0 writes; a write that fails there (a full disk) still
takes it to the barrier the other ranks wait in, so that every rank hears the same error (a periodic
save on a full disk is skipped on all). ``resume_path()`` returns the ``lightning.ckpt`` of the newest *complete*
checkpoint (manifest valid, CRC32C checked), downloading it from the bucket when the local root has none.

Exact resume. Lightning checkpoints hold no RNG states, so the callback adds them (Python, NumPy,
torch CPU and CUDA) to its own checkpoint entry and restores them just before the first training
batch after the resume, when nothing else draws from them any more. Mid-epoch, Lightning restores
the position only for a resumable loader: use torchdata's ``StatefulDataLoader`` with generators of
its own for the loader and its sampler, and under DDP ``ResumableDistributedSampler`` with
``Trainer(use_distributed_sampler=False)`` (README, "Exact resume and DataLoaders"). A SIGTERM makes
Lightning raise its own ``SIGTERMException`` after the batch; the urgent checkpoint is committed by then.

Between step boundaries. A notice is also looked for before the first training step
(``on_train_start``), at every batch end of validation (the sanity check included), and at test and
predict batch ends inside ``fit``. The model does not change there, so the checkpoint is of the last
completed step (``trainer.global_step``), written by ``trainer.save_checkpoint`` at once; the loop in
progress then ends at that batch and ``trainer.should_stop`` ends the run. A checkpoint written inside
validation records the validation loop as interrupted: on resume Lightning fast-forwards it to its end
(as for a ``ModelCheckpoint`` written in ``on_validation_end``) and training continues with the next
step; the interrupted validation is not run again. A notice during the sanity check ends the sanity
check and is acted on in ``on_train_start``. ``validate``/``test``/``predict`` run on their own have no
training state to save and are not watched. Exact resume across a checkpoint taken inside validation
needs validation loaders that draw nothing from the global RNG (no shuffling, or their own generator).

Not covered by the tests: a notice during the sanity check or before the first step, iterable
loaders without a length (Lightning prefetches a batch ahead there, and the saved loader position
may count it), gradient accumulation (the callback checks only where an
optimizer step just happened, so it never saves in the middle of one), and callbacks listed after
this one that change state in ``on_train_batch_end`` (their change misses the checkpoint: list
``SpotguardCallback`` last).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Unpack

import lightning.pytorch as pl
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from spotguard.integrations.common import ResumeAnswer, check_ranks_resume_alike, checked_options, resume_for
from spotguard.notice import EXIT_STOPPED
from spotguard.trainer.external import AlreadyCommitted
from spotguard.trainer.settings import GuardOptions

if TYPE_CHECKING:
    from spotguard.trainer.guard import Guard

logger = logging.getLogger("spotguard.integrations")

FRAMEWORK = "lightning"
CKPT_NAME = "lightning.ckpt"
_STATE_FORMAT = 1


def _save_checkpoint(trainer: pl.Trainer, path: Path) -> None:
    """``trainer.save_checkpoint(path)``; where this rank's write fails, the rank still enters the barrier
    that ``save_checkpoint`` ends with before the error goes on. Under DDP only rank 0 writes and the
    others wait in that barrier: without it, rank 0 would meet them in the ranks' agreement on the
    failure instead (another collective), and the run would hang until the process group's timeout."""
    strategy = trainer.strategy
    write = strategy.save_checkpoint
    own = vars(strategy).get("save_checkpoint")  # set on the instance by someone else: put back after
    write_failed = False

    def save(*args: Any, **kwargs: Any) -> None:
        nonlocal write_failed
        try:
            write(*args, **kwargs)
            _finish_queued_write(strategy)
        except BaseException:
            write_failed = True
            raise

    strategy.save_checkpoint = save  # type: ignore[method-assign]  # this call's only: restored below
    try:
        trainer.save_checkpoint(path)
    except BaseException:
        if write_failed and trainer.world_size > 1:
            try:
                strategy.barrier("Trainer.save_checkpoint")
            except Exception:  # a rank is gone: the agreement that follows reports it
                logger.warning("spotguard: the barrier after a failed checkpoint write failed", exc_info=True)
        raise
    finally:
        if own is None:
            del strategy.save_checkpoint  # the class's method again
        else:
            strategy.save_checkpoint = own  # type: ignore[method-assign]


def _warn_if_sampler_wrapped(loaders: Any) -> None:
    """Warn where the training loader's sampler is a distributed one that saves no place in the epoch:
    what Lightning's ``use_distributed_sampler`` (its default) puts there. With torchdata 0.11 that is
    its ``DistributedSamplerWrapper``, with torchdata 0.10 torch's own ``DistributedSampler``; in both
    a drilled mid-epoch resume ended with other parameters than an uninterrupted run."""
    from torch.utils.data.distributed import DistributedSampler

    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    for loader in loaders if isinstance(loaders, list | tuple) else [loaders]:
        # Lightning rebuilds the loader around a batch sampler, whose sampler is the one it chose.
        samplers = (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None))
        for sampler in samplers:
            if isinstance(sampler, DistributedSampler) and not callable(getattr(sampler, "state_dict", None)):
                logger.warning(
                    "spotguard: the training loader's sampler is a %s, which keeps no place in the epoch "
                    "(Lightning puts one there with use_distributed_sampler=True, its default): a resumed run "
                    "will not see the batches an uninterrupted one sees. Return a ResumableDistributedSampler "
                    "(spotguard.trainer.samplers) from train_dataloader() and pass "
                    "Trainer(use_distributed_sampler=False)",
                    type(sampler).__name__,
                )
                return


def _live(model: Any, optimizers: list[Any]) -> dict[str, Any]:
    """What the manifest records: the module and its optimizers (``optimizer``, ``optimizer1``, ...)."""
    named = {("optimizer" if index == 0 else f"optimizer{index}"): opt for index, opt in enumerate(optimizers)}
    return {"model": model, **named}


class SpotguardCallback(pl.Callback):
    """Checkpoint a Lightning run when the VM is about to go away; resume it exactly.

    >>> cb = SpotguardCallback(checkpoint_dir="/nvme/ckpt", bucket="s3://b/run1", every_steps=1000)
    >>> trainer = lightning.Trainer(callbacks=[cb])
    >>> trainer.fit(model, datamodule=dm, ckpt_path=cb.resume_path())

    Takes the keyword arguments of :class:`spotguard.Guard`. ``handle_sigterm`` uses Lightning's
    own SIGTERM handler (``trainer.received_sigterm``) rather than installing another.
    """

    def __init__(self, **options: Unpack[GuardOptions]) -> None:
        self.handle_sigterm = options.get("handle_sigterm", True)
        options["handle_sigterm"] = False  # Lightning's own handler takes the signal (see _take_sigterm)
        self._guard_options = checked_options(options)
        self.guard: Guard | None = None
        self.last_saved: Path | None = None  # the step directory of the last committed checkpoint
        # ``sys.exit(callback.exit_code)`` after training: EXIT_STOPPED once a hard notice stopped it.
        self.exit_code = 0
        self._checked_step: int | None = None
        self._rng_to_restore: dict[str, Any] | None = None
        self._resumed: ResumeAnswer = None  # what resume_path() found, compared across ranks in setup()

    # --- resume ------------------------------------------------------------------------------

    def resume_path(self, model: Any = None, optimizer: Any = None) -> str | None:
        """``ckpt_path`` for ``trainer.fit``: the newest complete checkpoint's ``lightning.ckpt``, or None.

        Fetches it from the bucket into the local root when the local root has none. Given the
        LightningModule (and, if it exists yet, its optimizer), first compares them with what the
        checkpoint's manifest records and raises :class:`~spotguard.SpotguardMismatch` on a mismatch,
        before anything is fetched: ``cb.resume_path(model)``. Lightning loads the checkpoint itself
        (strictly), so there is no ``strict=False`` here.
        """
        live = {key: value for key, value in (("model", model), ("optimizer", optimizer)) if value is not None}
        found, self._resumed = resume_for(self._guard_options, FRAMEWORK, live)
        return str(found) if found is not None else None

    # --- lifetime ----------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.guard is not None:
            return
        from spotguard.trainer.guard import Guard

        # Here, not in __init__: torch.distributed is up now (the Guard knows its rank), and Lightning
        # has loaded no checkpoint yet.
        check_ranks_resume_alike(self._resumed)
        self.guard = Guard(**self._guard_options)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self.guard is not None:
            self.guard.close()
            self.guard = None

    # --- the step boundary -------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._checked_step = trainer.global_step  # a resumed run does not save its starting step again
        if trainer.global_rank == 0:
            _warn_if_sampler_wrapped(trainer.train_dataloader)
        # Before the first step (after the sanity check and loader setup, which can take long).
        self._check_between_steps(trainer)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._rng_to_restore is not None:
            from spotguard.trainer.state import restore_rng

            # As late as possible: setting up loaders, the sanity check and the first fetch are done.
            restore_rng(self._rng_to_restore)
            self._rng_to_restore = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        guard = self.guard
        if guard is None:
            return
        step = trainer.global_step
        if step == self._checked_step:
            return  # accumulating gradients: no optimizer step since the last boundary
        self._checked_step = step
        self._take_sigterm(trainer, guard)
        if guard.should_checkpoint(step):
            self._save(trainer, guard, step)

    def _take_sigterm(self, trainer: pl.Trainer, guard: Guard) -> None:
        if self.handle_sigterm and getattr(trainer, "received_sigterm", False):
            guard.notify_sigterm()  # what Guard's own handler would have done

    def _save(self, trainer: pl.Trainer, guard: Guard, step: int) -> None:
        try:
            meta = {"framework": FRAMEWORK, "resume": CKPT_NAME}
            with guard.external_save(step, meta, _live(trainer.lightning_module, trainer.optimizers)) as step_dir:
                _save_checkpoint(trainer, step_dir / CKPT_NAME)
        except AlreadyCommitted as exc:
            step_dir = exc.step_dir
        if guard.last_checkpoint == step_dir:  # else a periodic save the full disk skipped (logged)
            self.last_saved = step_dir
        if guard.stop_requested:
            trainer.should_stop = True
            self.exit_code = EXIT_STOPPED

    # --- between step boundaries: evaluation, before the first step -------------------------

    def _check_between_steps(self, trainer: pl.Trainer) -> bool:
        """Act on a notice outside a training step; True if the loop in progress should end now.

        Every rank reaches the same hooks, so the agreement inside ``should_checkpoint`` holds.
        """
        guard = self.guard
        if guard is None:
            return False
        self._take_sigterm(trainer, guard)
        if not guard.should_checkpoint(trainer.global_step, periodic=False):
            return False
        if trainer.sanity_checking:
            # Nothing is trained and the fit loop has not started: end the sanity check; the notice
            # is still there in on_train_start, where the loops are in the state a resume expects.
            return True
        # The model has not changed since the last optimizer step: that step is what is saved.
        self._save(trainer, guard, trainer.global_step)
        return guard.stop_requested

    def _end_loop_if_stopping(self, trainer: pl.Trainer) -> None:
        if self._check_between_steps(trainer):
            # Lightning's evaluation loop ends cleanly on a StopIteration from inside its step
            # (hooks included): the epoch-end hooks run on what was evaluated so far.
            raise StopIteration

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *batch_args: Any) -> None:
        self._end_loop_if_stopping(trainer)

    def on_test_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *batch_args: Any) -> None:
        self._end_loop_if_stopping(trainer)

    def on_predict_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *batch_args: Any) -> None:
        self._end_loop_if_stopping(trainer)

    # --- what goes into Lightning's checkpoint -----------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Called on every rank by ``trainer.save_checkpoint``; only rank 0's copy is written, so it
        carries every rank's RNG states."""
        from spotguard.trainer import dist
        from spotguard.trainer.state import capture_rng

        states = [capture_rng()]
        if dist.active() and dist.world_size() > 1:
            import torch.distributed

            gathered: list[Any] = [None] * dist.world_size()
            torch.distributed.all_gather_object(gathered, states[0])
            states = gathered
        return {"format": _STATE_FORMAT, "rng": states}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from spotguard.trainer import dist

        if state_dict.get("format") != _STATE_FORMAT:
            logger.warning("spotguard: no RNG states of a known format in the checkpoint; not restoring them")
            return
        states = state_dict["rng"]
        # Another number of ranks than the run that saved: every rank takes rank 0's states.
        rank = dist.rank() if len(states) == dist.world_size() else 0
        self._rng_to_restore = states[rank]


def _finish_queued_write(strategy: Any) -> None:
    """Lightning's AsyncCheckpointIO only queues the write (a thread of its own): wait for it, its
    error raised here, before the step directory is committed. The commit listed no file, and a fresh
    VM's resume found nothing to resume. Its teardown waits and raises; its next save sets it up again."""
    io = getattr(strategy, "checkpoint_io", None)
    if isinstance(io, AsyncCheckpointIO):
        io.teardown()
