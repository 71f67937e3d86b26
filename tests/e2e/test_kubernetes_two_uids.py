"""Two pods on one node, as kubernetes/ deploys them: the daemon and a trainer as processes with different
uids that share only the socket directory and the checkpoint root (host directories prepared as the
DaemonSet's init container prepares them), with the daemon's settings from the DaemonSet's ConfigMap.

The trainer runs as uid 12345 with the daemon's gid only as a supplementary group, like the example Job.
With trainer_uids (as the ConfigMap sets it) a drill gives an exact resume on a second "node"; without
it the trainer is refused, as before the setting existed, even when allowed_gids names the daemon's gid
and the trainer runs in a PID namespace of its own (its supplementary groups are then invisible).

Needs root (to run processes as other uids); skipped otherwise.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from spotguard.control import request
from spotguard.harness import collect_events, compare_final, trainer_command, wait_for

REPO = Path(__file__).resolve().parents[2]
CONFIGMAP_TOML = REPO / "kubernetes" / "base" / "spotguard.toml"
DAEMON_UID = DAEMON_GID = 10001  # the Dockerfile's defaults, as the DaemonSet runs them
TRAINER_UID = TRAINER_GID = 12345  # the example Job's
STEPS, K = 14, 6


def as_user(uid: int, gid: int, groups: list[int], command: list[str]) -> list[str]:
    """``command`` as uid:gid with these supplementary groups (setpriv, util-linux). Where this Python's
    own files are out of that uid's reach (an interpreter under root's 0700 home), the process keeps
    CAP_DAC_READ_SEARCH, and only it: it may read and traverse anything, but writes, and connecting to the
    socket, still go by the file modes, and SO_PEERCRED still reports the uid."""
    group_option = f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups"
    prefix = ["setpriv", f"--reuid={uid}", f"--regid={gid}", group_option]
    if not _interpreter_reachable_by(uid, gid):
        prefix += ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
    return [*prefix, "--", *command]


_reachable: dict[tuple[int, int], bool] = {}


def _interpreter_reachable_by(uid: int, gid: int) -> bool:
    if (uid, gid) not in _reachable:
        probe = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"]
        probe += [sys.executable, "-c", "import spotguard"]
        _reachable[uid, gid] = subprocess.run(probe, capture_output=True, cwd="/", check=False).returncode == 0
    return _reachable[uid, gid]


pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs the daemon and the trainer as other uids (root only)")


class Node:
    """One node's host directories, prepared like the DaemonSet's init container does, and its daemon."""

    def __init__(self, base: Path, name: str, bucket: str, config: Path, own_pid_namespace: bool = False) -> None:
        self.dir = base / name
        self.socket_dir = self.dir / "run-spotguard"
        self.root = self.dir / "checkpoints"
        self.state = self.dir / "state"
        self.socket = self.socket_dir / "spotguard.sock"
        self.bucket, self.config = bucket, config
        self.own_pid_namespace = own_pid_namespace
        self.log = self.dir / "daemon.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.dir.mkdir(mode=0o755)
        for path, mode in ((self.socket_dir, 0o750), (self.root, 0o2770), (self.state, 0o750)):
            path.mkdir()
            os.chown(path, DAEMON_UID, DAEMON_GID)
            path.chmod(mode)

    def start_daemon(self) -> None:
        command = [
            sys.executable, "-m", "spotguard", "run", "--config", str(self.config), "--provider", "none",
            "--socket", str(self.socket), "--checkpoint-dir", str(self.root), "--state-dir", str(self.state),
            "--bucket", self.bucket,
        ]  # fmt: skip
        env = {**os.environ, "SPOTGUARD_SCAN_INTERVAL": "0.5", "HOME": str(self.state)}
        command = as_user(DAEMON_UID, DAEMON_GID, [], command)
        if self.own_pid_namespace:  # as a pod: no other pod's processes are visible to it
            command = ["unshare", "--pid", "--fork", *command]
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=log, env=env, cwd="/", umask=0o022, start_new_session=True
            )
        wait_for(self._listening, 30, f"the daemon to listen (log: {self.log})")

    def _listening(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"the daemon exited with {self.process.returncode}: {self.log.read_text()[-2000:]}")
        try:
            request(self.socket, "status", timeout=1)  # as root: allowed by default
        except Exception:
            return False
        return True

    def stop_daemon(self) -> int:
        """SIGTERM, as the kubelet sends it; the daemon drains and exits by itself."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGTERM)
        code = self.process.wait(timeout=60)
        self.process = None
        return code

    def kill(self) -> None:
        if self.process is not None:
            # The whole process group: a daemon in a PID namespace of its own is unshare's child.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def as_trainer(
    command: list[str], home: Path, *, own_pid_namespace: bool = False, **kwargs: Any
) -> subprocess.Popen[str]:
    """A process as the example Job's trainer: uid/gid 12345, the daemon's gid as a supplementary group
    (supplementalGroups), umask 0007 (the Job's command). Optionally in a PID namespace of its own, as
    another pod is: the daemon then sees pid 0 and cannot read its supplementary groups."""
    command = as_user(TRAINER_UID, TRAINER_GID, [DAEMON_GID], command)
    if own_pid_namespace:
        command = ["unshare", "--pid", "--fork", *command]
    env = {**os.environ, "HOME": str(home), "TMPDIR": str(home)}
    return subprocess.Popen(command, env=env, cwd="/", umask=0o007, text=True, **kwargs)


def trainer_events(command: list[str], home: Path, on_event: Callable[[dict[str, Any]], None] | None = None) -> list:
    return collect_events(as_trainer(command, home, stdout=subprocess.PIPE), on_event, timeout=180)


def status_as_trainer(node: Node, home: Path, *, own_pid_namespace: bool = False) -> subprocess.CompletedProcess[str]:
    proc = as_trainer(
        [sys.executable, "-m", "spotguard", "status", "--json", "--socket", str(node.socket)],
        home,
        own_pid_namespace=own_pid_namespace,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture
def cluster() -> Iterator[Callable[..., Node]]:
    """Nodes sharing one file:// bucket, under a world-traversable scratch directory (pytest's tmp_path
    is root-only); the daemons are killed and the directory removed at teardown."""
    base = Path(tempfile.mkdtemp(prefix="spotguard-k8s-"))
    base.chmod(0o755)
    bucket = base / "bucket"
    bucket.mkdir()
    os.chown(bucket, DAEMON_UID, DAEMON_GID)
    home = base / "trainer-home"
    home.mkdir()
    os.chown(home, TRAINER_UID, TRAINER_GID)
    nodes: list[Node] = []

    def make(name: str, config: Path = CONFIGMAP_TOML, own_pid_namespace: bool = False) -> Node:
        node = Node(base, name, bucket.as_uri(), config, own_pid_namespace)
        nodes.append(node)
        node.start_daemon()
        return node

    make.home = home  # type: ignore[attr-defined]
    make.base = base  # type: ignore[attr-defined]
    try:
        yield make
    finally:
        for node in nodes:
            node.kill()
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slow
def test_trainer_with_another_uid_gets_an_exact_resume_through_the_configmaps_setting(
    cluster: Callable[..., Node],
) -> None:
    home: Path = cluster.home  # type: ignore[attr-defined]
    base: Path = cluster.base  # type: ignore[attr-defined]
    out_dir = base / "out"
    out_dir.mkdir()
    os.chown(out_dir, TRAINER_UID, TRAINER_GID)

    # The uninterrupted run, for comparison (no daemon needed).
    reference = out_dir / "reference.pt"
    trainer_events(trainer_command(out_dir / "ref-root", None, out_dir / "none.sock", STEPS, reference), home)

    node_a = cluster("node-a")
    assert status_as_trainer(node_a, home).returncode == 0, "uid 12345 is in the ConfigMap's trainer_uids"

    def drill_at_k(event: dict[str, Any]) -> None:
        if event["event"] == "waiting":
            request(node_a.socket, "drill", deadline_s=120)

    events = trainer_events(
        trainer_command(node_a.root, node_a.bucket, node_a.socket, STEPS, None, wait_notice_at=K), home, drill_at_k
    )
    saved = [e for e in events if e["event"] == "saved"]
    assert [e["step"] for e in saved] == [K] and saved[0]["stop"] is True
    wait_for(lambda: (s := request(node_a.socket, "status")["last_notice"]) and s.get("committed_at"), 60, "commit")
    # What the trainer (uid 12345) wrote, the daemon (uid 10001) read and uploaded: group 10001 through
    # the setgid root, group-readable through the umask.
    step_dir = node_a.root / f"step-{K:09d}"
    assert step_dir.stat().st_gid == DAEMON_GID and step_dir.stat().st_uid == TRAINER_UID
    assert node_a.stop_daemon() == 0, "SIGTERM: drains and exits cleanly within the pod's grace"

    # A replacement node: empty local disk, the same bucket; the trainer resumes from the bucket.
    node_b = cluster("node-b")
    resumed = out_dir / "resumed.pt"
    events = trainer_events(trainer_command(node_b.root, node_b.bucket, node_b.socket, STEPS, resumed), home)
    assert events[0]["event"] == "resumed" and events[0]["step"] == K
    assert events[-1]["event"] == "finished" and events[-1]["step"] == STEPS
    assert compare_final(reference, resumed) == []


def test_without_the_setting_the_other_uid_is_refused_as_before(cluster: Callable[..., Node]) -> None:
    home: Path = cluster.home  # type: ignore[attr-defined]
    base: Path = cluster.base  # type: ignore[attr-defined]
    without = base / "without-trainer-uids.toml"
    lines = CONFIGMAP_TOML.read_text().splitlines()
    without.write_text("\n".join(line for line in lines if not line.startswith("trainer_uids")) + "\n")
    node = cluster("node", config=without)
    refused = status_as_trainer(node, home)
    assert refused.returncode != 0
    assert "may not use this socket" in refused.stderr

    # allowed_gids with the daemon's gid lets the same trainer in while the daemon can see it (one PID
    # namespace), but not when both run in PID namespaces of their own, as two pods do: SO_PEERCRED then
    # gives pid 0, and the trainer's supplementary groups cannot be read.
    with_gids = base / "allowed-gids.toml"
    with_gids.write_text(without.read_text() + f"allowed_gids = [{DAEMON_GID}]\n")
    node_gids = cluster("node-gids", config=with_gids)
    assert status_as_trainer(node_gids, home).returncode == 0
    pod_gids = cluster("pod-gids", config=with_gids, own_pid_namespace=True)
    other_pod = status_as_trainer(pod_gids, home, own_pid_namespace=True)
    assert other_pod.returncode != 0 and "may not use this socket" in other_pod.stderr
