"""The deadline plan's choice of route and its revision from the uploader's forecast."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

from spotguard.daemon.events import PlanChanged
from spotguard.daemon.plan import (
    FIT_FRACTION,
    PROBE_PREFIX,
    AnnouncedSizes,
    Planner,
    RateMeter,
    Route,
    SizeFrom,
    choose_route,
    sweep_rate_probes,
)
from spotguard.manifest import FileEntry, step_dir_name, write_part
from spotguard.notice import Kind, Notice
from spotguard.safefile import TMP_MARK
from spotguard.storage.base import put_bytes
from spotguard.storage.file import FileStorage
from tests.checkpoints import write_checkpoint

MB = 1_000_000


def test_the_bucket_route_needs_room_to_spare() -> None:
    fits = choose_route(80 * MB, 10 * MB, 10.0, peer_available=True)
    assert fits.route is Route.BUCKET and fits.seconds_needed == 8.0 and FIT_FRACTION * 10 >= 8.0
    tight = choose_route(90 * MB, 10 * MB, 10.0, peer_available=True)
    assert tight.route is Route.PEER and tight.seconds_needed == 9.0


def test_without_a_free_peer_a_state_too_big_for_the_deadline_stays_local() -> None:
    plan = choose_route(400 * MB, 1 * MB, 10.0, peer_available=False)
    assert plan.route is Route.LOCAL
    assert plan.to_dict() | {"why": ""} == {
        "route": "local", "bytes": 400 * MB, "rate_bytes_s": MB, "seconds_needed": 400.0, "seconds_left": 10.0,
        "why": "", "event_id": "", "revision": 0, "size_from": "checkpoint",
    }  # fmt: skip


def test_no_measured_rate_tries_the_bucket_and_says_so() -> None:
    plan = choose_route(5 * MB, None, 30.0, peer_available=True)
    assert plan.route is Route.BUCKET and plan.seconds_needed is None and "no upload rate" in plan.why
    assert choose_route(0, None, 30.0, peer_available=False).seconds_needed == 0.0
    assert choose_route(0, None, 30.0, peer_available=True, bucket=False).route is Route.LOCAL


def test_rate_is_weighted_by_bytes_over_recent_uploads() -> None:
    meter = RateMeter(keep=2)
    assert meter.rate() is None
    meter.add(1 * MB, 10.0)  # pushed out below
    meter.add(100 * MB, 1.0)
    meter.add(1 * MB, 1.0)
    assert meter.rate() == 101 * MB / 2.0


def test_a_bucket_upload_falling_behind_starts_the_peer_route_and_never_goes_back() -> None:
    free_peer = [False]
    planner = Planner(peer_available=lambda: free_peer[0])
    told: list[tuple[str, Route, int]] = []
    planner.bus.subscribe(PlanChanged, lambda e: told.append((e.notice.event_id, e.plan.route, e.plan.revision)))
    planner.observe_size(50 * MB)
    planner.observe_upload(100 * MB, 1.0)
    notice = Notice.in_seconds("none", Kind.DRILL, 30.0, identity="x")
    assert planner.plan(notice).route is Route.BUCKET

    behind = {"urgent": True, "rate_bytes_s": 1 * MB, "bytes_total": 60 * MB, "bytes_done": 10 * MB}
    revised = planner.revise(behind)
    assert revised is not None and revised.route is Route.LOCAL and revised.bytes == 60 * MB
    assert revised.seconds_needed == 50.0
    free_peer[0] = True
    assert (revised := planner.revise(behind)) is not None and revised.route is Route.PEER
    fast = {"urgent": True, "rate_bytes_s": 1000 * MB, "bytes_total": 60 * MB, "bytes_done": 50 * MB}
    assert (revised := planner.revise(fast)) is not None and revised.route is Route.PEER  # kept
    # Announced files count before any part is in: the size is known before the live rate.
    planner.end()
    assert planner.plan(notice).route is Route.BUCKET
    early = {"urgent": True, "rate_bytes_s": None, "bytes_total": 5000 * MB, "bytes_done": 0}
    assert (revised := planner.revise(early)) is not None and revised.route is Route.PEER
    assert revised.seconds_needed == 50.0 and revised.rate_bytes_s == 100 * MB
    assert [(route, revision) for _, route, revision in told[:3]] == [
        (Route.BUCKET, 0), (Route.LOCAL, 1), (Route.PEER, 2),
    ]  # fmt: skip
    planner.end()
    assert planner.revise(fast) is None and planner.current is None


def test_the_size_on_disk_is_what_this_node_uploads_of_its_newest_checkpoint(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 3, {"weights.bin": bytes(1000)})
    planner = Planner()
    planner.size_from_disk(tmp_path)
    assert planner.state_bytes == 1000
    # A later checkpoint of a multi-node job: this disk holds only node 1's committed share of it.
    share = tmp_path / step_dir_name(5)
    share.mkdir()
    (share / "ballast.rank1.pt").write_bytes(bytes(300))
    write_part(share, 1, 2, {"ballast.rank1.pt": FileEntry(size=300, crc32c="00000000")})
    planner = Planner()
    planner.size_from_disk(tmp_path)
    assert planner.state_bytes == 300


def test_replicated_trainers_on_a_node_count_once_and_sharded_ones_add_up() -> None:
    sizes = AnnouncedSizes()
    assert sizes.estimate() is None
    # DDP: every rank holds the whole state, DCP writes it once per node: the largest counts.
    sizes.set(1, 90 * MB, sharded=False)
    sizes.set(2, 96 * MB, sharded=False)
    assert sizes.estimate() == 96 * MB
    # FSDP: each rank holds its share and writes it: the shares add up.
    sizes.set(1, 48 * MB, sharded=True)
    sizes.set(2, 48 * MB, sharded=True)
    assert sizes.estimate() == 96 * MB and sizes.of(2) == (48 * MB, True)
    sizes.drop(2)  # a trainer that disconnects no longer counts
    sizes.drop(7)
    assert sizes.estimate() == 48 * MB and sizes.of(2) is None


def test_a_plan_before_any_save_counts_with_the_announced_size() -> None:
    planner = Planner()
    planner.observe_upload(150 * MB, 1.0)
    planner.announced.set(1, 96 * MB, sharded=False)
    plan = planner.plan(Notice.in_seconds("none", Kind.DRILL, 30.0, identity="first"))
    assert plan.bytes == 96 * MB and plan.size_from is SizeFrom.ANNOUNCED and plan.size_known
    assert plan.seconds_needed is not None and plan.seconds_needed > 0.6
    assert "92 MiB (announced)" in plan.describe() and plan.to_dict()["size_from"] == "announced"
    # A checkpoint of a smaller state saved earlier does not shrink it: the larger counts.
    planner.end()
    planner.observe_size(50 * MB)
    plan = planner.plan(Notice.in_seconds("none", Kind.DRILL, 30.0, identity="second"))
    assert plan.bytes == 96 * MB and plan.size_from is SizeFrom.BOTH
    planner.announced.drop(1)
    planner.end()
    plan = planner.plan(Notice.in_seconds("none", Kind.DRILL, 30.0, identity="third"))
    assert plan.bytes == 50 * MB and plan.size_from is SizeFrom.CHECKPOINT


def test_the_announced_size_alone_can_send_a_plan_to_a_peer() -> None:
    planner = Planner(peer_available=lambda: True)
    planner.observe_upload(1 * MB, 1.0)
    planner.announced.set(1, 100 * MB, sharded=True)
    planner.announced.set(2, 100 * MB, sharded=True)
    plan = planner.plan(Notice.in_seconds("none", Kind.DRILL, 100.0, identity="x"))
    assert plan.route is Route.PEER and plan.bytes == 200 * MB and plan.seconds_needed == 200.0


def test_a_plan_with_nothing_known_says_it_is_a_guess() -> None:
    planner = Planner()
    planner.observe_upload(150 * MB, 1.0)
    plan = planner.plan(Notice.in_seconds("none", Kind.DRILL, 30.0, identity="x"))
    assert plan.size_from is SizeFrom.UNKNOWN and not plan.size_known
    assert plan.route is Route.BUCKET and plan.seconds_needed is None and plan.bytes == 0
    assert "size unknown: no trainer announced its state and no checkpoint exists yet" in plan.why
    assert "0 MiB" not in plan.describe() and "size unknown" in plan.describe()
    assert choose_route(0, None, 30.0, peer_available=False, size_from=SizeFrom.UNKNOWN).seconds_needed is None


def test_a_revision_learns_the_size_announced_while_the_race_runs() -> None:
    planner = Planner(peer_available=lambda: False)
    planner.observe_upload(10 * MB, 1.0)
    notice = Notice.in_seconds("none", Kind.DRILL, 30.0, identity="x")
    assert planner.plan(notice).size_from is SizeFrom.UNKNOWN
    planner.announced.set(1, 500 * MB, sharded=False)
    revised = planner.revise(None)
    assert revised is not None and revised.route is Route.LOCAL and revised.size_from is SizeFrom.ANNOUNCED
    assert revised.bytes == 500 * MB and revised.revision == 1
    # The trainer goes (its urgent save under way): its number still stands for this notice.
    planner.announced.drop(1)
    revised = planner.revise(None)
    assert revised is not None and revised.bytes == 500 * MB and revised.size_from is SizeFrom.ANNOUNCED
    # The urgent checkpoint's own files, once more than that, are the size.
    writing = {"urgent": True, "rate_bytes_s": None, "bytes_total": 600 * MB, "bytes_done": 0}
    revised = planner.revise(writing)
    assert revised is not None and revised.bytes == 600 * MB and revised.size_from is SizeFrom.URGENT


def test_rate_probes_older_than_the_grace_are_swept_and_younger_ones_kept(tmp_path: Path) -> None:
    """A daemon killed between a probe's upload and its delete left .spotguard-rate-probe/<uuid>.bin
    (1 MiB) in the bucket for good; a young one may be another daemon's probe under way."""
    storage = FileStorage((tmp_path / "bucket").as_uri())
    two_hours_ago = (datetime.now(UTC) - timedelta(hours=2)).timestamp()
    for name in ("left.bin", "fresh.bin"):
        put_bytes(storage, f"{PROBE_PREFIX}/{name}", b"p" * 1024)
    killed_mid_write = storage.root / PROBE_PREFIX / f".cut.bin{TMP_MARK}0a1b2c3d"
    killed_mid_write.write_bytes(b"p")
    for path in (storage.root / PROBE_PREFIX / "left.bin", killed_mid_write):
        os.utime(path, (two_hours_ago, two_hours_ago))
    write_checkpoint(storage.root, 1, {"w.pt": b"1"})
    os.utime(storage.root / "step-000000001" / "w.pt", (two_hours_ago, two_hours_ago))

    assert sweep_rate_probes(storage, older_than=timedelta(hours=1)) == 2
    assert [obj.key for obj in storage.list(PROBE_PREFIX)] == [f"{PROBE_PREFIX}/fresh.bin"]
    assert not killed_mid_write.exists()
    assert (storage.root / "step-000000001" / "w.pt").exists()  # only the probe's prefix is swept
    assert sweep_rate_probes(storage, older_than=timedelta(hours=1)) == 0


def test_the_files_finished_during_the_race_count_each_once() -> None:
    """A file's message read twice (repeated, or read late) must not make the checkpoint look bigger
    than it is, and send the plan towards a peer or local for bytes that do not exist."""
    planner = Planner(peer_available=lambda: False)
    planner.observe_upload(10 * MB, 1.0)
    planner.plan(Notice.in_seconds("none", Kind.DRILL, 30.0, identity="x"))
    planner.observe_file("step-000000009", "model.bin", 150 * MB)
    planner.observe_file("step-000000009", "optim.bin", 50 * MB)
    planner.observe_file("step-000000009", "model.bin", 150 * MB)  # told again
    revised = planner.revise(None)
    assert revised is not None and revised.bytes == 200 * MB and revised.route is Route.BUCKET
