"""Tiny Lightning and Hugging Face trainers wired with ``SpotguardCallback``, run as subprocesses by the tests.

``python -m tests.e2e.integration_trainers --framework lightning|transformers --root DIR --socket PATH
--steps N [--bucket URL] [--out FILE] [--wait-notice-at K] [--every-steps S] [--eval-every E
[--wait-notice-in-eval-at K]] [--wait-notice-at-start] [--devices N]`` prints JSON lines (``resumed``, ``step``,
``eval`` (one per evaluation batch), ``waiting``, ``saved``, ``stopped``/``finished``) like
``spotguard.demo``; ``--out`` gets the final parameters, optimizer and scheduler state of an unstopped
run. With ``--eval-every E`` an evaluation of ``EVAL_BATCHES`` batches runs every E steps;
``--wait-notice-in-eval-at K`` holds in the second batch of the first evaluation at or after step K, and
``--wait-notice-at-start`` (Lightning) in ``on_train_start``, until the notice reached the callback.
``--devices N`` (Lightning): N ranks under DDP (gloo; Lightning's own launcher, or torchrun's processes
when it runs under torchrun); rank 0 prints. ``--roots R0,R1`` (under torchrun): each rank's root (the
Trainer's output_dir, the Lightning callback's checkpoint_dir), as on nodes with disks of their own;
``--sockets S0,S1`` each rank's daemon (one per node) and ``--wait-rank R`` holds on rank R alone (a notice
that reached one node: the others go on to the step's agreement and wait there).

Both models have dropout, AdamW and a per-step LR schedule; 96 samples in batches of 8 (12 steps an
epoch), so a resume at k not divisible by 12 continues mid-epoch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from spotguard.demo import emit
from spotguard.manifest import load_manifest

SAMPLES = 96
BATCH = 8
STEPS_PER_EPOCH = SAMPLES // BATCH
EVAL_BATCHES = 20


def hold(step: int, notice_arrived: Callable[[], bool], timeout: float = 60.0) -> None:
    """Hold at ``step`` until the notice (daemon drill or SIGTERM) has reached the callback, so that the
    checkpoint lands at exactly this step; the notice still travels the real path (like
    ``spotguard.demo.wait_for_notice``)."""
    emit("waiting", step=step)
    deadline = time.monotonic() + timeout
    while not notice_arrived():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no notice arrived within {timeout} s at step {step}")
        time.sleep(0.005)


def eval_holder(args: argparse.Namespace) -> Callable[[int, int], bool]:
    """Whether to hold at this evaluation batch: the second batch of the first evaluation at or after
    ``--wait-notice-in-eval-at`` (the evaluation is then under way when the notice comes)."""
    held: list[int] = []

    def hold_here(step: int, batch_idx: int) -> bool:
        at = args.wait_notice_in_eval_at
        if at is None or held or step < at or batch_idx != 1:
            return False
        held.append(step)
        return True

    return hold_here


def _resumed_step(path: str | None) -> int:
    return 0 if path is None else load_manifest(Path(path).parent).step


def torchrun_rank() -> int:
    return int(os.environ.get("RANK", "0"))  # under torchrun; one process otherwise


def this_ranks(args: argparse.Namespace) -> tuple[Path, Path]:
    """This rank's root and daemon socket: ``--roots``/``--sockets`` pick one per rank (a node each)."""
    rank = torchrun_rank()
    root = args.root if args.roots is None else Path(args.roots.split(",")[rank])
    socket = args.socket if args.sockets is None else Path(args.sockets.split(",")[rank])
    return root, socket


# --- Lightning ---------------------------------------------------------------------------------


def run_lightning(args: argparse.Namespace) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import RandomSampler

    from spotguard.integrations.lightning import SpotguardCallback
    from spotguard.trainer.samplers import ResumableDistributedSampler

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(64, 1)
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            inputs, targets = batch
            return torch.nn.functional.mse_loss(self.net(inputs), targets)

        def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            inputs, targets = batch
            return torch.nn.functional.mse_loss(self.net(inputs), targets)

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
            scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=500)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    class Data(pl.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            generator = torch.Generator().manual_seed(0)
            self.dataset = torch.utils.data.TensorDataset(
                torch.randn(SAMPLES, 16, generator=generator), torch.randn(SAMPLES, 1, generator=generator)
            )

        def train_dataloader(self) -> Any:
            # Own generators for the loader and its sampler, and under DDP a sampler of our own that
            # saves its place (README, "Exact resume and DataLoaders").
            sampler: Any = (
                ResumableDistributedSampler(self.dataset, shuffle=True, seed=1)
                if args.devices > 1 and not args.lightning_wraps_sampler
                else RandomSampler(self.dataset, generator=torch.Generator().manual_seed(1))
            )
            return StatefulDataLoader(
                self.dataset, batch_size=BATCH, sampler=sampler, generator=torch.Generator().manual_seed(2)
            )

        def val_dataloader(self) -> Any:
            generator = torch.Generator().manual_seed(3)
            samples = EVAL_BATCHES * BATCH
            dataset = torch.utils.data.TensorDataset(
                torch.randn(samples, 16, generator=generator), torch.randn(samples, 1, generator=generator)
            )
            return torch.utils.data.DataLoader(dataset, batch_size=BATCH)

    root, socket = this_ranks(args)
    cb = SpotguardCallback(checkpoint_dir=root, bucket=args.bucket, socket=socket, every_steps=args.every_steps)
    rank = torchrun_rank()

    class Progress(pl.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            step = trainer.global_step
            if trainer.global_rank == 0:
                emit("step", step=step, loss=round(float(outputs["loss"]), 6))
            if args.wait_notice_at == step and args.wait_rank in (None, rank):
                # Lightning's own SIGTERM handler sets trainer.received_sigterm; the callback reads it.
                hold(step, lambda: (cb.guard is not None and cb.guard.notice_pending) or trainer.received_sigterm)

        def on_train_start(self, trainer: Any, module: Any) -> None:
            if args.wait_notice_at_start:  # before the first step: a notice told when the hook connected
                hold(trainer.global_step, lambda: cb.guard is not None and cb.guard.notice_pending)

        def on_validation_batch_end(self, trainer: Any, module: Any, *batch_args: Any) -> None:
            step, batch_idx = trainer.global_step, batch_args[2]
            emit("eval", step=step, batch=batch_idx)
            if hold_in_eval(step, batch_idx):
                hold(step, lambda: cb.guard is not None and cb.guard.notice_pending)

    hold_in_eval = eval_holder(args)
    pl.seed_everything(0, verbose=False)
    module, data = Module(), Data()
    # Several ranks: a collective left unmatched fails in a minute, not at the default half hour.
    strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60)) if args.devices > 1 else "auto"
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        # Ours (above) under DDP; Lightning's would wrap it and lose its place.
        use_distributed_sampler=args.lightning_wraps_sampler,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        val_check_interval=args.eval_every,
        limit_val_batches=1.0 if args.eval_every else 0,
        callbacks=[Progress(), cb],
    )
    ckpt_path = cb.resume_path()
    if rank == 0:
        emit("resumed", step=_resumed_step(ckpt_path), path=ckpt_path)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return {
        "step": trainer.global_step,
        "rank": trainer.global_rank,
        "saved": cb.last_saved,
        "final": {
            "step": trainer.global_step,
            "model": module.state_dict(),
            "optimizer": trainer.optimizers[0].state_dict(),
            "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        },
    }


# --- Hugging Face Trainer ----------------------------------------------------------------------


class TokenDataset(torch.utils.data.Dataset):
    """Random token sequences with binary labels, as dicts (no ``datasets`` needed)."""

    def __init__(self, samples: int = SAMPLES, length: int = 16, vocab: int = 100) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, vocab, (samples, length), generator=generator)
        self.labels = torch.randint(0, 2, (samples,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.ids[index],
            "attention_mask": torch.ones_like(self.ids[index]),
            "labels": self.labels[index],
        }


def run_transformers(args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    from spotguard.integrations.transformers import SpotguardCallback

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100
    )
    model = transformers.BertForSequenceClassification(config)
    rank = torchrun_rank()
    root, socket = this_ranks(args)
    training_args = transformers.TrainingArguments(
        output_dir=str(root),
        max_steps=args.steps,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-3,
        weight_decay=0.01,
        warmup_steps=3,
        save_strategy="no",
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
        eval_strategy="steps" if args.eval_every else "no",
        eval_steps=args.eval_every,
        per_device_eval_batch_size=BATCH,
    )
    cb = SpotguardCallback(bucket=args.bucket, socket=socket, every_steps=args.every_steps)
    hold_in_eval = eval_holder(args)
    eval_batch = [0]

    class Progress(transformers.TrainerCallback):
        def on_step_end(self, hf_args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.is_world_process_zero:
                emit("step", step=state.global_step)
            if args.wait_notice_at == state.global_step and args.wait_rank in (None, rank):
                hold(state.global_step, lambda: cb.guard is not None and cb.guard.notice_pending)

        def on_evaluate(self, hf_args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            eval_batch[0] = 0

        def on_prediction_step(self, hf_args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            emit("eval", step=state.global_step, batch=eval_batch[0])
            if hold_in_eval(state.global_step, eval_batch[0]):
                hold(state.global_step, lambda: cb.guard is not None and cb.guard.notice_pending)
            eval_batch[0] += 1

    trainer = transformers.Trainer(
        model=model,
        args=training_args,
        train_dataset=TokenDataset(),
        eval_dataset=TokenDataset(samples=EVAL_BATCHES * BATCH) if args.eval_every else None,
        callbacks=[Progress(), cb],
    )
    resume = cb.resume_path(training_args.output_dir)
    if training_args.process_index == 0:
        emit("resumed", step=_resumed_step(resume), path=resume)
    trainer.train(resume_from_checkpoint=resume)
    return {
        "step": trainer.state.global_step,
        "rank": trainer.args.process_index,
        "saved": cb.last_saved,
        "final": {
            "step": trainer.state.global_step,
            "model": trainer.model.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.lr_scheduler.state_dict(),
        },
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.e2e.integration_trainers")
    parser.add_argument("--framework", choices=["lightning", "transformers"], required=True)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--roots", help="under torchrun: each rank's root (a node's disk)")
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--sockets", help="under torchrun: each rank's daemon socket (a node's daemon)")
    parser.add_argument("--wait-rank", type=int, help="with --wait-notice-at: the one rank that holds")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--bucket")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--wait-notice-at", type=int)
    parser.add_argument("--every-steps", type=int)
    parser.add_argument("--eval-every", type=int)
    parser.add_argument("--wait-notice-in-eval-at", type=int)
    parser.add_argument("--wait-notice-at-start", action="store_true")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument(
        "--lightning-wraps-sampler", action="store_true", help="Lightning's own distributed sampler (not exact)"
    )
    args = parser.parse_args(argv)

    warnings.filterwarnings("ignore")  # framework chatter (no GPU, few workers, ...) is not the test's business
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)  # same reduction order in every process
    result = run_lightning(args) if args.framework == "lightning" else run_transformers(args)
    if result.get("rank", 0) != 0:
        return 0  # rank 0 speaks for the run
    if result["saved"] is not None:
        emit("saved", step=load_manifest(result["saved"]).step, path=str(result["saved"]))
    stopped = result["step"] < args.steps
    if args.out is not None and not stopped:
        torch.save(result["final"], args.out)
    emit("stopped" if stopped else "finished", step=result["step"])
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Leave without tearing down DDP, as tests/e2e/dist_trainer.py does: the framework's DDP model
        # outlives main(), and freeing it at exit runs the gloo process group's destructor, which joins
        # a gloo thread that may wait for the GIL (torch 2.13). A rank aborted with "terminate called
        # without an active exception" once in a CI run, after its last step. Everything is written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
