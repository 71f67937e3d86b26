"""Distributed acceptance: ranks agree on the stop step, sharded (DCP) checkpoints resume bit for bit,
and a checkpoint saved by 2 ranks loads into 1 and into 4 (resharding)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

import pytest
import torch

from spotguard.control import request
from spotguard.harness import Vm, bucket_status, compare_final, wait_for
from spotguard.localstore import scan_local
from spotguard.manifest import load_manifest, verify_dir
from tests.preloaded import popen

STEPS = 20  # 8 steps per epoch per rank with 2 ranks


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted 2-rank run every interrupted one must match."""
    base = tmp_path_factory.mktemp("reference")
    launch(2, "--root", str(base / "nvme"), "--steps", str(STEPS), "--out", str(base / "reference.pt"))
    return base / "reference.pt"


def rendezvous_env(stack: contextlib.ExitStack, world: int) -> dict[str, str]:
    """A fresh file rendezvous per job: no TCP port picked here and raced for by the time rank 0 binds it."""
    directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rendezvous-")))
    return {**os.environ, "RENDEZVOUS_FILE": str(directory / "store"), "WORLD_SIZE": str(world)}


def launch(world: int, *args: str, on_event: Callable[[dict], None] | None = None) -> list[dict]:
    """Run the trainer with ``world`` ranks (one process each); returns rank 0's events.

    A rank that dies takes the others down with it (they would wait for it forever), and the
    failure message carries every rank's stderr.
    """
    command = [sys.executable, "-m", "tests.e2e.dist_trainer", *args]
    with contextlib.ExitStack() as stack:
        env = rendezvous_env(stack, world)
        logs = [stack.enter_context(tempfile.TemporaryFile(mode="w+")) for _ in range(world)]
        return _run_ranks(command, env, logs, on_event)


def _run_ranks(
    command: list[str], env: dict[str, str], logs: list[IO[str]], on_event: Callable[[dict], None] | None
) -> list[dict]:
    world = len(logs)
    procs = [
        popen(
            command,
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
            stderr=logs[r],
        )
        for r in range(world)
    ]
    events = []
    try:
        assert procs[0].stdout is not None
        for line in procs[0].stdout:
            if not line.startswith("{"):
                continue  # a library talking on stdout; only our JSON lines count
            event = json.loads(line)
            events.append(event)
            if on_event:
                on_event(event)
        codes = [procs[0].wait(timeout=300)]
        if codes[0] == 0:
            codes += [proc.wait(timeout=300) for proc in procs[1:]]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if procs[0].stdout is not None:
            procs[0].stdout.close()
    if codes != [0] * world:
        tails = []
        for rank, log in enumerate(logs):
            log.seek(0)
            tails.append(f"--- rank {rank} exit {procs[rank].returncode}:\n{log.read()[-3000:]}")
        raise AssertionError("\n".join(tails))
    return events


@pytest.mark.slow
def test_ddp_notice_on_one_rank_saves_same_step_everywhere_and_resumes_bitwise(
    reference: Path, vm_factory: Callable[..., Vm], bucket: str, tmp_path: Path
) -> None:
    # Two daemons, as on two VMs; both ranks write to one shared checkpoint root (a shared disk).
    vm_a, vm_b = vm_factory("vm-a"), vm_factory("vm-b", start=False)
    vm_b.root = vm_a.root
    vm_b.start_daemon()
    k = 6

    def drill_rank1(event: dict) -> None:
        if event["event"] == "step" and event["step"] == k:
            request(vm_b.socket, "drill", deadline_s=120)  # only rank 1's daemon hears of it

    events = launch(
        2, "--root", str(vm_a.root), "--bucket", bucket, "--sockets", f"{vm_a.socket},{vm_b.socket}",
        "--steps", str(STEPS), "--notice-at", str(k), on_event=drill_rank1,
    )  # fmt: skip
    assert [e["step"] for e in events if e["event"] == "saved"] == [k]
    assert events[-1]["event"] == "stopped"
    manifest = load_manifest(vm_a.root / f"step-{k:09d}")
    assert manifest.meta["layout"] == "dcp" and manifest.world_size == 2
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "loader.rank0.pt", "loader.rank1.pt"} <= set(manifest.files)
    wait_for(lambda: (s := vm_a.status()["uploads"]["last_committed"]) and s["step"] == k, 30, "the bucket commit")
    vm_a.stop_daemon()
    vm_b.stop_daemon()

    fresh = tmp_path / "fresh-vm"
    resumed = tmp_path / "resumed.pt"
    events = launch(2, "--root", str(fresh), "--bucket", bucket, "--steps", str(STEPS), "--out", str(resumed))
    assert events[0] == {"event": "resumed", "step": k}
    assert compare_final(reference, resumed) == []


@pytest.mark.slow
def test_ddp_resumed_from_an_epochs_last_step_trains_the_next_epoch_whole(reference: Path, tmp_path: Path) -> None:
    """A checkpoint at step 8, the last batch of the first epoch on both ranks: the resumed run trains
    the next epoch whole and ends bit for bit where the uninterrupted one ends. (torchdata's own
    distributed sampler resumed into an empty epoch here, and the run went on an epoch behind.)"""
    root, resumed = tmp_path / "nvme", tmp_path / "resumed.pt"
    launch(2, "--root", str(root), "--steps", "8", "--every-steps", "8")
    events = launch(2, "--root", str(root), "--steps", str(STEPS), "--out", str(resumed))
    assert events[0] == {"event": "resumed", "step": 8}
    assert [e["step"] for e in events if e["event"] == "step"] == list(range(9, STEPS + 1))
    assert compare_final(reference, resumed) == []


@pytest.mark.slow
def test_periodic_saves_of_two_ranks_are_written_while_training_goes_on_and_resume_bitwise(
    reference: Path, tmp_path: Path
) -> None:
    """A periodic save returns once the state is copied to host memory, with several ranks too: each
    rank's background thread writes it and the ranks agree on its commit on a group of their own,
    while the training's collectives go on. What was copied is what is written: the model and
    optimizer resume bit for bit, and the ballast (changed in place by every later step, a per-rank
    file) holds the saved step's values (the trainer checks it at the end)."""
    root, resumed = tmp_path / "nvme", tmp_path / "resumed.pt"
    ballast = ["--ballast-mib", "8"]
    events = launch(2, "--root", str(root), "--steps", "14", "--every-steps", "6", *ballast)
    saved = [e for e in events if e["event"] == "saved"]
    assert [(e["step"], e["committed"]) for e in saved] == [(6, False), (12, False)]  # returned before its commit
    assert [(info.step, info.status) for info in scan_local(root)] == [(6, "complete"), (12, "complete")]
    assert all(verify_dir(root / info.name) == [] for info in scan_local(root))
    events = launch(2, "--root", str(root), "--steps", str(STEPS), "--out", str(resumed), *ballast)
    assert events[0] == {"event": "resumed", "step": 12}
    assert events[-1] == {"event": "finished", "step": STEPS}  # the ballast matched on both ranks
    assert compare_final(reference, resumed) == []


@pytest.mark.slow
@pytest.mark.parametrize("write_threads", ["1", "3"])
def test_a_notice_during_a_periodic_save_of_two_ranks_cancels_it_on_every_rank(
    reference: Path, vm_factory: Callable[..., Vm], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write_threads: str
) -> None:
    """A notice while every rank writes a periodic save (held before DCP writes until the urgent save
    cancels it): each rank drops DCP's writes from the first on, the ranks agree on the cancellation
    instead of one waiting for another, the periodic save's files go, and the urgent one commits on
    time and resumes bit for bit. With 3 threads, in DCP's own writer threads too."""
    monkeypatch.setenv("SPOTGUARD_WRITE_THREADS", write_threads)
    vm = vm_factory("vm-a")
    periodic, k = 6, 7

    def drill_as_the_periodic_save_is_written(event: dict) -> None:
        if event["event"] == "saved" and event["step"] == periodic:
            request(vm.socket, "drill", deadline_s=120)

    ballast = ["--ballast-mib", "4"]
    events = launch(
        2, "--root", str(vm.root), "--sockets", str(vm.socket), "--steps", str(STEPS), "--every-steps", str(periodic),
        "--notice-at", str(k), "--hold-periodic", *ballast, on_event=drill_as_the_periodic_save_is_written,
    )  # fmt: skip
    assert [(e["step"], e["committed"]) for e in events if e["event"] == "saved"] == [(periodic, False), (k, True)]
    assert events[-1] == {"event": "stopped", "step": k}
    assert [(info.step, info.status) for info in scan_local(vm.root)] == [(k, "complete")]
    log = vm.log.read_text()
    assert f"periodic checkpoint at step {periodic} cancelled" in log
    assert f"checkpoint at step {periodic} failed" not in log  # every rank saw a cancellation, none a failure
    vm.stop_daemon()
    resumed = tmp_path / "resumed.pt"
    events = launch(2, "--root", str(vm.root), "--steps", str(STEPS), "--out", str(resumed), *ballast)
    assert events[0] == {"event": "resumed", "step": k}
    assert events[-1] == {"event": "finished", "step": STEPS}
    assert compare_final(reference, resumed) == []


@pytest.fixture(scope="module")
def saved_by_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A checkpoint of step 12 saved by 2 ranks, and the state they saved (once for the module)."""
    base = tmp_path_factory.mktemp("two-ranks")
    root, saved = base / "ckpt", base / "saved.pt"
    launch(2, "--root", str(root), "--steps", "12", "--every-steps", "12", "--dump-saved", str(saved))
    [info] = scan_local(root)
    assert (info.step, info.status) == (12, "complete")
    assert load_manifest(root / info.name).meta["world_size"] == 2
    return root, saved


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 4])
def test_checkpoint_saved_by_two_ranks_reshards(
    world: int, saved_by_two_ranks: tuple[Path, Path], tmp_path: Path
) -> None:
    import shutil

    root = tmp_path / "ckpt"
    shutil.copytree(saved_by_two_ranks[0], root)  # each loading job its own disk
    saved = saved_by_two_ranks[1]
    loaded = tmp_path / "loaded.pt"
    events = launch(world, "--root", str(root), "--steps", "14", "--dump-loaded", str(loaded))
    assert events[0] == {"event": "resumed", "step": 12}
    assert events[-1] == {"event": "finished", "step": 14}  # and training goes on
    assert compare_final(saved, loaded) == []  # every parameter and optimizer tensor as saved
    assert torch.load(loaded, weights_only=True)["model"]


@pytest.mark.slow
def test_dcp_writes_several_files_per_rank_with_threads_and_resumes_bitwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPOTGUARD_WRITE_THREADS", "3")  # every rank: DCP's thread_count, and the readers
    root = tmp_path / "ckpt"
    saved = tmp_path / "saved.pt"
    launch(2, "--root", str(root), "--steps", "12", "--every-steps", "12", "--dump-saved", str(saved))
    [info] = scan_local(root)
    step_dir = root / info.name
    files = load_manifest(step_dir).files
    for rank in range(2):
        assert sorted(name for name in files if name.startswith(f"__{rank}_")) == [
            f"__{rank}_{i}.distcp" for i in range(3)
        ]
    # Every file DCP (or anyone) wrote is in the manifest, and the manifest verifies.
    assert {p.name for p in step_dir.iterdir()} == {*files, "manifest.json"}
    assert verify_dir(step_dir) == []

    loaded = tmp_path / "loaded.pt"
    events = launch(2, "--root", str(root), "--steps", "13", "--dump-loaded", str(loaded))
    assert events[0] == {"event": "resumed", "step": 12}
    assert compare_final(saved, loaded) == []


@pytest.mark.slow
def test_a_mismatch_on_one_rank_raises_the_same_error_on_every_rank(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    launch(2, "--root", str(root), "--steps", "4", "--every-steps", "4")
    [info] = scan_local(root)
    contents = load_manifest(root / info.name).contents
    assert contents is not None and contents["world_size"] == 2
    assert "0.weight" in contents["entries"]["model"]["keys"]  # as DCP saved it: no DDP "module." prefix
    out = tmp_path / "mismatch"
    out.mkdir()
    # Only rank 1 resumes with another optimizer; rank 0's state matches, yet it must not load either.
    events = launch(2, "--root", str(root), "--steps", "6", "--sgd-on-rank", "1", "--mismatch-out", str(out))
    assert events[0] == {"event": "mismatch", "differences": 1}
    errors = [(out / f"rank{rank}.txt").read_text() for rank in range(2)]
    assert errors[0] == errors[1]
    assert "optimizer: class: saved torch.optim.adamw.AdamW, live torch.optim.sgd.SGD" in errors[0]


def two_node_job(
    vm_factory: Callable[..., Vm],
    tmp_path: Path,
    env: dict[str, str],
    bucket: str,
    *,
    peers: bool = False,
    env_b: dict[str, str] | None = None,
) -> tuple[Vm, Vm, list[str]]:
    """Two simulated VMs, each with its own daemon and local disk, one rank each (node B's daemon with
    ``env_b`` where given). With ``peers`` both daemons serve the peer tier and find each other
    through the bucket, as the Terraform modules set them up."""
    tier = ["--peer-listen", "127.0.0.1:0", "--peers", "bucket"] if peers else []
    vm_a = vm_factory("node-a", start=False, extra_args=["--provider", "none", *tier])
    vm_b = vm_factory("node-b", start=False, extra_args=["--provider", "none", *tier])
    for vm, vm_env in ((vm_a, env), (vm_b, env if env_b is None else env_b)):
        vm.bucket = bucket
        vm.start_daemon(env=vm_env)
    args = ["--roots", f"{vm_a.root},{vm_b.root}", "--sockets", f"{vm_a.socket},{vm_b.socket}", "--bucket", bucket]
    return vm_a, vm_b, args


@pytest.mark.slow
@pytest.mark.parametrize("store", ["file", "moto"])
def test_two_nodes_commit_in_the_bucket_only_when_both_shares_are_there(
    store: str,
    reference: Path,
    vm_factory: Callable[..., Vm],
    bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from contextlib import ExitStack

    from tests.servers import FAKE_AWS_ENV, moto_s3

    with ExitStack() as stack:
        env: dict[str, str] = {}
        if store == "moto":
            server = stack.enter_context(moto_s3())
            env = {**FAKE_AWS_ENV, "AWS_ENDPOINT_URL_S3": server.endpoint_url}
            for key, value in env.items():
                monkeypatch.setenv(key, value)  # the trainers read the bucket on resume too
            bucket = f"s3://{server.bucket}/run1"

        vm_a, vm_b, args = two_node_job(vm_factory, tmp_path, env, bucket)
        k = 6

        def drill_node_b(event: dict) -> None:
            if event["event"] == "step" and event["step"] == k:
                request(vm_b.socket, "drill", deadline_s=120)

        events = launch(2, *args, "--steps", str(STEPS), "--notice-at", str(k), on_event=drill_node_b)
        assert [e["step"] for e in events if e["event"] == "saved"] == [k]
        name = f"step-{k:09d}"
        # Neither disk holds the whole checkpoint; each holds its node's committed share.
        assert (vm_a.root / name / "part-0.json").exists() and (vm_b.root / name / "part-1.json").exists()
        assert [(i.name, i.status) for i in scan_local(vm_b.root)] == [(name, "incomplete")]
        wait_for(lambda: bucket_status(bucket, name) == "complete", 60, "the two-node commit in the bucket")
        for vm in (vm_a, vm_b):
            vm.stop_daemon()

        resumed = tmp_path / "resumed.pt"
        fresh = f"{tmp_path / 'fresh-a'},{tmp_path / 'fresh-b'}"
        events = launch(2, "--roots", fresh, "--bucket", bucket, "--steps", str(STEPS), "--out", str(resumed))
        assert events[0] == {"event": "resumed", "step": k}
        assert compare_final(reference, resumed) == []


@pytest.mark.slow
def test_a_node_that_dies_before_uploading_leaves_the_checkpoint_incomplete(
    vm_factory: Callable[..., Vm], bucket: str, tmp_path: Path
) -> None:
    vm_a, vm_b, args = two_node_job(vm_factory, tmp_path, {}, bucket)
    first, second = 4, 6

    def lose_node_b_then_notice(event: dict) -> None:
        if event["event"] == "step" and event["step"] == second:
            wait_for(lambda: bucket_status(bucket, f"step-{first:09d}") == "complete", 60, "the periodic checkpoint")
            vm_b.kill_daemon()  # VM B goes away with its share of the next checkpoint
            request(vm_a.socket, "drill", deadline_s=120)

    events = launch(
        2,
        *args,
        "--steps",
        str(STEPS),
        "--every-steps",
        str(first),
        "--notice-at",
        str(second),
        on_event=lose_node_b_then_notice,
    )
    assert [e["step"] for e in events if e["event"] == "saved"] == [first, second]
    # Node A's share reaches the bucket, but without node B's the manifest must never appear.
    name = f"step-{second:09d}"
    wait_for(lambda: bucket_status(bucket, name) == "incomplete", 30, "node A's share in the bucket")
    assert (vm_a.status()["uploads"]["current"] or {}).get("name") == name  # still waiting for node B
    assert bucket_status(bucket, name) == "incomplete"

    events = launch(
        2, "--roots", f"{tmp_path / 'fresh-a'},{tmp_path / 'fresh-b'}", "--bucket", bucket, "--steps", str(first + 1)
    )
    assert events[0] == {"event": "resumed", "step": first}


PEER_TOKEN = "the-job-s-peer-token-0123456789abcdef"
RELAY_RATE = 500_000  # bytes/s per connection to the bucket
BALLAST_MIB = 4  # per rank: at the relay's rate a node's share needs some 9 s; the drill gives 6
DEADLINE = 6.0


@pytest.mark.slow
@pytest.mark.parametrize("dying", [1, 0], ids=["node-1-dies", "node-0-dies"])
def test_a_peer_rescues_the_share_of_a_node_the_bucket_cannot_take_in_time(
    dying: int, reference: Path, vm_factory: Callable[..., Vm], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One node gets a drill; its share cannot reach the bucket in time, so its daemon hands it to the
    other's (found through the bucket), and at the deadline the node dies with its disk. The other
    daemon commits the share and the whole checkpoint (node 0's part: when node 0 dies, its peer
    commits the job's manifest it was handed); a fresh job resumes that urgent step bit for bit."""
    import shutil
    import time

    from tests.pacedrelay import PacedRelay
    from tests.servers import moto_s3, point_at

    with (
        moto_s3() as server,
        PacedRelay(server.endpoint_url, RELAY_RATE) as link_a,
        PacedRelay(server.endpoint_url, RELAY_RATE) as link_b,
    ):
        bucket = point_at(server, monkeypatch)  # the trainers and this test read the bucket directly
        env = {"SPOTGUARD_PEER_TOKEN": PEER_TOKEN}
        # Each VM its own slow link to the bucket: the dying VM's goes down with it.
        env_a, env_b = ({**env, "AWS_ENDPOINT_URL_S3": link.url} for link in (link_a, link_b))
        vm_a, vm_b, args = two_node_job(vm_factory, tmp_path, env_a, bucket, peers=True, env_b=env_b)
        (vm, link), (survivor, _) = [(vm_a, link_a), (vm_b, link_b)][:: 1 if dying == 0 else -1]
        k = 6
        name = f"step-{k:09d}"
        ballast_file = f"ballast.rank{dying}.pt"
        deadlines: list[float] = []

        def drill(event: dict) -> None:
            if event["event"] == "step" and event["step"] == k:
                wait_for(lambda: vm.status()["upload_rate_bytes_s"], 30, "the dying node's upload-rate probe")
                request(vm.socket, "drill", deadline_s=DEADLINE)
                deadlines.append(time.monotonic() + DEADLINE)

        ballast = ["--ballast-mib", str(BALLAST_MIB)]
        events = launch(2, *args, *ballast, "--steps", str(STEPS), "--notice-at", str(k), on_event=drill)
        assert [e["step"] for e in events if e["event"] == "saved"] == [k]
        [deadline] = deadlines
        handed = wait_for(
            lambda: (h := vm.status()["peers"]["handoff"])["state"] in ("handed", "failed") and h,
            deadline - time.monotonic(),
            "the dying node to hand its share to the other",
        )
        assert handed["state"] == "handed", handed
        assert handed["name"] == name and handed["bytes_sent"] > BALLAST_MIB << 20
        assert handed["peer"] == survivor.status()["peers"]["listen"]  # found through the bucket
        plan = vm.status()["plan"]
        assert plan["route"] == "peer" and plan["bytes"] > BALLAST_MIB << 20, plan

        # The deadline: the VM is gone, and its disk with it (its trainer stopped after the urgent save).
        time.sleep(max(0.0, deadline - time.monotonic()))  # waiting for the deadline itself
        link.close()
        vm.kill_daemon()  # SIGKILL
        shutil.copy(vm.log, tmp_path / "dead-node.log")  # kept for the timeline, off the deleted disk
        shutil.rmtree(vm.dir)
        assert ballast_file not in remote_files(bucket, name)  # the dying node's own upload did not make it
        wait_for(lambda: bucket_status(bucket, name) == "complete", 60, "the survivor to commit the checkpoint")
        assert ballast_file in remote_files(bucket, name)
        wait_for(lambda: survivor.status()["peers"]["replicas"] == [], 30, "the survivor to drop the replica")
        survivor.stop_daemon()

        resumed = tmp_path / "resumed.pt"
        fresh = f"{tmp_path / 'fresh-a'},{tmp_path / 'fresh-b'}"
        events = launch(2, "--roots", fresh, "--bucket", bucket, *ballast, "--steps", str(STEPS), "--out", str(resumed))
        assert events[0] == {"event": "resumed", "step": k}
        assert events[-1] == {"event": "finished", "step": STEPS}  # each rank's ballast as an uninterrupted run's
        assert compare_final(reference, resumed) == []


def remote_files(bucket: str, name: str) -> set[str]:
    from spotguard.storage import open_storage

    storage = open_storage(bucket)
    try:
        return {o.key.partition("/")[2] for o in storage.list(f"{name}/")}
    finally:
        storage.close()


@pytest.mark.slow
@pytest.mark.parametrize("reason", ["urgent", "periodic"])
def test_fsdp_sharded_state_round_trips_and_reshards_into_one_process(reason: str, tmp_path: Path) -> None:
    """FSDP2's DTensor state, written from the live state (urgent) or staged and written in the
    background while the next step changes it (periodic), resumes as saved: sharded, and (the same
    files) in one process."""
    root, reference = tmp_path / "ckpt", tmp_path / "full.pt"
    stack = contextlib.ExitStack()
    env = rendezvous_env(stack, 2)
    command = [sys.executable, "-m", "tests.e2e.fsdp_check"]
    ranks = [
        popen(
            [*command, "save", str(root), str(reference), reason],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
        )
        for r in range(2)
    ]
    outputs = [proc.communicate(timeout=300)[0] for proc in ranks]
    assert [proc.returncode for proc in ranks] == [0, 0] and all("ok" in out for out in outputs)
    manifest = load_manifest(root / "step-000000003")
    assert manifest.meta["layout"] == "dcp" and {"__0_0.distcp", "__1_0.distcp"} <= set(manifest.files)
    if reason == "periodic":
        return  # the files are those of an urgent save: loading them into one process is checked there
    single = subprocess.run(
        [*command, "load", str(root), str(reference)], capture_output=True, text=True, timeout=300, check=False
    )
    assert single.returncode == 0, single.stderr[-2000:]
