"""Configuration: TOML file, ``SPOTGUARD_*`` environment and CLI flags, parsed once, here.

Precedence: explicit flag > environment > file > default. The result is a
frozen, validated :class:`DaemonConfig`; any bad value raises
:class:`ConfigError` naming the key and what to fix. Stdlib only.
"""

from __future__ import annotations

import contextlib
import ipaddress
import math
import os
import string
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from spotguard import protocol
from spotguard.errors import ConfigError
from spotguard.jsontext import parse_json
from spotguard.notice import Action
from spotguard.peer.channel import IO_TIMEOUT
from spotguard.peer.flows import MAX_FLOWS
from spotguard.peer.networks import DEFAULT_PEER_NETWORKS, LOOPBACK_NETWORKS, PeerNetworks, parse_networks
from spotguard.peer.wire import parse_address
from spotguard.providers import registry as providers
from spotguard.providers.base import MonitorSettings
from spotguard.storage.base import CHECKSUM_MODES
from spotguard.storage.schemes import SCHEMES, check_bucket_url, scheme_of
from spotguard.trainer.settings import DEFAULT_SOCKET, TrainerSettings

DEFAULT_CONFIG_FILE = Path("/etc/spotguard/spotguard.toml")
DEFAULT_CHECKPOINT_DIR = Path("/var/lib/spotguard/checkpoints")
DEFAULT_STATE_DIR = Path("/var/lib/spotguard/state")
#: ``peers = "bucket"``: find the job's other daemons under the bucket's ``.spotguard-peers/``.
PEERS_FROM_BUCKET = "bucket"
#: What a ``webhook_template`` may name (``${name}``); see spotguard/daemon/webhook.py.
WEBHOOK_FIELDS = (
    "type", "event_id", "provider", "kind", "action", "deadline", "seconds_left", "host", "message",
    "outcome", "checkpoint", "step", "bytes", "seconds", "upload_seconds", "margin_s", "error", "pid",
    "reason", "bytes_needed", "bytes_free", "path", "route", "plan_bytes", "rate_bytes_s", "seconds_needed",
)  # fmt: skip


# Settings that are a number of seconds and must be positive.
_POSITIVE_SECONDS = (
    "poll_interval", "http_timeout", "drill_deadline", "scan_interval", "bucket_scan_interval", "shutdown_grace",
    "forecast_interval", "incomplete_grace", "stall_min_seconds", "upload_retry_max", "stale_upload_age",
)  # fmt: skip
# The most any of those (and notice_grace, peer_io_timeout) may be: a century, which is how "never" is
# written (stale_upload_age of 20 years: never abort another node's upload). Past it the times computed
# from a setting overflow: notice_grace = 1e308 once stopped the daemon at start (OverflowError), and
# threading's waits end at about 292 years. Some are bounded closer by what they mean (below).
_MAX_SECONDS = 100 * 365 * 86400.0
_MAX_SECONDS_OF = {
    # GCP's and Azure's notices give 30 s: a monitor that looks less often can miss one whole.
    "poll_interval": (30.0, "a GCP or Azure notice gives 30 s; a monitor that looks less often can miss one"),
    # A metadata request that answers later than this is no answer within a notice's window.
    "http_timeout": (30.0, "a metadata request is an answer within a notice's window, not later"),
    "drill_deadline": (protocol.MAX_DRILL_SECONDS, "the longest deadline a drill may give"),
    # TCP_USER_TIMEOUT takes milliseconds in a C int; an hour of silence is a peer gone.
    "peer_io_timeout": (3600.0, "a peer silent this long is gone"),
}
# Loops that wait this long between rounds: below 10 ms one is a busy loop (a monitor asking the
# metadata service, the uploader listing the root or the bucket, a failed upload retried) for no gain.
_MIN_SECONDS_OF = ("poll_interval", "scan_interval", "bucket_scan_interval", "forecast_interval", "upload_retry_max")
_MIN_LOOP_SECONDS = 0.01
_MAX_SOCKET_PATH = 107  # bytes of a Unix socket's path (Linux: sun_path is 108, NUL included)
# Each count's range, and why its ceiling: generous for any real VM, and short of what would take the
# process down (threads, descriptors, memory) or overflow what is computed from it.
_COUNT_RANGES: dict[str, tuple[int, int, str]] = {
    "keep_local": (1, 10_000, "checkpoints kept on the local disk"),
    "keep_remote": (1, 1_000_000, "checkpoints kept in the bucket"),
    "max_connections": (1, 65_536, "each connection is a descriptor; no VM has trainers past this"),
    "upload_concurrency": (1, 1024, "each stream is a thread and a connection"),
    "upload_alert_after": (1, 1_000_000, "failures in a row before an alert"),
    "max_message_bytes": (1024, 64 << 20, "a socket message is read whole into memory"),
    "peer_max_replica_bytes": (1, 1 << 50, "1 PiB"),
    # At most 64: a fetch's list of them (id, name, bucket URL, size) must fit one 64 KiB frame.
    "peer_max_replicas": (1, 64, "replicas held at once, each with its connections and files"),
    "peer_max_flows": (1, 256, "connections one handoff opens"),
}


def _own_uid_and_root() -> tuple[int, ...]:
    uid = os.getuid()
    return (uid,) if uid == 0 else (uid, 0)


@dataclass(frozen=True)
class DaemonConfig:
    """Everything ``spotguard run`` needs. Defaults suit the systemd unit."""

    provider: str = "auto"
    metadata_url: str | None = None  # base URL, e.g. http://127.0.0.1:8080; None = the provider's own
    socket: Path = DEFAULT_SOCKET
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR
    state_dir: Path = DEFAULT_STATE_DIR  # remembers handled event ids across restarts
    bucket: str | None = None  # s3://b/prefix, gs://b/prefix or file:///dir; None = keep local only
    # s3://: verify uploads by CRC32C, by per-request Content-MD5, or CRC32C until the store is seen to
    # answer wrong ones, then Content-MD5 (auto). GCS always verifies CRC32C.
    checksum: str = "auto"
    poll_interval: float = 1.0
    http_timeout: float = 2.0
    keep_local: int = 2  # newest complete checkpoints kept on local disk (plus any not yet uploaded)
    keep_remote: int = 3  # newest complete checkpoints kept in the bucket
    incomplete_grace: float = 3600.0  # seconds untouched before an incomplete checkpoint in the bucket is removed
    # At start, abort unfinished multipart uploads under the prefix only once they are this old:
    # younger ones may be another node's, in flight (longer than any notice plus its upload).
    stale_upload_age: float = 3600.0
    allowed_uids: tuple[int, ...] = field(default_factory=_own_uid_and_root)
    allowed_gids: tuple[int, ...] = ()
    # uids allowed on the socket on top of allowed_uids, which keeps its default (the daemon's own and root):
    # trainers in other containers or pods, whose supplementary groups the daemon cannot see (another PID namespace)
    trainer_uids: tuple[int, ...] = ()
    max_message_bytes: int = 64 * 1024
    max_connections: int = 64
    drill_deadline: float = 120.0  # seconds a drill gives, unless `spotguard drill --deadline` says
    notice_grace: float = 60.0  # seconds past its deadline a hard notice still stops new trainers, then is over
    scan_interval: float = 2.0  # how often the uploader rescans the checkpoint root
    bucket_scan_interval: float = 60.0  # how often it lists the bucket with nothing new on disk (requests cost)
    shutdown_grace: float = 110.0  # on SIGTERM, upload for at most this long (or the notice deadline)
    upload_concurrency: int = 16  # upload streams in flight at once (S3 gives each connection tens of MB/s)
    upload_retry_max: float = 60.0  # a failed upload waits 2 s, doubled per failure in a row, up to this
    upload_alert_after: int = 5  # failures in a row of one checkpoint's upload before an alert (log, metric)
    forecast_interval: float = 5.0  # how often an urgent upload logs whether it will beat the deadline
    # A trainer told of a notice that has not reached a checkpoint point (stuck in eval, a long
    # data-loader start) after max(stall_fraction x the notice's window, stall_min_seconds) is reported.
    stall_fraction: float = 0.1
    stall_min_seconds: float = 3.0
    on_rebalance: Action = Action.CHECKPOINT
    on_maintenance: Action = Action.CHECKPOINT
    imds_v1_fallback: bool = False  # AWS: fall back to IMDSv1 if no token can be had
    asg_lifecycle_hook: str | None = None  # AWS: complete this termination lifecycle hook after the commit
    asg_name: str | None = None  # AWS: the Auto Scaling group; None = the instance's aws:autoscaling:groupName tag
    vm_name: str | None = None  # Azure: this VM's name in Scheduled Events `Resources`; None = ask IMDS
    log_level: str = "info"
    metrics_port: int | None = None  # Prometheus /metrics on this port; None = off, 0 = any free port
    metrics_host: str = "127.0.0.1"
    webhook_url: str | None = None  # POST JSON here on each notice and its outcome; None = off
    webhook_template: str | None = None  # a JSON document with ${field} placeholders; None = the full event
    # The peer tier (spotguard/peer/): the token is SPOTGUARD_PEER_TOKEN or this file's contents.
    peer_listen: str | None = None  # HOST:PORT this daemon takes other daemons' checkpoints on; None = off
    # HOST:PORT[,HOST:PORT...]: the job's other daemons, or "bucket": find them under the bucket's
    # .spotguard-peers/ (spotguard/peer/discovery.py); None = no peer route
    peers: str | None = None
    # HOST:PORT other daemons connect to (registered under .spotguard-peers/ with peers = "bucket");
    # None = peer_listen when its host is not a wildcard, else this host's own address
    peer_advertise: str | None = None
    peer_token_file: Path | None = None
    # During a token rotation: the token being replaced, still accepted (SPOTGUARD_PEER_TOKEN_PREVIOUS
    # or this file's contents; docs/security.md). None = only the job's token.
    peer_token_previous_file: Path | None = None
    peer_max_replica_bytes: int = 1 << 40  # the most one replica may hold
    peer_max_replicas: int = 2  # replicas held at once (each until it is committed in the bucket)
    # CIDRs the peers found in the bucket may be dialled on (spotguard/peer/networks.py); link-local and
    # the metadata services never are. Loopback is added unless this daemon listens on another address.
    peer_networks: tuple[str, ...] = DEFAULT_PEER_NETWORKS
    # Seconds a peer may stay silent mid-record (or leave our writes unread) before its connection, and
    # the replica it was sending, are dropped (spotguard/peer/channel.py; also TCP_USER_TIMEOUT)
    peer_io_timeout: float = IO_TIMEOUT
    # The most connections one handoff spreads its replica over (spotguard/peer/flows.py): it opens
    # more while the bytes left cannot cross on those open before the deadline (clouds cap one flow).
    peer_max_flows: int = MAX_FLOWS

    def __post_init__(self) -> None:
        self._check_sources()
        self._check_numbers()
        self._check_observers()
        self._check_peers()

    def _check_sources(self) -> None:
        """Where notices come from and where checkpoints go."""
        if self.provider not in providers.choices():
            raise ConfigError("provider", f"{self.provider!r} is not one of {', '.join(providers.choices())}")
        if self.metadata_url is not None:
            _check_http_url("metadata_url", self.metadata_url, "scheme://host[:port]")
        if self.bucket is not None:
            check_bucket_url(self.bucket, key="bucket")
            self._check_bucket_leaves_the_root(self.bucket)
        # Past the limit the daemon stopped with only "AF_UNIX path too long", naming neither setting nor limit.
        socket_bytes = len(os.fsencode(self.socket))
        if socket_bytes > _MAX_SOCKET_PATH:
            raise ConfigError(
                "socket", f"{str(self.socket)!r} is {socket_bytes} bytes; a Unix socket's path holds at most 107"
            )
        if self.checksum not in CHECKSUM_MODES:
            raise ConfigError("checksum", f"{self.checksum!r} is not one of {', '.join(CHECKSUM_MODES)}")
        store = scheme_of(self.bucket or "")
        if store is not None and self.checksum not in store.checksum_modes:
            takers = [f"{s.name}://" for s in SCHEMES.values() if self.checksum in s.checksum_modes and s.options]
            raise ConfigError("checksum", f"{self.checksum} is for {', '.join(takers)} stores; {store.checksum_note}")

    def _check_bucket_leaves_the_root(self, url: str) -> None:
        """A file:// bucket that is the checkpoint root, lies inside it or holds it: every upload
        would be a copy on the same disk, and a lost VM would lose the bucket with it."""
        if urlparse(url).scheme != "file":
            return
        bucket = Path(urlparse(url).path).resolve()
        root = self.checkpoint_dir.absolute().resolve()
        if bucket == root or bucket.is_relative_to(root) or root.is_relative_to(bucket):
            where = "is" if bucket == root else "lies inside" if bucket.is_relative_to(root) else "holds"
            raise ConfigError(
                "bucket",
                f"{url!r} {where} the checkpoint root {root}: nothing would leave this VM; point the "
                "bucket at storage of its own (s3://, gs://, or file:// on a shared filesystem outside the root)",
            )

    def _check_numbers(self) -> None:
        for name in _POSITIVE_SECONDS:
            if not getattr(self, name) > 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)}")
        for name in (*_POSITIVE_SECONDS, "notice_grace", "peer_io_timeout"):
            most, why = _MAX_SECONDS_OF.get(name, (_MAX_SECONDS, "a century; longer overflows the times computed"))
            if getattr(self, name) > most:
                raise ConfigError(name, f"must be at most {most:.0f} s ({why}), got {getattr(self, name)}")
        if not 0 < self.stall_fraction <= 1:
            raise ConfigError("stall_fraction", f"must be in (0, 1], got {self.stall_fraction}")
        if not self.notice_grace >= 0:
            raise ConfigError("notice_grace", f"must be >= 0, got {self.notice_grace}")
        if not self.allowed_uids:
            # An empty SPOTGUARD_ALLOWED_UIDS= (a template's unset value) did it: even the daemon's own
            # uid was refused, its status command and a liveness probe with it.
            raise ConfigError(
                "allowed_uids", "is empty, which refuses every client, the daemon's own uid too; leave it "
                "unset for the default (the daemon's own uid and root), or list the uids",
            )  # fmt: skip
        for name in ("allowed_uids", "allowed_gids", "trainer_uids"):
            # (uid_t)-1 is no user: chown's "leave it" and setuid's error, never a peer's credential.
            wrong = [each for each in getattr(self, name) if not 0 <= each < 2**32 - 1]
            if wrong:
                raise ConfigError(name, f"{wrong[0]} is not a uid or gid (0 to 4294967294)")
        for name in _MIN_SECONDS_OF:
            if getattr(self, name) < _MIN_LOOP_SECONDS:
                raise ConfigError(
                    name, f"must be at least {_MIN_LOOP_SECONDS} s (less is a busy loop), got {getattr(self, name)}"
                )
        for name, (least, most, why) in _COUNT_RANGES.items():
            if not least <= getattr(self, name) <= most:
                raise ConfigError(name, f"must be in {least}..{most} ({why}), got {getattr(self, name)}")
        if self.bucket is not None and self.keep_local > self.keep_remote:
            # Local checkpoints the bucket no longer holds look "not uploaded": each rescan would
            # send them again and each retention would delete them again, forever.
            raise ConfigError(
                "keep_local",
                f"{self.keep_local} is more than keep_remote = {self.keep_remote}: the bucket must keep at least "
                "what the local disk keeps; raise keep_remote or lower keep_local",
            )

    def _check_observers(self) -> None:
        """Logs, metrics and the webhook."""
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError("log_level", f"{self.log_level!r} is not debug, info, warning or error")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError("metrics_port", f"must be 0..65535 (0 = any free port), got {self.metrics_port}")
        if not self.metrics_host.strip():
            raise ConfigError("metrics_host", "must be an address to listen on, e.g. 127.0.0.1")
        if self.webhook_url is not None:
            _check_http_url("webhook_url", self.webhook_url, "an http:// or https:// URL")
        if self.webhook_template is not None:
            parse_webhook_template(self.webhook_template)

    def _check_peers(self) -> None:
        if self.peers is not None and PEERS_FROM_BUCKET in _addresses(self.peers) and self.peers.strip() != "bucket":
            raise ConfigError("peers", f'{self.peers!r}: either "bucket" or a list of HOST:PORT, not both')
        if self.peer_advertise is not None and not self.peer_listen:
            raise ConfigError("peer_advertise", "is the address of peer_listen: set peer_listen too")
        for key in ("peer_listen", "peers", "peer_advertise"):
            for address in _addresses(getattr(self, key)):
                if key == "peers" and self.peer_discovery:
                    continue
                try:
                    parse_address(address)
                except ValueError as exc:
                    raise ConfigError(key, str(exc)) from None
        if (self.peer_listen or self.peers) and self.bucket is None:
            raise ConfigError("peers" if self.peers else "peer_listen", "peers share one bucket: set bucket too")
        try:
            parse_networks(self.peer_networks)
        except ValueError as exc:
            raise ConfigError("peer_networks", f"{exc}; write CIDRs such as 10.0.0.0/8, fc00::/7") from None
        if not self.peer_io_timeout > 0:
            raise ConfigError("peer_io_timeout", f"must be > 0, got {self.peer_io_timeout}")

    @property
    def peer_discovery(self) -> bool:
        """``peers = "bucket"``: the peers are found in the bucket, not listed."""
        return (self.peers or "").strip() == PEERS_FROM_BUCKET

    def peer_addresses(self) -> list[tuple[str, int]]:
        """``peers`` as (host, port) pairs (none when they are found in the bucket)."""
        return [] if self.peer_discovery else [parse_address(address) for address in _addresses(self.peers)]

    def peer_network_policy(self) -> PeerNetworks:
        """Where peers found in the bucket may be dialled: ``peer_networks``, plus loopback when this
        daemon listens on loopback (a test, a single-host job) or listens nowhere (it only sends, and
        cannot tell where its fleet lives; entries are signed all the same)."""
        networks = parse_networks(self.peer_networks)
        host = parse_address(self.peer_listen)[0] if self.peer_listen else None
        if host is None or host == "localhost" or _is_loopback(host):
            networks += parse_networks(LOOPBACK_NETWORKS)
        return PeerNetworks(networks)

    def action_for_soft(self, kind: str) -> Action:
        return self.on_rebalance if kind == "rebalance" else self.on_maintenance

    def monitor_settings(self) -> MonitorSettings:
        """What the provider's monitors and the doctor's probe are built from: every field of
        :class:`MonitorSettings` is the config's field of the same name."""
        return MonitorSettings(**{item.name: getattr(self, item.name) for item in fields(MonitorSettings)})

    def storage_options(self) -> dict[str, Any]:
        """Keyword arguments for ``open_storage(self.bucket, ...)``, the same for the daemon and doctor:
        each scheme takes those it declares (``spotguard.storage.schemes``)."""
        # max_concurrency: one budget of parallel streams for everything in flight.
        offered = {"max_concurrency": self.upload_concurrency, "checksum": self.checksum}
        store = scheme_of(self.bucket or "")
        return {key: value for key, value in offered.items() if store is not None and key in store.options}


def _check_http_url(key: str, url: str, form: str) -> None:
    try:
        parsed = urlparse(url)
        parsed.port  # noqa: B018  (a port that is no number, or past 65535, raises only here)
    except ValueError as exc:
        # urlparse's own words ("Invalid IPv6 URL") named neither the setting nor the fix.
        hint = "; put an IPv6 host in a pair of brackets, e.g. http://[fd00::1]:8080" if "IPv6" in str(exc) else ""
        raise ConfigError(key, f"{url!r} is not {form}: {exc}{hint}") from None
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ConfigError(key, f"{url!r} is not {form}")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _addresses(value: str | None) -> list[str]:
    return [item.strip() for item in (value or "").split(",") if item.strip()]


def parse_webhook_template(text: str, *, key: str = "webhook_template") -> Any:
    """Parse and check a webhook template: a JSON document whose strings may hold ``${field}``
    placeholders (:class:`string.Template` syntax, ``$$`` for a literal ``$``). A string that is
    exactly one placeholder becomes the field's JSON value (a number stays a number).

    >>> parse_webhook_template('{"text": "spotguard on ${host}: ${message}"}')
    {'text': 'spotguard on ${host}: ${message}'}
    """
    try:
        document = parse_json(text)
    except ValueError as exc:
        raise ConfigError(key, f"is not valid JSON: {exc}") from None

    def strings(value: Any) -> list[str]:
        if isinstance(value, str):
            return [value]
        if isinstance(value, dict):
            return [s for k, v in value.items() for s in (*strings(k), *strings(v))]
        if isinstance(value, list):
            return [s for item in value for s in strings(item)]
        return []

    for text_value in strings(document):
        template = string.Template(text_value)
        if not template.is_valid():
            raise ConfigError(key, f"{text_value!r} has a bad placeholder; write ${{name}}, and $$ for a literal $")
        unknown = sorted(set(template.get_identifiers()) - set(WEBHOOK_FIELDS))
        if unknown:
            raise ConfigError(key, f"unknown placeholder ${{{unknown[0]}}}; known: {', '.join(WEBHOOK_FIELDS)}")
    return document


# --- parsing -------------------------------------------------------------------------------


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{value!r} is not a boolean (true/false)")


def _as_int_tuple(value: Any) -> tuple[int, ...]:
    """Whole numbers (uids, gids): ``[true, 1000.9]`` read as (1, 1000), an id nobody asked for."""
    items = value if isinstance(value, list | tuple) else str(value).replace(",", " ").split()
    if any(isinstance(item, bool) for item in items):
        raise ValueError("a list of whole numbers, not of booleans")
    return tuple(_as_whole_number(item) for item in items)


def _as_str_tuple(value: Any) -> tuple[str, ...]:
    items = value if isinstance(value, list | tuple) else str(value).replace(",", " ").split()
    return tuple(str(item).strip() for item in items if str(item).strip())


def _as_number(kind: type) -> Callable[[Any], Any]:
    def parse(value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError(f"{value!r} is not a number")
        if kind is int:
            return _as_whole_number(value)
        try:
            number = kind(value)
        except ValueError:  # float's own message ("could not convert string to float") is Python's, not the user's
            raise ValueError("not a number") from None
        # float("inf") and float("1e999") parse: a poll interval of infinity left the monitor deaf
        # after its first look, and no check of "> 0" refuses it.
        if isinstance(number, float) and not math.isfinite(number):
            raise ValueError("not a finite number")
        return number

    return parse


def _as_whole_number(value: Any) -> int:
    """An integer, or a float or text that is one (TOML's ``1e6``); int() cut ``keep_local = 1.7`` to 1."""
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return int(value)
        try:
            value = float(value)
        except ValueError:  # as in _as_number: float's message is not the user's
            raise ValueError("not a whole number") from None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    raise ValueError("not a whole number")


def _as_str(value: Any) -> str:
    # str() made asg_name = {a=1} the group "{'a': 1}".
    if not isinstance(value, str):
        raise TypeError(f"{_toml_type(value)}, where a string is wanted; quote it")
    return value


def _toml_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a float", dict: "a table", list: "an array"}
    return next((name for kind, name in names.items() if isinstance(value, kind)), f"a {type(value).__name__}")


def _as_path(value: Any) -> Path:
    text = os.fspath(value) if isinstance(value, os.PathLike) else _as_str(value)
    # An empty path is the working directory (/ under systemd): the checkpoint root would be the whole disk.
    if not text.strip():
        raise ValueError("an empty path; name a directory or file")
    if "\x00" in text:
        raise ValueError("a path with a NUL byte")
    return Path(text).expanduser()


def _as_optional_str(value: Any) -> str | None:
    text = _as_str(value).strip()
    return text or None


def _as_optional_int(value: Any) -> int | None:
    if isinstance(value, str) and not value.strip():
        return None
    parsed: int = _as_number(int)(value)
    return parsed


_PARSERS: dict[str, Callable[[Any], Any]] = {
    "str": _as_str,
    "str | None": _as_optional_str,
    "Path": _as_path,
    "Path | None": lambda v: None if isinstance(v, str) and not v.strip() else _as_path(v),
    "float": _as_number(float),
    "int": _as_number(int),
    "int | None": _as_optional_int,
    "bool": _as_bool,
    "tuple[int, ...]": _as_int_tuple,
    "tuple[str, ...]": _as_str_tuple,
    "Action": Action,
}


def _parse(key: str, type_name: str, value: Any) -> Any:
    try:
        return _PARSERS[type_name](value)
    except (ValueError, TypeError) as exc:
        raise ConfigError(key, f"cannot use {value!r}: {exc}") from None


def env_name(key: str) -> str:
    return "SPOTGUARD_" + key.upper()


def read_config_file(path: Path) -> dict[str, Any]:
    # Each error is keyed by the file: the CLI prints "config: <file>: <what is wrong>".
    try:
        with path.open("rb") as handle:
            data = tomllib.load(handle)
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), f"not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:  # tomllib decodes the bytes itself, outside its own error
        raise ConfigError(str(path), f"not UTF-8 text (byte {exc.start}): save it as UTF-8") from None
    except RecursionError:
        raise ConfigError(str(path), "not valid TOML: arrays or tables nested too deeply") from None
    # Top-level keys, a [daemon] table (for files shared with other tools, whose tables are left
    # alone), or both: a key after a [daemon] header belongs to the table, and the top-level ones
    # before it (as the Terraform boot script writes them, with a user's extra lines after) were lost.
    table = data.get("daemon")
    if table is None:
        table = data
    elif not isinstance(table, dict):
        raise ConfigError(str(path), "[daemon] must be a table")
    else:
        top = {k: v for k, v in data.items() if k != "daemon" and not isinstance(v, dict)}
        both = sorted(set(top) & set(table))
        if both:
            raise ConfigError(str(path), f"{both[0]} is set both at the top and in [daemon]: keep one")
        table = {**top, **table}
    return {k.replace("-", "_"): v for k, v in table.items()}


def load_config(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: Path | None = None,
) -> DaemonConfig:
    """Build the daemon's config. ``flags`` holds only flags given on the command line."""
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    env = os.environ if env is None else env
    known = {f.name: str(f.type) for f in fields(DaemonConfig)}

    path = config_file
    if path is None and env.get("SPOTGUARD_CONFIG"):
        path = Path(env["SPOTGUARD_CONFIG"])
    if path is None and DEFAULT_CONFIG_FILE.is_file():
        path = DEFAULT_CONFIG_FILE
    from_file = read_config_file(path) if path is not None else {}
    unknown = sorted(set(from_file) - set(known))
    if unknown:
        raise ConfigError(unknown[0], f"unknown key in {path}; known keys: {', '.join(sorted(known))}")

    values: dict[str, Any] = {}
    for key, type_name in known.items():
        if key in flags:
            values[key] = _parse(f"--{key.replace('_', '-')}", type_name, flags[key])
        elif env_name(key) in env:
            values[key] = _parse(env_name(key), type_name, env[env_name(key)])
        elif key in from_file:
            values[key] = _parse(key, type_name, from_file[key])
    return DaemonConfig(**values)


def with_overrides(config: DaemonConfig, **changes: Any) -> DaemonConfig:
    return replace(config, **changes)


# --- trainer side --------------------------------------------------------------------------


def trainer_settings(
    checkpoint_dir: str | os.PathLike[str] | None,
    bucket: str | None,
    socket: str | os.PathLike[str] | None,
    env: Mapping[str, str] | None = None,
) -> TrainerSettings:
    """Resolve the hook's arguments: explicit argument > environment > default (the trainer package's rule)."""
    return TrainerSettings.from_env(checkpoint_dir, bucket, socket, env=env)
