"""A handoff spreads its replica over several connections when one is too slow for the deadline.

B is a real daemon (moto as the bucket) listening on the peer port; the sending side is a real
:class:`~spotguard.peer.handoff.Handoff`, reaching B through a relay on 127.0.0.1 that paces each
connection (a link whose every flow is capped, as a cloud caps them). Every flow authenticates on
its own, and B takes data of a replica only on connections that opened or joined it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from spotguard.harness import Vm, wait_for
from spotguard.manifest import load_manifest
from spotguard.peer import wire
from spotguard.peer.channel import GONE_AFTER
from spotguard.peer.client import PeerClient
from spotguard.peer.flows import Flows
from spotguard.peer.handoff import Handoff, HandoffState
from tests.checkpoints import write_checkpoint
from tests.netns import Island, island
from tests.pacedrelay import PacedRelay
from tests.peers import TOKEN, address, committed_steps, receiving_daemon, urgent_handoff
from tests.servers import moto_s3, point_at

MiB = 1 << 20


async def hand_over(
    step_dir: Path,
    url: str,
    where: tuple[str, int] | list[tuple[str, int]],
    seconds_left: float | None,
    handoff: Handoff | None = None,
    expected_bytes: int | None = None,
) -> Handoff:
    """Hand the committed checkpoint ``step_dir`` to the peer at ``where`` (or the first of a list
    that answers), as the daemon would on a notice routed to the peer with ``seconds_left`` to its
    deadline (None: no deadline known); with ``handoff``, as that one's next handoff (the daemon
    keeps one for its lifetime); ``expected_bytes``: the plan's size, if not the checkpoint's."""

    async def candidates() -> list[tuple[str, int]]:
        return where if isinstance(where, list) else [where]

    handoff = handoff or Handoff(candidates, TOKEN.encode(), url, max_flows=6)
    manifest = load_manifest(step_dir)
    for rel, entry in manifest.files.items():
        handoff.file_ready(step_dir, rel, entry)
    handoff.saved(step_dir)
    deadline = None if seconds_left is None else time.monotonic() + seconds_left
    handoff.start(expected_bytes=expected_bytes or manifest.total_bytes, deadline=deadline)
    async with asyncio.timeout(60):
        while handoff.state not in (HandoffState.HANDED, HandoffState.FAILED):
            await asyncio.sleep(0.05)
    await handoff.close()
    return handoff


def test_a_capped_flow_gets_company_until_the_deadline_can_be_met(receiver_vm: Vm, url: str, tmp_path: Path) -> None:
    # 40 MiB at 4 MB/s a connection: one flow needs 10.5 s, and the deadline is 5 s away.
    files = {f"shard-{i}.bin": os.urandom(10 * MiB) for i in range(4)}
    step_dir = write_checkpoint(tmp_path / "vm-a", 11, files)
    with PacedRelay(receiver_vm.status()["peers"]["listen"], 4_000_000, buffer_bytes=64 * 1024) as relay:
        relay_address = wire.parse_address(relay.url.removeprefix("http://"))
        started = time.monotonic()
        handoff = asyncio.run(hand_over(step_dir, url, relay_address, seconds_left=5.0))
        took = time.monotonic() - started
    assert handoff.state is HandoffState.HANDED, handoff.error
    assert handoff.flows >= 3, f"{handoff.flows} flow(s) for 40 MiB at 4 MB/s each in 5 s"
    assert handoff.bytes_sent == sum(len(data) for data in files.values())
    # Not a timing assertion, a sanity bound: one flow alone could not have done it in 10 s.
    assert took < 10.0, f"the handoff took {took:.1f} s on {handoff.flows} flows"
    wait_for(lambda: 11 in committed_steps(url), 30, "B's commit of the handed-over step in the bucket")


@pytest.mark.slow
def test_a_joined_flow_lost_alone_has_its_pieces_sent_again_by_the_others(
    receiver_vm: Vm, url: str, tmp_path: Path
) -> None:
    """A flow's piece counts as sent once the kernel took it. A joined flow whose connection was reset
    lost the tail of a piece still in the buffers; only the piece it was sending went back, the
    peer refused the replica at the commit (bytes never received), and the handoff failed, as for a
    replica unlike its manifest: no other peer, no resend, with a healthy peer."""
    step_dir = write_checkpoint(tmp_path / "sender", 9, {f"part{i}.bin": os.urandom(16 * MiB) for i in range(3)})
    host, port = address(receiver_vm)
    with PacedRelay(f"http://{host}:{port}", 2_000_000) as relay:
        relay.reset_after(1, 8 * MiB - 256 * 1024)  # the first joined flow, its first piece's tail unread
        where = relay.url.removeprefix("http://").split(":")
        handoff = asyncio.run(hand_over(step_dir, url, (where[0], int(where[1])), seconds_left=20))
    assert relay.was_reset.is_set()
    assert handoff.state is HandoffState.HANDED, handoff.status()
    assert handoff.moves == 0
    wait_for(lambda: 9 in committed_steps(url), 60, "B to commit the replica in the bucket")


def test_a_fast_link_keeps_one_flow(receiver_vm: Vm, url: str, tmp_path: Path) -> None:
    step_dir = write_checkpoint(tmp_path / "vm-a", 12, {"weights.bin": os.urandom(8 * MiB)})
    handoff = asyncio.run(hand_over(step_dir, url, address(receiver_vm), seconds_left=60.0))
    assert handoff.state is HandoffState.HANDED, handoff.error
    assert handoff.flows == 1
    wait_for(lambda: 12 in committed_steps(url), 30, "B's commit in the bucket")


def test_a_daemon_s_next_handoff_counts_its_own_bytes(receiver_vm: Vm, url: str, tmp_path: Path) -> None:
    first = write_checkpoint(tmp_path / "vm-a", 15, {"weights.bin": os.urandom(3 * MiB)})
    second = write_checkpoint(tmp_path / "vm-a", 16, {"weights.bin": os.urandom(2 * MiB)})

    async def two_notices() -> tuple[dict[str, object], dict[str, object]]:
        handoff = await hand_over(first, url, address(receiver_vm), seconds_left=60.0)
        before = handoff.status()
        handoff.reset()  # the notice is over
        await hand_over(second, url, address(receiver_vm), seconds_left=60.0, handoff=handoff)
        return before, handoff.status()

    before, after = asyncio.run(two_notices())
    assert (before["name"], before["bytes_sent"], before["state"]) == (first.name, 3 * MiB, "handed")
    # What the pacer takes from the plan's size, and what the status says: this handoff's alone.
    assert (after["name"], after["bytes_sent"], after["state"]) == (second.name, 2 * MiB, "handed")
    wait_for(lambda: {15, 16} <= set(committed_steps(url)), 30, "B's commits in the bucket")


def test_a_replica_its_peer_finds_unlike_its_manifest_is_not_sent_to_another_peer(
    receiver_vm: Vm, url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A refusal that speaks of the replica (a file that does not match its manifest here: a bit
    flipped on this disk) would come from any peer: the handoff fails, and the next peer listed
    (another receiver on the same bucket) is not sent the replica again."""
    step_dir = write_checkpoint(tmp_path / "vm-a", 13, {"weights.bin": os.urandom(2 * MiB)})
    weights = step_dir / "weights.bin"
    flipped = bytearray(weights.read_bytes())
    flipped[MiB] ^= 0x01
    weights.write_bytes(flipped)
    with receiving_daemon(tmp_path / "vm-c", url) as vm_c:
        caplog.set_level("WARNING", logger="spotguard.handoff")
        handoff = asyncio.run(hand_over(step_dir, url, [address(receiver_vm), address(vm_c)], seconds_left=60.0))
        assert vm_c.status()["peers"]["replicas"] == []
    assert handoff.state is HandoffState.FAILED
    assert handoff.error is not None and handoff.error.startswith("mismatch"), handoff.error
    assert handoff.peer == receiver_vm.status()["peers"]["listen"]
    assert not [r for r in caplog.records if "sending the replica again" in r.getMessage()]


def test_a_peer_is_told_the_files_announced_where_the_plan_guessed_fewer_bytes(
    receiver_vm: Vm, url: str, tmp_path: Path, tmpfs: Callable[[int], Path], caplog: pytest.LogCaptureFixture
) -> None:
    """The plan expects 1 MiB (an older, smaller checkpoint) where the trainer announced 3 MiB: the
    open tells 3 MiB, so a peer on a 2 MiB disk refuses before a byte is sent, and the next one
    takes the replica (told 1 MiB, the first peer admitted it and failed at its first file)."""
    step_dir = write_checkpoint(tmp_path / "vm-a", 14, {"weights.bin": os.urandom(3 * MiB)})
    small = Vm(tmp_path, "vm-small", url, extra_args=["--provider", "none", "--peer-listen", "127.0.0.1:0"])
    small.root = tmpfs(2 * MiB)
    small.start_daemon(env={"SPOTGUARD_PEER_TOKEN": TOKEN})
    try:
        caplog.set_level("WARNING", logger="spotguard.handoff")
        where = [address(small), address(receiver_vm)]
        handoff = asyncio.run(hand_over(step_dir, url, where, seconds_left=60.0, expected_bytes=MiB))
    finally:
        small.kill_daemon()
    assert handoff.state is HandoffState.HANDED, handoff.error
    assert handoff.peer == receiver_vm.status()["peers"]["listen"]
    said = [record.getMessage() for record in caplog.records]
    assert any("did not open the replica (no-space" in line for line in said), said
    assert not any("failed after" in line for line in said), said


def test_a_peer_that_goes_silent_mid_stream_is_left_well_before_the_kernel_gives_up(
    receiver_vm: Vm, url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The peer taking the replica vanishes without a FIN or a RST (its VM reclaimed at once, its
    link cut: here a relay that stops passing bytes and keeps the connections open). The kernel would
    give up on it only after io_timeout (30 s), past the 20 s deadline; the handoff sees nothing
    acknowledged for a quarter of the time left and sends the replica to the next peer."""
    files = {f"shard-{i}.bin": os.urandom(8 * MiB) for i in range(3)}
    step_dir = write_checkpoint(tmp_path / "vm-a", 17, files)
    caplog.set_level("WARNING", logger="spotguard.handoff")

    async def hand_over_through(relay: PacedRelay) -> tuple[Handoff, float]:
        silent = wire.parse_address(relay.url.removeprefix("http://"))

        async def candidates() -> list[tuple[str, int]]:
            return [silent, address(receiver_vm)]

        handoff = Handoff(candidates, TOKEN.encode(), url, max_flows=1)
        manifest = load_manifest(step_dir)
        for rel, entry in manifest.files.items():
            handoff.file_ready(step_dir, rel, entry)
        handoff.saved(step_dir)
        handoff.start(expected_bytes=manifest.total_bytes, deadline=time.monotonic() + 20.0)
        async with asyncio.timeout(30):
            while not (handoff.peer == f"{silent[0]}:{silent[1]}" and handoff.bytes_sent >= 2 * MiB):
                await asyncio.sleep(0.02)
            relay.freeze()
            frozen = time.monotonic()
            while handoff.state not in (HandoffState.HANDED, HandoffState.FAILED):
                await asyncio.sleep(0.05)
        await handoff.close()
        return handoff, time.monotonic() - frozen

    # 4 MB/s a connection: the 24 MiB take 6 s, time enough to go silent mid-stream.
    with (
        receiving_daemon(tmp_path / "vm-c", url) as vm_c,
        PacedRelay(vm_c.status()["peers"]["listen"], 4_000_000, buffer_bytes=64 * 1024) as relay,
    ):
        handoff, after_freeze = asyncio.run(hand_over_through(relay))
    assert handoff.state is HandoffState.HANDED, handoff.error
    assert handoff.peer == receiver_vm.status()["peers"]["listen"] and handoff.moves == 1
    assert handoff.bytes_sent == sum(len(data) for data in files.values())
    said = [record.getMessage() for record in caplog.records]
    assert any("acknowledged nothing for" in line and "while bytes waited" in line for line in said), said
    # The relay's kernel still acknowledged what reached it: a slow peer, not a vanished one.
    assert not any("(its host, or the way to it, is gone)" in line for line in said), said
    print(f"handed to the next peer {after_freeze:.1f} s after the first went silent")
    # Left after 5 s (a quarter of the ~18 s left, at least 5 s), not after the kernel's 30 s.
    assert after_freeze < 15.0, f"handed to the next peer {after_freeze:.1f} s after the first went silent"
    wait_for(lambda: 17 in committed_steps(url), 30, "B's commit in the bucket")


def test_a_peer_whose_host_vanishes_is_left_within_seconds_while_a_slow_one_gets_the_stall_limit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The peer taking the replica is a daemon in a network namespace, and the link to it is cut
    mid-stream: its kernel acknowledges nothing any more (a VM reclaimed at once). With 60 s to the
    deadline the stall limit is 15 s, time a receiver whose disk stalls is given; a host that answers
    nothing is left once what is in flight went unanswered for GONE_AFTER seconds."""
    url = f"file://{tmp_path / 'bucket'}"
    first, rest = {"shard-0.bin": os.urandom(8 * MiB)}, {f"shard-{i}.bin": os.urandom(8 * MiB) for i in (1, 2)}
    step_dir = write_checkpoint(tmp_path / "vm-a", 19, {**first, **rest})
    manifest = load_manifest(step_dir)
    caplog.set_level("WARNING", logger="spotguard.handoff")

    async def hand_over_while_cut(place: Island, vanishing: tuple[str, int], rescuer: tuple[str, int]) -> float:
        async def candidates() -> list[tuple[str, int]]:
            return [vanishing, rescuer]

        handoff = Handoff(candidates, TOKEN.encode(), url, max_flows=1)
        handoff.file_ready(step_dir, "shard-0.bin", manifest.files["shard-0.bin"])
        handoff.start(expected_bytes=manifest.total_bytes, deadline=time.monotonic() + 60.0)
        try:
            async with asyncio.timeout(45):
                # The trainer is still writing: the first file went to the peer, then its host vanishes.
                while not (handoff.peer == f"{vanishing[0]}:{vanishing[1]}" and handoff.bytes_sent >= 8 * MiB):
                    await asyncio.sleep(0.02)
                await asyncio.to_thread(place.cut)
                cut = time.monotonic()
                for rel in rest:
                    handoff.file_ready(step_dir, rel, manifest.files[rel])
                handoff.saved(step_dir)
                while handoff.moves == 0 and handoff.state is not HandoffState.FAILED:
                    await asyncio.sleep(0.05)
                left_after = time.monotonic() - cut
                while handoff.state not in (HandoffState.HANDED, HandoffState.FAILED):
                    await asyncio.sleep(0.05)
        finally:
            await handoff.close()
        assert handoff.state is HandoffState.HANDED, handoff.error
        assert handoff.peer == f"{rescuer[0]}:{rescuer[1]}" and handoff.moves == 1
        assert handoff.bytes_sent == manifest.total_bytes  # sent again from its first byte
        return left_after

    with island() as place, receiving_daemon(tmp_path / "vm-c", url) as vm_c:
        with receiving_daemon(tmp_path, url, listen=place.address, prefix=place.prefix) as vm_v:
            left_after = asyncio.run(hand_over_while_cut(place, address(vm_v), address(vm_c)))
        wait_for(lambda: 19 in committed_steps(url), 30, "C's commit in the bucket")
    said = [record.getMessage() for record in caplog.records]
    assert any("with bytes in flight or probes (its host, or the way to it, is gone)" in line for line in said), said
    assert not any("while bytes waited" in line for line in said), said  # not the stall limit
    print(f"left the vanished peer {left_after:.1f} s after its link was cut")
    assert left_after < GONE_AFTER + 5.0, f"left the vanished peer {left_after:.1f} s after the cut (stall limit 15 s)"


@pytest.mark.parametrize("phase", ["sending", "committing"])
def test_a_flow_whose_way_to_the_peer_is_cut_fails_the_flows_within_seconds(tmp_path: Path, phase: str) -> None:
    """Two ways to the same peer (one path of several failing). ``sending``: the flow that opened the
    replica goes over the first, a joined flow over the second, which is cut mid-replica; whether the
    joined flow is sending a piece then or only telling the peer it is done, what it sent stays in
    flight unanswered. The flows fail whole, since what that flow sent before may be lost with it.
    ``committing``: every piece went, and the opener's way is cut as it sends the manifest. Either
    way the flows fail GONE_AFTER later, not after the stall limit (60 s here), io_timeout or the
    commit's 600 s, with an error that says so."""
    url = f"file://{tmp_path / 'bucket'}"
    files = {f"shard-{i}.bin": os.urandom(8 * MiB) for i in range(3)}
    step_dir = write_checkpoint(tmp_path / "vm-a", 23, files)
    cut_way = 1 if phase == "sending" else 0

    async def send_while_cut(place: Island, port: int) -> tuple[BaseException | None, float]:
        token = TOKEN.encode()
        opener = await PeerClient.connect(place.addresses[0], port, token)

        async def over_the_second_way() -> PeerClient:
            return await PeerClient.connect(place.addresses[1], port, token)

        try:
            flows = Flows(opener, await opener.open_replica(step_dir.name, url), over_the_second_way, max_flows=2)
            watch = asyncio.create_task(flows.watch(lambda: 60.0))  # the stall limit far off
            try:
                assert await flows.grow()
                await flows.send_file(step_dir / "shard-0.bin", "shard-0.bin")
                while flows.backlog:
                    await asyncio.sleep(0.02)
                if phase == "sending":
                    await asyncio.to_thread(place.cut, cut_way)
                    cut = time.monotonic()
                for rel in ("shard-1.bin", "shard-2.bin"):
                    await flows.send_file(step_dir / rel, rel)
                with pytest.raises((OSError, TimeoutError, wire.PeerError)):
                    async with asyncio.timeout(30):
                        await flows.sent()
                        if phase == "committing":
                            await asyncio.to_thread(place.cut, cut_way)
                            cut = time.monotonic()
                        await opener.commit(step_dir)
                failed_after = time.monotonic() - cut
                try:
                    flows.raise_if_failed()
                except TimeoutError as exc:
                    return exc, failed_after
                return None, failed_after
            finally:
                watch.cancel()
                await flows.close()
        finally:
            await opener.close()

    with island(ways=2) as place, receiving_daemon(tmp_path, url, listen="0.0.0.0", prefix=place.prefix) as vm:
        error, failed_after = asyncio.run(send_while_cut(place, address(vm)[1]))
    print(f"{phase}: the flows failed {failed_after:.1f} s after the cut: {error}")
    assert error is not None and f"{place.addresses[cut_way]}:" in str(error), error
    assert "with bytes in flight or probes (its host, or the way to it, is gone)" in str(error), error
    assert failed_after < GONE_AFTER + 3.0, f"the flows failed {failed_after:.1f} s after the cut"
    assert committed_steps(url) == []


def test_only_authenticated_connections_of_the_same_sender_join_a_replica(
    receiver_vm: Vm, url: str, tmp_path: Path
) -> None:
    where = address(receiver_vm)
    step_dir = write_checkpoint(tmp_path / "vm-a", 13, {"a.bin": os.urandom(MiB), "b.bin": os.urandom(MiB)})

    async def scenario() -> None:
        opener = await PeerClient.connect(*where, TOKEN.encode())
        replica_id = await opener.open_replica(step_dir.name, url)
        # Without the token there is no connection to join on: the handshake fails.
        with pytest.raises(wire.PeerError) as caught:
            await PeerClient.connect(*where, b"not-the-job-s-token-at-all-0000")
        assert caught.value.code == "auth"
        # With it, a replica nobody is sending cannot be joined.
        stranger = await PeerClient.connect(*where, TOKEN.encode())
        with pytest.raises(wire.PeerError) as caught:
            await stranger.join("step-000000013-00000000")
        assert caught.value.code == "gone"
        await stranger.close()
        # A joined flow carries data, but may not commit: only the opener does.
        joined = await PeerClient.connect(*where, TOKEN.encode())
        await joined.join(replica_id)
        await joined.send_file(step_dir / "a.bin", "a.bin")
        await joined.finish()
        await opener.send_file(step_dir / "b.bin", "b.bin")
        late = await PeerClient.connect(*where, TOKEN.encode())
        await late.join(replica_id)
        with pytest.raises(wire.PeerError) as caught:
            await late.commit(step_dir)
        assert caught.value.code == "bad-frame"
        await late.close()
        assert (await opener.commit(step_dir))["state"] == "verified"
        # Once committed, the replica takes no more data from anyone.
        after = await PeerClient.connect(*where, TOKEN.encode())
        with pytest.raises(wire.PeerError) as caught:
            await after.join(replica_id)
        assert caught.value.code == "gone"
        await after.close()
        await joined.close()
        await opener.close()

    asyncio.run(scenario())
    wait_for(lambda: 13 in committed_steps(url), 30, "B's commit in the bucket")


def test_a_replica_whose_opener_goes_away_is_dropped_whatever_its_joined_flows_sent(
    receiver_vm: Vm, url: str, tmp_path: Path
) -> None:
    where = address(receiver_vm)
    step_dir = write_checkpoint(tmp_path / "vm-a", 14, {"a.bin": os.urandom(2 * MiB)})

    async def scenario() -> str:
        opener = await PeerClient.connect(*where, TOKEN.encode())
        replica_id = await opener.open_replica(step_dir.name, url)
        joined = await PeerClient.connect(*where, TOKEN.encode())
        await joined.join(replica_id)
        await joined.send_file(step_dir / "a.bin", "a.bin")
        await opener.close()
        wait_deadline = time.monotonic() + 10
        while any(r["id"] == replica_id for r in receiver_vm.status()["peers"]["replicas"]):
            assert time.monotonic() < wait_deadline, "the opener's replica outlived it"
            await asyncio.sleep(0.05)
        with pytest.raises((wire.PeerError, OSError)):
            await joined.send_file(step_dir / "a.bin", "a.bin")
            await joined.finish()
        await joined.close()
        return replica_id

    asyncio.run(scenario())
    assert 14 not in committed_steps(url)
    assert not any(r["name"] == step_dir.name for r in receiver_vm.status()["peers"]["replicas"])


def test_a_daemon_routed_to_its_peer_opens_the_flows_its_deadline_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole path: A's plan routes its urgent checkpoint to B (the bucket is far too slow), and
    A's link to B caps each connection: one flow would take 11 s, the drill gives 8."""
    size = 32 * MiB
    with moto_s3() as server, PacedRelay(server.endpoint_url, 1_000_000) as bucket_link:
        url = point_at(server, monkeypatch)
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", bucket_link.url)
        monkeypatch.setenv("SPOTGUARD_PEER_TOKEN", TOKEN)
        with (
            receiving_daemon(tmp_path, url) as vm_b,
            PacedRelay(vm_b.status()["peers"]["listen"], 3_000_000, buffer_bytes=64 * 1024) as peer_link,
        ):
            peers = ["--peers", peer_link.url.removeprefix("http://")]
            vm_a = Vm(tmp_path, "vm-a", url, extra_args=["--provider", "none", *peers])
            write_checkpoint(vm_a.root, 1, {"state.bin": bytes(size)})  # the plan's size
            vm_a.start_daemon()
            try:
                handed, _ = urgent_handoff(vm_a, size=size, chunk=4 * MiB, timeout=60)
            finally:
                vm_a.kill_daemon()
    assert handed["state"] == "handed", handed
    assert handed["flows"] >= 2, handed
    assert handed["bytes_sent"] == size
