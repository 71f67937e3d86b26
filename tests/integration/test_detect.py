"""Provider detection from DMI (fake /sys trees) and monitor wiring, ending on a real emulator."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from spotguard.config import DaemonConfig
from spotguard.notice import Kind
from spotguard.providers.aws import AwsMonitor
from spotguard.providers.azure import AZURE_ASSET_TAG, AzureMonitor
from spotguard.providers.base import MonitorSettings
from spotguard.providers.gcp import GcpMonitor
from spotguard.providers.registry import build_monitors, detect_provider
from tests.emulators import emulator, http_session, run

DMI = {
    "aws-nitro": {"sys_vendor": "Amazon EC2\n", "board_vendor": "Amazon EC2\n", "product_name": "g5.xlarge\n"},
    "aws-xen": {"sys_vendor": "Xen\n", "bios_vendor": "Xen\n", "bios_version": "4.11.amazon\n"},
    "gcp": {"sys_vendor": "Google\n", "product_name": "Google Compute Engine\n", "bios_vendor": "Google\n"},
    "azure": {
        "sys_vendor": "Microsoft Corporation\n",
        "product_name": "Virtual Machine\n",
        "chassis_asset_tag": AZURE_ASSET_TAG + "\n",
    },
    "hyperv-desk": {"sys_vendor": "Microsoft Corporation\n", "product_name": "Virtual Machine\n"},
    "laptop": {"sys_vendor": "LENOVO\n", "product_name": "21CB\n", "bios_vendor": "LENOVO\n"},
}


def plain(config: DaemonConfig) -> tuple[str, MonitorSettings]:
    """What the composition root hands the registry: the provider setting and the plain settings."""
    return config.provider, config.monitor_settings()


def fake_dmi(root: Path, name: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for field, value in DMI[name].items():
        (root / field).write_text(value)
    return root


@pytest.mark.parametrize(
    ("machine", "provider"),
    [
        ("aws-nitro", "aws"),
        ("aws-xen", "aws"),
        ("gcp", "gcp"),
        ("azure", "azure"),
        ("hyperv-desk", "none"),
        ("laptop", "none"),
    ],
)
def test_detect_provider_from_dmi(tmp_path: Path, machine: str, provider: str) -> None:
    assert detect_provider(fake_dmi(tmp_path / "id", machine)) == provider


def test_detect_provider_without_dmi_is_none_and_quick(tmp_path: Path) -> None:
    started = time.monotonic()
    assert detect_provider(tmp_path / "missing") == "none"
    assert time.monotonic() - started < 0.5


def test_build_monitors_uses_config(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with http_session() as session:
            config = DaemonConfig(
                provider="aws", metadata_url="http://127.0.0.1:9", poll_interval=0.5, http_timeout=0.25
            )
            (monitor,) = build_monitors(*plain(config), session)
            assert isinstance(monitor, AwsMonitor) and monitor.interval == 0.5
            auto = build_monitors(
                *plain(DaemonConfig(provider="auto")), session, dmi_root=fake_dmi(tmp_path / "g", "gcp")
            )
            assert [type(m) for m in auto] == [GcpMonitor]
            azure = build_monitors(*plain(DaemonConfig(provider="azure", vm_name="train-0")), session)
            assert [type(m) for m in azure] == [AzureMonitor]
            assert build_monitors(*plain(DaemonConfig(provider="none")), session) == []
            nothing = build_monitors(*plain(DaemonConfig(provider="auto")), session, dmi_root=tmp_path / "missing")
            assert nothing == []

    run(scenario())


@pytest.mark.parametrize(
    ("provider", "trigger", "kind"),
    [
        ("aws", {"kind": "spot", "action": "stop"}, Kind.STOP),
        ("gcp", {"preempted": True}, Kind.TERMINATE),
        ("azure", {"type": "Preempt"}, Kind.TERMINATE),
    ],
)
def test_built_monitor_reads_its_emulator(provider: str, trigger: dict[str, object], kind: Kind) -> None:
    async def scenario() -> None:
        with emulator(provider) as emu:
            emu.trigger(**trigger)
            async with http_session() as session:
                config = DaemonConfig(provider=provider, metadata_url=emu.url, http_timeout=1.0)
                (monitor,) = build_monitors(*plain(config), session)
                notice = await monitor.check()
                await monitor.close()
                assert notice is not None and notice.kind is kind and notice.provider == provider

    run(scenario())


def test_emulator_notice_after_fires_by_itself() -> None:
    async def scenario() -> None:
        with emulator("aws", notice_after=0.05, action="hibernate") as emu:
            async with http_session() as session:
                (monitor,) = build_monitors(*plain(DaemonConfig(provider="aws", metadata_url=emu.url)), session)
                deadline = time.monotonic() + 5
                notice = None
                while notice is None and time.monotonic() < deadline:
                    notice = await monitor.check()
                assert notice is not None and notice.kind is Kind.HIBERNATE

    run(scenario())
