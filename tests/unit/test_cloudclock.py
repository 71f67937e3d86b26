"""The cloud's time as the daemon knows it (spotguard/cloudclock.py): what a measured lead of this VM's
clock does to the age of objects in the bucket and to the deadlines the cloud gives."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client import CollectorRegistry

from spotguard import cloudclock
from spotguard.cloudclock import CLOCK_OFF, DATE_RESOLUTION, cloud_now, cloud_time, note_ahead, on_this_clock
from spotguard.daemon.metrics import DaemonMetrics
from spotguard.notice import utcnow

DEADLINE = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def test_without_a_measurement_this_vms_clock_is_the_clouds() -> None:
    assert on_this_clock(DEADLINE) == DEADLINE
    assert abs((cloud_now() - utcnow()).total_seconds()) < 0.5


def test_a_clock_ahead_ages_objects_on_the_clouds_time_and_moves_its_deadlines_later() -> None:
    note_ahead(7200.0)
    assert (utcnow() - cloud_now()).total_seconds() == pytest.approx(7200.0, abs=0.5)
    # A second less than the lead: a Date header's whole seconds may overstate it, and a deadline
    # must not come later on this clock than on the cloud's.
    assert on_this_clock(DEADLINE) == DEADLINE + timedelta(seconds=7200.0 - DATE_RESOLUTION)


def test_a_clock_behind_keeps_objects_longer_and_moves_its_deadlines_earlier() -> None:
    note_ahead(-600.0)
    assert abs((cloud_now() - utcnow()).total_seconds()) < 0.5  # never later than this VM's clock
    assert (cloud_time() - utcnow()).total_seconds() == pytest.approx(600.0, abs=0.5)  # the registry's, either way
    assert on_this_clock(DEADLINE) == DEADLINE - timedelta(seconds=600.0 + DATE_RESOLUTION)


def test_a_lead_moves_a_deadline_no_later_than_the_longest_notice_allows() -> None:
    """A Date header two hours in the past (a proxy's, a broken host's) reads as a clock two hours
    ahead: the correction stops where the event's kind says the deadline can be at the latest."""
    note_ahead(7200.0)
    latest = DEADLINE + timedelta(seconds=30)
    assert on_this_clock(DEADLINE, no_later_than=latest) == latest
    # A true lead of 20 s more than the warning bound stays well inside it and is applied in full.
    note_ahead(CLOCK_OFF + 20.0)
    moved = DEADLINE + timedelta(seconds=CLOCK_OFF + 20.0 - DATE_RESOLUTION)
    assert on_this_clock(DEADLINE, no_later_than=DEADLINE + timedelta(minutes=15)) == moved
    # The bound cannot pull a deadline before the cloud's own, nor limit a correction earlier.
    note_ahead(7200.0)
    assert on_this_clock(DEADLINE, no_later_than=DEADLINE - timedelta(seconds=60)) == DEADLINE
    note_ahead(-600.0)
    assert on_this_clock(DEADLINE, no_later_than=DEADLINE) == DEADLINE - timedelta(seconds=600.0 + DATE_RESOLUTION)


def test_clocks_within_the_warning_bound_agree_on_deadlines() -> None:
    note_ahead(CLOCK_OFF)
    assert on_this_clock(DEADLINE) == DEADLINE
    note_ahead(-CLOCK_OFF)
    assert on_this_clock(DEADLINE) == DEADLINE


def test_a_measurement_nobody_renewed_stops_counting(monkeypatch: pytest.MonkeyPatch) -> None:
    note_ahead(7200.0)
    monkeypatch.setattr(cloudclock, "MEASUREMENT_LASTS", 0.0)  # an hour without a metadata answer
    assert on_this_clock(DEADLINE) == DEADLINE
    assert abs((cloud_now() - utcnow()).total_seconds()) < 0.5


def test_the_measured_lead_is_a_metric_absent_without_a_measurement() -> None:
    registry = CollectorRegistry()
    DaemonMetrics(registry)
    assert registry.get_sample_value("spotguard_clock_ahead_seconds") is None
    note_ahead(-42.0)
    assert registry.get_sample_value("spotguard_clock_ahead_seconds") == -42.0
