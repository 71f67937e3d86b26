"""Peers found through the bucket (``peers = "bucket"``), and choosing among candidates at once."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import pytest

from spotguard.control import request
from spotguard.harness import Vm, wait_for
from spotguard.peer.client import choose_peer
from spotguard.peer.discovery import PREFIX
from spotguard.peer.receiver import PeerReceiver
from spotguard.peer.wire import parse_address
from spotguard.storage.file import FileStorage
from spotguard.storage.s3 import S3Storage
from tests.checkpoints import write_checkpoint
from tests.pacedrelay import PacedRelay
from tests.servers import S3Server, point_at

TOKEN = "the-job-s-peer-token-0123456789abcdef"
MiB = 1 << 20


def registry_keys(url: str) -> list[str]:
    storage = S3Storage(url)
    try:
        return sorted(info.key for info in storage.list(f"{PREFIX}/"))
    finally:
        storage.close()


def test_a_drill_routed_to_peer_reaches_the_peer_found_in_the_bucket(
    tmp_path: Path, server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = point_at(server, monkeypatch)
    monkeypatch.setenv("SPOTGUARD_PEER_TOKEN", TOKEN)
    with PacedRelay(server.endpoint_url, 1_000_000) as relay:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", relay.url)  # slow enough that the plan picks a peer
        vm_b = Vm(tmp_path, "vm-b", url, ["--provider", "none", "--peer-listen", "127.0.0.1:0", "--peers", "bucket"])
        vm_a = Vm(tmp_path, "vm-a", url, ["--provider", "none", "--peers", "bucket"])
        write_checkpoint(vm_a.root, 3, {"weights.bin": os.urandom(4 * MiB)})  # the state's size, for A's plan
        vm_b.start_daemon()
        try:
            where = vm_b.status()["peers"]["listen"]
            assert vm_b.status()["peers"]["discovery"]["advertised"] == where  # not a wildcard: as it listens
            wait_for(lambda: registry_keys(url), 20, "B's entry in the bucket")
            vm_a.start_daemon()
            wait_for(lambda: vm_a.status()["upload_rate_bytes_s"], 30, "A's upload-rate probe")
            request(vm_a.socket, "drill", deadline_s=1.5)
            assert vm_a.status()["plan"]["route"] == "peer"
            handoff = wait_for(lambda: (h := vm_a.status()["peers"]["handoff"])["peer"] and h, 10, "A to choose B")
            assert handoff["peer"] == where and handoff["state"] in ("choosing", "sending")
            assert vm_a.status()["peers"]["peers"] == [where]  # A itself listens nowhere: B is all there is
            # A clean shutdown takes B out of the registry.
            assert vm_b.stop_daemon() == 0
            assert registry_keys(url) == []
        finally:
            vm_a.kill_daemon()
            vm_b.kill_daemon()
    assert "asking 1 peer(s)" in vm_a.log.read_text()


def test_choosing_asks_every_candidate_at_once_and_keeps_the_listed_order(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/bucket/run1"

    async def scenario() -> tuple[float, list[str]]:
        receivers = [
            PeerReceiver(tmp_path / name, FileStorage(url), token=TOKEN.encode(), host="127.0.0.1", port=0)
            for name in ("b", "c")
        ]
        first, second = [parse_address(await receiver.start()) for receiver in receivers]
        # A stale candidate that accepts connections (the kernel's backlog) and never says a word.
        with socket.create_server(("127.0.0.1", 0)) as silent:
            dead = silent.getsockname()[:2]
            try:
                started = time.monotonic()
                chosen = await choose_peer([dead, second, first], TOKEN.encode(), url, timeout=5.0)
                took = time.monotonic() - started
                assert chosen is not None
                await chosen.close()
                # With both answering, the one listed first is taken, the other closed.
                preferred = await choose_peer([first, second], TOKEN.encode(), url, timeout=5.0)
                assert preferred is not None
                await preferred.close()
                names = [f"{host}:{port}" for host, port in (first, second)]
                return took, [chosen.address, preferred.address, *names]
            finally:
                for receiver in receivers:
                    await receiver.close()

    took, (chosen, preferred, first, second) = asyncio.run(scenario())
    assert took < 2.0, f"waited {took:.1f} s: the dead candidate's timeout was waited out"
    assert chosen == second  # the first listed that answers
    assert preferred == first
