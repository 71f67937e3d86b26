"""A real daemon listening on the peer port, for the peer tier's tests."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from spotguard.control import request
from spotguard.daemon.plan import PROBE_PREFIX
from spotguard.harness import Vm, bucket_storage, wait_for
from spotguard.peer import wire
from spotguard.peer.client import PeerClient
from spotguard.peer.flows import send_committed
from spotguard.peer.replicas import AREA
from spotguard.storage.checkpoints import list_remote
from spotguard.storage.schemes import open_storage
from tests.pacedrelay import PacedRelay
from tests.servers import moto_s3, point_at
from tests.streaming import ProgressiveWriter

TOKEN = "a-shared-secret-of-the-job-0123456789"


@contextmanager
def receiving_daemon(
    tmp_path: Path,
    url: str,
    env: dict[str, str] | None = None,
    *,
    listen: str = "127.0.0.1",
    prefix: Sequence[str] = (),
) -> Iterator[Vm]:
    """Daemon "vm-b" committing to ``url``, its peer receiver on ``listen`` (a free port), the job's
    token :data:`TOKEN`; ``env`` adds settings, ``prefix`` runs it in a network namespace (tests/netns.py)."""
    vm = Vm(tmp_path, "vm-b", url, extra_args=["--provider", "none", "--peer-listen", f"{listen}:0"], prefix=prefix)
    vm.start_daemon(env={"SPOTGUARD_PEER_TOKEN": TOKEN, **(env or {})})
    try:
        yield vm
    finally:
        vm.kill_daemon()


@contextmanager
def peer_behind_a_slow_bucket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Vm]]:
    """Moto behind a relay pacing each connection to 1 MB/s, so that a sender's plan routes a
    checkpoint of a few MiB to a peer, and daemon "vm-b" receiving on the peer port; yields (the
    bucket's URL, vm-b). Daemons started meanwhile take the paced endpoint and the token :data:`TOKEN`."""
    with moto_s3() as server, PacedRelay(server.endpoint_url, 1_000_000) as relay:
        url = point_at(server, monkeypatch)
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", relay.url)
        monkeypatch.setenv("SPOTGUARD_PEER_TOKEN", TOKEN)
        vm_b = Vm(tmp_path, "vm-b", url, extra_args=["--provider", "none", "--peer-listen", "127.0.0.1:0"])
        vm_b.start_daemon()
        try:
            yield url, vm_b
        finally:
            vm_b.kill_daemon()


def drill_routed_to_peer(vm: Vm, deadline_s: float) -> None:
    """A drill on ``vm``, once it has measured its bucket, and its plan routing to the peer."""
    wait_for(lambda: vm.status()["upload_rate_bytes_s"], 30, f"{vm.dir.name}'s upload-rate probe")
    request(vm.socket, "drill", deadline_s=deadline_s)
    wait_for(lambda: vm.status()["plan"]["route"] == "peer", 10, f"{vm.dir.name}'s plan to route to the peer")


def handoff_ended(vm: Vm, timeout: float) -> dict[str, Any]:
    """``vm``'s handoff once it is handed or failed: its status."""
    return dict(
        wait_for(
            lambda: (h := vm.status()["peers"]["handoff"])["state"] in ("handed", "failed") and h,
            timeout,
            f"{vm.dir.name} to hand its checkpoint over",
        )
    )


def urgent_handoff(vm: Vm, *, size: int, chunk: int, timeout: float) -> tuple[dict[str, Any], str]:
    """A drill on ``vm`` routed to the peer, then an urgent save of one ``size``-byte file written
    through its socket ``chunk`` bytes at a time: the handoff's status once it ended, and the step's
    directory name."""
    writer = ProgressiveWriter(vm.root, 5, vm.socket, size=size, chunk=chunk)
    try:
        drill_routed_to_peer(vm, deadline_s=8.0)
        writer.write_whole()
        return handoff_ended(vm, timeout), writer.step_dir.name
    finally:
        writer.close()


def hand_over(where: tuple[str, int], step_dir: Path, url: str, token: str | bytes = TOKEN) -> dict[str, Any]:
    """Hand ``step_dir`` (committed) to the receiver at ``where`` over one flow; its last answer."""
    secret = token.encode() if isinstance(token, str) else token

    async def run() -> dict[str, Any]:
        client = await PeerClient.connect(*where, secret)
        try:
            return await send_committed(client, step_dir, url, secret, flows=1)
        finally:
            await client.close()

    return asyncio.run(run())


def committed_steps(url: str) -> list[int]:
    """The steps committed whole in the bucket at ``url``."""
    storage = open_storage(url)
    try:
        return [info.step for info in list_remote(storage) if info.status == "complete"]
    finally:
        storage.close()


def address(vm: Vm) -> tuple[str, int]:
    """Where ``vm``'s peer receiver listens."""
    return wire.parse_address(vm.status()["peers"]["listen"])


def bucket_keys(url: str) -> list[str]:
    """Every key under the S3 ``url`` but the daemons' rate probes."""
    return sorted(o.key for o in bucket_storage(url).list() if not o.key.startswith(PROBE_PREFIX))


def replica_area(vm: Vm) -> list[str]:
    """What ``vm``'s peer receiver holds on disk."""
    area = vm.root / AREA
    return sorted(p.name for p in area.iterdir()) if area.exists() else []
