"""The Lightning callback with Lightning's own AsyncCheckpointIO plugin, in this process (CPU): the
checkpoint is committed with its file, not before the plugin's thread has written it."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from spotguard.integrations.lightning import SpotguardCallback
from spotguard.manifest import load_manifest

warnings.filterwarnings("ignore", ".*does not have many workers.*")


class Wide(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(1024, 2048)  # 8 MiB of weights, 24 MiB with AdamW's state

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_a_checkpoint_written_by_async_checkpoint_io_is_committed_with_its_file(tmp_path: Path) -> None:
    """The plugin's save only queues the write: the manifest was committed listing no file, so the
    upload (and a peer, and a restore) copied none, and a fresh VM's resume_path() found nothing."""
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 1024)), batch_size=4)
    root = tmp_path / "ckpt"
    callback = SpotguardCallback(checkpoint_dir=root, socket=tmp_path / "none.sock", every_steps=2, daemon_wait=0.1)
    trainer = pl.Trainer(
        max_steps=2,
        callbacks=[callback],
        plugins=[AsyncCheckpointIO()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    trainer.fit(Wide(), data)
    step_dir = callback.last_saved
    assert step_dir is not None
    files = load_manifest(step_dir).files
    assert list(files) == ["lightning.ckpt"]
    assert files["lightning.ckpt"].size == (step_dir / "lightning.ckpt").stat().st_size > 24 << 20
