"""A full local disk on a real (small tmpfs) filesystem, without a daemon: periodic saves log and go
on, urgent ones drop older local checkpoints (never the newest) or raise ``SpotguardDiskFull``."""

from __future__ import annotations

import errno
import io
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from spotguard import Guard, SpotguardDiskFull
from spotguard.localstore import scan_local
from spotguard.manifest import step_dir_name
from tests.diskspace import fill

MiB = 1 << 20


@pytest.fixture
def root(tmpfs: Callable[[int], Path]) -> Path:
    return tmpfs(8 * MiB) / "ckpt"


@pytest.fixture
def guard(root: Path, tmp_path: Path) -> Iterator[Guard]:
    # No daemon listens on this socket: only local retention decides what may go.
    guard = Guard(checkpoint_dir=root, socket=tmp_path / "none.sock", every_steps=1, handle_sigterm=False, keep=10)
    yield guard
    guard.close()


def complete(root: Path) -> list[int]:
    return [info.step for info in scan_local(root) if info.status == "complete"]


def test_periodic_save_on_a_full_disk_is_logged_training_goes_on_and_the_next_save_succeeds(
    root: Path, guard: Guard, caplog: pytest.LogCaptureFixture
) -> None:
    state = {"w": torch.arange(3 * MiB // 4, dtype=torch.float32)}
    guard.save(state, 1)
    guard.wait()
    filler = fill(root.parent, leave=1 * MiB)

    with caplog.at_level(logging.WARNING, logger="spotguard.trainer"):
        guard.save(state, 2)  # periodic: staged, written in the background
        guard.wait()  # the failure is not kept for the loop to trip over
    assert not (root / step_dir_name(2)).exists(), "the partial step directory is removed"
    assert complete(root) == [1], "the newest local checkpoint is never dropped without a daemon"
    failure = next(r for r in caplog.records if "periodic checkpoint step-000000002 not written" in r.getMessage())
    assert "bytes needed" in failure.getMessage() and str(root) in failure.getMessage()

    filler.unlink()
    guard.save(state, 3)
    guard.wait()
    assert complete(root) == [1, 3]


def test_periodic_save_running_out_of_room_mid_write_removes_its_partial_directory(
    root: Path, guard: Guard, caplog: pytest.LogCaptureFixture
) -> None:
    guard.save({"w": torch.ones(MiB // 4)}, 1)
    guard.wait()
    fill(root.parent, leave=1 * MiB)
    # Plain bytes count only in the estimate's margin: the write itself hits ENOSPC.
    blob = {"blob": b"x" * (3 * MiB)}
    with caplog.at_level(logging.WARNING, logger="spotguard.trainer"):
        guard.save(blob, 2)
        guard.wait()
    assert "ran out of room" in caplog.text
    assert "periodic checkpoint step-000000002 not written" in caplog.text
    assert sorted(p.name for p in root.iterdir()) == [step_dir_name(1)]


def test_urgent_save_out_of_room_mid_write_drops_an_older_local_checkpoint_and_retries(
    root: Path, guard: Guard, caplog: pytest.LogCaptureFixture
) -> None:
    guard.save({"blob": b"y" * (2 * MiB)}, 1, reason="urgent")
    guard.save({"blob": b"y" * (MiB // 2)}, 2, reason="urgent")  # the size the next save expects
    fill(root.parent, leave=1 * MiB)

    with caplog.at_level(logging.WARNING, logger="spotguard.trainer"):
        step_dir = guard.save({"blob": b"z" * (2 * MiB)}, 3, reason="urgent")  # grew past it
    assert "ran out of room" in caplog.text
    assert step_dir == root / step_dir_name(3)
    assert complete(root) == [2, 3], "step 1 made room; step 2, the newest before, stays"


def test_urgent_save_with_no_room_raises_disk_full_with_the_numbers(root: Path, guard: Guard) -> None:
    guard.save({"w": torch.ones(MiB // 4)}, 1, reason="urgent")
    fill(root.parent, leave=1 * MiB)
    with pytest.raises(SpotguardDiskFull) as info:
        guard.save({"w": torch.ones(4 * MiB // 4)}, 2, reason="urgent")
    error = info.value
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC
    assert error.bytes_needed >= 4 * MiB and error.bytes_free <= 1 * MiB and error.path == root
    assert f"{error.bytes_needed} bytes needed, {error.bytes_free} free" in str(error) and str(root) in str(error)
    assert not (root / step_dir_name(2)).exists()
    assert complete(root) == [1]


def test_without_a_daemon_a_bucket_set_for_resume_does_not_stop_local_retention(tmp_path: Path) -> None:
    """The example trainer unit sets SPOTGUARD_BUCKET; with no daemon nothing uploads, so the hook prunes."""
    from spotguard import Guard
    from spotguard.localstore import scan_local

    root = tmp_path / "nvme"
    guard = Guard(
        checkpoint_dir=root,
        bucket=(tmp_path / "bucket").as_uri(),
        socket=tmp_path / "none.sock",
        keep=2,
        handle_sigterm=False,
        daemon_wait=0.1,
    )
    try:
        for step in range(1, 6):
            # Periodic saves: an urgent one leaves pruning to the next save (it races a deadline).
            guard.save({"w": torch.full((1024,), float(step))}, step)
            guard.wait()
    finally:
        guard.close()
    assert [info.step for info in scan_local(root) if info.status == "complete"] == [4, 5]


def write_framework_checkpoint(path: Path, size: int, *, buffered: bool = True) -> None:
    """What a framework's own save does, ``size`` bytes: Lightning's ``torch.save`` into memory, then
    one write of the file (a full disk raises ENOSPC), or ``torch.save`` to the path (its C++ writer
    reports a full disk as 'basic_ios::clear: iostream error', with no errno)."""
    state = {"weights": torch.ones(size // 4, dtype=torch.float32)}
    if not buffered:
        torch.save(state, path)
        return
    buffer = io.BytesIO()
    torch.save(state, buffer)
    path.write_bytes(buffer.getvalue())


def test_a_framework_written_periodic_save_on_a_full_disk_is_skipped_and_training_goes_on(
    root: Path, guard: Guard, caplog: pytest.LogCaptureFixture
) -> None:
    """Lightning's and the Hugging Face callbacks' saves go through external_save: a full disk there must
    not end the run any more than in save(). torch.save hides ENOSPC behind its zip writer's
    RuntimeError; the hook still recognizes it."""
    with guard.external_save(1, {"framework": "test", "resume": "model.ckpt"}) as step_dir:
        write_framework_checkpoint(step_dir / "model.ckpt", MiB)
    assert guard.last_checkpoint == step_dir == root / step_dir_name(1)
    filler = fill(root.parent, leave=1 * MiB)

    with (
        caplog.at_level(logging.WARNING, logger="spotguard.trainer"),
        guard.external_save(2, {"framework": "test", "resume": "model.ckpt"}) as step_dir,
    ):
        write_framework_checkpoint(step_dir / "model.ckpt", 3 * MiB)
    assert guard.last_checkpoint == root / step_dir_name(1), "the skipped save is not taken for a commit"
    assert not (root / step_dir_name(2)).exists(), "its partial directory is removed at once"
    failure = next(r for r in caplog.records if "periodic checkpoint step-000000002 not written" in r.getMessage())
    assert "no room for a checkpoint" in failure.getMessage()
    assert not guard.should_checkpoint(2), "the periodic clock restarted: no doomed save at the very next step"

    filler.unlink()
    with guard.external_save(3, {"framework": "test", "resume": "model.ckpt"}) as step_dir:
        write_framework_checkpoint(step_dir / "model.ckpt", 3 * MiB)
    assert guard.last_checkpoint == root / step_dir_name(3)
    assert complete(root) == [1, 3]


def test_a_framework_written_urgent_save_on_a_full_disk_raises_disk_full_and_ends_the_loop(
    root: Path, guard: Guard
) -> None:
    fill(root.parent, leave=1 * MiB)
    guard.notify_sigterm()
    with (
        pytest.raises(SpotguardDiskFull) as info,
        guard.external_save(4, {"framework": "test", "resume": "model.ckpt"}) as step_dir,
    ):
        write_framework_checkpoint(step_dir / "model.ckpt", 3 * MiB, buffered=False)
    assert info.value.errno == errno.ENOSPC and str(root) in str(info.value)
    assert not (root / step_dir_name(4)).exists()
    assert guard.last_checkpoint is None
    assert guard.stop_requested, "SIGTERM: the loop ends cleanly after the failed save"


def test_a_full_disk_is_found_behind_the_errors_frameworks_wrap_it_in() -> None:
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from spotguard.space import as_disk_full, disk_full_behind

    full = OSError(errno.ENOSPC, "No space left on device", "/nvme/ckpt/step-000000002/__0_0.distcp")
    try:
        try:
            raise full
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None
    except RuntimeError as masked:  # torch.save's zip writer: the ENOSPC is only the context
        wrapped = masked
    assert disk_full_behind(wrapped) is full
    dcp_failure = CheckpointException("save failed", {1: _wrap_exception(wrapped)})
    assert disk_full_behind(dcp_failure) is full
    assert disk_full_behind(RuntimeError("unexpected pos")) is None
    assert disk_full_behind(OSError(errno.EIO, "Input/output error")) is None
    numbers = as_disk_full(full)
    assert numbers.path == Path("/nvme/ckpt/step-000000002") and numbers.bytes_needed == numbers.bytes_free + 1


def test_a_failed_write_is_a_full_disk_by_its_error_or_by_the_room_it_left(tmp_path: Path) -> None:
    from spotguard.space import full_disk_of

    masked = RuntimeError("basic_ios::clear: iostream error")  # torch.save to a path: no errno
    assert full_disk_of(masked, tmp_path) is None  # this disk has room: some other failure
    masked.__context__ = OSError(errno.ENOSPC, "No space left on device")
    full = full_disk_of(masked, tmp_path)
    assert full is not None and full.path == tmp_path and full.bytes_needed == full.bytes_free + 1
    assert full_disk_of(masked, tmp_path / "gone") is not None  # the error's word, where the disk cannot be asked
    assert full_disk_of(RuntimeError("unexpected pos"), tmp_path / "gone") is None
