"""A failure on one rank reaches every rank within seconds, with the same message, instead of a hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from spotguard.crc32c import crc32c_of_file
from spotguard.harness import Vm, bucket_status, wait_for
from spotguard.localstore import scan_local
from spotguard.manifest import load_manifest
from tests.diskspace import fill
from tests.preloaded import popen

MiB = 1 << 20


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on a read-only tmpfs: even root cannot write there."""
    path = tmp_path / "readonly-nvme"
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], check=False)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (tests need root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def two_ranks(
    rendezvous: Path, module: str, *args: str, env: dict[str, str] | None = None
) -> list[tuple[int, str, str]]:
    """Both ranks of the gloo job ``python -m module args`` (``env`` added), run to their end: each
    one's (exit status, stdout, stderr), rank 0's first."""
    base = {**os.environ, **(env or {}), "WORLD_SIZE": "2", "RENDEZVOUS_FILE": str(rendezvous)}
    procs = [
        popen(
            [sys.executable, "-m", module, *args],
            env={**base, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for rank in range(2)
    ]
    ended = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            ended.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            proc.kill()
    return ended


def run_two_ranks(
    tmp_path: Path, roots: list[Path], kind: str, plan: str, filler: Path | None = None, sockets: str = ""
) -> list[list[dict[str, Any]]]:
    """Both ranks of tests/e2e/dist_failure.py; each rank's JSON lines (one per save), rank 0's first.
    ``sockets``: each rank's daemon, comma-separated."""
    env = {"FILLER": str(filler), **({"SOCKETS": sockets} if sockets else {})}
    args = (",".join(map(str, roots)), kind, plan)
    lines = []
    for _, out, err in two_ranks(tmp_path / "rendezvous", "tests.e2e.dist_failure", *args, env=env):
        mine = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert len(mine) == plan.count(":"), f"rank printed {mine}; stderr:\n{err}"
        lines.append(mine)
    return lines


def last_lines(rendezvous: Path, module: str, *args: str) -> list[dict[str, Any]]:
    """Both ranks of the gloo job ``python -m module args``, each to a clean exit; the JSON of each
    one's last line of output, rank 0's first."""
    outcomes = []
    for status, out, err in two_ranks(rendezvous, module, *args):
        assert status == 0, err
        outcomes.append(json.loads(out.strip().splitlines()[-1]))
    return outcomes


@pytest.mark.slow
@pytest.mark.parametrize("reason", ["urgent", "periodic"])
def test_a_rank_whose_write_fails_takes_every_rank_down_with_the_same_error(
    reason: str, tmp_path: Path, read_only_dir: Path
) -> None:
    """Urgent, or periodic and written in the background (its error raised by ``guard.wait()``)."""
    good = tmp_path / "nvme0"
    outcomes = [lines[0] for lines in run_two_ranks(tmp_path, [good, read_only_dir], "files", f"5:{reason}")]
    assert [o["raised"] for o in outcomes] == ["RankFailed", "RankFailed"], outcomes
    assert outcomes[0]["message"] == outcomes[1]["message"]
    message = outcomes[0]["message"]
    assert "rank 1" in message and "rank 0:" not in message
    assert "Read-only file system" in message
    assert all(o["seconds"] < 10 for o in outcomes), outcomes
    assert not (good / "step-000000005" / "manifest.json").exists()  # nothing half-written counts


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "full_rank"), [("dcp", 0), ("files", 1)])
def test_a_full_disk_on_one_rank_skips_a_periodic_save_on_every_rank_and_fails_an_urgent_one_alike(
    tmp_path: Path, tmpfs: Callable[[int], Path], kind: str, full_rank: int
) -> None:
    """A full disk is a full disk on every rank: a periodic save is skipped by all ranks and training
    goes on (it ended the run, as RankFailed, or as DCP's CheckpointException, which no ``except
    Exception`` sees); an urgent one raises the same SpotguardDiskFull everywhere; the partial
    directories go at once; once there is room again the next save commits."""
    small = tmpfs(8 * MiB)
    roots = [tmp_path / "nvme0" / "ckpt", tmp_path / "nvme1" / "ckpt"]
    roots[full_rank] = small / "ckpt"
    roots[full_rank].mkdir()
    filler = fill(small, leave=1 * MiB)

    ranks = run_two_ranks(tmp_path, roots, kind, "5:periodic,6:urgent,7:periodic+room", filler)

    periodic, urgent, after = ([lines[i] for lines in ranks] for i in range(3))
    assert [o["raised"] for o in periodic] == [None, None], periodic
    assert periodic[full_rank]["on_disk"] == [], "the failed save's directory went at once, its room with it"
    assert urgent[full_rank]["on_disk"] == []
    assert [o["raised"] for o in urgent] == ["RankDiskFull", "RankDiskFull"], urgent
    assert all(o["disk_full"] for o in urgent)
    assert urgent[0]["message"] == urgent[1]["message"]
    assert f"failed on rank {full_rank}:" in urgent[0]["message"]
    assert f"rank {1 - full_rank}:" not in urgent[0]["message"]
    assert [o["raised"] for o in after] == [None, None], after
    committed = str(roots[0] / "step-000000007")
    assert (Path(committed) / "manifest.json").is_file()
    assert [o["last_checkpoint"] for o in after] == [committed, str(roots[1] / "step-000000007")]
    # Nothing of the failed saves is left on either disk, the full one included.
    for root in roots:
        assert sorted(p.name for p in root.iterdir()) == ["step-000000007"], root


@pytest.mark.slow
def test_a_framework_save_that_fills_the_ranks_disk_is_a_full_disk_on_every_rank(
    tmp_path: Path, tmpfs: Callable[[int], Path]
) -> None:
    """Two ranks on one disk save through external_save, each torch.save to a path, as a framework's
    callback does: a full disk raises there with no errno ('basic_ios::clear'), which ended the run
    as RankFailed. Each rank judges its own disk (under 1 MiB left after a failed write) and both
    decide on both verdicts: a periodic save is skipped, an urgent one raises RankDiskFull alike."""
    small = tmpfs(16 * MiB)  # room for both ranks' 4 MiB once the filler goes
    root = small / "ckpt"
    root.mkdir()
    filler = fill(small, leave=1 * MiB)

    ranks = run_two_ranks(tmp_path, [root, root], "external", "5:periodic,6:urgent,7:periodic+room", filler)

    periodic, urgent, after = ([lines[i] for lines in ranks] for i in range(3))
    assert [o["raised"] for o in periodic] == [None, None], periodic
    assert [o["raised"] for o in urgent] == ["RankDiskFull", "RankDiskFull"], urgent
    assert all(o["disk_full"] for o in urgent)
    assert urgent[0]["message"] == urgent[1]["message"]
    assert "no errno" not in urgent[0]["message"] and "rank 1:" in urgent[0]["message"]
    assert [o["raised"] for o in after] == [None, None], after
    committed = root / "step-000000007"
    assert [o["last_checkpoint"] for o in after] == [str(committed), str(committed)]
    assert sorted(load_manifest(committed).files) == ["rank0.pt", "rank1.pt"]
    assert sorted(p.name for p in root.iterdir()) == ["step-000000007"], "the failed saves left nothing"


@pytest.mark.slow
def test_a_framework_save_on_nodes_with_disks_of_their_own_commits_each_nodes_share(
    vm_factory: Callable[..., Vm], bucket: str, tmp_path: Path
) -> None:
    """Two nodes, each with its disk and its daemon. Where only rank 0 writes (Lightning's DDP) the
    save commits on rank 0's disk and leaves nothing on the other; where rank 1 writes on its own
    disk too (a sharded save), each node commits its share, rank 0's manifest lists both nodes'
    files, and the checkpoint counts in the bucket once both daemons uploaded their share, so that a
    fresh node restores all of it; a name written on both disks is rank 0's (one copy in the bucket).
    The second case was refused before (the manifest, recorded from rank 0's disk, would have missed
    rank 1's file), and before that failed as 'Parent directory ... does not exist'."""
    from spotguard.integrations.common import find_resumable

    vms = [vm_factory(name, extra_args=["--provider", "none"]) for name in ("node-a", "node-b")]
    roots = [vm.root for vm in vms]
    sockets = ",".join(str(vm.socket) for vm in vms)

    only_rank_0 = run_two_ranks(tmp_path, roots, "external0", "5:periodic", sockets=sockets)
    assert [lines[0]["raised"] for lines in only_rank_0] == [None, None], only_rank_0
    assert sorted(load_manifest(roots[0] / "step-000000005").files) == ["rank0.pt"]
    assert "nodes" not in load_manifest(roots[0] / "step-000000005").meta  # one node holds it all
    assert not (roots[1] / "step-000000005").exists(), "the empty step directory on rank 1's disk went"
    wait_for(lambda: bucket_status(bucket, "step-000000005") == "complete", 60, "the one-node commit in the bucket")

    (tmp_path / "rendezvous").unlink(missing_ok=True)
    both = run_two_ranks(tmp_path, roots, "external", "6:periodic", sockets=sockets)
    assert [lines[0]["raised"] for lines in both] == [None, None], both
    name = "step-000000006"
    manifest = load_manifest(roots[0] / name)
    assert sorted(manifest.files) == ["rank0.pt", "rank1.pt"] and manifest.meta["nodes"] == 2
    assert sorted(p.name for p in (roots[0] / name).iterdir()) == ["manifest.json", "part-0.json", "rank0.pt"]
    assert sorted(p.name for p in (roots[1] / name).iterdir()) == ["part-1.json", "rank1.pt"]
    assert [(i.name, i.status) for i in scan_local(roots[1]) if i.name == name] == [(name, "incomplete")]
    wait_for(lambda: bucket_status(bucket, name) == "complete", 60, "the two-node commit in the bucket")

    fresh = tmp_path / "fresh-node" / "ckpt"
    resumable = find_resumable(fresh, bucket, "test")
    assert resumable == fresh / name / "rank0.pt"
    for rank in range(2):
        restored = torch.load(fresh / name / f"rank{rank}.pt", weights_only=True)
        assert torch.equal(restored["weights"], torch.full((1 << 20,), float(rank + 1)))

    (tmp_path / "rendezvous").unlink(missing_ok=True)
    same = [lines[0] for lines in run_two_ranks(tmp_path, roots, "external-same", "7:periodic", sockets=sockets)]
    assert [o["raised"] for o in same] == [None, None], same
    kept = roots[0] / "step-000000007" / "rank0.pt"  # both disks hold a rank0.pt, each its rank's bytes
    assert load_manifest(kept.parent).files["rank0.pt"].crc32c == crc32c_of_file(kept)
    assert "nodes" not in load_manifest(kept.parent).meta, "rank 1's disk holds nothing of its own"
    assert not (roots[1] / "step-000000007").exists(), "nor keeps its copy"
    wait_for(lambda: bucket_status(bucket, "step-000000007") == "complete", 60, "the commit in the bucket")


def test_a_job_that_destroys_its_group_during_a_periodic_save_commits_nothing_and_exits(tmp_path: Path) -> None:
    """``destroy_process_group()`` before ``guard.close()`` while a periodic save is written: without its
    collectives each rank would write, and rank 0 commit, as if alone. The save is refused with a
    message naming the fix; at the interpreter's exit it is given up, not waited for."""

    def two_ranks(mode: str) -> list[tuple[str, str]]:
        root = tmp_path / mode
        env = {**os.environ, "WORLD_SIZE": "2", "RENDEZVOUS_FILE": str(tmp_path / f"rendezvous-{mode}")}
        command = [sys.executable, "-m", "tests.e2e.dist_destroyed", str(root), mode]
        ranks = [
            popen(command, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for r in range(2)
        ]
        try:
            outputs = [proc.communicate(timeout=120) for proc in ranks]
        finally:
            for proc in ranks:
                proc.kill()
        assert [proc.returncode for proc in ranks] == [0, 0], outputs
        assert [info.step for info in scan_local(root) if info.status == "complete"] == []
        return [(out or "", err or "") for out, err in outputs]

    for out, _ in two_ranks("wait"):
        refused = json.loads(out)
        assert refused["raised"] == "GroupGone"
        assert "call guard.close() before destroy_process_group()" in refused["message"]
    for _, err in two_ranks("exit"):
        assert "the process group was destroyed while spotguard-save-5 was written: it is lost" in err


def test_a_signal_reaching_one_rank_after_the_agreement_changes_no_rank_s_save_and_stops_both_at_the_next(
    tmp_path: Path,
) -> None:
    """The ranks agreed on a periodic save; a SIGTERM reached rank 1 before its save. Rank 1's save was
    urgent and in the foreground, rank 0's periodic and in the background: their collectives never
    matched, and the job hung where the VM was going away. Rank 1 then left the loop alone, and rank
    0 waited for it in the next step's agreement. Now the save keeps the agreed reason, and the stop
    is agreed at the next step boundary, on both ranks."""
    root = tmp_path / "nvme"
    outcomes = last_lines(tmp_path / "rendezvous", "tests.e2e.dist_late_signal", str(root))
    for outcome in outcomes:
        assert outcome["saves"] == [[2, "periodic"], [3, "urgent"]], outcomes
        assert outcome["left_at"] == 3, outcomes
    assert [info.step for info in scan_local(root) if info.status == "complete"][-1] == 3
    assert load_manifest(root / "step-000000003").reason == "urgent"


def test_a_save_of_several_ranks_before_the_first_step_changes_neither_training_nor_its_resume(tmp_path: Path) -> None:
    """DCP's get_state_dict steps an optimizer that never stepped once (zero gradients, lr 0) to give
    it a state: a save that early (a notice before the first step) left Adam at step 1 with zero
    moments, so the run and every run resumed from the checkpoint were a step of bias correction off
    an uninterrupted one."""
    root = tmp_path / "nvme"

    def ranks(how: str) -> list[dict[str, Any]]:
        return last_lines(tmp_path / f"rendezvous-{how}", "tests.e2e.dist_fresh_optimizer", str(root), how)

    plain, saved, resumed = ranks("plain"), ranks("save"), ranks("resume")
    for rank in range(2):
        assert saved[rank]["after_save"] == []  # still never stepped
        assert saved[rank]["steps"] == resumed[rank]["steps"] == plain[rank]["steps"] == [3.0, 3.0]
        assert saved[rank]["params"] == plain[rank]["params"]
        assert resumed[rank]["params"] == plain[rank]["params"]
