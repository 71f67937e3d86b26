"""The Hugging Face callback beside the Trainer's own evaluation and saving, in this process (a tiny
BERT on CPU): a notice's checkpoint is written whatever ``save_strategy`` says after an evaluation,
and the Trainer's best model stays where ``load_best_model_at_end`` looks for it."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import transformers

from spotguard import EXIT_STOPPED
from spotguard.integrations.transformers import SpotguardCallback
from tests.e2e.integration_trainers import TokenDataset

warnings.filterwarnings("ignore", category=FutureWarning)


def tiny_trainer(tmp_path: Path, callbacks: list[Any], **arguments: Any) -> transformers.Trainer:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100
    )
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=6,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        logging_strategy="no",
        **arguments,
    )
    return transformers.Trainer(
        model=transformers.BertForSequenceClassification(config),
        args=args,
        train_dataset=TokenDataset(),
        eval_dataset=TokenDataset(8),
        compute_metrics=lambda _: {"const": 1.0},
        callbacks=callbacks,
    )


def test_a_notice_under_save_strategy_best_is_saved_though_the_metric_did_not_improve(tmp_path: Path) -> None:
    """After an evaluation the Trainer sets should_save to whether the metric improved: a notice's
    checkpoint was dropped, and with an evaluation at every step never written, nor the loop stopped."""
    callback = SpotguardCallback(socket=str(tmp_path / "none.sock"), daemon_wait=0.1)

    class SigtermAtStep2(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 2:
                assert callback.guard is not None
                callback.guard.notify_sigterm()  # as Guard's own SIGTERM handler, or a notice, does

    trainer = tiny_trainer(
        tmp_path,
        [SigtermAtStep2(), callback],
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="best",
        metric_for_best_model="const",
        greater_is_better=True,
    )
    trainer.train()
    assert trainer.state.global_step == 2
    assert callback.last_saved is not None and callback.last_saved.name == "step-000000002"
    assert callback.exit_code == EXIT_STOPPED  # the run goes on elsewhere: no exit 0


def test_the_trainers_best_model_stays_where_load_best_model_at_end_looks(tmp_path: Path) -> None:
    """The callback moved the Trainer's checkpoint-N into its step directory, also the one the Trainer
    keeps as its best model: at the end it logged that it could not find it and kept the last weights."""
    callback = SpotguardCallback(socket=str(tmp_path / "none.sock"), every_steps=2, daemon_wait=0.1)
    trainer = tiny_trainer(
        tmp_path,
        [callback],
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="const",
        greater_is_better=True,
    )
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None and Path(best).is_dir(), best
    out = tmp_path / "out"
    steps = sorted(p.name for p in out.glob("step-*"))
    assert steps[-1] == "step-000000006"
    assert (out / "step-000000002" / "checkpoint-2").is_dir() or "step-000000002" not in steps
    assert callback.exit_code == 0
