"""systemd readiness and watchdog notifications (``sd_notify``) without libsystemd.

The protocol is one datagram of newline-separated ``KEY=VALUE`` lines sent to the
``AF_UNIX``/``SOCK_DGRAM`` socket named by ``$NOTIFY_SOCKET`` (a path, or ``@name`` for
the abstract namespace). Outside systemd the variable is unset and every call is a
no-op, so the daemon calls these unconditionally.

Sending never raises: a notification that cannot be delivered is logged and the
daemon goes on. A missed ``WATCHDOG=1`` is systemd's business (it restarts us);
crashing the daemon over it would be worse.

Example::

    notifier = SystemdNotifier(os.environ)
    ...                                   # pending-notice check, socket bound, uploader started
    notifier.ready("watching aws, 0 trainers")
    pinger = asyncio.create_task(watchdog_loop(notifier, notifier.watchdog_interval()))
    ...
    notifier.stopping()
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Mapping

logger = logging.getLogger(__name__)

__all__ = ["SystemdNotifier", "watchdog_loop"]


class SystemdNotifier:
    """Talks to systemd's notification socket named in ``env["NOTIFY_SOCKET"]``.

    ``env`` is injected (pass ``os.environ`` in the daemon, a dict in tests); ``pid`` is
    this process's id, used to tell whether ``WATCHDOG_PID`` means us.
    """

    def __init__(self, env: Mapping[str, str], *, pid: int | None = None) -> None:
        self._env = env
        self._pid = os.getpid() if pid is None else pid
        self._address = _socket_address(env.get("NOTIFY_SOCKET", ""))
        self._sock: socket.socket | None = None
        self._failing = False

    @property
    def enabled(self) -> bool:
        """True when running under systemd with a notification socket."""
        return self._address is not None

    def ready(self, status: str | None = None) -> bool:
        """Tell systemd start-up is complete (``Type=notify``); optionally set STATUS too."""
        return self._with_status("READY=1", status)

    def status(self, text: str) -> bool:
        """Set the one-line status shown by ``systemctl status``."""
        return self.notify(_status_field(text))

    def watchdog(self) -> bool:
        """Ping the watchdog (``WatchdogSec=``)."""
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> bool:
        """Tell systemd we are shutting down (uploads may still be draining)."""
        return self._with_status("STOPPING=1", status)

    def _with_status(self, field: str, status: str | None) -> bool:
        return self.notify(field, *([] if status is None else [_status_field(status)]))

    def extend_timeout(self, usec: int) -> bool:
        """Ask for ``usec`` more microseconds before the current start/stop timeout fires.

        Used while draining an urgent upload on shutdown: it extends ``TimeoutStopSec``
        from now, so it can be sent repeatedly as long as progress is being made.
        """
        if usec <= 0:
            raise ValueError(f"extend_timeout needs a positive number of microseconds, got {usec}")
        return self.notify(f"EXTEND_TIMEOUT_USEC={int(usec)}")

    def watchdog_interval(self) -> float | None:
        """Seconds between watchdog pings: half of ``WATCHDOG_USEC``; None when the watchdog is off.

        Like ``sd_watchdog_enabled()``: ``WATCHDOG_PID``, when set, must be our pid
        (otherwise the watchdog belongs to another process, e.g. our parent).
        """
        raw_usec = self._env.get("WATCHDOG_USEC", "").strip()
        if not raw_usec:
            return None
        try:
            usec = int(raw_usec)
        except ValueError:
            logger.warning("ignoring WATCHDOG_USEC=%r: not an integer", raw_usec)
            return None
        if usec <= 0:
            return None
        raw_pid = self._env.get("WATCHDOG_PID", "").strip()
        if raw_pid:
            try:
                if int(raw_pid) != self._pid:
                    return None
            except ValueError:
                logger.warning("ignoring WATCHDOG_PID=%r: not an integer", raw_pid)
                return None
        return usec / 2 / 1_000_000

    def notify(self, *fields: str) -> bool:
        """Send raw ``KEY=VALUE`` fields in one datagram. True if sent, False if disabled or failed."""
        if self._address is None:
            return False
        payload = "\n".join(fields).encode("utf-8", errors="replace")
        try:
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                # Non-blocking: a full receive queue in systemd must never stall the event loop.
                sock.setblocking(False)
                self._sock = sock
            self._sock.sendto(payload, self._address)
        except OSError as exc:
            # Log the first failure loudly and repeats quietly: the watchdog would otherwise
            # log the same error every few seconds.
            level = logging.DEBUG if self._failing else logging.WARNING
            logger.log(level, "sd_notify to %s failed (%s): %s", _printable(self._address), fields[0], exc)
            self._failing = True
            self._close_socket()
            return False
        if self._failing:
            logger.info("sd_notify to %s works again", _printable(self._address))
            self._failing = False
        return True

    def close(self) -> None:
        self._close_socket()

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


async def watchdog_loop(notifier: SystemdNotifier, interval: float | None) -> None:
    """Ping the watchdog every ``interval`` seconds until cancelled; return at once if None.

    The pings come from the event loop on purpose: if the loop hangs (a blocking call,
    a deadlock), the pings stop and systemd restarts the daemon, which then resumes any
    unfinished upload. A thread would keep pinging for a dead loop.
    """
    if interval is None or not notifier.enabled:
        return
    if interval <= 0:
        raise ValueError(f"watchdog interval must be > 0, got {interval}")
    while True:
        notifier.watchdog()
        await asyncio.sleep(interval)


def _socket_address(value: str) -> str | bytes | None:
    value = value.strip()
    if not value:
        return None
    if value.startswith("@"):
        # Abstract namespace: leading NUL instead of '@', no terminator.
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    # systemd also knows vsock:CID:PORT (VMs); nothing here needs it.
    logger.warning("NOTIFY_SOCKET=%r is not a path or @abstract name; sd_notify disabled", value)
    return None


def _status_field(text: str) -> str:
    # A newline would start a new KEY=VALUE field; keep the status on one line.
    return "STATUS=" + " ".join(text.splitlines())


def _printable(address: str | bytes) -> str:
    if isinstance(address, bytes):
        return "@" + address[1:].decode(errors="replace")
    return address
