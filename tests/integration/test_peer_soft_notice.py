"""The peer route at a soft notice (an AWS rebalance recommendation, whose action is a checkpoint).

A soft notice is over as soon as a checkpoint is saved for it, while the handoff of that checkpoint
has only begun. Two real daemons and the AWS metadata emulator; the bucket (moto) behind a relay
pacing each connection to 1 MB/s, so that A's plan routes to its peer B. The handoff must still be
told of the save and finish, and the next notice must get a handoff of its own; a handoff whose
notice ends with nothing saved must end too, not wait for a save that no longer comes.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from spotguard.control import request
from spotguard.emulate.aws import iso_z
from spotguard.emulate.common import RunningEmulator
from spotguard.emulate.registry import start_emulator
from spotguard.harness import Vm, wait_for
from tests.checkpoints import write_checkpoint
from tests.pacedrelay import PacedRelay
from tests.peers import bucket_keys, peer_behind_a_slow_bucket

MiB = 1 << 20
REBALANCE_HORIZON = 120  # seconds from a rebalance recommendation's noticeTime to its deadline


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Vm, Vm, RunningEmulator, str]]:
    emu = start_emulator("aws")
    try:
        with peer_behind_a_slow_bucket(tmp_path, monkeypatch) as (url, vm_b):
            aws = ["--provider", "aws", "--metadata-url", emu.url, "--poll-interval", "0.2"]
            vm_a = Vm(tmp_path, "vm-a", url, extra_args=[*aws, "--peers", vm_b.status()["peers"]["listen"]])
            # A's last checkpoint says how big the next one is: 24 s at 1 MB/s, more than a notice's 20 s.
            write_checkpoint(vm_a.root, 1, {"state.bin": bytes(24 * MiB)})
            vm_a.start_daemon()
            try:
                wait_for(lambda: vm_a.status()["upload_rate_bytes_s"], 30, "A's upload-rate probe")
                yield vm_a, vm_b, emu, url
            finally:
                vm_a.kill_daemon()
    finally:
        emu.stop()


def rebalance(vm: Vm, emu: RunningEmulator, seconds_left: float) -> str:
    """A rebalance recommendation whose deadline is ``seconds_left`` away (a second more at most); its
    event id, once A's plan routes it to the peer.

    A recommendation is known by its ``noticeTime``, to the second, so each is dated at least a second
    after the one A saw last: two made as many seconds apart as their ``seconds_left`` differ would
    otherwise carry the same time, and A rightly takes the second for the first, already over."""
    notice_time = datetime.now(UTC) - timedelta(seconds=REBALANCE_HORIZON - seconds_left)
    seen = vm.status()["last_notice"]
    if seen is not None and seen["kind"] == "rebalance":
        seen_time = datetime.fromisoformat(seen["deadline"]) - timedelta(seconds=REBALANCE_HORIZON)
        notice_time = max(notice_time, seen_time + timedelta(seconds=1))
    emu.trigger(kind="rebalance", time=iso_z(notice_time))
    notice = wait_for(
        lambda: (n := vm.status()["last_notice"]) and n["kind"] == "rebalance" and n["state"] == "pending" and n,
        10,
        "A to see the rebalance recommendation",
    )
    wait_for(lambda: (vm.status()["plan"] or {}).get("route") == "peer", 10, "A's plan to route to the peer")
    event_id: str = notice["event_id"]
    return event_id


def save_for(vm: Vm, event_id: str, step: int, size: int = 2 * MiB) -> str:
    """The trainer's checkpoint for the notice: committed on A's disk, then told (which ends the notice)."""
    step_dir = write_checkpoint(vm.root, step, {"state.bin": os.urandom(size)})
    request(vm.socket, "saved", path=str(step_dir), step=step, reason="soft", event_id=event_id)
    return step_dir.name


def test_a_checkpoint_saved_for_a_soft_notice_is_handed_over_and_the_next_notice_gets_its_own_handoff(
    setup: tuple[Vm, Vm, RunningEmulator, str],
) -> None:
    vm_a, vm_b, emu, url = setup
    # Step 5's size makes the next plan: 12 MiB at 1 MB/s need more than the second notice's 8 s.
    for step, seconds_left, size in ((5, 20, 12 * MiB), (6, 8, 2 * MiB)):
        event_id = rebalance(vm_a, emu, seconds_left)
        name = save_for(vm_a, event_id, step, size)
        wait_for(lambda: vm_a.status()["last_notice"]["state"] == "over", 10, "the soft notice over once saved")
        # The handoff goes on after its notice is over, to the peer's verified replica, and B commits it.
        wait_for(
            lambda name=name: f"{name}/manifest.json" in bucket_keys(url) and vm_b.status()["peers"]["replicas"] == [],
            60,
            f"B to commit {name} in the bucket",
        )
        handoff = wait_for(
            lambda name=name: (h := vm_a.status()["peers"]["handoff"])["name"] == name and h["seconds"] and h,
            10,
            f"A's handoff of {name} to finish",
        )
        assert handoff["error"] is None and handoff["bytes_sent"] >= size, handoff
        assert handoff["state"] == "idle"  # forgotten at its end: its notice was over by then
    log = vm_a.log.read_text()
    assert log.count("-> handed") == 2, log


def test_a_handoff_whose_notice_ends_with_nothing_saved_ends_and_the_next_notice_hands_over(
    setup: tuple[Vm, Vm, RunningEmulator, str],
) -> None:
    vm_a, vm_b, emu, url = setup
    rebalance(vm_a, emu, seconds_left=3)  # nobody saves for it
    wait_for(lambda: vm_a.status()["last_notice"]["state"] == "over", 15, "the notice over by its time")
    handoff = wait_for(lambda: (h := vm_a.status()["peers"]["handoff"])["error"] and h, 10, "A's handoff to end")
    assert handoff["error"] == "the notice ended before a checkpoint was saved for it"
    assert handoff["state"] == "idle" and vm_b.status()["peers"]["replicas"] == []

    event_id = rebalance(vm_a, emu, seconds_left=20)
    name = save_for(vm_a, event_id, 7)
    wait_for(lambda: f"{name}/manifest.json" in bucket_keys(url), 30, f"B to commit {name} in the bucket")
    wait_for(lambda: vm_a.status()["peers"]["handoff"]["seconds"], 10, "A's handoff to finish")
    assert vm_a.status()["peers"]["handoff"]["name"] == name


def test_a_notice_that_comes_while_the_last_notices_checkpoint_is_still_handed_over_gets_its_own_handoff(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AWS posts a rebalance recommendation, then the interruption, often close together. The handoff
    of the recommendation's checkpoint was still sending when the hard notice's plan routed to the
    peer: that start was ignored, the end of the first handoff forgot the urgent checkpoint announced
    meanwhile, and nothing handed it over (the route stayed ``peer``, so nothing asked again)."""
    emu = start_emulator("aws")
    try:
        with peer_behind_a_slow_bucket(tmp_path, monkeypatch) as (url, vm_b):
            listen = vm_b.status()["peers"]["listen"]
            # B behind 3 MB/s a connection: the first checkpoint's 24 MiB take some 8 s to hand over.
            with PacedRelay(f"http://{listen}", 3_000_000, buffer_bytes=64 * 1024) as peer_link:
                aws = ["--provider", "aws", "--metadata-url", emu.url, "--poll-interval", "0.2"]
                peers = ["--peers", peer_link.url.removeprefix("http://")]
                vm_a = Vm(tmp_path, "vm-a", url, extra_args=[*aws, *peers])
                write_checkpoint(vm_a.root, 1, {"state.bin": bytes(24 * MiB)})
                vm_a.start_daemon()
                try:
                    wait_for(lambda: vm_a.status()["upload_rate_bytes_s"], 30, "A's upload-rate probe")
                    soft = rebalance(vm_a, emu, seconds_left=20)
                    first = save_for(vm_a, soft, 5, size=24 * MiB)
                    wait_for(
                        lambda: (h := vm_a.status()["peers"]["handoff"])["name"] == first and h["state"] == "sending",
                        10,
                        f"A to be handing {first} over",
                    )
                    request(vm_a.socket, "drill", deadline_s=8)  # 24 MiB at 1 MB/s: the bucket cannot
                    hard = wait_for(
                        lambda: (n := vm_a.status()["last_notice"]) and n["kind"] == "drill" and n, 10, "the drill"
                    )
                    wait_for(lambda: (vm_a.status()["plan"] or {}).get("route") == "peer", 10, "the plan: peer")
                    handoff = vm_a.status()["peers"]["handoff"]
                    assert (handoff["name"], handoff["state"]) == (first, "sending"), handoff  # what is under test
                    urgent = write_checkpoint(vm_a.root, 6, {"state.bin": os.urandom(12 * MiB)}, reason="urgent")
                    request(vm_a.socket, "saved", path=str(urgent), step=6, reason="urgent", event_id=hard["event_id"])
                    wait_for(
                        lambda: (
                            (h := vm_a.status()["peers"]["handoff"])["name"] == urgent.name
                            and h["state"] in ("handed", "failed")
                        ),
                        60,
                        f"A to hand {urgent.name} over too",
                    )
                    assert vm_a.status()["peers"]["handoff"]["state"] == "handed"
                    assert vm_a.log.read_text().count("-> handed") == 2
                finally:
                    vm_a.kill_daemon()
    finally:
        emu.stop()


def test_a_peers_list_that_names_this_daemon_too_hands_over_to_the_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One static peers list for a whole fleet names every VM, this one too, first here. At a soft
    notice this daemon's own receiver answered (no hard notice of its own) and took the replica: a
    copy on the disk of the VM the notice is about, and no rescue."""
    with socket.socket() as probe:  # a port for A's receiver, known before A starts
        probe.bind(("127.0.0.1", 0))
        own = f"127.0.0.1:{probe.getsockname()[1]}"
    emu = start_emulator("aws")
    try:
        with peer_behind_a_slow_bucket(tmp_path, monkeypatch) as (url, vm_b):
            other = vm_b.status()["peers"]["listen"]
            aws = ["--provider", "aws", "--metadata-url", emu.url, "--poll-interval", "0.2"]
            vm_a = Vm(tmp_path, "vm-a", url, extra_args=[*aws, "--peer-listen", own, "--peers", f"{own},{other}"])
            write_checkpoint(vm_a.root, 1, {"state.bin": bytes(24 * MiB)})
            vm_a.start_daemon()
            try:
                assert vm_a.status()["peers"]["listen"] == own
                wait_for(lambda: vm_a.status()["upload_rate_bytes_s"], 30, "A's upload-rate probe")
                event_id = rebalance(vm_a, emu, seconds_left=20)
                name = save_for(vm_a, event_id, 5)
                handoff = wait_for(
                    lambda: (h := vm_a.status()["peers"]["handoff"])["name"] == name and h["seconds"] and h,
                    30,
                    f"A to hand {name} over",
                )
                assert handoff["peer"] == other and handoff["error"] is None, handoff
                assert vm_a.status()["peers"]["replicas"] == []  # nothing of its own taken in
                assert f"peer {own} is this daemon itself: not choosing it" in vm_a.log.read_text()
            finally:
                vm_a.kill_daemon()
    finally:
        emu.stop()
