from __future__ import annotations

import copy
import random
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler

from spotguard import Guard
from spotguard.localstore import scan_local
from spotguard.manifest import load_manifest
from spotguard.trainer.saving import Saver
from spotguard.trainer.state import StateError, capture_rng, read_state, restore_rng


@pytest.fixture
def guard(tmp_path: Path):  # type: ignore[no-untyped-def]
    g = Guard(checkpoint_dir=tmp_path / "ckpt", socket=tmp_path / "no-daemon.sock", handle_sigterm=False)
    yield g
    g.close()


def test_rng_states_round_trip_and_load_weights_only(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    saved = capture_rng()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    torch.save(saved, tmp_path / "rng.pt")
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_save_and_resume_model_optimizer_tensor_and_plain_data(guard: Guard, tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    counter = torch.arange(4.0)
    state = {"model": model, "optimizer": opt, "counter": counter, "extra": {"epoch": 3, "name": "run"}}
    guard.save(state, 9)

    model2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.AdamW(model2.parameters())
    counter2 = torch.zeros(4)
    state2 = {"model": model2, "optimizer": opt2, "counter": counter2, "extra": None}
    assert guard.resume(state2) == 9
    assert torch.equal(model2.weight, model.weight)
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert state2["counter"] is counter2 and torch.equal(counter2, counter)  # restored in place
    assert state2["extra"] == {"epoch": 3, "name": "run"}


def test_resume_with_nothing_saved_returns_zero(guard: Guard) -> None:
    assert guard.resume({"x": torch.zeros(1)}) == 0


def test_resume_skips_a_corrupt_newest_checkpoint(guard: Guard) -> None:
    guard.save({"x": torch.full((1000,), 1.0)}, 1)
    newest = guard.save({"x": torch.full((1000,), 2.0)}, 2)
    guard.wait()
    payload = newest / "x.pt"
    data = bytearray(payload.read_bytes())
    data[-100] ^= 0xFF
    payload.write_bytes(bytes(data))
    state = {"x": torch.zeros(1000)}
    assert guard.resume(state) == 1
    assert torch.equal(state["x"], torch.full((1000,), 1.0))


def test_missing_key_in_checkpoint_says_what_to_fix(guard: Guard) -> None:
    guard.save({"model": torch.nn.Linear(1, 1)}, 1)
    with pytest.raises(StateError, match="optimizer: entry: saved absent, live value dict"):
        guard.resume({"model": torch.nn.Linear(1, 1), "optimizer": {"lr": 1}})


def test_plain_dataloader_is_refused_with_advice(guard: Guard) -> None:
    loader = torch.utils.data.DataLoader(list(range(10)))
    with pytest.raises(StateError, match="StatefulDataLoader"):
        guard.save({"loader": loader}, 1)


def test_bad_key_is_refused(guard: Guard) -> None:
    with pytest.raises(StateError, match="file name"):
        guard.save({"../etc": 1}, 1)


def test_loader_without_own_generators_warns() -> None:
    data = list(range(32))
    plain = StatefulDataLoader(data, batch_size=4, shuffle=True)
    with pytest.warns(UserWarning, match="global torch RNG"):
        from spotguard.trainer.state import check_state

        check_state({"loader": plain})
    seeded = StatefulDataLoader(
        data,
        batch_size=4,
        sampler=RandomSampler(data, generator=torch.Generator().manual_seed(1)),
        generator=torch.Generator().manual_seed(2),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_state({"loader": seeded})


def test_a_loader_whose_sampler_shares_its_generator_warns_as_its_resume_is_not_exact() -> None:
    """``shuffle=True`` with a loader generator hands the sampler that same generator. The warning
    rests on what the loader does: resumed mid-epoch from its state, the rest of the run comes in
    another order than the uninterrupted one's; with two generators of its own it does not."""
    from spotguard.trainer.state import check_state

    data = list(range(40))

    def shared() -> StatefulDataLoader:
        return StatefulDataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2))

    def separate() -> StatefulDataLoader:
        sampler = RandomSampler(data, generator=torch.Generator().manual_seed(1))
        return StatefulDataLoader(data, batch_size=4, sampler=sampler, generator=torch.Generator().manual_seed(2))

    def resumes_exactly(make: Callable[[], StatefulDataLoader]) -> bool:
        whole = make()
        uninterrupted = [batch.tolist() for _ in range(2) for batch in whole]  # two epochs
        first = make()
        batches = iter(first)
        seen = [next(batches).tolist() for _ in range(3)]
        resumed = make()
        resumed.load_state_dict(copy.deepcopy(first.state_dict()))
        seen += [batch.tolist() for batch in resumed] + [batch.tolist() for batch in resumed]
        return seen == uninterrupted

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchdata's own deprecation notices
        assert not resumes_exactly(shared)
        assert resumes_exactly(separate)
    with pytest.warns(UserWarning, match="shares the loader's generator"):
        check_state({"loader": shared()})


def test_torchdatas_distributed_sampler_warns_and_the_resumable_one_does_not() -> None:
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    from spotguard.trainer.samplers import ResumableDistributedSampler
    from spotguard.trainer.state import check_state

    data = list(range(32))
    generator = torch.Generator().manual_seed(2)
    upstream = StatefulDistributedSampler(data, num_replicas=2, rank=0, seed=1)
    with pytest.warns(UserWarning, match="empty epoch"):
        check_state({"loader": StatefulDataLoader(data, batch_size=4, sampler=upstream, generator=generator)})
    ours = ResumableDistributedSampler(data, num_replicas=2, rank=0, seed=1)
    loader = StatefulDataLoader(data, batch_size=4, sampler=ours, generator=generator)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_state({"loader": loader})
    assert [str(w.message) for w in caught] == []


def test_saving_a_committed_step_again_keeps_the_first(guard: Guard) -> None:
    first = guard.save({"x": torch.ones(2)}, 4)
    again = guard.save({"x": torch.zeros(2)}, 4)
    assert first == again
    state = {"x": torch.empty(2)}
    guard.resume(state)
    assert torch.equal(state["x"], torch.ones(2))


def test_without_daemon_or_bucket_old_checkpoints_are_pruned(tmp_path: Path) -> None:
    g = Guard(checkpoint_dir=tmp_path / "c", socket=tmp_path / "none.sock", keep=2, handle_sigterm=False)
    try:
        for step in range(1, 6):
            g.save({"x": torch.tensor([step])}, step)
    finally:
        g.close()
    assert [i.step for i in scan_local(tmp_path / "c")] == [4, 5]


def test_an_urgent_save_prunes_nothing_before_it_returns(tmp_path: Path) -> None:
    root = tmp_path / "c"
    g = Guard(checkpoint_dir=root, socket=tmp_path / "none.sock", keep=2, handle_sigterm=False)
    try:
        for step in range(1, 4):
            g.save({"x": torch.tensor([step])}, step)
            g.wait()
        assert [i.step for i in scan_local(root)] == [2, 3]
        g.save({"x": torch.tensor([4])}, 4, reason="urgent")
        # Nothing pruned: it raced a deadline (and the disk has room).
        assert [i.step for i in scan_local(root)] == [2, 3, 4]
        g.save({"x": torch.tensor([5])}, 5)  # the next save prunes
        g.wait()
    finally:
        g.close()
    assert [i.step for i in scan_local(root)] == [4, 5]


def test_guard_without_directory_or_daemon_explains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPOTGUARD_CHECKPOINT_DIR", raising=False)
    with pytest.raises(ValueError, match="SPOTGUARD_CHECKPOINT_DIR"):
        Guard(socket=tmp_path / "none.sock", daemon_wait=0.1, handle_sigterm=False)


def test_periodic_save_returns_after_staging_and_commits_in_background(guard: Guard) -> None:
    live = torch.zeros(1 << 16)
    target = guard.save({"w": live}, 1)  # no notice: periodic, written in the background
    live += 1  # training goes on and changes the tensor right away
    guard.wait()
    state = {"w": torch.empty(1 << 16)}
    assert guard.resume(state) == 1
    assert torch.equal(state["w"], torch.zeros(1 << 16))  # the staged copy, not the live tensor
    assert (target / "manifest.json").exists()


def test_urgent_save_cancels_a_periodic_save_in_flight(tmp_path: Path) -> None:
    import threading

    class HeldSaver(Saver):
        """Holds its background writer until a cancel arrives, like a big state on a slow disk."""

        started = threading.Event()

        def write(self, writer, payloads, *rest):  # type: ignore[no-untyped-def]
            if writer.reason == "periodic":
                self.started.set()
                assert writer.cancel is not None and writer.cancel.wait(20)
            super().write(writer, payloads, *rest)

    class HeldGuard(Guard):
        saver_type = HeldSaver

    guard = HeldGuard(checkpoint_dir=tmp_path / "c", socket=tmp_path / "none.sock", handle_sigterm=False)
    try:
        guard.save({"w": torch.zeros(1 << 20)}, 1)  # periodic, in the background
        assert HeldSaver.started.wait(20)
        urgent = guard.save({"w": torch.ones(1 << 20)}, 2, reason="urgent")
        assert (urgent / "manifest.json").exists()
        assert [(i.step, i.status) for i in scan_local(tmp_path / "c")] == [(2, "complete")]
    finally:
        guard.close()


# A script that ends without guard.close(): its periodic save writes only once the interpreter has
# begun to shut down (the script's own hook there, run before spotguard's, lets it go).
ENDS_WITHOUT_CLOSE = """
import sys, threading
from pathlib import Path
import torch
from spotguard import Guard
from spotguard.trainer.saving import Saver

exiting = threading.Event()

class AtExit(Saver):
    def write(self, writer, payloads, *rest):
        exiting.wait()
        super().write(writer, payloads, *rest)

class ScriptGuard(Guard):
    saver_type = AtExit

root = Path(sys.argv[1])
guard = ScriptGuard(checkpoint_dir=root, socket=root.parent / "none.sock", daemon_wait=0.1, handle_sigterm=False)
guard.save({"w": torch.arange(1 << 20, dtype=torch.float32), "b": torch.ones(1 << 20)}, 7)  # periodic
threading._register_atexit(exiting.set)
"""


def test_a_script_that_ends_without_close_still_commits_its_periodic_save(tmp_path: Path) -> None:
    script = [sys.executable, "-c", ENDS_WITHOUT_CLOSE, str(tmp_path / "c")]
    done = subprocess.run(script, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [(i.step, i.status) for i in scan_local(tmp_path / "c")] == [(7, "complete")]
    state = {"w": torch.empty(1 << 20), "b": torch.empty(1 << 20)}
    with Guard(checkpoint_dir=tmp_path / "c", socket=tmp_path / "none.sock", handle_sigterm=False) as guard:
        assert guard.resume(state) == 7
    assert torch.equal(state["w"], torch.arange(1 << 20, dtype=torch.float32))
    assert torch.equal(state["b"], torch.ones(1 << 20))


def test_sigterm_between_the_checks_never_stops_without_a_save(guard: Guard) -> None:
    guard._on_sigterm(15, None)  # the signal lands after should_checkpoint() was asked
    assert not guard.stop_requested  # ... so the loop must not leave yet
    assert guard.should_checkpoint(1)  # the next step boundary takes the checkpoint
    assert guard.stop_requested


class MeetsAnother:
    """An entry whose load_state_dict returns only once another entry is being loaded at the same time."""

    def __init__(self, meeting: threading.Barrier | None = None, fail: bool = False) -> None:
        self.meeting, self.fail, self.value = meeting, fail, torch.zeros(3)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"value": self.value}

    def load_state_dict(self, saved: dict[str, torch.Tensor]) -> None:
        if self.meeting is not None:
            self.meeting.wait()
        if self.fail:
            raise RuntimeError("this entry refuses its state")
        self.value = saved["value"].clone()


def test_entries_are_put_back_by_several_threads_at_once(guard: Guard) -> None:
    saved = {"a": MeetsAnother(), "b": MeetsAnother(), "t": torch.arange(5.0)}
    saved["a"].value, saved["b"].value = torch.ones(3), torch.full((3,), 2.0)
    step_dir = guard.save(saved, 4, reason="urgent")

    meeting = threading.Barrier(2, timeout=30)  # broken (and raising) if the entries went one by one
    live = {"a": MeetsAnother(meeting), "b": MeetsAnother(meeting), "t": torch.zeros(5)}
    read_state(step_dir, load_manifest(step_dir), live, threads=4)
    assert torch.equal(live["a"].value, torch.ones(3)) and torch.equal(live["b"].value, torch.full((3,), 2.0))
    assert torch.equal(live["t"], torch.arange(5.0))


def test_an_entry_that_fails_to_load_among_threads_raises_and_leaves_the_rng_alone(guard: Guard) -> None:
    step_dir = guard.save({"a": MeetsAnother(), "b": MeetsAnother(), "t": torch.arange(5.0)}, 4, reason="urgent")
    torch.manual_seed(5)
    before = torch.get_rng_state()
    live = {"a": MeetsAnother(fail=True), "b": MeetsAnother(), "t": torch.zeros(5)}
    with pytest.raises(RuntimeError, match="refuses its state"):
        read_state(step_dir, load_manifest(step_dir), live, threads=4)
    assert torch.equal(torch.get_rng_state(), before)  # the RNG states go last, after every entry


def test_a_framework_caught_sigterm_is_told_through_the_public_api(guard: Guard) -> None:
    assert not guard.notice_pending and guard.pending_notice is None and guard.save_reason() == "periodic"
    guard.notify_sigterm()  # e.g. Lightning's own handler caught the signal
    assert guard.notice_pending and guard.save_reason() == "urgent"
    assert not guard.stop_requested  # only the next step boundary agrees on it
    assert guard.should_checkpoint(1) and guard.stop_requested


def test_trainer_errors_derive_from_the_error_root_and_keep_their_bases() -> None:
    from spotguard.errors import ConfigError, FatalError
    from spotguard.trainer.contents import SpotguardMismatch
    from spotguard.trainer.dist import RankFailed
    from spotguard.trainer.external import AlreadyCommitted

    for error, base in (
        (StateError, ValueError),
        (SpotguardMismatch, ValueError),
        (RankFailed, RuntimeError),
        (AlreadyCommitted, Exception),
        (ConfigError, ValueError),
    ):
        assert issubclass(error, FatalError) and issubclass(error, base), error
