"""Deadlines: whether the checkpoint uploading now will be in the bucket before a notice's deadline,
and what a commit left of it. A deadline here is on ``time.monotonic()``'s clock, as the notice
counts it (:attr:`spotguard.notice.Notice.monotonic_deadline`) and the store's calls do."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from spotguard.manifest import Manifest
from spotguard.notice import utcnow
from spotguard.storage.checkpoints import UploadProgress

logger = logging.getLogger("spotguard.uploader")


def forecast_report(
    name: str, urgent: bool, progress: UploadProgress, *, total_known: bool, deadline: float | None
) -> dict[str, Any]:
    """How much of ``name`` is in the bucket, at what rate, and (if ``urgent`` and a ``deadline``
    is pending) whether it will be in before the deadline."""
    rate, eta, total = progress.rate(), progress.eta(), progress.total
    report: dict[str, Any] = {
        "name": name,
        "urgent": urgent,
        "bytes_done": progress.done,
        "bytes_total": total,
        # Before the commit the trainer may still be writing files nobody has announced yet.
        "total_known": total_known,
        "rate_bytes_s": None if rate is None else round(rate),
        "eta_s": None if eta is None else round(eta, 2),
    }
    if deadline is not None and urgent:
        left = deadline - time.monotonic()
        report["deadline_s_left"] = round(left, 2)
        report["will_meet_deadline"] = None if eta is None else eta <= left
    return report


async def watch_deadline(forecast: Callable[[], dict[str, Any] | None], interval: Callable[[], float]) -> None:
    """Log, every ``interval()`` while an urgent upload races a deadline, whether it will make it
    at the rate so far; say once per checkpoint when the deadline passed with it unfinished."""
    late_logged: set[str] = set()  # while this race lasts: a daemon outlives many notices
    while True:
        await asyncio.sleep(interval())
        report = forecast()
        if report is None or "deadline_s_left" not in report:
            late_logged.clear()
            continue
        name, left = report["name"], report["deadline_s_left"]
        where = f"{name}: {_mib(report['bytes_done'])} of {_mib(report['bytes_total'])} MiB in the bucket"
        rate = report["rate_bytes_s"]
        if left <= 0:
            if name not in late_logged:
                late_logged.add(name)
                logger.error("deadline passed %.1f s ago with %s still uploading (%s)", -left, name, where)
            continue
        if rate is None:
            logger.info("%s; no rate yet, deadline in %.1f s", where, left)
        elif report["will_meet_deadline"]:
            logger.info(
                "%s at %.0f MB/s; done in ~%.1f s, deadline in %.1f s: on track",
                where,
                rate / 1e6,
                report["eta_s"],
                left,
            )
        else:
            logger.warning(
                "%s at %.0f MB/s; done in ~%.1f s, deadline in %.1f s: will MISS it by ~%.1f s",
                where,
                rate / 1e6,
                report["eta_s"],
                left,
                report["eta_s"] - left,
            )


def commit_report(
    name: str, manifest: Manifest, elapsed: float, *, deadline: float | None, bucket: str
) -> dict[str, Any]:
    """Log the commit of ``name`` in ``bucket``, ``elapsed`` seconds from its first byte sent, with
    its margin to ``deadline``; returns the record of it."""
    now = utcnow()
    margin = deadline - time.monotonic() if deadline is not None else None
    if margin is not None and margin < 0:
        logger.error("%s committed in the bucket %.1f s AFTER the deadline", name, -margin)
    else:
        logger.info(
            "%s committed in %s in %.2f s (%.1f MB/s)%s",
            name,
            bucket,
            elapsed,
            manifest.total_bytes / max(elapsed, 1e-9) / 1e6,
            "" if margin is None else f", {margin:.1f} s before the deadline",
        )
    return {
        "name": name,
        "step": manifest.step,
        "bytes": manifest.total_bytes,
        "seconds": round(elapsed, 3),
        "at": now.isoformat(),
        "deadline_margin_s": None if margin is None else round(margin, 3),
    }


def _mib(count: int) -> str:
    return f"{count / (1 << 20):.0f}"
