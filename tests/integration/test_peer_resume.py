"""Resuming from a peer: a replacement VM's daemon fetches a verified replica newer than the bucket's.

Real daemons on 127.0.0.1 and moto as the shared bucket. The peers holding replicas reach the bucket
through a relay paced so slowly that their own uploads are still far from done when the fresh VM
resumes: the window in which only a peer holds the newest checkpoint.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotguard import Guard
from spotguard.crc32c import crc32c_of_bytes
from spotguard.harness import Vm, wait_for
from spotguard.manifest import FileEntry, load_manifest, write_part
from spotguard.peer import wire
from spotguard.peer.client import PeerClient
from spotguard.peer.fetch import STAGING, fetch_replica, list_replicas
from spotguard.peer.flows import send_committed
from spotguard.peer.replicas import AREA
from spotguard.storage.checkpoints import commit_remote, upload_checkpoint
from spotguard.storage.s3 import S3Storage
from tests.checkpoints import write_checkpoint
from tests.integration.test_daemon_buckets import make_state, remote, same_files, zeros_like
from tests.pacedrelay import PacedRelay
from tests.servers import S3Server

TOKEN = "the-job-s-peer-token-0123456789abcdef"
OTHER_TOKEN = "another-job-s-token-0123456789abcdef"
HELD_BACK = 2_000  # bytes/s: a holder's own upload of a replica takes minutes, the test seconds
MiB = 1 << 20


@pytest.fixture
def relay(server: S3Server) -> Iterator[PacedRelay]:
    with PacedRelay(server.endpoint_url, HELD_BACK) as paced:
        yield paced


@pytest.fixture
def checkpoints(tmp_path: Path, url: str) -> dict[int, tuple[Path, dict[str, object]]]:
    """Steps 5, 9 and 11 of one job as the dead VM wrote them; step 5 alone is in the bucket."""
    guard = Guard(checkpoint_dir=tmp_path / "dead-vm", socket=tmp_path / "none.sock", handle_sigterm=False, keep=10)
    saved = {}
    try:
        for step in (5, 9, 11):
            state = make_state(3, MiB, seed=step)
            saved[step] = (guard.save(state, step, reason="urgent"), state)
    finally:
        guard.close()
    storage = S3Storage(url)
    try:
        upload_checkpoint(storage, saved[5][0])
    finally:
        storage.close()
    return saved  # type: ignore[return-value]


def holder(tmp_path: Path, name: str, url: str, relay: PacedRelay, token: str = TOKEN, replicas: int = 2) -> Vm:
    """A peer's daemon holding replicas; its way to the bucket is the slow relay."""
    vm = Vm(tmp_path, name, url, extra_args=["--provider", "none", "--peer-listen", "127.0.0.1:0"])
    env = {"SPOTGUARD_PEER_TOKEN": token, "AWS_ENDPOINT_URL_S3": relay.url}
    vm.start_daemon(env={**env, "SPOTGUARD_PEER_MAX_REPLICAS": str(replicas)})
    return vm


def listen(vm: Vm) -> tuple[str, int]:
    return wire.parse_address(vm.status()["peers"]["listen"])


def hand(vm: Vm, step_dir: Path, url: str, token: str = TOKEN) -> None:
    async def go() -> dict[str, object]:
        client = await PeerClient.connect(*listen(vm), token.encode())
        try:
            return await send_committed(client, step_dir, url, token.encode(), flows=1)
        finally:
            await client.close()

    assert asyncio.run(go())["state"] == "verified"


def hand_share(vm: Vm, where: Path, step: int, url: str) -> Path:
    """Node 1's share of a two-node checkpoint (its files and its part, no manifest) to ``vm``."""
    share = where / f"step-{step:09d}"
    share.mkdir(parents=True)
    data = os.urandom(MiB + 7)
    (share / "w.bin").write_bytes(data)
    write_part(share, 1, 2, {"w.bin": FileEntry(len(data), crc32c_of_bytes(data))})

    async def go() -> dict[str, object]:
        client = await PeerClient.connect(*listen(vm), TOKEN.encode())
        try:
            await client.open_replica(share.name, url)
            await client.send_file(share / "w.bin", "w.bin")
            return await client.commit(share)
        finally:
            await client.close()

    assert asyncio.run(go())["state"] == "verified"
    return share


def fresh_vm(tmp_path: Path, url: str, *peers: Vm) -> Vm:
    addresses = ",".join(vm.status()["peers"]["listen"] for vm in peers)
    vm = Vm(tmp_path, "fresh", url, extra_args=["--provider", "none", "--peers", addresses])
    vm.start_daemon(env={"SPOTGUARD_PEER_TOKEN": TOKEN})
    return vm


def resume(vm: Vm, url: str, like: dict[str, object]) -> tuple[int, dict[str, object]]:
    loaded = zeros_like(like)  # type: ignore[arg-type]
    guard = Guard(checkpoint_dir=vm.root, bucket=url, socket=vm.socket, handle_sigterm=False)
    try:
        return guard.resume(loaded), loaded  # type: ignore[arg-type]
    finally:
        guard.close()


def replicas(vm: Vm) -> list[tuple[str, str]]:
    return [(r["name"], r["state"]) for r in vm.status()["peers"]["replicas"]]


def test_a_fresh_vm_resumes_the_newer_checkpoint_a_peer_holds_bit_identical(
    tmp_path: Path,
    url: str,
    relay: PacedRelay,
    checkpoints: dict[int, tuple[Path, dict[str, object]]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    step_dir, state = checkpoints[9]
    vm_b = holder(tmp_path, "vm-b", url, relay)
    vm_a: Vm | None = None
    try:
        hand(vm_b, step_dir, url)
        hand_share(vm_b, tmp_path / "node1", 12, url)  # newer, but only one node's share of step 12
        vm_a = fresh_vm(tmp_path, url, vm_b)
        # A save of step 9 cut short on this disk (no manifest: no checkpoint) does not keep the
        # peer's complete step 9 out; one with a manifest would (tests/integration/test_peer_security_inputs.py).
        (vm_a.root / step_dir.name).mkdir(parents=True)
        (vm_a.root / step_dir.name / ".w.bin.tmp-1").write_bytes(b"cut short")
        with caplog.at_level(logging.WARNING, logger="spotguard.trainer"):
            step, loaded = resume(vm_a, url, state)
        assert step == 9
        warned = [r.getMessage() for r in caplog.records if "step-000000012" in r.getMessage()]
        assert warned and f"step-000000012 on {vm_b.status()['peers']['listen']}" in warned[0]
        for key, tensor in state.items():
            assert bool((loaded[key] == tensor).all()), key  # type: ignore[attr-defined]
        assert same_files(step_dir, vm_a.root / step_dir.name) == []
        assert not (vm_a.root / STAGING).exists()
        # Still only on the peer when fetched: its own upload is held back by the relay.
        assert replicas(vm_b) == [("step-000000009", "verified"), ("step-000000012", "verified")]
        assert not (vm_a.root / "step-000000012").exists()
        assert "step-000000009" in vm_a.log.read_text() and "fetched and verified" in vm_a.log.read_text()
        # The fresh VM's uploader commits the fetched copy itself ...
        wait_for(lambda: remote(url).get(9) == "complete", 60, "the fetched checkpoint committed from the fresh VM")
        # ... and the peer's commit of the same bytes, when it comes, counts as done (no conflict, no loop).
        storage = S3Storage(url)
        try:
            assert commit_remote(storage, step_dir) is False
        finally:
            storage.close()
    finally:
        vm_b.kill_daemon()
        if vm_a is not None:
            vm_a.kill_daemon()


def test_a_corrupt_replica_and_a_peer_without_the_token_are_not_used(
    tmp_path: Path, url: str, relay: PacedRelay, checkpoints: dict[int, tuple[Path, dict[str, object]]]
) -> None:
    vm_b = holder(tmp_path, "vm-b", url, relay)
    vm_c = holder(tmp_path, "vm-c", url, relay, token=OTHER_TOKEN)
    vm_a: Vm | None = None
    try:
        hand(vm_b, checkpoints[9][0], url)
        hand(vm_c, checkpoints[11][0], url, token=OTHER_TOKEN)  # a newer one, behind another token
        # One byte of B's verified replica flips on B's disk after B checked it.
        replica = next((vm_b.root / AREA).glob("*/step-000000009"))
        victim = max((p for p in replica.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x01
        victim.write_bytes(bytes(data))

        vm_a = fresh_vm(tmp_path, url, vm_c, vm_b)
        step, loaded = resume(vm_a, url, checkpoints[5][1])
        assert step == 5  # the bucket's newest: neither peer's replica counts
        for key, tensor in checkpoints[5][1].items():
            assert bool((loaded[key] == tensor).all()), key  # type: ignore[attr-defined]
        assert sorted(p.name for p in vm_a.root.iterdir()) == ["step-000000005"]  # nothing half fetched
        log = vm_a.log.read_text()
        assert "step-000000009 on" in log and "refused: mismatch" in log and "crc32c" in log
        assert f"peer {vm_c.status()['peers']['listen']}: not asked" in log and "auth" in log
        assert "step-000000011" not in log  # never even listed
        assert vm_c.status()["peers"]["refused"] == 1
    finally:
        for vm in (vm_a, vm_b, vm_c):
            if vm is not None:
                vm.kill_daemon()


def test_list_and_fetch_frames(tmp_path: Path, url: str, relay: PacedRelay) -> None:
    """Only verified replicas of the holder's bucket are listed; a share is listed as one and not
    fetchable; an unknown id is refused; a fetch is verified and committed into the given root; a
    replica removed from the holder's disk while it is sent ends in an error frame, not in ``end``."""
    vm_b = holder(tmp_path, "vm-b", url, relay, replicas=3)
    try:
        whole = write_checkpoint(tmp_path / "sender", 31, {"w.bin": os.urandom(MiB + 7), "sub/x.bin": b""})
        hand(vm_b, whole, url)
        hand_share(vm_b, tmp_path / "node1", 32, url)
        # Files bigger than what the socket and the sender's buffer hold: the third is opened only
        # once the fetching side reads on.
        big = write_checkpoint(tmp_path / "sender", 33, {f"{i}.bin": os.urandom(24 * MiB) for i in range(3)})
        hand(vm_b, big, url)

        async def go() -> None:
            client = await PeerClient.connect(*listen(vm_b), TOKEN.encode())
            try:
                items = sorted(await list_replicas(client), key=lambda item: item["name"])
                assert [(i["name"], i["state"], i["bucket"], i["bytes"], i["share"]) for i in items] == [
                    ("step-000000031", "verified", url, MiB + 7, False),
                    ("step-000000032", "verified", url, MiB + 7, True),
                    ("step-000000033", "verified", url, 72 * MiB, False),
                ]
                with pytest.raises(wire.PeerError) as caught:
                    await fetch_replica(client, items[1]["id"], tmp_path / "fresh")
                assert caught.value.code == "share"
                with pytest.raises(wire.PeerError) as caught:
                    await fetch_replica(client, "step-000000031-nope", tmp_path / "fresh")
                assert caught.value.code == "gone"
                (tmp_path / "fresh").mkdir()
                fetched = await fetch_replica(client, items[0]["id"], tmp_path / "fresh")
                assert fetched == tmp_path / "fresh" / "step-000000031"
                assert load_manifest(fetched).files == load_manifest(whole).files
                assert same_files(whole, fetched) == [] and not (tmp_path / "fresh" / STAGING).exists()

                # On three connections, each its slice of the pieces: the same files, bit for bit.
                (tmp_path / "three").mkdir()
                connect = functools.partial(PeerClient.connect, *listen(vm_b), TOKEN.encode())
                fetched = await fetch_replica(client, items[2]["id"], tmp_path / "three", connect=connect, flows=3)
                assert same_files(big, fetched) == []
                other = await connect()
                other.writer.write(wire.encode({"t": "fetch", "id": items[2]["id"], "slice": [3, 3]}))
                with pytest.raises(wire.PeerError) as caught:
                    await wire.read_frame(other.reader)
                assert caught.value.code == "bad-field"
                await other.close()

                client.writer.write(wire.encode({"t": "fetch", "id": items[2]["id"]}))
                assert (await wire.read_frame(client.reader))["name"] == "step-000000033"
                shutil.rmtree(next((vm_b.root / AREA).glob("step-000000033-*")))  # as a deletion does
                with pytest.raises(wire.PeerError) as caught:
                    while (frame := await wire.read_frame(client.reader))["t"] == "data":
                        await client.reader.readexactly(frame["len"])
                assert caught.value.code == "gone"
                assert await list_replicas(client)  # the connection still serves
            finally:
                await client.close()

        asyncio.run(go())
    finally:
        vm_b.kill_daemon()
