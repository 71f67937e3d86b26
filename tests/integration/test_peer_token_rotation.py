"""Rotating the job's peer token across a fleet that keeps running: a daemon given the previous token
too is a peer of the VMs not yet restarted and of those already rotated, and of nobody else."""

from __future__ import annotations

import asyncio
import io
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotguard.config import DaemonConfig
from spotguard.doctor import run_doctor
from spotguard.harness import Vm, wait_for
from spotguard.peer import wire
from spotguard.peer.client import PeerClient, choose_peer
from spotguard.peer.discovery import PeerRegistry
from spotguard.peer.flows import send_committed
from spotguard.peer.networks import LOOPBACK_NETWORKS, PeerNetworks, parse_networks
from spotguard.peer.receiver import PeerReceiver
from spotguard.peer.tokens import PREVIOUS_ONLY, JobToken, PeerToken
from spotguard.storage.checkpoints import list_remote
from spotguard.storage.file import FileStorage
from spotguard.storage.s3 import S3Storage
from tests.checkpoints import write_checkpoint
from tests.peers import (
    TOKEN,
    address,
    bucket_keys,
    peer_behind_a_slow_bucket,
    receiving_daemon,
    replica_area,
    urgent_handoff,
)
from tests.scrape import names, scrape, value

MiB = 1 << 20
OLD = TOKEN.encode()  # the token the fleet ran with
NEW = b"the-job-s-rotated-token-0123456789abcdef"
STRANGER = b"another-job-s-token-0123456789abcdef"


@pytest.fixture(autouse=True)
def no_remembered_receivers() -> Iterator[None]:
    """Which receivers take only the previous token is remembered per process: start each test afresh."""
    PREVIOUS_ONLY.clear()
    yield
    PREVIOUS_ONLY.clear()


async def hand_over(where: tuple[str, int], step_dir: Path, url: str, token: PeerToken, flows: int) -> str:
    client = await PeerClient.connect(*where, token)
    try:
        return str((await send_committed(client, step_dir, url, token, flows=flows))["state"])
    finally:
        await client.close()


async def refused_code(where: tuple[str, int], token: PeerToken) -> str:
    with pytest.raises(wire.PeerError) as caught:
        await PeerClient.connect(*where, token)
    return caught.value.code


def committed(url: str, count: int) -> list[str]:
    """The checkpoints complete in the bucket, once there are ``count`` of them."""
    storage = S3Storage(url)
    try:
        names = lambda: [i.name for i in list_remote(storage) if i.status == "complete"]  # noqa: E731
        return list(wait_for(lambda: len(found := names()) >= count and found, 30, f"{count} commits"))
    finally:
        storage.close()


def test_a_daemon_given_the_previous_token_takes_handoffs_made_with_either_and_no_other(
    tmp_path: Path, url: str
) -> None:
    env = {"SPOTGUARD_PEER_TOKEN": NEW.decode(), "SPOTGUARD_PEER_TOKEN_PREVIOUS": OLD.decode()}
    from_old = write_checkpoint(tmp_path / "old-vm", 7, {"weights.bin": os.urandom(2 * MiB)})
    from_new = write_checkpoint(tmp_path / "new-vm", 8, {"weights.bin": os.urandom(2 * MiB)})
    with receiving_daemon(tmp_path, url, env=env) as vm:
        where = address(vm)
        # A VM not yet restarted knows only the old token; one already rotated only the new one.
        assert asyncio.run(hand_over(where, from_old, url, OLD, flows=2)) == "verified"
        assert asyncio.run(hand_over(where, from_new, url, NEW, flows=2)) == "verified"
        # Another job's token is refused, alone or with a previous token of its own (two tries).
        assert asyncio.run(refused_code(where, STRANGER)) == "auth"
        assert asyncio.run(refused_code(where, JobToken(STRANGER, previous=b"its-own-old-token-0123456789"))) == "auth"
        assert committed(url, 2) == ["step-000000007", "step-000000008"]
        assert vm.status()["peers"]["refused"] == 3
        status = vm.status()["peers"]
        assert (status["token"], status["previous_token"]) == (wire.token_fingerprint(NEW), wire.token_fingerprint(OLD))
        wait_for(lambda: replica_area(vm) == [], 10, "the replicas to be deleted once committed")
    log = vm.log.read_text()
    assert "the previous peer token is accepted too" in log
    assert OLD.decode() not in log and NEW.decode() not in log
    assert all(key.startswith(("step-000000007/", "step-000000008/")) for key in bucket_keys(url))


def test_a_rotated_sender_hands_over_to_a_daemon_not_yet_restarted_knocking_once(tmp_path: Path, url: str) -> None:
    step_dir = write_checkpoint(tmp_path / "sender", 9, {"a.bin": os.urandom(2 * MiB), "b.bin": os.urandom(MiB)})
    rotated = JobToken(NEW, previous=OLD)
    with receiving_daemon(tmp_path, url) as vm:  # the old token only
        where = address(vm)
        assert asyncio.run(hand_over(where, step_dir, url, rotated, flows=3)) == "verified"
        # The new token was refused once; the handoff's other flows went with the old one at once.
        assert vm.status()["peers"]["refused"] == 1
        status = vm.status()["peers"]
        assert (status["token"], status["previous_token"]) == (wire.token_fingerprint(OLD), None)
        assert committed(url, 1) == ["step-000000009"]
        # Once the fleet is rotated and the previous token dropped, this daemon is no peer of it.
        assert asyncio.run(refused_code(where, NEW)) == "auth"
        assert vm.status()["peers"]["refused"] == 2


def test_a_rotated_sender_asks_a_daemon_its_registry_entry_shows_not_yet_restarted_with_the_old_token_first(
    tmp_path: Path,
) -> None:
    """The entry of a daemon not yet restarted is signed under the old token alone: a rotated sender
    that found it in the bucket asks it with the old token at once, and is refused nothing there."""
    url = f"file://{tmp_path}/bucket/run1"
    rotated = JobToken(NEW, previous=OLD)
    loopback = PeerNetworks(parse_networks(LOOPBACK_NETWORKS))

    async def refusals_seen_by_the_old_daemon(*, through_the_registry: bool) -> int:
        receiver = PeerReceiver(tmp_path / "old-vm", FileStorage(url), token=OLD, host="127.0.0.1", port=0)
        listening = await receiver.start()
        try:
            PeerRegistry(FileStorage(url), token=OLD, networks=loopback, address=listening).register()
            if through_the_registry:
                candidates = await PeerRegistry(FileStorage(url), token=rotated, networks=loopback).candidates()
            else:  # a static peers list: nothing says which token it holds
                candidates = [wire.parse_address(listening)]
            chosen = await choose_peer(candidates, rotated, url, timeout=5.0)
            assert chosen is not None
            await chosen.close()
            return receiver.refused
        finally:
            await receiver.close()

    assert asyncio.run(refusals_seen_by_the_old_daemon(through_the_registry=False)) == 1
    PREVIOUS_ONLY.clear()
    assert asyncio.run(refusals_seen_by_the_old_daemon(through_the_registry=True)) == 0


def test_the_metrics_say_which_token_each_vm_runs_and_whether_anyone_still_proves_the_old_one(
    tmp_path: Path, url: str
) -> None:
    env = {
        "SPOTGUARD_PEER_TOKEN": NEW.decode(),
        "SPOTGUARD_PEER_TOKEN_PREVIOUS": OLD.decode(),
        "SPOTGUARD_METRICS_PORT": "0",
    }
    with receiving_daemon(tmp_path, url, env=env) as vm:
        metrics = str(vm.status()["metrics_url"])
        before = scrape(metrics)
        fingerprints = {"token": wire.token_fingerprint(NEW), "previous_token": wire.token_fingerprint(OLD)}
        assert value(before, "spotguard_peer_token_info", **fingerprints) == 1
        assert value(before, "spotguard_peer_handshakes_total", token="previous") == 0
        assert value(before, "spotguard_peer_replicas", state="receiving") == 0

        async def knock(token: PeerToken) -> None:
            client = await PeerClient.connect(*address(vm), token)
            await client.close()

        for token in (OLD, OLD, NEW, JobToken(NEW, previous=OLD)):
            asyncio.run(knock(token))
        assert asyncio.run(refused_code(address(vm), STRANGER)) == "auth"
        samples = wait_for(
            lambda: (s := scrape(metrics)) and value(s, "spotguard_peer_handshakes_total", token="current") == 2 and s,
            10,
            "the receiver to count the handshakes",
        )
        assert value(samples, "spotguard_peer_handshakes_total", token="previous") == 2
        assert value(samples, "spotguard_peer_connections_refused_total") == 1
        assert vm.status()["peers"]["handshakes"] == {"token": 2, "previous_token": 2}
    # A daemon that only sends shows its token, and no receiver's counts.
    sender = Vm(tmp_path, "vm-a", url, extra_args=["--provider", "none", "--peers", "127.0.0.1:9"])
    sender.start_daemon(env={"SPOTGUARD_PEER_TOKEN": NEW.decode(), "SPOTGUARD_METRICS_PORT": "0"})
    try:
        samples = scrape(str(sender.status()["metrics_url"]))
    finally:
        sender.kill_daemon()
    assert value(samples, "spotguard_peer_token_info", token=wire.token_fingerprint(NEW), previous_token="") == 1
    assert not {"spotguard_peer_handshakes_total", "spotguard_peer_replicas"} & names(samples)
    assert value(samples, "spotguard_peer_handoffs_total", outcome="handed") == 0  # a sender's own counts
    assert value(samples, "spotguard_peer_handoff_moves_total") == 0


def test_doctor_reports_a_rotation_under_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = DaemonConfig(
        provider="none",
        bucket=f"file://{tmp_path}/bucket/run1",
        checkpoint_dir=tmp_path / "doctor",
        peer_listen="127.0.0.1:0",
        peers="bucket",
    )
    monkeypatch.setenv("SPOTGUARD_PEER_TOKEN", "b0776ae8b8256a5f66376c0e208bf4c6874840e3aaad918b3eab3bfefa70f579")
    monkeypatch.setenv("SPOTGUARD_PEER_TOKEN_PREVIOUS", OLD.decode())
    out = io.StringIO()
    run_doctor(config, out=out, write_probe_bytes=1 << 20, upload_probe_bytes=1 << 20)
    assert "ok    peer token: 64 bytes" in out.getvalue(), out.getvalue()
    assert "warn  peer token: the previous token is accepted too (a rotation under way)" in out.getvalue()
    monkeypatch.setenv("SPOTGUARD_PEER_TOKEN_PREVIOUS", "short")
    out = io.StringIO()
    run_doctor(config, out=out, write_probe_bytes=1 << 20, upload_probe_bytes=1 << 20)
    assert "FAIL  peer token: the previous peer token from SPOTGUARD_PEER_TOKEN_PREVIOUS is shorter" in out.getvalue()
    assert "the token the fleet ran with before the rotation" in out.getvalue()


def test_a_restarted_daemon_given_both_tokens_hands_its_urgent_checkpoint_to_one_not_yet_restarted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with peer_behind_a_slow_bucket(tmp_path, monkeypatch) as (url, vm_b):  # B: the old token only
        peers = ["--peers", vm_b.status()["peers"]["listen"]]
        vm_a = Vm(tmp_path, "vm-a", url, extra_args=["--provider", "none", *peers])
        # A's last checkpoint says how big the next one is: 16 s at 1 MB/s, more than the deadline.
        write_checkpoint(vm_a.root, 1, {"state.bin": bytes(16 * MiB)})
        vm_a.start_daemon(env={"SPOTGUARD_PEER_TOKEN": NEW.decode(), "SPOTGUARD_PEER_TOKEN_PREVIOUS": OLD.decode()})
        try:
            handed, name = urgent_handoff(vm_a, size=3 * MiB, chunk=MiB, timeout=8.0)
        finally:
            vm_a.kill_daemon()
        assert handed["state"] == "handed", handed
        assert handed["name"] == name
        [replica] = wait_for(lambda: vm_b.status()["peers"]["replicas"], 10, "B's replica")
        assert replica["name"] == name
    assert "the previous peer token is accepted too" in vm_a.log.read_text()
    assert NEW.decode() not in vm_a.log.read_text() and OLD.decode() not in vm_b.log.read_text()
