"""A real receiver daemon on loopback: which replicas it admits, and which names it takes.

Slots and bytes are reserved before the receiver awaits anything; an offer that would leave no room
for this node's own next checkpoint is refused; step and file names are taken in one canonical form
only. Each refusal leaves nothing on disk nor in the bucket.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from spotguard.cli import main
from spotguard.control import request
from spotguard.crc32c import crc32c_of_bytes
from spotguard.harness import Vm, wait_for
from spotguard.localstore import scan_local
from spotguard.manifest import load_manifest
from spotguard.peer import wire
from spotguard.peer.client import PeerClient
from spotguard.peer.handoff import Handoff, HandoffState
from spotguard.peer.replicas import AREA
from spotguard.storage.base import Storage
from spotguard.storage.checkpoints import list_remote, restore
from spotguard.storage.file import FileStorage
from spotguard.storage.s3 import S3Storage
from tests.checkpoints import write_checkpoint
from tests.diskspace import fill
from tests.peers import (
    TOKEN,
    address,
    bucket_keys,
    drill_routed_to_peer,
    hand_over,
    handoff_ended,
    peer_behind_a_slow_bucket,
    replica_area,
    urgent_handoff,
)
from tests.scrape import scrape, value
from tests.streaming import ProgressiveWriter

MiB = 1 << 20


async def connect(vm: Vm) -> PeerClient:
    return await PeerClient.connect(*address(vm), TOKEN.encode())


async def offer(client: PeerClient, name: str, bucket: str, nbytes: int | None = None) -> str:
    """A replica offered as a handoff opens one (with ``nbytes`` announced, if given): ``ok``, or the
    code the receiver refused it with."""
    try:
        await client.open_replica(name, bucket, nbytes)
    except wire.PeerError as exc:
        return exc.code
    return "ok"


def refusal(call: Any) -> str:
    """The error code a coroutine ends with (it must end with one)."""

    async def run() -> str:
        with pytest.raises(wire.PeerError) as caught:
            await call()
        return caught.value.code

    return asyncio.run(run())


def test_seven_concurrent_offers_get_exactly_the_two_slots(receiver_vm: Vm, url: str) -> None:
    async def race() -> list[str]:
        clients = await asyncio.gather(*(connect(receiver_vm) for _ in range(7)))
        try:
            answers = await asyncio.gather(
                *(offer(c, f"step-00000010{i}", url) for i, c in enumerate(clients)), return_exceptions=True
            )
            codes = [a if isinstance(a, str) else repr(a) for a in answers]
            # While they are held, the receiver shows exactly the two it took.
            held = receiver_vm.status()["peers"]["replicas"]
            assert len(held) == 2 and all(r["state"] == "receiving" for r in held)
            return codes
        finally:
            await asyncio.gather(*(c.close() for c in clients))

    codes = asyncio.run(race())
    assert sorted(codes) == ["full"] * 5 + ["ok"] * 2, codes
    wait_for(lambda: replica_area(receiver_vm) == [], 10, "the unfinished replicas to be removed")
    assert receiver_vm.status()["peers"]["replicas"] == [] and bucket_keys(url) == []


@contextmanager
def tmpfs_receiver(tmp_path: Path, url: str, own: int) -> Iterator[Vm]:
    """A receiver whose checkpoint root is a 64 MiB tmpfs, holding a committed checkpoint of its own
    of ``own`` bytes (none if 0)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs takes root")
    vm = Vm(tmp_path, "vm-small", url, extra_args=["--provider", "none", "--peer-listen", "127.0.0.1:0"])
    vm.root.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(vm.root)], check=True)
    try:
        if own:
            write_checkpoint(vm.root, 3, {"own.bin": os.urandom(own)})
        vm.start_daemon(env={"SPOTGUARD_PEER_TOKEN": TOKEN})
        try:
            yield vm
        finally:
            vm.kill_daemon()
    finally:
        subprocess.run(["umount", str(vm.root)], check=True)


@pytest.fixture
def small_vm(tmp_path: Path, url: str) -> Iterator[Vm]:
    """A receiver on a 64 MiB tmpfs, holding a committed 40 MiB checkpoint of its own."""
    with tmpfs_receiver(tmp_path, url, 40 * MiB) as vm:
        yield vm


def test_a_disk_that_fills_while_a_replica_comes_in_refuses_it_as_no_space_and_serves_on(
    tmp_path: Path, url: str
) -> None:
    """Admitted, then another writer takes the rest of the disk: the sender hears ``no-space`` (it saw
    the connection close mid-record, the receiver logged "connection lost"), nothing of the replica
    stays, and once there is room again the same checkpoint is taken."""
    source = write_checkpoint(tmp_path / "source", 70, {"w.bin": os.urandom(16 * MiB)})
    with tmpfs_receiver(tmp_path, url, 0) as vm:

        def landed() -> bool:  # the first range written on the receiver's disk, not only read
            return any(path.stat().st_blocks * 512 >= 2 * MiB for path in (vm.root / AREA).rglob("w.bin"))

        async def hand_over_while_the_disk_fills() -> str:
            client = await connect(vm)
            try:
                await client.open_replica(source.name, url)
                with (source / "w.bin").open("rb", buffering=0) as file:
                    await client.send_part(file, "w.bin", 16 * MiB, 0, 2 * MiB)
                    await asyncio.to_thread(wait_for, landed, 10, "the first range on the receiver's disk")
                    fill(vm.root, leave=MiB)
                    await client.send_part(file, "w.bin", 16 * MiB, 2 * MiB, 14 * MiB)
                await client.commit(source)
                return "committed"
            except wire.PeerError as exc:
                return exc.code
            finally:
                await client.close()

        assert asyncio.run(hand_over_while_the_disk_fills()) == "no-space"
        wait_for(lambda: replica_area(vm) == [], 10, "the refused replica to be removed")
        log = vm.log.read_text()
        assert f"no-space: writing {source.name}/w.bin on this node failed: No space left on device" in log
        assert "connection lost" not in log
        (vm.root / "filler").unlink()
        assert hand_over(address(vm), source, url)["t"] == "ok"
        wait_for(lambda: source.name in [k.partition("/")[0] for k in bucket_keys(url)], 30, "the replica uploaded")


def test_a_handoff_a_peer_has_no_room_for_goes_to_the_next_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tmpfs: Callable[[int], Path]
) -> None:
    """The preferred peer's disk cannot take the replica (a wave of notices fills the freshest peer the
    same way): told the size at the open, it refuses at once, and the sender hands over to the next
    one, where it failed the handoff once the first file did not fit."""
    with peer_behind_a_slow_bucket(tmp_path, monkeypatch) as (url, vm_b):
        vm_c = Vm(tmp_path, "vm-c", url, extra_args=["--provider", "none", "--peer-listen", "127.0.0.1:0"])
        vm_c.root = tmpfs(2 * MiB)  # less than the 3 MiB checkpoint
        vm_c.start_daemon()
        peers = ["--peers", f"{vm_c.status()['peers']['listen']},{vm_b.status()['peers']['listen']}"]
        vm_a = Vm(tmp_path, "vm-a", url, extra_args=["--provider", "none", *peers])
        write_checkpoint(vm_a.root, 1, {"state.bin": bytes(3 * MiB)})  # the plan's size for the next one
        vm_a.start_daemon()
        try:
            handed, name = urgent_handoff(vm_a, size=3 * MiB, chunk=MiB, timeout=20.0)
        finally:
            vm_a.kill_daemon()
            vm_c.kill_daemon()
        assert handed["state"] == "handed" and handed["peer"] == vm_b.status()["peers"]["listen"], handed
        [replica] = wait_for(lambda: vm_b.status()["peers"]["replicas"], 10, "B's replica")
        assert replica["name"] == name
    assert "no-space" in vm_c.log.read_text() and replica_area(vm_c) == []
    assert "did not open the replica (no-space" in vm_a.log.read_text()


@pytest.mark.parametrize("committed", ["before-the-open", "after-a-refusal", "as-it-is-refused"])
def test_a_peer_with_room_for_the_committed_checkpoint_but_not_the_plans_size_takes_it(
    tmp_path: Path, url: str, tmpfs: Callable[[int], Path], committed: str
) -> None:
    """The plan sized the handoff from a larger checkpoint than the one saved (the last was 24 MiB,
    this one is 2 MiB). The only peer has room for the replica, not for the plan's size.
    ``before-the-open`` (a soft notice's checkpoint, or one sent again after a move): the open tells
    the replica's own size, and the peer takes it. ``after-a-refusal`` (an urgent save still being
    written): the peer refuses the plan's size; once the trainer commits, it is asked again with the
    checkpoint's, and takes it. Before, the handoff failed either way, no peer having room.
    ``as-it-is-refused``: the commit comes while the handoff takes in the refusal (at its log line,
    before it looks again); the refusal was still of the plan's size, so the peer is asked again.
    This order failed the handoff in one CI run ("after-a-refusal" can meet it too)."""
    step_dir = write_checkpoint(tmp_path / "vm-a", 7, {"state.bin": os.urandom(2 * MiB)})
    vm_c = Vm(tmp_path, "vm-c", url, extra_args=["--provider", "none", "--peer-listen", "127.0.0.1:0"])
    vm_c.root = tmpfs(8 * MiB)
    vm_c.start_daemon(env={"SPOTGUARD_PEER_TOKEN": TOKEN})

    async def hand_over() -> Handoff:
        async def candidates() -> list[tuple[str, int]]:
            return [address(vm_c)]

        handoff = Handoff(candidates, TOKEN.encode(), url)
        for rel, entry in load_manifest(step_dir).files.items():
            handoff.file_ready(step_dir, rel, entry)
        if committed == "before-the-open":
            handoff.saved(step_dir)
        elif committed == "as-it-is-refused":
            refusal.on_record = lambda: handoff.saved(step_dir)
        handoff.start(expected_bytes=24 * MiB, deadline=time.monotonic() + 20.0)
        try:
            async with asyncio.timeout(30):
                if committed == "after-a-refusal":
                    while "no-space" not in vm_c.log.read_text():
                        await asyncio.sleep(0.05)
                    assert handoff.state is HandoffState.CHOOSING  # waiting for the commit, not failed
                    handoff.saved(step_dir)
                while handoff.state not in (HandoffState.HANDED, HandoffState.FAILED):
                    await asyncio.sleep(0.05)
        finally:
            await handoff.close()
        return handoff

    refusal = OnLogRecord("did not open the replica")
    logging.getLogger("spotguard.handoff").addHandler(refusal)
    try:
        handoff = asyncio.run(hand_over())
        assert handoff.state is HandoffState.HANDED, handoff.error
        wait_for(lambda: f"{step_dir.name}/manifest.json" in bucket_keys(url), 30, "the replica committed")
    finally:
        logging.getLogger("spotguard.handoff").removeHandler(refusal)
        vm_c.kill_daemon()
    assert vm_c.log.read_text().count("no-space") == (committed != "before-the-open")
    assert refusal.seen == (committed != "before-the-open")


class OnLogRecord(logging.Handler):
    """Calls ``on_record`` (once) at the first record whose message holds ``text``, in the thread and at
    the moment the record is made: a point of the code under test, without changing it."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.seen = False
        self.on_record: Callable[[], None] = lambda: None

    def emit(self, record: logging.LogRecord) -> None:
        if not self.seen and self.text in record.getMessage():
            self.seen = True
            self.on_record()


@pytest.mark.parametrize("going", ["killed", "hard-notice"])
def test_a_handoff_whose_peer_goes_mid_stream_is_sent_again_to_the_next_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], going: str
) -> None:
    """The peer taking the replica is reclaimed itself while bytes go to it: killed at once, or told
    by a hard notice of its own (it then takes no more of the replica, and answers ``busy``). The
    handoff sends the replica again, from its first byte, to the next peer that answers, where it
    failed (killed) or went on into a VM about to go (notice) before."""
    size = 4 * MiB
    with peer_behind_a_slow_bucket(tmp_path, monkeypatch) as (url, vm_b):
        vm_c = Vm(tmp_path, "vm-c", url, extra_args=["--provider", "none", "--peer-listen", "127.0.0.1:0"])
        vm_c.start_daemon()
        c_listen = vm_c.status()["peers"]["listen"]
        peers = ["--peers", f"{c_listen},{vm_b.status()['peers']['listen']}"]
        vm_a = Vm(tmp_path, "vm-a", url, extra_args=["--provider", "none", *peers])
        write_checkpoint(vm_a.root, 1, {"state.bin": bytes(size)})  # the plan's size for the next one
        vm_a.start_daemon(env={"SPOTGUARD_METRICS_PORT": "0"})
        writer = ProgressiveWriter(vm_a.root, 5, vm_a.socket, size=size, chunk=MiB)
        try:
            drill_routed_to_peer(vm_a, deadline_s=8.0)
            writer.begin()
            writer.write_until(2 * MiB)
            wait_for(
                lambda: (h := vm_a.status()["peers"]["handoff"])["peer"] == c_listen and h["bytes_sent"] >= MiB,
                10,
                "A to send its first MiB to C",
            )
            if going == "killed":
                vm_c.kill_daemon()  # C's VM is taken back mid-stream
            else:
                request(vm_c.socket, "drill", deadline_s=60.0)  # C is told it goes too
            writer.write_until(size)
            writer.finish_file()
            writer.commit()
            handed = handoff_ended(vm_a, 20.0)
            samples = scrape(str(vm_a.status()["metrics_url"]))
            assert main(["status", "--socket", str(vm_a.socket)]) == 0
            if going == "hard-notice":  # what C received is gone: it will never be committed
                wait_for(lambda: replica_area(vm_c) == [], 10, "C to drop the replica it was receiving")
                assert vm_c.status()["peers"]["replicas"] == []
        finally:
            writer.close()
            vm_a.kill_daemon()
            vm_c.kill_daemon()
        assert handed["state"] == "handed" and handed["peer"] == vm_b.status()["peers"]["listen"], handed
        assert handed["bytes_sent"] == size, handed  # all of it again, not only what C lacked
        assert handed["moves"] == 1 and handed["totals"] == {"handed": 1, "failed": 0, "moves": 1}, handed
        assert value(samples, "spotguard_peer_handoffs_total", outcome="handed") == 1
        assert value(samples, "spotguard_peer_handoffs_total", outcome="failed") == 0
        assert value(samples, "spotguard_peer_handoff_moves_total") == 1
        assert "handed (4.0 MiB sent, after 1 peer(s) failed mid-stream)" in capsys.readouterr().out
        [replica] = wait_for(lambda: vm_b.status()["peers"]["replicas"], 10, "B's replica")
        assert replica["name"] == writer.step_dir.name
    assert f"{c_listen} failed after" in vm_a.log.read_text()
    if going == "hard-notice":
        assert "hard notice of its own; send the replica elsewhere" in vm_c.log.read_text()


def test_an_offer_that_leaves_no_room_for_the_node_s_own_checkpoint_is_refused(small_vm: Vm, url: str) -> None:
    async def offered(nbytes: int) -> str:
        client = await connect(small_vm)
        try:
            return await offer(client, "step-000000050", url, nbytes)
        finally:
            await client.close()

    assert asyncio.run(offered((1 << 40) + 1)) == "too-large"  # over the replica bound itself
    free = os.statvfs(small_vm.root).f_bavail * os.statvfs(small_vm.root).f_frsize
    assert free < 30 * MiB
    assert asyncio.run(offered(60 * MiB)) == "no-space"  # more than the whole disk
    # It would fit in what is free, but not beside this node's own next checkpoint (40 MiB).
    assert asyncio.run(offered(free - 4 * MiB)) == "no-space"
    wait_for(lambda: replica_area(small_vm) == [], 10, "nothing in the replica area")
    assert not any(k.startswith("step-000000050") for k in bucket_keys(url))
    assert "no-space" in small_vm.log.read_text() or "do not fit" in small_vm.log.read_text()


def test_a_replica_that_announces_nothing_is_held_to_its_files_sizes(receiver_vm: Vm, url: str, tmp_path: Path) -> None:
    payload = tmp_path / "payload"
    payload.write_bytes(b"x")
    free = os.statvfs(receiver_vm.root).f_bavail * os.statvfs(receiver_vm.root).f_frsize

    async def stream(size: int, name: str = "w.bin") -> None:
        client = await connect(receiver_vm)
        try:
            await client.open_replica("step-000000060", url)
            with payload.open("rb", buffering=0) as file:
                await client.send_part(file, name, size, 0, 1)
            await client.query()
        finally:
            await client.close()

    declared = free + (1 << 30)  # beyond the free space by a margin that other writers on this disk do not close
    expected = "no-space" if declared <= 1 << 40 else "too-large"
    assert refusal(lambda: stream(declared)) == expected
    wait_for(lambda: replica_area(receiver_vm) == [], 10, "the refused replica to be removed")
    assert bucket_keys(url) == []


BAD_STEPS = [
    "step-000000005\n",
    "step-" + "\u0660" * 8 + "\u0665",  # Arabic-Indic digits: int() takes them
    "step-" + "9" * 5000,
    "step-0000000005",
    "step-00000005",
    "step-00000000a",
    "./step-000000005",
]

BAD_FILES = ["./manifest.json", "a/../b", "a//b", "/etc/x", "a\x00b", "a\nb", "x\x1b[2J", "a/", "a\\b", "."]


def test_non_canonical_step_names_are_refused_and_nothing_is_written(receiver_vm: Vm, url: str) -> None:
    async def offered(name: str) -> str:
        client = await connect(receiver_vm)
        try:
            return await offer(client, name, url)
        finally:
            await client.close()

    for name in BAD_STEPS:
        assert asyncio.run(offered(name)) == "bad-field", name
    assert receiver_vm.status()["peers"]["replicas"] == []  # the receiver still answers
    assert replica_area(receiver_vm) == [] and bucket_keys(url) == []
    assert "Traceback" not in receiver_vm.log.read_text()


def test_non_canonical_file_names_are_refused_and_nothing_is_written(receiver_vm: Vm, url: str, tmp_path: Path) -> None:
    payload = tmp_path / "payload"
    payload.write_bytes(b"x")

    async def sent(rel: str) -> None:
        client = await connect(receiver_vm)
        try:
            await client.open_replica("step-000000070", url)
            with payload.open("rb", buffering=0) as file:
                await client.send_part(file, rel, 1, 0, 1)
            await client.query()
        finally:
            await client.close()

    for rel in BAD_FILES:
        assert refusal(lambda rel=rel: sent(rel)) == "bad-path", rel
    wait_for(lambda: replica_area(receiver_vm) == [], 10, "the refused replicas to be removed")
    assert bucket_keys(url) == [] and not (receiver_vm.dir / "b").exists()
    assert "Traceback" not in receiver_vm.log.read_text()

    # A manifest naming such a file is refused at the commit, even with every canonical file in place.
    step_dir = write_checkpoint(tmp_path / "sender", 71, {"w.bin": b"weights"})
    text = (step_dir / "manifest.json").read_text().replace('"w.bin"', '"./w.bin"')

    async def hand_over() -> None:
        client = await connect(receiver_vm)
        try:
            await client.open_replica(step_dir.name, url)
            await client.send_file(step_dir / "w.bin", "w.bin")
            client.writer.write(wire.encode({"t": "commit", "manifest": text}))
            await client.writer.drain()
            await wire.read_frame(client.reader)
        finally:
            await client.close()

    assert refusal(hand_over) == "bad-manifest"
    wait_for(lambda: replica_area(receiver_vm) == [], 10, "the refused replica to be removed")
    assert bucket_keys(url) == []


def _upload_as(storage: Storage, step_dir: Path, name: str) -> None:
    """A whole checkpoint's objects under the directory name ``name`` (manifest last)."""
    files = sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != "manifest.json")
    for path in [*files, step_dir / "manifest.json"]:
        key = f"{name}/{path.relative_to(step_dir).as_posix()}"
        storage.put_file(path, key, crc32c=crc32c_of_bytes(path.read_bytes()))


IMPOSTORS = ["step-000000009\n", "step-" + "\u0660" * 8 + "\u0669", "step-0000000009", "step-00000009", "step-9"]


@pytest.mark.parametrize("store", ["s3", "file"])
def test_listings_and_restore_ignore_non_canonical_step_directories(url: str, tmp_path: Path, store: str) -> None:
    real = write_checkpoint(tmp_path / "src", 5, {"w.bin": b"the real step 5"})
    newer = write_checkpoint(tmp_path / "src", 9, {"w.bin": b"an impostor of step 9"})
    # A newline in a key is beyond the S3 emulator's URLs: that one goes to the file store only.
    impostors = IMPOSTORS if store == "file" else IMPOSTORS[1:]
    storage: Storage = S3Storage(url) if store == "s3" else FileStorage(f"file://{tmp_path / 'bucket'}")
    try:
        _upload_as(storage, real, real.name)
        for name in impostors:
            _upload_as(storage, newer, name)
        assert [(i.name, i.status) for i in list_remote(storage)] == [("step-000000005", "complete")]
        dest = tmp_path / "dest"
        dest.mkdir()
        assert restore(storage, dest) == dest / "step-000000005"
        assert (dest / "step-000000005" / "w.bin").read_bytes() == b"the real step 5"
    finally:
        storage.close()

    # The same on a local disk: such directories are never scanned as checkpoints.
    local = tmp_path / "local"
    write_checkpoint(local, 5, {"w.bin": b"the real step 5"})
    for name in IMPOSTORS:
        os.rename(write_checkpoint(tmp_path / "other", 9, {"w.bin": b"x"}), local / name)
    assert [(i.name, i.status) for i in scan_local(local)] == [("step-000000005", "complete")]
