"""A peer whose host can vanish: a network namespace reached over veth pairs whose far ends can be cut.

A daemon started in the namespace (:attr:`Island.prefix` before its command) listens on the
namespace's end of a pair, an address of the 198.18.0.0/15 range set aside for tests of network
devices (RFC 2544, never routed), in a /29 of its own for each use so that runs side by side do not
meet. After :meth:`Island.cut` every packet sent to that address is dropped beyond this side, with
no FIN, no RST and no ICMP, as when a VM is reclaimed at once. A process that is only stopped
(SIGSTOP), or a relay that stops passing bytes, still has a kernel that acknowledges what reached it,
which is not the same thing.

Needs root and iproute2 (CI has both); elsewhere the test using it is skipped, with that reason.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

import pytest

_TEST_NETWORK = ipaddress.ip_network("198.18.0.0/15")


def _run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise OSError(f"{' '.join(command)}: {done.stderr.strip()}")
    return done.stdout


def _ip(*args: str) -> str:
    return _run("ip", *args)


@dataclass(frozen=True)
class Island:
    name: str  # the namespace's
    inner: list[str]  # its end of each veth pair ("way")
    addresses: list[str]  # each end's address: a daemon listening on 0.0.0.0 is reached over any
    outer: str  # this side's address on every way, which the island reaches over the first

    @property
    def address(self) -> str:
        """The first way's address."""
        return self.addresses[0]

    @property
    def prefix(self) -> list[str]:
        """What runs a command in the namespace."""
        return ["ip", "netns", "exec", self.name]

    def cut(self, way: int = 0) -> None:
        """Nothing sent over ``way`` is answered any more: the island drops its address there, so
        what arrives for it is dropped (it forwards nothing, and says nothing of it). The link stays
        up, so what is sent leaves this side and is lost beyond it, as on the way to a VM reclaimed
        at once. (Taking the link down instead would drop it here, before TCP counts it in flight.)"""
        _ip("-n", self.name, "addr", "del", f"{self.addresses[way]}/32", "dev", self.inner[way])

    def pace(self, mbit: int) -> None:
        """What the island sends over the first way goes out at ``mbit`` Mbit/s at most (tbf): a
        transfer from it long enough to be cut midway."""
        tbf = ["tbf", "rate", f"{mbit}mbit", "burst", "64kb", "latency", "200ms"]
        _run(*self.prefix, "tc", "qdisc", "add", "dev", self.inner[0], "root", *tbf)

    def pids(self) -> list[int]:
        return [int(pid) for pid in _ip("netns", "pids", self.name).split()]


def _addresses(ways: int) -> tuple[str, list[str]]:
    """From a random /29 of the test range: this namespace's address, and one for each way to the island."""
    base = _TEST_NETWORK.network_address + 8 * secrets.randbelow(_TEST_NETWORK.num_addresses // 8)
    return str(base + 1), [str(base + 2 + i) for i in range(ways)]


@contextmanager
def island(ways: int = 1) -> Iterator[Island]:
    """A fresh namespace reached over ``ways`` veth pairs, one address at its end of each. This side
    has one address on all of them (a connection over any way comes from the same host, as a
    handoff's flows do), and the island answers it over the first: cutting another way stops only
    what is sent over that one. Every process left in the namespace is killed at the end."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("a network namespace needs root and iproute2 (ip)")
    if not 1 <= ways <= 6:
        raise ValueError("1 to 6 ways")
    tag = secrets.token_hex(4)
    here, there = _addresses(ways)
    place = Island(name=f"sg-{tag}", inner=[f"sgi{i}{tag}" for i in range(ways)], addresses=there, outer=here)
    try:
        _ip("netns", "add", place.name)
    except OSError as exc:
        pytest.skip(f"no network namespace here: {exc}")
    try:
        _ip("-n", place.name, "link", "set", "lo", "up")
        for i, (inner, address) in enumerate(zip(place.inner, there, strict=True)):
            outer = f"sgo{i}{tag}"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner, "netns", place.name)
            _ip("addr", "add", f"{here}/32", "dev", outer)
            _ip("link", "set", outer, "up")
            _ip("route", "add", f"{address}/32", "dev", outer, "src", here)
            _ip("-n", place.name, "addr", "add", f"{address}/32", "dev", inner)
            _ip("-n", place.name, "link", "set", inner, "up")
        _ip("-n", place.name, "route", "add", f"{here}/32", "dev", place.inner[0])
        # What comes in over another way than the one the answers take is not a spoofed source here.
        for conf in ("all", "default", *place.inner):
            _ip("netns", "exec", place.name, "sh", "-c", f"echo 0 > /proc/sys/net/ipv4/conf/{conf}/rp_filter")
        yield place
    finally:
        for pid in place.pids():
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _ip("netns", "del", place.name)  # its ends of the pairs go with it, and the other ends too
