"""A fetch from a real peer daemon stages its files in a private directory of its own.

Another local user may pre-create ``<root>/.peer-fetch`` (the staging path of earlier versions) as a
link, or leave links in a directory named like a staging one: the fetch still works, writes nothing
through any of them, and the links' targets stay as they were.
"""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

from spotguard.manifest import load_manifest
from spotguard.peer.client import PeerClient
from spotguard.peer.fetch import STAGING, fetch_replica, list_replicas
from spotguard.peer.replicas import make_private_dir
from tests.checkpoints import write_checkpoint
from tests.integration import test_peer_resume as resuming
from tests.integration.test_daemon_buckets import same_files
from tests.integration.test_peer_resume import TOKEN, hand, holder, listen
from tests.pacedrelay import PacedRelay

relay = resuming.relay  # the fixture: the holders' slow way to the bucket

MiB = 1 << 20


def snapshot(path: Path) -> dict[str, tuple[int, int, int]]:
    """(mode, size, mtime in ns) of everything under ``path``, links not followed."""
    found = {}
    for entry in [path, *path.rglob("*")]:
        info = entry.lstat()
        found[entry.relative_to(path).as_posix()] = (info.st_mode, info.st_size, info.st_mtime_ns)
    return found


def test_a_fetch_never_writes_through_links_planted_at_its_staging_paths(
    tmp_path: Path, url: str, relay: PacedRelay
) -> None:
    whole = write_checkpoint(tmp_path / "sender", 41, {"w.bin": os.urandom(MiB), "sub/o.bin": os.urandom(MiB)})
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    victim = tmp_path / "victim"  # what another local user would like the fetch to write into or chmod
    write_checkpoint(victim, 41, {"w.bin": b"not yours"})
    (victim / "loose.txt").write_text("keep me")
    victim.chmod(0o755)
    (fresh / STAGING).symlink_to(victim)  # the old fixed staging path, as a link
    stale = fresh / f"{STAGING}-planted"  # named like a staging directory, with a link inside
    stale.mkdir()
    (stale / "step-000000041").symlink_to(victim / "step-000000041")
    (fresh / f"{STAGING}-link").symlink_to(victim)
    before = snapshot(victim)

    vm = holder(tmp_path, "vm-b", url, relay)
    try:
        hand(vm, whole, url)

        async def go() -> Path:
            client = await PeerClient.connect(*listen(vm), TOKEN.encode())
            try:
                (item,) = await list_replicas(client)
                return await fetch_replica(client, item["id"], fresh)
            finally:
                await client.close()

        fetched = asyncio.run(go())
    finally:
        vm.kill_daemon()

    assert fetched == fresh / "step-000000041" and not fetched.is_symlink()
    assert load_manifest(fetched).files == load_manifest(whole).files and same_files(whole, fetched) == []
    for path in fetched.rglob("*"):
        if path.is_file():
            assert stat.S_IMODE(path.stat().st_mode) == 0o644, path  # set on the descriptor, umask aside
    assert snapshot(victim) == before  # nothing written, created, removed or chmod-ed through a link
    assert (fresh / STAGING).is_symlink() and (fresh / f"{STAGING}-link").is_symlink()  # not followed
    assert not stale.exists()  # a real leftover directory is removed, its link unlinked, not followed
    leftovers = sorted(p.name for p in fresh.iterdir())
    assert leftovers == [STAGING, f"{STAGING}-link", "step-000000041"]


def test_the_replica_area_is_private_and_never_a_link(tmp_path: Path) -> None:
    area = tmp_path / "root" / "peer-replicas"
    make_private_dir(area)
    assert stat.S_IMODE(area.lstat().st_mode) == 0o700
    area.chmod(0o777)
    make_private_dir(area)  # an existing one is made private again
    assert stat.S_IMODE(area.lstat().st_mode) == 0o700

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    linked = tmp_path / "other" / "peer-replicas"
    linked.parent.mkdir()
    linked.symlink_to(elsewhere)
    try:
        make_private_dir(linked)
    except OSError as exc:
        assert "not a directory of this user's" in str(exc)
    else:
        raise AssertionError("a link was taken as the replica area")
    assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o755 and list(elsewhere.iterdir()) == []
