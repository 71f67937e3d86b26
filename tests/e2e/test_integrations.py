"""Acceptance for the framework callbacks: a drill at step k, the framework's own checkpoint committed
in a spotguard step directory, a clean stop, and a fresh process on a new "VM" (new daemon, empty
local root, same bucket) resuming through ``resume_path()`` ends bit for bit where the uninterrupted
run ends. Plus what ``resume_path()`` must skip and HF's ``get_last_checkpoint`` does not."""

from __future__ import annotations

import logging
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from spotguard.control import request
from spotguard.harness import Vm, bucket_status, collect_events, compare_final, wait_for
from spotguard.localstore import CheckpointWriter, scan_local
from spotguard.manifest import load_manifest, verify_dir
from tests.diskspace import fill
from tests.e2e.integration_trainers import EVAL_BATCHES, STEPS_PER_EPOCH
from tests.preloaded import popen

REPO = Path(__file__).resolve().parents[2]
STEPS = 30  # 12 steps an epoch: two epoch boundaries
K = 17  # mid-epoch (epoch 1, batch 5)
FRAMEWORKS = ["lightning", "transformers"]


def trainer_command(framework: str, root: Path, socket: Path, out: Path | None = None, **extra: object) -> list[str]:
    command = [sys.executable, "-m", "tests.e2e.integration_trainers", "--framework", framework]
    command += ["--root", str(root), "--socket", str(socket), "--steps", str(STEPS)]
    if out is not None:
        command += ["--out", str(out)]
    for key, value in extra.items():
        flag = f"--{key.replace('_', '-')}"
        if value is True:
            command.append(flag)
        elif value is not None:
            command += [flag, str(value)]
    return command


def urgent_commit_in_the_bucket(vm: Vm, step: int, framework: str) -> None:
    """The framework's urgent checkpoint of ``step`` is complete on VM A's disk and committed in the bucket."""
    step_dir = vm.root / f"step-{step:09d}"
    manifest = load_manifest(step_dir)
    assert manifest.reason == "urgent" and manifest.meta["framework"] == framework
    assert verify_dir(step_dir) == []
    wait_for(lambda: (s := vm.status()["last_notice"]) and s.get("committed_at"), 30, "the bucket commit")
    assert vm.status()["last_notice"]["checkpoint"] == step_dir.name


def resume_on_a_fresh_vm(
    vm_factory: Callable[..., Vm], framework: str, step: int, out: Path, **extra: object
) -> list[dict]:
    """The replacement VM (empty local disk, same bucket) resumes ``step`` and trains to the end."""
    vm_b = vm_factory("vm-b")
    events = run_events(trainer_command(framework, vm_b.root, vm_b.socket, out, **extra))
    assert events[0]["event"] == "resumed" and events[0]["step"] == step
    assert events[0]["path"].startswith(str(vm_b.root / f"step-{step:09d}"))
    assert [e["step"] for e in events if e["event"] == "step"] == list(range(step + 1, STEPS + 1))
    assert events[-1] == {**events[-1], "event": "finished", "step": STEPS}
    return events


def run_events(command: list[str], on_event: Callable[[subprocess.Popen[str], dict], None] | None = None) -> list[dict]:
    proc = popen(command, stdout=subprocess.PIPE, cwd=REPO)
    # The Trainer prints its metrics dict on stdout too: only our events count.
    return collect_events(proc, (lambda event: on_event(proc, event)) if on_event else None, marker='{"event"')


@pytest.mark.slow
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_drill_mid_epoch_then_fresh_vm_resumes_bitwise_identical(
    framework: str, vm_factory: Callable[..., Vm], bucket: str, tmp_path: Path
) -> None:
    pytest.importorskip("lightning" if framework == "lightning" else "transformers")
    assert K % STEPS_PER_EPOCH != 0
    # The uninterrupted run, alongside VM A's (2 cores; each process uses one thread).
    reference_out = tmp_path / "reference.pt"
    reference = popen(
        trainer_command(framework, tmp_path / "ref", tmp_path / "none.sock", reference_out),
        stdout=subprocess.DEVNULL,
        cwd=REPO,
    )
    try:
        vm_a = vm_factory("vm-a")

        def drill_at_k(proc: subprocess.Popen[str], event: dict) -> None:
            if event["event"] == "waiting":
                request(vm_a.socket, "drill", deadline_s=120)

        events = run_events(
            trainer_command(framework, vm_a.root, vm_a.socket, bucket=bucket, wait_notice_at=K), drill_at_k
        )
        assert [e["step"] for e in events if e["event"] == "saved"] == [K]
        assert events[-1]["event"] == "stopped" and events[-1]["step"] == K
        assert max(e["step"] for e in events if e["event"] == "step") == K  # a clean stop right after the save
        urgent_commit_in_the_bucket(vm_a, K, framework)
        vm_a.stop_daemon()
        resumed_out = tmp_path / "resumed.pt"
        resume_on_a_fresh_vm(vm_factory, framework, K, resumed_out, bucket=bucket)
        assert reference.wait(timeout=120) == 0
    finally:
        reference.kill()  # no-op when it finished
    assert compare_final(reference_out, resumed_out) == []


@pytest.mark.slow
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_periodic_saves_go_on_and_sigterm_commits_an_urgent_one_then_stops(framework: str, tmp_path: Path) -> None:
    pytest.importorskip("lightning" if framework == "lightning" else "transformers")
    root = tmp_path / "nvme"

    def sigterm_at_k(proc: subprocess.Popen[str], event: dict) -> None:
        if event["event"] == "waiting":
            proc.send_signal(signal.SIGTERM)

    # No daemon: SIGTERM to the trainer is the notice. Lightning then raises its own
    # SIGTERMException (a SystemExit with status 0) out of fit(), after the checkpoint is committed.
    events = run_events(
        trainer_command(framework, root, tmp_path / "none.sock", every_steps=10, wait_notice_at=K), sigterm_at_k
    )
    assert max(e["step"] for e in events if e["event"] == "step") == K
    infos = scan_local(root)
    assert [(i.name, i.status) for i in infos] == [(f"step-{s:09d}", "complete") for s in (10, K)]
    assert [i.manifest.reason for i in infos if i.manifest] == ["periodic", "urgent"]
    assert all(verify_dir(root / i.name) == [] for i in infos)
    if framework == "transformers":
        assert events[-1] == {**events[-1], "event": "stopped", "step": K}


@pytest.mark.slow
def test_lightning_periodic_saves_on_a_full_disk_are_skipped_and_training_runs_to_the_end(
    tmp_path: Path, tmpfs: Callable[[int], Path]
) -> None:
    """The callback's saves are written by Lightning itself (external_save): a full disk there ended
    the run at the first periodic save; Guard.save's rule holds for them too."""
    pytest.importorskip("lightning")
    disk = tmpfs(1 << 20)
    root = disk / "ckpt"
    root.mkdir()
    fill(disk, leave=0)
    events = run_events(trainer_command("lightning", root, tmp_path / "none.sock", every_steps=10))
    assert [e["step"] for e in events if e["event"] == "step"] == list(range(1, STEPS + 1))
    assert events[-1] == {**events[-1], "event": "finished", "step": STEPS}
    assert not [e for e in events if e["event"] == "saved"], "nothing committed, and nothing claimed"
    assert list(root.iterdir()) == [], "no partial step directory holds what little room there is"


@pytest.mark.slow
def test_lightning_ddp_periodic_saves_on_rank_0s_full_disk_are_skipped_on_every_rank(
    tmp_path: Path, tmpfs: Callable[[int], Path]
) -> None:
    """Under DDP only rank 0 writes Lightning's checkpoint, and the other ranks wait for it in
    Lightning's barrier: a write that fails on rank 0 must bring it to that barrier before the ranks
    agree on the failure, or rank 0's agreement meets the others' barrier and the run hangs."""
    pytest.importorskip("lightning")
    disk = tmpfs(1 << 20)
    root = disk / "ckpt"
    root.mkdir()
    fill(disk, leave=0)
    events = run_events(trainer_command("lightning", root, tmp_path / "none.sock", every_steps=4, devices=2))
    steps = [e["step"] for e in events if e["event"] == "step"]
    assert steps == list(range(1, STEPS + 1)), "rank 0 trained every step"
    assert events[-1] == {**events[-1], "event": "finished", "step": STEPS}  # and every rank exited 0
    assert not [e for e in events if e["event"] == "saved"], "nothing committed, and nothing claimed"
    assert list(root.iterdir()) == [], "no partial step directory holds what little room there is"


@pytest.mark.slow
def test_lightning_wrapping_the_loaders_sampler_under_ddp_is_warned_about(tmp_path: Path) -> None:
    """The single-process recipe (a RandomSampler with its own generator) under DDP with Lightning's
    default ``use_distributed_sampler``: Lightning puts a sampler there that keeps no place (its wrapper
    with torchdata 0.11, torch's DistributedSampler with 0.10: with 0.10 nothing was said), so a resume
    is not exact (a drilled mid-epoch resume ended with other parameters with either): the callback says
    so, once, and what to use instead."""
    pytest.importorskip("lightning")
    command = trainer_command("lightning", tmp_path / "nvme", tmp_path / "none.sock", devices=2)
    done = subprocess.run(
        [*command, "--steps", "2", "--lightning-wraps-sampler"],
        capture_output=True, text=True, timeout=300, cwd=REPO, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # Lightning's choice depends on torchdata's version: its wrapper with 0.11, torch's sampler with 0.10.
    warned = [line for line in done.stderr.splitlines() if "keeps no place in the epoch" in line]
    assert len(warned) == 1, done.stderr[-3000:]
    assert re.search(r"sampler is a (DistributedSamplerWrapper|DistributedSampler), ", warned[0]), warned[0]
    assert "Return a ResumableDistributedSampler" in warned[0] and "use_distributed_sampler=False" in warned[0]


TORCHRUN_TWO = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def two_nodes(
    roots: list[Path], sockets: list[Path], out: Path | None = None, framework: str = "transformers", **extra: object
) -> list[str]:
    """A trainer under torchrun, two processes, each a node: ``roots[i]`` its disk, ``sockets[i]`` its daemon."""
    if framework == "lightning":
        extra["devices"] = 2  # torchrun's two processes, not Lightning's own launcher
    command = trainer_command(framework, roots[0], sockets[0], out, **extra)
    return [*TORCHRUN_TWO, *command[1:], "--roots", ",".join(map(str, roots)), "--sockets", ",".join(map(str, sockets))]


def errors_of_a_failed_run(command: list[str], error: str) -> list[str]:
    """Run ``command``, which must fail before training a step; the lines of its stderr where ``error``
    was raised (at least one: every rank raises it, but torchrun stops the others once one has ended)."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO, check=False)
    assert done.returncode != 0
    assert not [line for line in done.stdout.splitlines() if '"event": "step"' in line], "no step trained"
    errors = [line for line in done.stderr.splitlines() if f"{error}: " in line]
    assert errors, done.stderr[-3000:]
    return errors


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], list[dict], Path]:
    """An uninterrupted two-node Trainer run with no daemon, saving every 3 steps: its disks, its
    events and its final state (periodic saves change nothing of the training)."""
    pytest.importorskip("transformers")
    tmp_path = tmp_path_factory.mktemp("two-nodes")
    roots, no_daemon, out = [tmp_path / "nvme0", tmp_path / "nvme1"], tmp_path / "none.sock", tmp_path / "final.pt"
    return roots, run_events(two_nodes(roots, [no_daemon, no_daemon], out, every_steps=3)), out


@pytest.mark.slow
def test_transformers_on_nodes_with_disks_of_their_own_commits_every_processs_files(
    two_node_run: tuple[list[Path], list[dict], Path],
) -> None:
    """Two processes under torchrun, each with output_dir on a disk of its own: the Trainer writes
    the model on rank 0's and each process's RNG state on its own. Every node's share is committed
    with the checkpoint; before, rank 1's RNG state was missing from it and its checkpoint-N folder
    was left behind in output_dir at every save."""
    roots, events, _ = two_node_run
    assert [e["step"] for e in events if e["event"] == "step"] == list(range(1, STEPS + 1))
    saved = [f"step-{step:09d}" for step in range(3, STEPS + 1, 3)]
    kept = sorted(p.name for p in roots[0].iterdir())  # with no daemon, the newest few are kept
    assert kept and kept[-1] == saved[-1] and set(kept) <= set(saved)
    assert sorted(p.name for p in roots[1].iterdir()) == kept, "no checkpoint-N left behind in output_dir"
    for name in kept:
        checkpoint = f"checkpoint-{int(name.removeprefix('step-'))}"
        manifest = load_manifest(roots[0] / name)
        assert manifest.meta["nodes"] == 2
        assert f"{checkpoint}/rng_state_0.pth" in manifest.files and f"{checkpoint}/rng_state_1.pth" in manifest.files
        assert sorted(p.name for p in (roots[1] / name / checkpoint).iterdir()) == ["rng_state_1.pth"]
        assert (roots[1] / name / "part-1.json").exists()


@pytest.mark.slow
def test_transformers_on_nodes_with_disks_of_their_own_and_no_bucket_refuses_to_start_over(
    two_node_run: tuple[list[Path], list[dict], Path], tmp_path: Path
) -> None:
    """Each disk holds its node's share of every checkpoint (rank 0's the model, rank 1's its RNG
    state) and there is no bucket to gather them from: the restarted job ends with an error saying
    so and what to set. Before, every rank skipped the incomplete checkpoints and trained from step 0."""
    roots = [tmp_path / root.name for root in two_node_run[0]]
    for source, copy in zip(two_node_run[0], roots, strict=True):
        shutil.copytree(source, copy)
    no_daemon = tmp_path / "none.sock"
    errors = errors_of_a_failed_run(two_nodes(roots, [no_daemon, no_daemon]), "SplitCheckpoint")
    newest = sorted(p.name for p in roots[0].iterdir())[-1]
    for line in errors:
        assert any(f"{root / newest} holds only this node's share" in line for root in roots), line
        assert "set bucket=" in line


@pytest.mark.slow
def test_transformers_on_nodes_with_disks_of_their_own_resumes_bitwise_on_two_fresh_nodes(
    two_node_run: tuple[list[Path], list[dict], Path], vm_factory: Callable[..., Vm], bucket: str, tmp_path: Path
) -> None:
    """A notice on node 1 of a two-node Trainer job, each node with its disk and its daemon: both
    commit their share of step K and upload it, and the checkpoint counts in the bucket once both
    shares are there. Two fresh nodes (empty disks, new daemons, the same bucket) each fetch all of it
    through ``resume_path()`` (node 1 had only its RNG state) and train to the end, bit for bit where
    the uninterrupted two-node run ends."""
    nodes = [vm_factory("node-0"), vm_factory("node-1")]

    def drill_node_1(proc: subprocess.Popen[str], event: dict) -> None:
        if event["event"] == "waiting":
            request(nodes[1].socket, "drill", deadline_s=120)

    roots, sockets = [vm.root for vm in nodes], [vm.socket for vm in nodes]
    events = run_events(two_nodes(roots, sockets, bucket=bucket, wait_notice_at=K, wait_rank=1), drill_node_1)
    assert [e["step"] for e in events if e["event"] == "saved"] == [K]
    assert events[-1]["event"] == "stopped" and events[-1]["step"] == K
    name, checkpoint = f"step-{K:09d}", f"checkpoint-{K}"
    assert sorted(p.name for p in (roots[1] / name / checkpoint).iterdir()) == ["rng_state_1.pth"]
    wait_for(lambda: bucket_status(bucket, name) == "complete", 60, "both shares in the bucket")
    for vm in nodes:
        vm.stop_daemon()

    fresh = [vm_factory("node-0b"), vm_factory("node-1b")]
    resumed_out = tmp_path / "resumed.pt"
    events = run_events(two_nodes([vm.root for vm in fresh], [vm.socket for vm in fresh], resumed_out, bucket=bucket))
    assert events[0]["event"] == "resumed" and events[0]["step"] == K
    assert [e["step"] for e in events if e["event"] == "step"] == list(range(K + 1, STEPS + 1))
    assert events[-1] == {**events[-1], "event": "finished", "step": STEPS}
    fetched = fresh[1].root / name / checkpoint
    assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"} <= {p.name for p in fetched.iterdir()}
    assert compare_final(two_node_run[2], resumed_out) == []


@pytest.fixture(scope="module")
def lightning_two_node_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], Path]:
    """An uninterrupted two-node Lightning DDP run with no daemon and no bucket, saving every 10 steps:
    its disks and its final state."""
    pytest.importorskip("lightning")
    tmp_path = tmp_path_factory.mktemp("lightning-two-nodes")
    roots, no_daemon, out = [tmp_path / "nvme0", tmp_path / "nvme1"], tmp_path / "none.sock", tmp_path / "final.pt"
    run_events(two_nodes(roots, [no_daemon, no_daemon], out, framework="lightning", every_steps=10))
    return roots, out


@pytest.mark.slow
def test_lightning_on_nodes_with_disks_of_their_own_and_no_bucket_refuses_to_resume_on_every_rank(
    lightning_two_node_run: tuple[list[Path], Path],
) -> None:
    """Rank 0's disk holds the newest checkpoint and rank 1's none (Lightning writes on rank 0 alone),
    and there is no bucket to fetch it from: the ranks raise an error naming what each found and what
    to set, before Lightning loads anything. Before, rank 1 started from scratch beside a
    resumed rank 0 and the job died in gloo ("Connection closed by peer")."""
    roots, _ = lightning_two_node_run
    assert (roots[0] / f"step-{STEPS:09d}" / "lightning.ckpt").is_file() and not any(roots[1].glob("step-*"))
    no_daemon = roots[0].parent / "none.sock"
    command = two_nodes(roots, [no_daemon, no_daemon], framework="lightning")
    errors = errors_of_a_failed_run(command, "ResumeDisagreement")
    for line in errors:
        assert f"rank 0: step-{STEPS:09d} in {roots[0]}; rank 1: none in {roots[1]}" in line
        assert "set bucket=" in line


@pytest.mark.slow
def test_lightning_on_nodes_with_disks_of_their_own_resumes_bitwise_on_two_fresh_nodes(
    lightning_two_node_run: tuple[list[Path], Path], vm_factory: Callable[..., Vm], bucket: str, tmp_path: Path
) -> None:
    """DDP over two nodes, each with its disk and its daemon: Lightning writes its checkpoint on rank
    0's disk alone. A notice on node 1 commits step K on both (node 1's share holds no checkpoint
    file), and it counts in the bucket once both shares are there. Two fresh nodes each fetch it
    through ``resume_path()`` (node 1 never had ``lightning.ckpt``; Lightning loads it on every rank)
    and train to the end, bit for bit where an uninterrupted two-node run ends."""
    nodes = [vm_factory("node-0"), vm_factory("node-1")]

    def drill_node_1(proc: subprocess.Popen[str], event: dict) -> None:
        if event["event"] == "waiting":
            request(nodes[1].socket, "drill", deadline_s=120)

    roots, sockets = [vm.root for vm in nodes], [vm.socket for vm in nodes]
    command = two_nodes(roots, sockets, framework="lightning", bucket=bucket, wait_notice_at=K, wait_rank=1)
    events = run_events(command, drill_node_1)
    assert [e["step"] for e in events if e["event"] == "saved"] == [K]
    assert events[-1]["event"] == "stopped" and events[-1]["step"] == K
    name = f"step-{K:09d}"
    assert (roots[0] / name / "lightning.ckpt").is_file() and not (roots[1] / name / "lightning.ckpt").exists()
    wait_for(lambda: bucket_status(bucket, name) == "complete", 60, "both shares in the bucket")
    for vm in nodes:
        vm.stop_daemon()

    fresh = [vm_factory("node-0b"), vm_factory("node-1b")]
    resumed_out = tmp_path / "resumed.pt"
    roots, sockets = [vm.root for vm in fresh], [vm.socket for vm in fresh]
    events = run_events(two_nodes(roots, sockets, resumed_out, framework="lightning", bucket=bucket))
    assert events[0]["event"] == "resumed" and events[0]["step"] == K
    assert [e["step"] for e in events if e["event"] == "step"] == list(range(K + 1, STEPS + 1))
    assert events[-1] == {**events[-1], "event": "finished", "step": STEPS}
    assert all((root / name / "lightning.ckpt").is_file() for root in roots), "each node fetched it"
    assert compare_final(lightning_two_node_run[1], resumed_out) == []


# --- a notice while the loop is evaluating --------------------------------------------------------

EVAL_EVERY = 4  # 12 steps an epoch: evaluations after steps 4, 8, 12, 16, ...
K_EVAL = 16  # the drill lands in the second batch of the evaluation after step 16


@pytest.mark.slow
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_drill_during_evaluation_checkpoints_the_last_finished_step_stops_and_resumes_bitwise(
    framework: str, vm_factory: Callable[..., Vm], bucket: str, tmp_path: Path
) -> None:
    pytest.importorskip("lightning" if framework == "lightning" else "transformers")
    reference_out = tmp_path / "reference.pt"
    reference = popen(
        trainer_command(framework, tmp_path / "ref", tmp_path / "none.sock", reference_out, eval_every=EVAL_EVERY),
        stdout=subprocess.DEVNULL,
        cwd=REPO,
    )
    try:
        vm_a = vm_factory("vm-a")

        def drill_in_eval(proc: subprocess.Popen[str], event: dict) -> None:
            if event["event"] == "waiting":
                request(vm_a.socket, "drill", deadline_s=120)

        events = run_events(
            trainer_command(
                framework,
                vm_a.root,
                vm_a.socket,
                bucket=bucket,
                eval_every=EVAL_EVERY,
                wait_notice_in_eval_at=K_EVAL,
            ),
            drill_in_eval,
        )
        waiting = next(i for i, e in enumerate(events) if e["event"] == "waiting")
        # The notice came while the evaluation after step K_EVAL was under way, not at a step boundary.
        assert events[waiting - 1] == {**events[waiting - 1], "event": "eval", "step": K_EVAL, "batch": 1}
        assert [e["step"] for e in events if e["event"] == "saved"] == [K_EVAL]
        assert max(e["step"] for e in events if e["event"] == "step") == K_EVAL  # no step trained after it
        assert events[-1] == {**events[-1], "event": "stopped", "step": K_EVAL}
        evaluated_after = [e for e in events[waiting:] if e["event"] == "eval"]
        if framework == "lightning":
            assert evaluated_after == []  # the validation loop ended at the batch where the notice was seen
        else:  # the Trainer's evaluation loop cannot be cut short; the save follows it
            assert [e["batch"] for e in evaluated_after] == list(range(2, EVAL_BATCHES))
        urgent_commit_in_the_bucket(vm_a, K_EVAL, framework)
        vm_a.stop_daemon()
        assert "has not reached a checkpoint point" not in vm_a.log.read_text()  # it acknowledged in time

        # A fresh VM resumes the step saved inside the evaluation and ends where the uninterrupted run ends.
        resumed_out = tmp_path / "resumed.pt"
        resume_on_a_fresh_vm(vm_factory, framework, K_EVAL, resumed_out, bucket=bucket, eval_every=EVAL_EVERY)
        assert reference.wait(timeout=120) == 0
    finally:
        reference.kill()
    assert compare_final(reference_out, resumed_out) == []


@pytest.mark.slow
def test_lightning_notice_pending_before_the_first_step_saves_that_step_and_trains_none(
    vm_factory: Callable[..., Vm], bucket: str
) -> None:
    pytest.importorskip("lightning")
    vm = vm_factory("vm-a")
    request(vm.socket, "drill", deadline_s=120)  # the trainer hears of it when it connects
    events = run_events(trainer_command("lightning", vm.root, vm.socket, bucket=bucket, wait_notice_at_start=True))
    assert [e["event"] for e in events if e["event"] == "step"] == []
    assert [e["step"] for e in events if e["event"] == "saved"] == [0]
    assert events[-1] == {**events[-1], "event": "stopped", "step": 0}
    manifest = load_manifest(vm.root / "step-000000000")
    assert manifest.reason == "urgent" and verify_dir(vm.root / "step-000000000") == []


# --- resume_path: what it returns and what it skips ----------------------------------------------


def fake_checkpoint(root: Path, step: int, framework: str, files: dict[str, bytes], *, commit: bool = True) -> Path:
    writer = CheckpointWriter(
        root, step, reason="urgent", meta={"framework": framework, "resume": _resume(framework, step)}
    )
    writer.prepare()
    for relpath, data in files.items():
        writer.write_bytes(relpath, data)
    if commit:
        writer.commit()
    return writer.dir


def _resume(framework: str, step: int) -> str:
    return "lightning.ckpt" if framework == "lightning" else f"checkpoint-{step}"


def hf_files(step: int) -> dict[str, bytes]:
    return {
        f"checkpoint-{step}/{name}": b"x" * 64 for name in ("model.safetensors", "optimizer.pt", "trainer_state.json")
    }


def make_callback(framework: str, root: Path, bucket: str | None) -> tuple[object, Callable[[], str | None]]:
    if framework == "lightning":
        pytest.importorskip("lightning")
        from spotguard.integrations.lightning import SpotguardCallback as LightningCallback

        lightning_cb = LightningCallback(checkpoint_dir=root, bucket=bucket, socket=root / "none.sock")
        return lightning_cb, lightning_cb.resume_path
    pytest.importorskip("transformers")
    from spotguard.integrations.transformers import SpotguardCallback as HfCallback

    hf_cb = HfCallback(bucket=bucket, socket=root / "none.sock")
    return hf_cb, lambda: hf_cb.resume_path(root)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_resume_path_is_none_with_nothing_saved(framework: str, tmp_path: Path, bucket: str) -> None:
    _, resume_path = make_callback(framework, tmp_path / "out", bucket)
    assert resume_path() is None


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_resume_path_fetches_from_the_bucket_when_the_local_root_has_none(framework: str, tmp_path: Path) -> None:
    remote = tmp_path / "bucket"
    files = hf_files(7) if framework == "transformers" else {"lightning.ckpt": b"ckpt" * 100}
    fake_checkpoint(remote, 7, framework, files)
    root = tmp_path / "out"
    _, resume_path = make_callback(framework, root, remote.as_uri())
    assert resume_path() == str(root / "step-000000007" / _resume(framework, 7))
    assert verify_dir(root / "step-000000007") == []


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_resume_path_skips_incomplete_and_corrupt_checkpoints(framework: str, tmp_path: Path) -> None:
    root = tmp_path / "out"
    root.mkdir()
    files = hf_files if framework == "transformers" else (lambda step: {"lightning.ckpt": b"ckpt" * 100})
    fake_checkpoint(root, 10, framework, files(10))
    corrupt = fake_checkpoint(root, 12, framework, files(12))
    victim = next(p for p in sorted(corrupt.rglob("*")) if p.is_file() and p.name != "manifest.json")
    victim.write_bytes(b"y" * victim.stat().st_size)  # same size, other bytes: only the CRC32C shows it
    fake_checkpoint(root, 15, framework, files(15), commit=False)  # killed before the manifest
    _, resume_path = make_callback(framework, root, None)
    assert resume_path() == str(root / "step-000000010" / _resume(framework, 10))


def test_resume_path_ignores_a_half_written_checkpoint_that_get_last_checkpoint_picks(tmp_path: Path) -> None:
    """HF's own resume helper goes by the folder name only: a checkpoint-N that a killed process left
    half-written (here without optimizer.pt) is what it hands to ``trainer.train``."""
    pytest.importorskip("transformers")
    from transformers.trainer_utils import get_last_checkpoint

    output_dir = tmp_path / "out"
    output_dir.mkdir()
    fake_checkpoint(output_dir, 10, "transformers", hf_files(10))
    half = output_dir / "checkpoint-15"  # the Trainer was writing it when the VM went away
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"x" * 10)
    fake_checkpoint(output_dir, 14, "transformers", hf_files(14), commit=False)  # moved in, not committed

    assert get_last_checkpoint(str(output_dir)) == str(half)
    _, resume_path = make_callback("transformers", output_dir, None)
    assert resume_path() == str(output_dir / "step-000000010" / "checkpoint-10")


def test_lightning_resume_path_asks_the_daemon_for_the_root_when_none_is_given(
    vm_factory: Callable[..., Vm], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("lightning")
    from spotguard.integrations.lightning import SpotguardCallback

    monkeypatch.delenv("SPOTGUARD_CHECKPOINT_DIR", raising=False)
    vm = vm_factory("vm-a")
    fake_checkpoint(vm.root, 3, "lightning", {"lightning.ckpt": b"ckpt"})
    assert SpotguardCallback(socket=vm.socket).resume_path() == str(vm.root / "step-000000003" / "lightning.ckpt")


def test_resume_path_skips_checkpoints_of_another_framework(tmp_path: Path) -> None:
    root = tmp_path / "out"
    root.mkdir()
    fake_checkpoint(root, 5, "lightning", {"lightning.ckpt": b"ckpt"})
    fake_checkpoint(root, 9, "transformers", hf_files(9))
    _, resume_path = make_callback("lightning", root, None)
    assert resume_path() == str(root / "step-000000005" / "lightning.ckpt")


def test_lightning_callback_restores_rng_states_right_before_the_first_resumed_batch() -> None:
    pytest.importorskip("lightning")
    import torch

    from spotguard.integrations.lightning import SpotguardCallback

    torch.manual_seed(3)
    saved = SpotguardCallback(checkpoint_dir="/nonexistent").state_dict()  # what goes into lightning.ckpt
    expected = torch.rand(4)
    cb = SpotguardCallback(checkpoint_dir="/nonexistent")
    cb.load_state_dict(saved)
    torch.rand(100)  # whatever the framework draws while setting up
    cb.on_train_batch_start(None, None, None, 0)
    assert torch.equal(torch.rand(4), expected)
    torch.rand(1)
    cb.on_train_batch_start(None, None, None, 1)  # only once
    assert not torch.equal(torch.rand(4), expected)


def test_only_a_distributed_sampler_that_keeps_no_place_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    """Both samplers Lightning puts in a DDP loader (its wrapper, torch's own) are warned about; the
    recommended one (it saves its place) and a single process's RandomSampler are not."""
    pytest.importorskip("lightning")
    import torch
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
    from torch.utils.data import DataLoader, RandomSampler, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    from spotguard.integrations.lightning import _warn_if_sampler_wrapped
    from spotguard.trainer.samplers import ResumableDistributedSampler

    dataset = TensorDataset(torch.arange(8.0))
    samplers = {
        "DistributedSamplerWrapper": DistributedSamplerWrapper(RandomSampler(dataset), num_replicas=2, rank=0),
        "DistributedSampler": DistributedSampler(dataset, num_replicas=2, rank=0),
        "ResumableDistributedSampler": ResumableDistributedSampler(dataset, num_replicas=2, rank=0),
        "RandomSampler": RandomSampler(dataset),
    }
    warned = []
    for name, sampler in samplers.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="spotguard.integrations"):
            _warn_if_sampler_wrapped({"train": DataLoader(dataset, batch_size=2, sampler=sampler)})
        if caplog.records:
            [record] = caplog.records
            assert f"sampler is a {name}, which keeps no place" in record.getMessage()
            warned.append(name)
    assert warned == ["DistributedSamplerWrapper", "DistributedSampler"]


@pytest.mark.parametrize(
    ("module", "framework_import"),
    [
        ("spotguard.integrations.lightning", "lightning.pytorch"),
        # accelerate (under transformers.TrainerCallback) imports boto3 itself when it is installed.
        ("spotguard.integrations.transformers", "transformers.trainer_callback"),
    ],
)
def test_importing_an_integration_adds_no_daemon_or_storage_sdk(module: str, framework_import: str) -> None:
    pytest.importorskip(framework_import.split(".", maxsplit=1)[0])
    code = (
        "import sys\n"
        "def sdks(): return {m for m in sys.modules if m.split('.')[0] in ('aiohttp', 'boto3', 'botocore')"
        " or m.startswith('google.cloud')}\n"
        f"import {framework_import}\n"
        "before = sdks()\n"
        f"import {module}\n"
        "added = sorted(sdks() - before)\n"
        "print(added); sys.exit(1 if added else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
