"""Which cloud is this, and which monitors watch it.

Detection reads only DMI (``/sys/class/dmi/id``): no network request, so no waiting for a metadata
service that is not there. The markers:

* AWS: ``sys_vendor`` ``Amazon EC2`` (Nitro), or ``amazon`` in ``bios_version``/``bios_vendor``
  (older Xen instances, whose ``sys_vendor`` is ``Xen``).
* GCP: ``Google`` in ``sys_vendor``/``bios_vendor``/``product_name`` (``Google Compute Engine``).
* Azure: ``sys_vendor`` ``Microsoft Corporation`` *and* the Azure chassis asset tag
  ``7783-7084-3265-9085-8269-3286-77`` (Hyper-V on a desk has the first, not the second).
"""

from __future__ import annotations

import logging
from pathlib import Path

import aiohttp

from spotguard.config import DaemonConfig
from spotguard.monitors import aws, azure, gcp
from spotguard.monitors.base import Monitor

logger = logging.getLogger(__name__)

GCP_LONG_POLL_S = 10.0
DMI_ROOT = Path("/sys/class/dmi/id")
AZURE_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"
DMI_FIELDS = ("sys_vendor", "board_vendor", "product_name", "product_version", "bios_vendor", "bios_version")


def _read(dmi_root: Path, name: str) -> str:
    try:
        return (dmi_root / name).read_text(errors="replace").strip()
    except OSError:
        # Missing (not a VM, a container without /sys) or root-only: no marker, not an error.
        return ""


def detect_provider(dmi_root: Path = DMI_ROOT) -> str:
    """``"aws"``, ``"gcp"``, ``"azure"`` or ``"none"`` from DMI; never touches the network."""
    values = {name: _read(dmi_root, name) for name in DMI_FIELDS}
    lowered = {name: value.lower() for name, value in values.items()}
    if lowered["sys_vendor"] == "amazon ec2" or lowered["board_vendor"] == "amazon ec2":
        return "aws"
    if any("amazon" in lowered[name] for name in ("bios_version", "bios_vendor", "product_version")):
        return "aws"
    if any("google" in lowered[name] for name in ("sys_vendor", "board_vendor", "bios_vendor", "product_name")):
        return "gcp"
    microsoft = "microsoft corporation" in (lowered["sys_vendor"], lowered["board_vendor"])
    if microsoft and _read(dmi_root, "chassis_asset_tag") == AZURE_ASSET_TAG:
        return "azure"
    logger.debug("no cloud recognised in DMI: %s", values)
    return "none"


def build_monitors(config: DaemonConfig, session: aiohttp.ClientSession, *, dmi_root: Path = DMI_ROOT) -> list[Monitor]:
    """The monitors for ``config.provider`` (``auto`` = :func:`detect_provider`); ``[]`` for ``none``.

    ``config.metadata_url`` replaces the provider's metadata base URL (emulators). The session is
    the daemon's; the monitors never close it.
    """
    provider = detect_provider(dmi_root) if config.provider == "auto" else config.provider
    if config.provider == "auto":
        logger.info("provider auto-detected: %s", provider)
    interval, timeout = config.poll_interval, config.http_timeout
    if provider == "aws":
        base = config.metadata_url or aws.DEFAULT_BASE_URL
        return [
            aws.AwsMonitor(
                session,
                base,
                interval,
                timeout,
                imds_v1_fallback=config.imds_v1_fallback,
                lifecycle_hook=config.asg_lifecycle_hook,
                asg_name=config.asg_name,
            )
        ]
    if provider == "gcp":
        base = config.metadata_url or gcp.DEFAULT_BASE_URL
        # A short long-poll: a metadata server that accepts and then hangs must show up well within
        # GCP's 30 s notice, not after a 60 s wait; six requests a minute cost nothing.
        return [gcp.GcpMonitor(session, base, interval, timeout, long_poll_timeout=GCP_LONG_POLL_S)]
    if provider == "azure":
        base = config.metadata_url or azure.DEFAULT_BASE_URL
        return [azure.AzureMonitor(session, base, interval, timeout, vm_name=config.vm_name)]
    return []
