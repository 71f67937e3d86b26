"""The peer registry cannot steer a daemon: forged, future, out-of-network entries are never dialled,
candidates are capped and probed at once within one deadline, and the job's token is checked.

Real daemons and registries in a file:// bucket; every socket that is really dialled is a listening
socket on 127.0.0.1. Addresses outside loopback (the metadata service, a public address) appear only
in registry entries that the filter refuses, so nothing ever dials them.
"""

from __future__ import annotations

import asyncio
import io
import logging
import random
import re
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotguard.config import DaemonConfig
from spotguard.control import request
from spotguard.doctor import run_doctor
from spotguard.harness import Vm
from spotguard.peer.discovery import MAX_CANDIDATES, PeerRegistry
from spotguard.peer.fetch import resume_from_peers
from spotguard.peer.networks import DEFAULT_PEER_NETWORKS, PeerNetworks, parse_networks
from spotguard.storage.base import put_bytes
from spotguard.storage.file import FileStorage

TOKEN = "the-job-s-peer-token-0123456789abcdef"
FORGER = "not-the-job-s-token-0123456789abcdefgh"
LOOPBACK_OK = DaemonConfig(bucket="file:///b", peer_listen="127.0.0.1:0", peers="bucket").peer_network_policy()


HOST = "127.0.0.1"
# Ports taken by number below the kernel's ephemeral range, where no port-0 bind (how every other
# server of the suite gets its port) lands: a connection that reaches a listener here was dialled by
# the test's own daemon, never by another test dialling a port it freed. The listeners' ports and the
# closed ones come from two ranges apart, so one test's closed port is never another's listener.
_EPHEMERAL_LOW = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
LISTENER_PORTS = range(_EPHEMERAL_LOW // 2, _EPHEMERAL_LOW)
CLOSED_PORTS = range(1024, _EPHEMERAL_LOW // 2)


def take_ports(ports: range, count: int, *, keep: bool) -> tuple[list[int], list[socket.socket]]:
    """``count`` ports of ``ports`` free now, at random (the system's generator: every worker its
    own); with ``keep`` their listening sockets, else closed again (nothing listens there)."""
    pick = random.SystemRandom()
    taken: list[int] = []
    servers: list[socket.socket] = []
    for port in pick.sample(ports, len(ports)):
        if len(taken) == count:
            break
        try:
            server = socket.create_server((HOST, port))
        except OSError:
            continue  # someone's already
        taken.append(port)
        if keep:
            servers.append(server)
        else:
            server.close()
    assert len(taken) == count, f"only {len(taken)} free ports in {ports}"
    return taken, servers


class Listeners:
    """Listening sockets on 127.0.0.1 (ports of :data:`LISTENER_PORTS`) that accept and never say a
    word; count what reaches them."""

    def __init__(self, count: int) -> None:
        self.ports, self.sockets = take_ports(LISTENER_PORTS, count, keep=True)
        self.dialled: set[int] = set()  # ports that got a connection
        self.open = 0
        self.most_open = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._selector = selectors.DefaultSelector()
        for server in self.sockets:
            server.setblocking(False)
            self._selector.register(server, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            # Hang-ups before new connections: a dialler that closed one socket and then opened the
            # next (both ready in one select) had only one open at a time, and must count so.
            for key, _ in sorted(self._selector.select(0.05), key=lambda ready: ready[0].data is None):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if key.data is None:  # a listener: take the connection, keep it open, say nothing
                    try:
                        conn, _ = sock.accept()
                    except BlockingIOError:
                        continue
                    conn.setblocking(False)
                    self._selector.register(conn, selectors.EVENT_READ, "conn")
                    with self._lock:
                        self.dialled.add(sock.getsockname()[1])
                        self.open += 1
                        self.most_open = max(self.most_open, self.open)
                else:  # the dialling side sent something, or hung up
                    try:
                        data = sock.recv(65536)
                    except OSError:
                        data = b""
                    if not data:
                        self._selector.unregister(sock)
                        sock.close()
                        with self._lock:
                            self.open -= 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()


@pytest.fixture
def listeners() -> Iterator[Listeners]:
    made: list[Listeners] = []

    def make(count: int) -> Listeners:
        made.append(Listeners(count))
        return made[-1]

    yield make  # type: ignore[misc]
    for item in made:
        item.close()


def closed_ports(count: int) -> list[int]:
    """Distinct ports nothing listens on (of :data:`CLOSED_PORTS`: no listener of the suite's takes one)."""
    return take_ports(CLOSED_PORTS, count, keep=False)[0]


def entry(storage: FileStorage, address: str, *, token: str = TOKEN, heartbeat: float | None = None) -> str:
    """A registry entry for ``address``, signed with ``token``, as a daemon writes it; returns its key."""
    now = time.time() if heartbeat is None else heartbeat
    registry = PeerRegistry(storage, token=token.encode(), networks=LOOPBACK_OK, clock=lambda: now)
    registry.advertise(address)
    registry.register()
    assert registry.key is not None
    return registry.key


def daemon(tmp_path: Path, url: str, env: dict[str, str] | None = None) -> Vm:
    vm = Vm(tmp_path, "fresh", url, ["--provider", "none", "--peer-listen", "127.0.0.1:0", "--peers", "bucket"])
    vm.start_daemon(env={"SPOTGUARD_PEER_TOKEN": TOKEN, **(env or {})})
    return vm


def peer_resume(vm: Vm) -> tuple[float, dict[str, object]]:
    started = time.monotonic()
    reply = request(vm.socket, "peer-resume", timeout=120, after=-1)
    return time.monotonic() - started, reply


def test_a_forged_entry_and_a_future_heartbeat_are_never_dialled_and_logged_once(
    tmp_path: Path, listeners: object
) -> None:
    url = f"file://{tmp_path}/bucket/run1"
    storage = FileStorage(url)
    socks = listeners(3)  # type: ignore[operator]
    forged, future, honest = (f"{HOST}:{port}" for port in socks.ports)
    forged_key = entry(storage, forged, token=FORGER)
    future_key = entry(storage, future, heartbeat=time.time() + 3600)
    entry(storage, honest)  # the control: a signed, fresh entry is dialled
    vm = daemon(tmp_path, url)
    try:
        for _ in range(2):
            reply = peer_resume(vm)[1]
            assert reply["path"] is None
    finally:
        vm.kill_daemon()
    assert socks.dialled == {socks.ports[2]}, "only the signed, fresh entry was dialled"
    log = vm.log.read_text()
    assert len(re.findall(re.escape(forged_key) + r" not signed with the job's token", log)) == 1, log
    assert len(re.findall(re.escape(future_key) + r" its heartbeat is more than 60 s in the future", log)) == 1, log


def test_what_was_logged_of_a_refused_entry_goes_with_the_entry(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A refused entry is logged once while it stays; once it is gone from the registry nothing is
    kept of it (a job's VMs come and go for months), and one that comes back is news again."""
    storage = FileStorage(f"file://{tmp_path}/bucket/run1")
    forged_key = entry(storage, "127.0.0.1:9", token=FORGER)
    saved = storage.read_bytes(forged_key)
    reader = PeerRegistry(storage, token=TOKEN.encode(), networks=LOOPBACK_OK)

    def logged() -> int:
        return len([r for r in caplog.records if forged_key in r.getMessage() and "not signed" in r.getMessage()])

    with caplog.at_level(logging.WARNING, logger="spotguard"):
        for _ in range(3):
            assert asyncio.run(reader.candidates()) == []
        assert logged() == 1
        storage.delete([forged_key])
        asyncio.run(reader.candidates())
        assert reader._reported == {}, "nothing is kept of an entry no longer in the registry"
        put_bytes(storage, forged_key, saved)
        asyncio.run(reader.candidates())
        assert logged() == 2, "the same forged entry, back again, is logged again"


def test_150_entries_are_capped_and_probed_at_once_within_one_deadline(tmp_path: Path, listeners: object) -> None:
    url = f"file://{tmp_path}/bucket/run1"
    storage = FileStorage(url)
    silent = listeners(75)  # type: ignore[operator]
    closed = closed_ports(75)
    now = time.time()
    # Interleaved, the freshest first: the cap takes half silent, half closed ones.
    order = [port for pair in zip(silent.ports, closed, strict=True) for port in pair]
    for i, port in enumerate(order):
        entry(storage, f"{HOST}:{port}", heartbeat=now - i)
    vm = daemon(tmp_path, url)
    try:
        took, reply = peer_resume(vm)
    finally:
        vm.kill_daemon()
    assert reply["path"] is None
    freshest = order[:MAX_CANDIDATES]  # the cap: 16 of 150, freshest first (the daemon's own entry is skipped)
    assert silent.dialled == set(freshest) & set(silent.ports), (silent.dialled, freshest)
    assert silent.most_open <= MAX_CANDIDATES
    # The silent ones were asked at once: one probe timeout (5 s), not 8 of them one after another.
    assert took < 15.0, f"the resume took {took:.1f} s"
    print(f"150 entries: resume answered in {took:.2f} s, {len(silent.dialled)} silent peers dialled")


def test_probes_keep_to_the_limit_in_flight_and_one_overall_deadline(tmp_path: Path, listeners: object) -> None:
    silent = listeners(150)  # type: ignore[operator]
    addresses = [(HOST, port) for port in silent.ports]

    async def go() -> float:
        started = time.monotonic()
        await resume_from_peers(addresses, TOKEN.encode(), "file:///b", tmp_path, -1, deadline=3.0, limit=16)
        return time.monotonic() - started

    took = asyncio.run(go())
    assert 16 <= len(silent.dialled) <= 16 * 2  # a probe lasts 5 s, the deadline 3 s: one wave
    assert silent.most_open <= 16
    assert took < 3.0 + 1.5, f"{took:.1f} s for one 3 s deadline"
    print(f"150 silent peers, limit 16, deadline 3 s: {took:.2f} s, at most {silent.most_open} open")


def test_link_local_metadata_and_outside_addresses_are_refused_by_the_filter(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing is dialled here: ``candidates()`` only reads the registry and filters it."""
    storage = FileStorage(f"file://{tmp_path}/bucket/run1")
    private = PeerNetworks(parse_networks(DEFAULT_PEER_NETWORKS))
    metadata = entry(storage, "169.254.169.254:80")
    link_local = entry(storage, "[fe80::1]:7140")
    ec2_v6 = entry(storage, "[fd00:ec2::254]:80")
    public = entry(storage, "8.8.8.8:7140")
    loopback = entry(storage, "127.0.0.1:7140")
    entry(storage, "10.0.1.7:7141")
    reader = PeerRegistry(storage, token=TOKEN.encode(), networks=private)
    with caplog.at_level(logging.WARNING, logger="spotguard.discovery"):
        assert asyncio.run(reader.candidates()) == [("10.0.1.7", 7141)]
        assert asyncio.run(reader.candidates()) == [("10.0.1.7", 7141)]
    text = caplog.text
    for key in (metadata, link_local, ec2_v6):
        assert text.count(f"{key} ") == 1 and "never dialled" in text, text
    for key in (public, loopback):
        assert text.count(f"{key} ") == 1, text
    assert "outside peer_networks" in text
    # A daemon listening on a wildcard takes no loopback peer; one listening on loopback does.
    wildcard = DaemonConfig(bucket="file:///b", peer_listen="0.0.0.0:7140", peers="bucket").peer_network_policy()
    assert wildcard.refuses(private.allowed[0][1]) is None
    assert wildcard.resolve("127.0.0.1", 7140)[0] is None
    assert LOOPBACK_OK.resolve("127.0.0.1", 7140) == ("127.0.0.1", None)
    assert LOOPBACK_OK.resolve("169.254.169.254", 80)[0] is None


def test_peer_token_prints_64_hex_characters_different_each_run() -> None:
    def one() -> str:
        done = subprocess.run(
            [sys.executable, "-m", "spotguard", "peer-token"], capture_output=True, text=True, check=True, timeout=60
        )
        return done.stdout.strip()

    first, second = one(), one()
    assert re.fullmatch(r"[0-9a-f]{64}", first) and re.fullmatch(r"[0-9a-f]{64}", second)
    assert first != second


def test_a_weak_token_is_warned_about_at_start_and_by_doctor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    weak = "aaaaaaaaaaaaaaaaaaaaaaaa"  # 24 bytes: long enough to be used, weak all the same
    url = f"file://{tmp_path}/bucket/run1"
    vm = daemon(tmp_path, url, env={"SPOTGUARD_PEER_TOKEN": weak})
    try:
        assert vm.status()["peers"]["listen"]
    finally:
        vm.kill_daemon()
    assert "the job's peer token is weak (it is 24 bytes, shorter than 32)" in vm.log.read_text()
    monkeypatch.setenv("SPOTGUARD_PEER_TOKEN", weak)
    config = DaemonConfig(
        provider="none", bucket=url, checkpoint_dir=tmp_path / "doctor", peer_listen="127.0.0.1:0", peers="bucket"
    )
    out = io.StringIO()
    run_doctor(config, out=out, write_probe_bytes=1 << 20, upload_probe_bytes=1 << 20)
    assert "warn  peer token: weak: it is 24 bytes" in out.getvalue(), out.getvalue()
    monkeypatch.setenv("SPOTGUARD_PEER_TOKEN", "b0776ae8b8256a5f66376c0e208bf4c6874840e3aaad918b3eab3bfefa70f579")
    out = io.StringIO()
    run_doctor(config, out=out, write_probe_bytes=1 << 20, upload_probe_bytes=1 << 20)
    assert "ok    peer token: 64 bytes" in out.getvalue(), out.getvalue()
