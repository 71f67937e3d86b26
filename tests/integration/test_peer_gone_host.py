"""A peer whose host is gone (reclaimed at once, or cut off: no FIN, no RST) is told from one that is
only idle or slow by what its kernel leaves unanswered: bytes in flight, or the keepalive probes that
go out once a connection is idle for a second. Each side that waits on such a peer leaves it within
seconds: the receiver frees the replica slot of a sender that vanished mid-record, a fetch leaves a
holder that vanished, and a handoff whose flows wait for the trainer leaves a peer that vanished
meanwhile. Before, the first two held on for the record deadline (31 s) and the third until its next
ping (10 s) plus the time its bytes stayed unanswered.

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
from spotguard.peer import wire
from spotguard.peer.channel import GONE_AFTER, GONE_PEER_RELEASE, IO_TIMEOUT, PeerGone
from spotguard.peer.client import PeerClient
from spotguard.peer.flows import Flows
from tests.checkpoints import write_checkpoint
from tests.netns import Island, island
from tests.peers import TOKEN, address, committed_steps, replica_area

MiB = 1 << 20
T = TypeVar("T")

# A sender in the island: it opens a replica on the receiver, sends a data frame's header and most
# of its first records, then nothing more (and never closes), as a VM reclaimed mid-record.
_SENDER = """
import asyncio, os, sys
from spotguard.peer import wire
from spotguard.peer.client import PeerClient

async def main(host, port, token, url):
    client = await PeerClient.connect(host, int(port), token.encode())
    await client.open_replica("step-000000031", url)
    header = {"t": "data", "name": "weights.bin", "size": 1 << 20, "offset": 0, "len": 1 << 20}
    sealed = client.channel.seal(wire.encode(header), os.urandom(300 * 1024))
    client.channel.write_sealed(sealed[:-1000])
    await client.channel.drain()
    print("sent", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(*sys.argv[1:]))
"""


def _daemon(tmp_path: Path, url: str, listen: str, prefix: list[str] | None = None) -> Vm:
    vm = Vm(tmp_path, "vm-b", url, ["--provider", "none", "--peer-listen", f"{listen}:0"], prefix=prefix or [])
    vm.start_daemon(env={"SPOTGUARD_PEER_TOKEN": TOKEN})
    return vm


def _against_a_daemon_in_an_island(
    tmp_path: Path, url: str, go: Callable[[Island, tuple[str, int]], Awaitable[T]]
) -> T:
    """``go(island, where)`` run against a daemon listening in a fresh island, at ``where``."""
    with island() as place:
        vm = _daemon(tmp_path, url, "0.0.0.0", place.prefix)
        try:
            return asyncio.run(go(place, (place.address, address(vm)[1])))
        finally:
            vm.kill_daemon()


def _replicas(vm: Vm) -> int:
    return len(vm.status()["peers"]["replicas"])


def test_a_sender_whose_host_vanishes_mid_record_frees_its_replica_slot_within_seconds(tmp_path: Path) -> None:
    """The receiver is a daemon here, the sender a process in the island. While the island is
    reachable, an idle sender keeps its connection past GONE_AFTER (its kernel answers the probes);
    once it is cut, the receiver drops the connection and the unfinished replica within
    GONE_PEER_RELEASE, where the record deadline alone took IO_TIMEOUT + 1 s."""
    url = f"file://{tmp_path / 'bucket'}"
    with island() as place:
        vm = _daemon(tmp_path, url, place.outer)
        sender: subprocess.Popen[str] | None = None
        try:
            host, port = address(vm)
            sender = subprocess.Popen(
                [*place.prefix, sys.executable, "-c", _SENDER, host, str(port), TOKEN, url],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert sender.stdout is not None
            ready, _, _ = select.select([sender.stdout], [], [], 30)
            assert ready and sender.stdout.readline().strip() == "sent", "the sender in the island did not start"
            wait_for(lambda: _replicas(vm) == 1, 10, "the replica opened")
            time.sleep(GONE_AFTER + 2)  # the time itself is what is tested: idle and answering is not gone
            assert _replicas(vm) == 1
            place.cut()
            cut = time.monotonic()
            wait_for(lambda: _replicas(vm) == 0, IO_TIMEOUT, "the receiver to drop the vanished sender's replica")
            released_after = time.monotonic() - cut
        finally:
            if sender is not None:
                sender.kill()
                sender.wait()
            vm.kill_daemon()
    print(f"the receiver freed the slot {released_after:.1f} s after the cut")
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
