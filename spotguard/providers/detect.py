"""Reading DMI (``/sys/class/dmi/id``): what providers recognise their VMs by.

No network request, so no waiting for a metadata service that is not there. Each provider's
``detect`` asks for the fields it needs through a :data:`~spotguard.providers.base.DmiReader`.
"""

from __future__ import annotations

from pathlib import Path

from spotguard.providers.base import DmiReader

DMI_ROOT = Path("/sys/class/dmi/id")
#: The fields ``spotguard doctor`` shows as evidence of what was (or was not) recognised.
DMI_FIELDS = ("sys_vendor", "board_vendor", "product_name", "product_version", "bios_vendor", "bios_version")


def read_dmi_field(dmi_root: Path, name: str) -> str:
    """One DMI field, stripped; ``""`` when it cannot be read."""
    try:
        return (dmi_root / name).read_text(errors="replace").strip()
    except OSError:
        # Missing (not a VM, a container without /sys) or root-only: no marker, not an error.
        return ""


def dmi_reader(dmi_root: Path = DMI_ROOT) -> DmiReader:
    """A reader of ``dmi_root``'s fields that reads each at most once."""
    cache: dict[str, str] = {}

    def read(name: str) -> str:
        if name not in cache:
            cache[name] = read_dmi_field(dmi_root, name)
        return cache[name]

    return read


def dmi_evidence(dmi_root: Path = DMI_ROOT) -> dict[str, str]:
    """The non-empty :data:`DMI_FIELDS` of ``dmi_root``."""
    return {name: value for name in DMI_FIELDS if (value := read_dmi_field(dmi_root, name))}
