"""A peer whose host is gone (reclaimed at once, or cut off: no FIN, no RST) is told from one that is
only idle or slow by what its kernel leaves unanswered: bytes in flight, or the keepalive probes that
go out once a connection is idle for a second. Each side that waits on such a peer leaves it within
seconds: the receiver frees the replica slot of a sender that vanished mid-record, a fetch leaves a
holder that vanished, and a handoff whose flows wait for the trainer leaves a peer that vanished
meanwhile. Before, the first two held on until the kernel's keepalive or ``peer_io_timeout`` ended
the connection (25-30 s), and the third until its next ping (10 s) put bytes in flight.

The far side lives in a network namespace (tests/netns.py) whose address is cut.
"""

from __future__ import annotations

import asyncio
import os
import select
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest

from spotguard.harness import Vm, wait_for
from spotguard.manifest import load_manifest
from spotguard.peer import wire
from spotguard.peer.channel import GONE_AFTER, GONE_PEER_RELEASE, IO_TIMEOUT, PeerGone
from spotguard.peer.client import PeerClient
from spotguard.peer.fetch import STAGING, PeerResume, resume_from_peers
from spotguard.peer.flows import Flows
from spotguard.peer.handoff import Handoff, HandoffState
from tests.checkpoints import write_checkpoint
from tests.netns import Island, island
from tests.pacedrelay import PacedRelay
from tests.peers import TOKEN, address, committed_steps, hand_over, receiving_daemon, replica_area
from tests.servers import S3Server

MiB = 1 << 20
T = TypeVar("T")

# A sender in the island: it opens a replica on the receiver, then does what each line it reads says,
# answering "sent": "full", the next 1 MiB data frame of the file (once the receiver has read it);
# "partial", half of the next one, once it is in the kernel, and then nothing more (it never closes),
# as a VM reclaimed mid-record.
_SENDER = """
import asyncio, os, sys
from spotguard.peer import wire
from spotguard.peer.client import PeerClient

async def main(host, port, token, url):
    client = await PeerClient.connect(host, int(port), token.encode())
    await client.open_replica("step-000000031", url)
    offset = 0
    for line in sys.stdin:
        length = 1 << 20
        header = {"t": "data", "name": "weights.bin", "size": 64 << 20, "offset": offset, "len": length}
        sealed = client.channel.seal(wire.encode(header), os.urandom(length))
        if line.strip() == "full":
            client.channel.write_sealed(sealed)
            await client.query()  # answered once the frame before it was read
        else:
            client.channel.write_sealed(sealed[: len(sealed) // 2])
            await client.channel.drain()
        offset += length
        print("sent", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(*sys.argv[1:]))
"""


class _Sender:
    """:data:`_SENDER` run in ``place``, sending to the receiver at ``where``."""

    def __init__(self, place: Island, where: tuple[str, int], url: str) -> None:
        command = [*place.prefix, sys.executable, "-c", _SENDER, where[0], str(where[1]), TOKEN, url]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def send(self, what: str) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(what + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], 30)
        assert ready and self.process.stdout.readline().strip() == "sent", f"the sender did not send {what}"

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


def _against_a_daemon_in_an_island(
    tmp_path: Path, url: str, go: Callable[[Island, tuple[str, int]], Awaitable[T]]
) -> T:
    """``go(island, where)`` run against a daemon listening in a fresh island, at ``where``."""
    with island() as place, receiving_daemon(tmp_path, url, listen="0.0.0.0", prefix=place.prefix) as vm:
        return asyncio.run(go(place, (place.address, address(vm)[1])))


def _replicas(vm: Vm) -> int:
    return len(vm.status()["peers"]["replicas"])


def _workers(vm: Vm) -> dict[str, int]:
    return dict(vm.status()["peers"]["workers"])


@pytest.mark.parametrize("receiving", ["in-process", "in-a-worker"])
def test_a_sender_whose_host_vanishes_mid_record_frees_its_replica_slot_within_seconds(
    tmp_path: Path, receiving: str
) -> None:
    """The receiver is a daemon here, the sender a process in the island, which stops mid-record: in
    the daemon's first frame (its workers not started yet), or in a frame a worker process receives.
    While the island is reachable, the idle sender keeps its connection past GONE_AFTER (its kernel
    answers the probes); once it is cut, the receiver drops the connection and the unfinished replica
    within GONE_PEER_RELEASE, where the record deadline alone took IO_TIMEOUT + 1 s."""
    url = f"file://{tmp_path / 'bucket'}"
    with island() as place, receiving_daemon(tmp_path, url, listen=place.outer) as vm:
        sender = _Sender(place, address(vm), url)
        try:
            if receiving == "in-a-worker":
                for _ in range(60):  # the workers start on the first big frames, which go in-process meanwhile
                    sender.send("full")
                    if _workers(vm)["frames"]:
                        break
                # The next frame goes to a worker only if one is free (the last frame may still be written).
                wait_for(lambda: (w := _workers(vm))["idle"] >= 1 and w["busy"] == 0, 10, "a free worker")
            sender.send("partial")
            if receiving == "in-a-worker":
                wait_for(lambda: _workers(vm)["busy"] >= 1, 10, "a worker holding the frame")
            else:
                assert _workers(vm)["frames"] == 0 and _workers(vm)["busy"] == 0
            wait_for(lambda: _replicas(vm) == 1, 10, "the replica opened")
            time.sleep(GONE_AFTER + 2)  # the time itself is what is tested: idle and answering is not gone
            assert _replicas(vm) == 1
            place.cut()
            cut = time.monotonic()
            wait_for(lambda: _replicas(vm) == 0, IO_TIMEOUT, "the receiver to drop the vanished sender's replica")
            released_after = time.monotonic() - cut
        finally:
            sender.kill()
    print(f"{receiving}: the receiver freed the slot {released_after:.1f} s after the cut")
    assert released_after < GONE_PEER_RELEASE + 2.0, f"freed {released_after:.1f} s after the cut"
    log = vm.log.read_text()
    assert "connection lost: its host answered nothing for" in log and "(gone, or the way to it cut)" in log, log
    assert replica_area(vm) == [] and committed_steps(url) == []


def test_a_fetching_connection_leaves_a_holder_whose_host_vanishes_and_a_handoff_s_does_not(tmp_path: Path) -> None:
    """Two connections to a daemon in the island, idle past GONE_AFTER and still answered (a live
    peer), then the island is cut while each waits for a frame: the one that leaves a gone host (a
    fetch's) ends with PeerGone within GONE_PEER_RELEASE; a handoff's (its flows are watched
    together: the next test) is still waiting then."""
    url = f"file://{tmp_path / 'bucket'}"

    async def wait_while_cut(place: Island, where: tuple[str, int]) -> tuple[float, bool]:
        fetching = await PeerClient.connect(*where, TOKEN.encode(), leave_when_gone=True)
        handing = await PeerClient.connect(*where, TOKEN.encode())
        try:
            await asyncio.sleep(GONE_AFTER + 2)  # the time itself is what is tested
            assert (await fetching.query())["replicas"] == 0 and (await handing.query())["replicas"] == 0
            waits = [asyncio.create_task(client.channel.read_frame()) for client in (fetching, handing)]
            await asyncio.to_thread(place.cut)
            cut = time.monotonic()
            async with asyncio.timeout(IO_TIMEOUT):
                with pytest.raises(PeerGone):
                    await waits[0]
            left_after = time.monotonic() - cut
            still_waiting = not waits[1].done()
            waits[1].cancel()
            return left_after, still_waiting
        finally:
            fetching.channel.abort()
            handing.channel.abort()

    left_after, still_waiting = _against_a_daemon_in_an_island(tmp_path, url, wait_while_cut)
    print(f"the fetching connection left the gone host {left_after:.1f} s after the cut")
    assert left_after < GONE_PEER_RELEASE + 1.0, f"left {left_after:.1f} s after the cut"
    assert still_waiting


def test_a_handoff_waiting_for_its_trainer_leaves_a_peer_whose_host_vanishes_meanwhile(tmp_path: Path) -> None:
    """The first file went and was acknowledged, the trainer has not written the next: nothing is in
    flight, and the flow waits for a piece (it pings every 10 s). The peer's host is cut then: its
    keepalive probes go unanswered, and the flows fail GONE_AFTER later, not after the next ping."""
    url = f"file://{tmp_path / 'bucket'}"
    step_dir = write_checkpoint(tmp_path / "vm-a", 37, {"shard-0.bin": os.urandom(4 * MiB)})

    async def wait_while_cut(place: Island, where: tuple[str, int]) -> tuple[BaseException, float]:
        opener = await PeerClient.connect(*where, TOKEN.encode())
        try:
            replica = await opener.open_replica(step_dir.name, url)
            flows = Flows(opener, replica, lambda: PeerClient.connect(*where, TOKEN.encode()), max_flows=1)
            watch = asyncio.create_task(flows.watch(lambda: 60.0))  # the stall limit far off
            try:
                await flows.send_file(step_dir / "shard-0.bin", "shard-0.bin")
                async with asyncio.timeout(30):
                    while flows.backlog or opener.channel.unanswered():
                        await asyncio.sleep(0.02)
                await asyncio.to_thread(place.cut)
                cut = time.monotonic()
                async with asyncio.timeout(30):
                    while True:
                        try:
                            flows.raise_if_failed()
                        except (OSError, wire.PeerError) as exc:
                            return exc, time.monotonic() - cut
                        await asyncio.sleep(0.05)
            finally:
                watch.cancel()
                await flows.close()
        finally:
            await opener.close()

    error, failed_after = _against_a_daemon_in_an_island(tmp_path, url, wait_while_cut)
    print(f"the waiting flows failed {failed_after:.1f} s after the cut: {error}")
    assert "answered nothing for" in str(error) and "(its host, or the way to it, is gone)" in str(error), error
    assert failed_after < GONE_AFTER + 2.0, f"the flows failed {failed_after:.1f} s after the cut"


def test_a_handoff_whose_peer_vanishes_before_the_trainer_writes_opens_on_the_next_within_seconds(
    tmp_path: Path,
) -> None:
    """A notice routed to a peer: the handoff chose its peer, and waits for the trainer's first byte.
    The peer's host is cut then, and the trainer writes: the open gets no answer, and the handoff asks
    the next peer GONE_AFTER later (nothing was sent: not a move), where the open's answer was waited
    for ``peer_io_timeout`` (30 s, a whole GCP notice) before."""
    url = f"file://{tmp_path / 'bucket'}"
    step_dir = write_checkpoint(tmp_path / "vm-a", 43, {"shard-0.bin": os.urandom(4 * MiB)})
    manifest = load_manifest(step_dir)

    async def hand_over_after_cut(place: Island, vanishing: tuple[str, int], rescuer: tuple[str, int]) -> float:
        async def candidates() -> list[tuple[str, int]]:
            return [vanishing, rescuer]

        handoff = Handoff(candidates, TOKEN.encode(), url, max_flows=1)
        handoff.start(expected_bytes=manifest.total_bytes, deadline=time.monotonic() + 60.0)
        try:
            async with asyncio.timeout(45):
                while handoff.peer != f"{vanishing[0]}:{vanishing[1]}":  # chosen; the trainer has not written
                    await asyncio.sleep(0.02)
                await asyncio.to_thread(place.cut)
                cut = time.monotonic()
                for rel, entry in manifest.files.items():
                    handoff.file_ready(step_dir, rel, entry)
                handoff.saved(step_dir)
                while handoff.state not in (HandoffState.HANDED, HandoffState.FAILED):
                    await asyncio.sleep(0.05)
                handed_after = time.monotonic() - cut
        finally:
            await handoff.close()
        assert handoff.state is HandoffState.HANDED, handoff.error
        assert handoff.peer == f"{rescuer[0]}:{rescuer[1]}" and handoff.moves == 0
        return handed_after

    with (
        island() as place,
        receiving_daemon(tmp_path / "vm-c", url) as vm_c,
        receiving_daemon(tmp_path, url, listen=place.address, prefix=place.prefix) as vm_v,
    ):
        handed_after = asyncio.run(hand_over_after_cut(place, address(vm_v), address(vm_c)))
    print(f"handed to the next peer {handed_after:.1f} s after the chosen one's host was cut")
    assert handed_after < GONE_PEER_RELEASE + 3.0, f"handed {handed_after:.1f} s after the cut"


def test_a_resume_leaves_a_holder_whose_host_vanishes_mid_fetch(
    tmp_path: Path, server: S3Server, url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A fresh VM fetches the newer checkpoint a peer holds (its own upload held back: 2,000 bytes/s
    to the bucket), at 40 Mbit/s; the holder's host is cut midway. The fetch leaves it GONE_AFTER
    later (the bucket's checkpoint is what the VM then resumes from), where it waited for
    ``peer_io_timeout`` before, and leaves no staging behind."""
    step_dir = write_checkpoint(tmp_path / "dead-vm", 41, {f"shard-{i}.bin": os.urandom(8 * MiB) for i in range(3)})
    fresh = tmp_path / "fresh-vm"
    fresh.mkdir()

    async def fetch_while_cut(place: Island, where: tuple[str, int]) -> tuple[PeerResume, float]:
        fetching = asyncio.create_task(resume_from_peers([where], TOKEN.encode(), url, fresh, -1))
        async with asyncio.timeout(30):
            while _staged_bytes(fresh) < 4 * MiB:  # midway: 24 MiB take about 5 s at 40 Mbit/s
                assert not fetching.done(), fetching
                await asyncio.sleep(0.02)
        await asyncio.to_thread(place.cut)
        cut = time.monotonic()
        async with asyncio.timeout(IO_TIMEOUT):
            found = await fetching
        return found, time.monotonic() - cut

    caplog.set_level("WARNING", logger="spotguard.peers")
    with (
        island() as place,
        PacedRelay(server.endpoint_url, 2_000, host=place.outer) as held_back,
        receiving_daemon(
            tmp_path, url, {"AWS_ENDPOINT_URL_S3": held_back.url}, listen="0.0.0.0", prefix=place.prefix
        ) as vm,
    ):
        where = (place.address, address(vm)[1])
        assert hand_over(where, step_dir, url)["state"] == "verified"
        place.pace(40)
        found, left_after = asyncio.run(fetch_while_cut(place, where))
    print(f"the fetch left the vanished holder {left_after:.1f} s after the cut")
    assert found.path is None and found.offer is None
    said = [record.getMessage() for record in caplog.records]
    assert any("refused: its host answered nothing for" in line for line in said), said
    assert left_after < GONE_PEER_RELEASE + 2.0, f"left {left_after:.1f} s after the cut"
    assert list(fresh.iterdir()) == []  # no staging left, nothing committed


def _staged_bytes(root: Path) -> int:
    """Bytes on disk in ``root``'s fetch staging directories (sparse until written)."""
    staged = (path for staging in root.glob(f"{STAGING}-*") for path in staging.rglob("*") if path.is_file())
    return sum(path.stat().st_blocks * 512 for path in staged)
