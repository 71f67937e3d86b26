"""A new cloud is one provider module: this test module defines and registers one, touching nothing else.

The fake cloud has everything a real one has: DMI detection (a fake ``/sys/class/dmi/id``), a metadata
service with its emulator (an :class:`~spotguard.emulate.common.Emulator` on 127.0.0.1, random port),
a monitor whose hard notice carries its acknowledgement, and the probe ``doctor`` runs. A real
in-process :class:`~spotguard.daemon.app.Daemon` detects it, watches it, tells a real ``Guard``, and
sends the notice's acknowledgement only once the checkpoint is committed in the bucket.
"""

from __future__ import annotations

import io
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from spotguard import Guard
from spotguard.config import DaemonConfig
from spotguard.control import request
from spotguard.daemon.app import Daemon
from spotguard.doctor import run_doctor
from spotguard.emulate.common import Emulator, RunningEmulator
from spotguard.emulate.registry import start_emulator
from spotguard.harness import wait_for
from spotguard.notice import Acknowledgement, Kind, Notice, event_id_for, utcnow
from spotguard.providers import registry
from spotguard.providers.base import (
    DmiReader,
    Monitor,
    MonitorError,
    MonitorSettings,
    PolledMonitor,
    ProbeResult,
    ProbeStatus,
    Provider,
)
from spotguard.storage.checkpoints import list_remote
from spotguard.storage.file import FileStorage
from tests.daemonthread import DaemonThread

WAIT = 15.0
NOTICE_PATH = "/fake-metadata/v1/interruption"
ACK_PATH = "/fake-metadata/v1/interruption/ack"

# --- the fake cloud: everything a provider module holds ----------------------------------------------


class FakeCloudEmulator(Emulator):
    """The metadata service: ``GET`` the pending interruption (404 when none), ``POST`` its ack."""

    provider = "fake"

    def __init__(self, notice_after: float | None = None, action: str | None = None) -> None:
        super().__init__(notice_after, action)
        self.interruption: dict[str, Any] | None = None
        self.acks: list[dict[str, Any]] = []

    def trigger(self, spec: dict[str, Any]) -> dict[str, Any]:
        self.interruption = {"id": str(spec.get("id", "interruption-1")), "in": float(spec.get("in", 60))}
        return dict(self.interruption)

    def clear(self) -> None:
        self.interruption = None

    def state(self) -> dict[str, Any]:
        return {"interruption": self.interruption, "acks": self.acks}

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(NOTICE_PATH, self._get)
        app.router.add_post(ACK_PATH, self._ack)

    async def _get(self, _request: web.Request) -> web.Response:
        if self.interruption is None:
            return web.Response(status=404)
        return web.json_response(self.interruption)

    async def _ack(self, request: web.Request) -> web.Response:
        self.acks.append(await request.json())
        return web.Response(status=204)


class FakeCloudMonitor(PolledMonitor):
    name = "fake"

    def __init__(self, session: aiohttp.ClientSession, base_url: str, interval: float, timeout: float) -> None:
        super().__init__(session, base_url, interval, timeout)
        self._first_seen: dict[str, Any] = {}

    async def check_all(self) -> list[Notice]:
        status, body = await self._send("GET", NOTICE_PATH)
        if status == 404:
            return []
        if status != 200 or not isinstance(body, dict):
            raise MonitorError(f"fake: reading {NOTICE_PATH}: HTTP {status}")
        interruption_id = str(body["id"])
        first_seen = self._first_seen.setdefault(interruption_id, utcnow())
        return [
            Notice(
                provider="fake",
                kind=Kind.TERMINATE,
                deadline=first_seen + timedelta(seconds=float(body["in"])),
                event_id=event_id_for("fake", Kind.TERMINATE, interruption_id),
                raw={"interruption": body},
                acknowledgement=Acknowledgement(f"fake: ack {interruption_id}", lambda: self.ack(interruption_id)),
            )
        ]

    async def ack(self, interruption_id: str) -> None:
        status, _body = await self._send("POST", ACK_PATH, {"id": interruption_id})
        if status != 204:
            raise MonitorError(f"fake: acknowledging {interruption_id}: HTTP {status}")

    async def _send(self, method: str, path: str, payload: Any = None) -> tuple[int, Any]:
        try:
            async with self._session.request(
                method, self._base + path, json=payload, timeout=aiohttp.ClientTimeout(total=self._timeout_s)
            ) as response:
                return response.status, (await response.json() if response.status == 200 else None)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise MonitorError(f"fake: {method} {path}") from exc


def detect(read: DmiReader) -> bool:
    return read("sys_vendor") == "Fake Cloud Inc."


def monitors(session: aiohttp.ClientSession, settings: MonitorSettings) -> list[Monitor]:
    url = settings.base_url("http://169.254.0.99")
    return [FakeCloudMonitor(session, url, settings.poll_interval, settings.http_timeout)]


async def probe(session: aiohttp.ClientSession, settings: MonitorSettings) -> ProbeResult:
    monitor = FakeCloudMonitor(session, settings.base_url("http://169.254.0.99"), 1.0, settings.http_timeout)
    try:
        pending = await monitor.check_all()
    except MonitorError as exc:
        return ProbeResult(ProbeStatus.FAIL, str(exc), "check --metadata-url")
    return ProbeResult(ProbeStatus.WARN if pending else ProbeStatus.OK, "fake metadata answers")


FAKE = Provider(
    name="fake",
    default_metadata_url="http://169.254.0.99",
    notice_window=45.0,
    detect=detect,
    monitors=monitors,
    probe=probe,
    emulator=FakeCloudEmulator,
)


# --- the test ------------------------------------------------------------------------------------------


@pytest.fixture
def fake_cloud(tmp_path: Path) -> Iterator[tuple[Path, RunningEmulator]]:
    """The provider registered, a VM of it (DMI) and its metadata service; unregistered afterwards."""
    registry.register(FAKE)
    dmi = tmp_path / "dmi"
    dmi.mkdir()
    (dmi / "sys_vendor").write_text("Fake Cloud Inc.\n")
    emu = start_emulator("fake")  # through the provider registry: the emulator is the provider's
    try:
        yield dmi, emu
    finally:
        emu.stop()
        registry.unregister("fake")


class FakeCloudDaemon(DaemonThread):
    """The daemon, with monitors built by the registry from ``provider = auto``."""

    def __init__(self, config: DaemonConfig, dmi: Path, storage: FileStorage) -> None:
        super().__init__(config, wait=WAIT)
        self.dmi, self.storage = dmi, storage

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Daemon]:
        async with aiohttp.ClientSession() as session:
            provider = registry.resolve(self.config.provider, self.dmi)
            built = registry.build_monitors(provider, self.config.monitor_settings(), session)
            yield Daemon(self.config, provider=provider, monitors=built, storage=self.storage)


def test_a_provider_registered_from_one_module_is_detected_watched_and_acknowledged_after_the_commit(
    tmp_path: Path, fake_cloud: tuple[Path, RunningEmulator]
) -> None:
    dmi, emu = fake_cloud
    assert registry.detect_provider(dmi) == "fake"
    # Uploads fail until the bucket directory can be made: a file stands where its parent should be.
    blocker = tmp_path / "blocked"
    blocker.write_text("not a directory")
    bucket = (blocker / "bucket").as_uri()
    config = DaemonConfig(
        provider="auto",
        metadata_url=emu.url,
        poll_interval=0.2,
        socket=tmp_path / "daemon.sock",
        checkpoint_dir=tmp_path / "nvme",
        state_dir=tmp_path / "state",
        bucket=bucket,
    )
    guard = None
    with FakeCloudDaemon(config, dmi, FileStorage(bucket)):
        status = request(config.socket, "status")
        assert status["provider"] == "fake" and status["monitors"] == ["fake"]
        guard = Guard(checkpoint_dir=config.checkpoint_dir, socket=config.socket, handle_sigterm=False)
        try:
            wait_for(guard.client.welcomed.is_set, WAIT, "the trainer to be welcomed")
            emu.trigger(id="interruption-7", **{"in": 60})
            wait_for(lambda: guard is not None and guard.should_checkpoint(1), WAIT, "the trainer to be told")
            assert guard.stop_requested  # a hard notice: checkpoint, then stop
            path = guard.save({"progress": {"step": 1}}, 1)
            wait_for(lambda: request(config.socket, "status")["uploads"]["failures"], WAIT, "a failed upload")
            assert emu.state()["acks"] == []  # committed locally only: the cloud must not be told yet

            blocker.unlink()

            def acknowledged() -> bool:
                acks: list[dict[str, Any]] = emu.state()["acks"]
                if acks:
                    committed = [i.name for i in list_remote(FileStorage(bucket)) if i.status == "complete"]
                    assert committed == [path.name], "acknowledged before the bucket had the checkpoint"
                return bool(acks)

            wait_for(acknowledged, WAIT, "the notice's acknowledgement")
            assert emu.state()["acks"] == [{"id": "interruption-7"}]
        finally:
            guard.close()


def test_doctor_runs_a_registered_providers_probe(tmp_path: Path, fake_cloud: tuple[Path, RunningEmulator]) -> None:
    dmi, emu = fake_cloud
    config = DaemonConfig(metadata_url=emu.url, socket=tmp_path / "s.sock", checkpoint_dir=tmp_path)
    out = io.StringIO()
    run_doctor(replace(config, provider="auto"), out=out, dmi_root=dmi, write_probe_bytes=1 << 20)
    lines = out.getvalue().splitlines()
    assert any(line.startswith("ok    provider: fake, auto-detected from DMI") for line in lines), lines
    assert any(line.startswith("ok    metadata: fake metadata answers") for line in lines), lines
