"""A distributed sampler that resumes exactly after a checkpoint taken at any step, an epoch's last included.

>>> from spotguard.trainer.samplers import ResumableDistributedSampler
>>> sampler = ResumableDistributedSampler(dataset, shuffle=True, seed=1)  # torch's DistributedSampler's arguments
>>> loader = StatefulDataLoader(dataset, batch_size=32, sampler=sampler, generator=torch.Generator().manual_seed(2))

Under DDP each rank's loader needs a sampler that gives it its share of the dataset and saves how far
into the epoch it got: torchdata's ``StatefulDistributedSampler`` does both, and its order depends on
the seed and the epoch alone. One case it gets wrong (torchdata 0.11, meta-pytorch/data#1513): loaded
from a state taken at an epoch's end, it skips the next epoch's indices as if they had been yielded,
so the resumed run trains on an empty epoch and goes on one epoch of data behind an uninterrupted
run. A checkpoint lands there whenever a notice or a periodic save comes at an epoch's last batch.
This subclass starts the next epoch whole there; anywhere else it is torchdata's.
"""

from __future__ import annotations

from typing import Any

from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler


class ResumableDistributedSampler(StatefulDistributedSampler):
    """torchdata's ``StatefulDistributedSampler`` (same arguments, same order), whose state taken at an
    epoch's end resumes into a whole next epoch instead of an empty one."""

    next_yielded: int | None  # torchdata's: where the next ``__iter__`` starts (None: at the epoch's first)
    num_samples: int  # torch's: this rank's share of an epoch

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if self.next_yielded is not None and self.next_yielded >= self.num_samples:
            self.next_yielded = None  # that epoch was finished: the next one starts at its first index


__all__ = ["ResumableDistributedSampler"]
