"""ResumableDistributedSampler: each rank's batches after a resume are those of an uninterrupted run,
at a step inside an epoch and at an epoch's last step."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchdata")

from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from spotguard.trainer.samplers import ResumableDistributedSampler  # noqa: E402

SAMPLES, BATCH, RANKS, EPOCHS = 40, 4, 2, 3
BATCHES_PER_EPOCH = SAMPLES // RANKS // BATCH  # 5


def loader(rank: int) -> StatefulDataLoader:
    sampler = ResumableDistributedSampler(range(SAMPLES), num_replicas=RANKS, rank=rank, shuffle=True, seed=1)
    return StatefulDataLoader(range(SAMPLES), batch_size=BATCH, sampler=sampler)


def batches(data: StatefulDataLoader, epochs: range, *, stop_after: int | None = None) -> list[list[int]]:
    """The batches of ``epochs``, the sampler's epoch set before each as a training loop does; stops
    after ``stop_after`` batches in all."""
    seen: list[list[int]] = []
    for epoch in epochs:
        data.sampler.set_epoch(epoch)
        for batch in data:
            seen.append(batch.tolist())
            if len(seen) == stop_after:
                return seen
    return seen


@pytest.mark.parametrize("rank", range(RANKS))
@pytest.mark.parametrize("stop", [BATCHES_PER_EPOCH + 2, 2 * BATCHES_PER_EPOCH], ids=["mid-epoch", "epoch-end"])
def test_a_resumed_rank_sees_the_batches_of_an_uninterrupted_run(rank: int, stop: int) -> None:
    uninterrupted = batches(loader(rank), range(EPOCHS))
    assert len(uninterrupted) == EPOCHS * BATCHES_PER_EPOCH

    first = loader(rank)
    before = batches(first, range(EPOCHS), stop_after=stop)
    state = first.state_dict()

    resumed = loader(rank)
    resumed.load_state_dict(state)
    # The epoch under way (mid-epoch), or the next one (the last stopped at an epoch's end).
    after = batches(resumed, range(stop // BATCHES_PER_EPOCH, EPOCHS))
    assert before + after == uninterrupted


def test_the_ranks_split_each_epoch_and_the_epochs_differ() -> None:
    runs = [batches(loader(rank), range(2)) for rank in range(RANKS)]
    for epoch in range(2):
        shares = [[i for batch in run[epoch * BATCHES_PER_EPOCH :][:BATCHES_PER_EPOCH] for i in batch] for run in runs]
        assert sorted(shares[0] + shares[1]) == list(range(SAMPLES))
    assert runs[0][:BATCHES_PER_EPOCH] != runs[0][BATCHES_PER_EPOCH:]
