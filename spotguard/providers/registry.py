"""Where the clouds are known: name -> :class:`~spotguard.providers.base.Provider`.

The built-in providers (``aws``, ``gcp``, ``azure``) are imported the first time one is asked for:
their modules need aiohttp, and the config (which the trainer side imports) reads only their names.
Another cloud is one module that defines a ``Provider`` and one :func:`register` call.

>>> register(my_cloud.PROVIDER)
>>> detect_provider()                     # "my-cloud" on one of its VMs
>>> build_monitors("auto", MonitorSettings(), session)
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from spotguard.providers.base import Monitor, MonitorSettings, ProbeResult, Provider
from spotguard.providers.detect import DMI_ROOT, dmi_evidence, dmi_reader

if TYPE_CHECKING:
    import aiohttp

logger = logging.getLogger(__name__)

#: In the order detection tries them (the AWS markers are the most specific).
BUILTIN = ("aws", "gcp", "azure")
AUTO, NONE = "auto", "none"

_providers: dict[str, Provider] = {}


def register(provider: Provider) -> None:
    """Make ``provider`` known (replacing one of the same name); tried by detection after the built-ins."""
    if provider.name in (AUTO, NONE):
        raise ValueError(f"{provider.name!r} is reserved")
    _providers[provider.name] = provider


def unregister(name: str) -> None:
    _providers.pop(name, None)


def names() -> tuple[str, ...]:
    """Every known provider, built-ins first."""
    return (*BUILTIN, *(name for name in _providers if name not in BUILTIN))


def choices() -> tuple[str, ...]:
    """What the ``provider`` setting accepts: ``auto``, every known provider, ``none``."""
    return (AUTO, *names(), NONE)


def get(name: str) -> Provider:
    """The provider called ``name``; LookupError if there is none."""
    if name not in _providers and name in BUILTIN:
        _providers[name] = importlib.import_module(f"spotguard.providers.{name}").PROVIDER
    try:
        return _providers[name]
    except KeyError:
        raise LookupError(f"no provider {name!r} (known: {', '.join(names())})") from None


def detect_provider(dmi_root: Path = DMI_ROOT) -> str:
    """The first provider whose DMI markers this machine has, or ``"none"``; never touches the network."""
    read = dmi_reader(dmi_root)
    for name in names():
        if get(name).detect(read):
            return name
    logger.debug("no cloud recognised in DMI: %s", dmi_evidence(dmi_root))
    return NONE


def resolve(provider: str, dmi_root: Path = DMI_ROOT) -> str:
    """``provider`` itself, or for ``auto`` the detected one."""
    if provider != AUTO:
        return provider
    detected = detect_provider(dmi_root)
    logger.info("provider auto-detected: %s", detected)
    return detected


def build_monitors(
    provider: str, settings: MonitorSettings, session: aiohttp.ClientSession, *, dmi_root: Path = DMI_ROOT
) -> list[Monitor]:
    """The monitors of ``provider`` (``auto``: detected from DMI); ``[]`` for ``none``.

    ``settings.metadata_url`` replaces the provider's metadata base URL (emulators). The session is
    the caller's; the monitors never close it.
    """
    name = resolve(provider, dmi_root)
    return [] if name == NONE else get(name).monitors(session, settings)


async def run_probe(provider: str, settings: MonitorSettings) -> ProbeResult:
    """``provider``'s metadata probe (``spotguard doctor``), in a session of its own."""
    import aiohttp

    # trust_env stays off: the metadata service is link-local, an http_proxy must not take it elsewhere.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=settings.http_timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return await get(provider).probe(session, settings)
