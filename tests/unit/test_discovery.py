"""Peer discovery through the bucket (a file:// bucket): registration, staleness, and staying out of
the way of checkpoints."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import time_machine

from spotguard import cloudclock
from spotguard.cli import main
from spotguard.config import ConfigError, DaemonConfig
from spotguard.peer.discovery import (
    HEARTBEAT,
    PREFIX,
    PRUNE_AFTER,
    STALE_AFTER,
    PeerRegistry,
    advertised_address,
    entry_signature,
    legacy_signing_key,
    signing_key,
)
from spotguard.peer.networks import DEFAULT_PEER_NETWORKS, LOOPBACK_NETWORKS, PeerNetworks, parse_networks
from spotguard.peer.noise import derive_psk
from spotguard.peer.tokens import REGISTRY_KEY_LABEL, hkdf, token_fingerprint
from spotguard.storage.base import put_bytes, scratch_dir
from spotguard.storage.checkpoints import list_remote, prune_remote, restore, upload_checkpoint
from spotguard.storage.file import FileStorage
from tests.checkpoints import write_checkpoint
from tests.diskspace import fill
from tests.emulators import eventually

TOKEN = b"the-job-s-peer-token-0123456789abcdef"
NETWORKS = PeerNetworks(parse_networks(DEFAULT_PEER_NETWORKS + LOOPBACK_NETWORKS))


def signed(storage: FileStorage, key: str, document: dict[str, object]) -> bytes:
    """An entry as a daemon of the job writes it: signed with the key derived from the token."""
    sig = entry_signature(signing_key(TOKEN), storage.url, key, str(document["address"]), float(document["heartbeat"]))  # type: ignore[arg-type]
    return json.dumps({**document, "sig": sig}).encode()


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0
        self.reads = 0  # a registry reads it once per write of its entry

    def __call__(self) -> float:
        self.reads += 1
        return self.now


@pytest.fixture
def storage(tmp_path: Path) -> FileStorage:
    return FileStorage(f"file://{tmp_path}/bucket/run1")


def keys(storage: FileStorage) -> list[str]:
    return sorted(info.key for info in storage.list(f"{PREFIX}/"))


def test_a_listening_daemon_is_found_and_a_sender_skips_itself(storage: FileStorage) -> None:
    clock = Clock()
    b = PeerRegistry(storage, token=TOKEN, networks=NETWORKS, address="127.0.0.1:7141", clock=clock)
    a = PeerRegistry(storage, token=TOKEN, networks=NETWORKS, address="127.0.0.1:7140", clock=clock)
    sender_only = PeerRegistry(storage, token=TOKEN, networks=NETWORKS, clock=clock)
    b.register()
    a.register()
    sender_only.register()  # nothing to register: it listens nowhere
    assert len(keys(storage)) == 2
    assert asyncio.run(a.candidates()) == [("127.0.0.1", 7141)]
    assert asyncio.run(b.candidates()) == [("127.0.0.1", 7140)]
    assert asyncio.run(sender_only.candidates()) == [("127.0.0.1", 7140), ("127.0.0.1", 7141)]  # freshest first
    assert sender_only.status() == {"advertised": None, "candidates": ["127.0.0.1:7140", "127.0.0.1:7141"]}
    # A clean shutdown removes the entry: no candidate any more.
    asyncio.run(b.close())
    assert asyncio.run(a.candidates()) == []


def test_an_entry_is_signed_under_the_tokens_psk_and_one_signed_the_old_way_is_still_believed(
    storage: FileStorage,
) -> None:
    """An entry read from the bucket must not let guesses at the token be checked fast: it is signed
    under a key derived from the psk (scrypt of the token), as the handshake is, not from the token
    itself (a guess checked in microseconds). Entries of daemons not upgraded yet, signed the old way,
    are still believed; none is written so. The fingerprint is the psk's too."""
    writer = PeerRegistry(storage, token=TOKEN, networks=NETWORKS, address="127.0.0.1:7141", clock=Clock())
    writer.register()
    [key] = keys(storage)
    entry = json.loads(storage.read_bytes(key))
    psk_key = hkdf(derive_psk(TOKEN), REGISTRY_KEY_LABEL)
    assert signing_key(TOKEN) == psk_key
    assert entry["sig"] == entry_signature(psk_key, storage.url, key, entry["address"], entry["heartbeat"])
    legacy = entry_signature(legacy_signing_key(TOKEN), storage.url, key, entry["address"], entry["heartbeat"])
    assert legacy != entry["sig"] and "sig_next" not in entry
    # A daemon of the version before signs the old way: its entry is believed, as it was.
    put_bytes(storage, key, json.dumps({**entry, "sig": legacy}).encode())
    reader = PeerRegistry(storage, token=TOKEN, networks=NETWORKS, clock=Clock())
    assert asyncio.run(reader.candidates()) == [("127.0.0.1", 7141)]
    tampered = legacy[:-1] + ("1" if legacy.endswith("0") else "0")
    put_bytes(storage, key, json.dumps({**entry, "sig": tampered}).encode())
    assert asyncio.run(PeerRegistry(storage, token=TOKEN, networks=NETWORKS, clock=Clock()).candidates()) == []
    assert token_fingerprint(TOKEN) == hashlib.sha256(b"spotguard-peer-token|" + derive_psk(TOKEN)).hexdigest()[:8]


def test_stale_entries_are_skipped_and_long_dead_ones_pruned(storage: FileStorage) -> None:
    clock = Clock()
    alive = PeerRegistry(storage, token=TOKEN, networks=NETWORKS, address="127.0.0.1:7141", clock=clock)
    reader = PeerRegistry(storage, token=TOKEN, networks=NETWORKS, clock=clock)
    alive.register()
    # A VM preempted without a clean shutdown: its entry stays, its heartbeat ages.
    stale = {"address": "127.0.0.1:7142", "heartbeat": clock.now - (STALE_AFTER + 1) * HEARTBEAT}
    dead = {"address": "127.0.0.1:7143", "heartbeat": clock.now - (PRUNE_AFTER + 1) * HEARTBEAT}
    put_bytes(storage, f"{PREFIX}/stale-7142.json", signed(storage, f"{PREFIX}/stale-7142.json", stale))
    put_bytes(storage, f"{PREFIX}/dead-7143.json", signed(storage, f"{PREFIX}/dead-7143.json", dead))
    put_bytes(storage, f"{PREFIX}/garbage.json", b"not json")
    assert asyncio.run(reader.candidates()) == [("127.0.0.1", 7141)]
    assert f"{PREFIX}/dead-7143.json" not in keys(storage)
    assert f"{PREFIX}/stale-7142.json" in keys(storage)  # kept: it may only have missed a few writes
    # An entry that cannot be read is pruned by the store's time of its last write.
    assert f"{PREFIX}/garbage.json" in keys(storage)
    old = clock.now - (PRUNE_AFTER + 1) * HEARTBEAT
    os.utime(Path(storage.url.removeprefix("file://")) / PREFIX / "garbage.json", (old, old))
    asyncio.run(reader.candidates())
    assert f"{PREFIX}/garbage.json" not in keys(storage)
    # The live one stops refreshing: after STALE_AFTER periods it is no candidate either.
    clock.now += STALE_AFTER * HEARTBEAT + 1
    assert asyncio.run(reader.candidates()) == []


@pytest.mark.parametrize(
    "body",
    [
        b'{"address": "127.0.0.1:7149", "heartbeat": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",
        b'{"address": "127.0.0.1:7149", "heartbeat": 1' + b"0" * 5000 + b"}",
        b'{"address": "127.0.0.1:7149", "heartbeat": NaN, "sig": ""}',
    ],
    ids=["nested", "digits", "nan"],
)
def test_a_hostile_entry_hides_no_peer_and_is_pruned_like_garbage(storage: FileStorage, body: bytes) -> None:
    """One forged object nested 20,000 deep used to raise RecursionError out of the registry's
    read: no candidate at all for a notice's handoff."""
    clock = Clock()
    alive = PeerRegistry(storage, token=TOKEN, networks=NETWORKS, address="127.0.0.1:7141", clock=clock)
    reader = PeerRegistry(storage, token=TOKEN, networks=NETWORKS, clock=clock)
    alive.register()
    put_bytes(storage, f"{PREFIX}/forged.json", body)
    assert asyncio.run(reader.candidates()) == [("127.0.0.1", 7141)]
    old = clock.now - (PRUNE_AFTER + 1) * HEARTBEAT
    os.utime(Path(storage.url.removeprefix("file://")) / PREFIX / "forged.json", (old, old))
    asyncio.run(reader.candidates())
    assert f"{PREFIX}/forged.json" not in keys(storage)


def test_registry_objects_never_show_up_as_checkpoints(storage: FileStorage, tmp_path: Path) -> None:
    registry = PeerRegistry(storage, token=TOKEN, networks=NETWORKS, address="127.0.0.1:7140")
    registry.register()
    for step in (1, 2):
        upload_checkpoint(storage, write_checkpoint(tmp_path / "local", step, {"w.bin": os.urandom(4096)}))
    assert [info.name for info in list_remote(storage)] == ["step-000000001", "step-000000002"]
    # Retention, even with every incomplete leftover long stale: the entry is not one.
    later = datetime.now(UTC) + timedelta(days=30)
    assert prune_remote(storage, keep=1, grace=timedelta(seconds=1), now=later) == ["step-000000001"]
    assert keys(storage) == [registry.key]
    restored = restore(storage, tmp_path / "fresh")
    assert restored is not None and restored.name == "step-000000002"
    assert sorted(p.name for p in (tmp_path / "fresh").iterdir()) == ["step-000000002"]


def test_spotguard_list_does_not_show_registry_objects(
    storage: FileStorage, capsys: pytest.CaptureFixture[str]
) -> None:
    PeerRegistry(storage, token=TOKEN, networks=NETWORKS, address="127.0.0.1:7140").register()
    assert main(["list", storage.url]) == 0
    assert "no checkpoints" in capsys.readouterr().out


def test_the_advertised_address() -> None:
    def no_lookup() -> str:
        raise AssertionError("a listen address that is not a wildcard needs no lookup")

    assert advertised_address("127.0.0.1:7140", None, lookup=no_lookup) == "127.0.0.1:7140"
    assert advertised_address("0.0.0.0:7140", "10.0.1.7:7140", lookup=no_lookup) == "10.0.1.7:7140"
    assert advertised_address("0.0.0.0:7140", None, lookup=lambda: "10.0.1.7") == "10.0.1.7:7140"
    assert advertised_address("[::]:7140", None, lookup=lambda: "fd00::7") == "[fd00::7]:7140"


def test_peers_bucket_in_the_config(tmp_path: Path) -> None:
    config = DaemonConfig(bucket="s3://b/run1", peer_listen="0.0.0.0:7140", peers="bucket")
    assert config.peer_discovery and config.peer_addresses() == []
    assert not DaemonConfig(bucket="s3://b/run1", peers="10.0.0.2:7140").peer_discovery
    with pytest.raises(ConfigError, match="either"):
        DaemonConfig(bucket="s3://b/run1", peers="bucket,10.0.0.2:7140")
    with pytest.raises(ConfigError, match="peer_advertise"):
        DaemonConfig(bucket="s3://b/run1", peers="bucket", peer_advertise="10.0.0.2:7140")
    with pytest.raises(ConfigError, match="peer_advertise"):
        DaemonConfig(bucket="s3://b/run1", peer_listen="0.0.0.0:7140", peer_advertise="10.0.0.2")


def test_a_write_that_keeps_failing_is_logged_once_and_its_recovery_once(
    tmpfs: Callable[[int], Path], caplog: pytest.LogCaptureFixture
) -> None:
    """A full disk under the entry (here the bucket's) failed every heartbeat and logged a warning at
    each, every 30 s for as long as the disk stayed full."""
    disk = tmpfs(256 * 1024)
    storage = FileStorage(f"file://{disk}/bucket/run1")
    filler = fill(disk, leave=0)
    clock = Clock()
    registry = PeerRegistry(
        storage, token=TOKEN, networks=NETWORKS, address="127.0.0.1:7141", heartbeat=0.001, clock=clock
    )

    async def scenario() -> None:
        task = asyncio.create_task(registry.run())
        try:
            await eventually(lambda: clock.reads >= 50, timeout=20)  # fifty failed heartbeats
            filler.unlink()
            # The line, not the object: the object is in place before the write returns and is logged.
            await eventually(lambda: "written again" in caplog.text, timeout=20)
        finally:
            task.cancel()

    with caplog.at_level(logging.INFO, logger="spotguard.discovery"):
        asyncio.run(scenario())
    assert keys(storage) == [f"{PREFIX}/{Path(registry.key or '').name}"]
    messages = [record.getMessage() for record in caplog.records]
    assert len([m for m in messages if "could not write" in m]) == 1, messages
    assert len([m for m in messages if "written again" in m]) == 1, messages


def test_the_entry_is_written_while_the_temporary_directory_is_full(
    tmpfs: Callable[[int], Path], storage: FileStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small object waits for its upload in memory (/dev/shm), not in /tmp on the root disk: a full
    one stopped every heartbeat, and the node fell out of the registry after 90 s."""
    if scratch_dir() is None:
        pytest.skip("no writable /dev/shm here: small objects go through the temporary directory")
    full = tmpfs(64 * 1024)
    fill(full, leave=0)
    monkeypatch.setattr(tempfile, "tempdir", str(full))  # what TMPDIR on a full disk gives
    registry = PeerRegistry(storage, token=TOKEN, networks=NETWORKS, address="127.0.0.1:7141", clock=Clock())
    registry.register()
    assert keys(storage) == [f"{PREFIX}/{Path(registry.key or '').name}"]
    with pytest.raises(OSError), tempfile.TemporaryFile(buffering=0) as probe:
        probe.write(b"x")  # the temporary directory really is full


def test_during_a_rotation_entries_signed_with_either_token_are_believed(storage: FileStorage) -> None:
    from spotguard.peer.tokens import JobToken

    new = b"the-job-s-new-peer-token-0123456789abcdef"
    clock = Clock()
    not_restarted = PeerRegistry(storage, token=TOKEN, networks=NETWORKS, address="127.0.0.1:7141", clock=clock)
    restarted = PeerRegistry(
        storage, token=JobToken(new, previous=TOKEN), networks=NETWORKS, address="127.0.0.1:7142", clock=clock
    )
    rotated = PeerRegistry(storage, token=new, networks=NETWORKS, address="127.0.0.1:7143", clock=clock)
    for registry in (not_restarted, restarted, rotated):
        registry.register()
    # The rotating daemon believes both, and signs its entry for both: "sig" under the old token (what
    # a daemon not yet restarted checks), "sig_next" under the new one. Old and new only never meet.
    assert sorted(asyncio.run(restarted.candidates())) == [("127.0.0.1", 7141), ("127.0.0.1", 7143)]
    assert asyncio.run(not_restarted.candidates()) == [("127.0.0.1", 7142)]
    assert asyncio.run(rotated.candidates()) == [("127.0.0.1", 7142)]
    entry = json.loads(storage.read_bytes(str(restarted.key)))
    assert set(entry) == {"address", "heartbeat", "sig", "sig_next"} and entry["sig"] != entry["sig_next"]
    plain = json.loads(storage.read_bytes(str(rotated.key)))
    assert set(plain) == {"address", "heartbeat", "sig"}  # no rotation, no second signature
    # A second signature moved onto another entry's key proves nothing there.
    forged = {**plain, "sig": "0" * 64, "sig_next": entry["sig_next"]}
    put_bytes(storage, str(rotated.key), json.dumps(forged).encode())
    assert asyncio.run(not_restarted.candidates()) == [("127.0.0.1", 7142)]
    assert sorted(asyncio.run(restarted.candidates())) == [("127.0.0.1", 7141)]
    # A stranger's token is none of them.
    stranger = PeerRegistry(
        storage, token=JobToken(b"another-job-s-token-0123456789abcdef", previous=b"and-its-old-one-0123456789abc"),
        networks=NETWORKS, clock=clock,
    )  # fmt: skip
    assert asyncio.run(stranger.candidates()) == []


def test_a_rotated_reader_learns_which_daemons_hold_only_the_previous_token(storage: FileStorage) -> None:
    from spotguard.peer.tokens import PREVIOUS_ONLY, JobToken

    new, clock = b"the-job-s-new-peer-token-0123456789abcdef", Clock()
    rotating = JobToken(new, previous=TOKEN)
    reader = PeerRegistry(storage, token=rotating, networks=NETWORKS, address="127.0.0.1:7140", clock=clock)
    PREVIOUS_ONLY.clear()
    try:
        PeerRegistry(storage, token=TOKEN, networks=NETWORKS, address="127.0.0.1:7141", clock=clock).register()
        PeerRegistry(storage, token=rotating, networks=NETWORKS, address="127.0.0.1:7142", clock=clock).register()
        PeerRegistry(storage, token=new, networks=NETWORKS, address="127.0.0.1:7143", clock=clock).register()
        assert len(asyncio.run(reader.candidates())) == 3
        # Signed under the old token alone: not restarted yet, asked with the old token first.
        ask_old_first = [port for port in (7141, 7142, 7143) if PREVIOUS_ONLY.first("127.0.0.1", port, rotating)]
        assert ask_old_first == [7141]
        # Restarted with both tokens, its entry signed under the new one too: asked with the new one again.
        PeerRegistry(storage, token=rotating, networks=NETWORKS, address="127.0.0.1:7141", clock=clock).register()
        asyncio.run(reader.candidates())
        assert not PREVIOUS_ONLY.first("127.0.0.1", 7141, rotating)
        # Restarted with the old token again (a rotation rolled back): learnt again. A later rotation
        # (another current token) starts afresh.
        PeerRegistry(storage, token=TOKEN, networks=NETWORKS, address="127.0.0.1:7141", clock=clock).register()
        asyncio.run(reader.candidates())
        assert PREVIOUS_ONLY.first("127.0.0.1", 7141, rotating)
        assert not PREVIOUS_ONLY.first("127.0.0.1", 7141, JobToken(b"the-next-token-after-that-0123456789", new))
    finally:
        PREVIOUS_ONLY.clear()


def test_what_is_remembered_of_previous_only_peers_is_bounded_and_kept_per_rotation() -> None:
    from spotguard.peer.tokens import JobToken, PreviousOnlyPeers

    rotating = JobToken(b"the-job-s-new-peer-token-0123456789abcdef", previous=TOKEN)
    peers = PreviousOnlyPeers(bound=4)
    for port in range(7140, 7146):
        peers.learn("10.0.1.7", port, rotating, previous_only=True)
    # The oldest two went; the four learnt last are asked with the previous token first.
    assert [port for port in range(7140, 7146) if peers.first("10.0.1.7", port, rotating)] == [7142, 7143, 7144, 7145]
    # Learnt again, the oldest goes first (7142), not the one refreshed (7143); unlearnt, it goes at once.
    peers.learn("10.0.1.7", 7143, rotating, previous_only=True)
    peers.learn("10.0.1.7", 7146, rotating, previous_only=True)
    peers.learn("10.0.1.7", 7144, rotating, previous_only=False)
    assert [port for port in range(7140, 7147) if peers.first("10.0.1.7", port, rotating)] == [7143, 7145, 7146]
    # Without a rotation nothing is learnt, and nothing is asked with another token first.
    alone = JobToken(TOKEN)
    peers.learn("10.0.1.8", 7140, alone, previous_only=True)
    assert not peers.first("10.0.1.8", 7140, alone) and not peers.first("10.0.1.7", 7145, alone)


def test_a_reader_whose_clock_runs_hours_ahead_keeps_its_live_peers(storage: FileStorage) -> None:
    """Heartbeats are compared with the reader's clock: one two hours ahead took every live peer's
    entry for one long dead, skipped it and deleted it. The metadata service's Date header says how
    far ahead the clock runs, and the registry counts on the cloud's time then (spotguard/cloudclock.py)."""
    peer = PeerRegistry(storage, token=TOKEN, networks=NETWORKS, address="127.0.0.1:7141", clock=time.time)
    peer.register()  # a peer whose clock is right
    with time_machine.travel(datetime.now(UTC) + timedelta(hours=2), tick=True):
        cloudclock.note_ahead(2 * 3600.0)  # what the monitors read from the metadata service's answers
        reader = PeerRegistry(storage, token=TOKEN, networks=NETWORKS)
        assert asyncio.run(reader.candidates()) == [("127.0.0.1", 7141)]
        assert keys(storage) == [peer.key]  # not deleted as long dead
        reader.advertise("127.0.0.1:7140")
        reader.register()  # and its own heartbeat is not two hours in the peer's future
    assert asyncio.run(peer.candidates()) == [("127.0.0.1", 7140)]


def test_a_reader_whose_clock_runs_minutes_behind_still_finds_and_is_found_by_its_peers(storage: FileStorage) -> None:
    """Ten minutes behind, every live peer's heartbeat lay in the reader's future and was refused, and
    its own looked ten minutes old to them: the VM was cut off from the peer tier both ways."""
    peer = PeerRegistry(storage, token=TOKEN, networks=NETWORKS, address="127.0.0.1:7141", clock=time.time)
    peer.register()
    with time_machine.travel(datetime.now(UTC) - timedelta(minutes=10), tick=True):
        cloudclock.note_ahead(-600.0)
        reader = PeerRegistry(storage, token=TOKEN, networks=NETWORKS, address="127.0.0.1:7140")
        assert asyncio.run(reader.candidates()) == [("127.0.0.1", 7141)]
        reader.register()
    assert asyncio.run(peer.candidates()) == [("127.0.0.1", 7140)]


def test_a_date_header_from_the_future_deletes_no_live_peers_entry(storage: FileStorage) -> None:
    """A metadata service whose Date header lies two hours ahead (a clock right, a Date wrong) makes
    every heartbeat look old to this reader: it asks nobody, and it deletes nothing, since what it
    deletes is aged on a clock never later than its own."""
    peer = PeerRegistry(storage, token=TOKEN, networks=NETWORKS, address="127.0.0.1:7141", clock=time.time)
    peer.register()
    cloudclock.note_ahead(-2 * 3600.0)
    reader = PeerRegistry(storage, token=TOKEN, networks=NETWORKS)
    assert asyncio.run(reader.candidates()) == []
    assert keys(storage) == [peer.key]
