"""``spotguard``: argv -> config -> the right command. Exit codes: 0 ok, 1 failure, 2 usage/config error."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from spotguard import protocol
from spotguard.config import ConfigError, DaemonConfig, load_config
from spotguard.control import CommandError, daemon_socket, request, trainers_on_another_version
from spotguard.localstore import scan_local
from spotguard.manifest import MANIFEST, CheckpointInfo, load_manifest_or_none, parse_step_dir, verify_dir
from spotguard.oneline import OneLineFormatter, one_line
from spotguard.providers import registry as providers
from spotguard.storage.schemes import scheme_of
from spotguard.version import __version__

if TYPE_CHECKING:
    from spotguard.storage.base import Storage

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def _say(text: str, file: TextIO | None = None) -> None:
    """Print a line that may hold text from outside (a trainer's report, a bucket's or a metadata
    service's answer): on one line, no terminal controls (spotguard/oneline.py)."""
    print(one_line(text), file=file or sys.stdout)


# --- locations: a local directory or a bucket URL ---------------------------------------------


def is_url(location: str) -> bool:
    return scheme_of(location) is not None


def split_checkpoint(location: str) -> tuple[str, str | None]:
    """``…/step-000000100`` names one checkpoint inside its root; anything else is a root."""
    stripped = location.rstrip("/")
    head, _, tail = stripped.rpartition("/")
    if head and parse_step_dir(tail) is not None:
        return head, tail
    return stripped or location, None


def _open(location: str) -> Any:
    from spotguard.storage import open_storage

    return open_storage(location if is_url(location) else Path(location).absolute().as_uri())


def list_location(location: str, *, progress: bool = False) -> list[CheckpointInfo]:
    """Checkpoints at a root or bucket; ``progress``: a bar on a terminal while manifests are read."""
    if is_url(location):
        storage = _open(location)
        try:
            return _list_remote(storage, progress)
        finally:
            storage.close()
    root = Path(location)
    if not root.is_dir():
        raise CommandError(f"{location}: no such directory")
    return scan_local(root)


def _list_remote(storage: Any, progress: bool) -> list[CheckpointInfo]:
    from spotguard.storage.checkpoints import list_remote

    if not progress:
        return list_remote(storage)
    bar = Progress(0, "reading manifests", unit="checkpoints")
    infos = list_remote(storage, progress=bar.update)
    if bar.done:
        bar.finish()
    return infos


def _human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size} B"  # pragma: no cover


class Progress:
    """A one-line progress bar on stderr, only when it is a terminal; counts bytes, or items
    (``unit``) such as the checkpoints whose manifests were read."""

    def __init__(self, total: int, label: str, unit: str | None = None) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.label = label
        self.unit = unit
        self.enabled = sys.stderr.isatty()
        self._lock = threading.Lock()  # called from download threads

    def __call__(self, count: int) -> None:
        with self._lock:
            self.done += count
            self._draw()

    def update(self, done: int, total: int) -> None:
        with self._lock:
            self.done, self.total = done, max(total, 1)
            self._draw()

    def _draw(self) -> None:
        if self.enabled:
            width = 30
            filled = int(width * min(self.done / self.total, 1.0))
            amount = f"{self.done}/{self.total} {self.unit}" if self.unit else _human(self.done)
            sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {amount}")
            sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


# --- commands -----------------------------------------------------------------------------


# The flags _add_daemon_settings gives both run and doctor (besides --config), as config keys.
_DAEMON_SETTINGS = ("provider", "metadata_url", "socket", "checkpoint_dir", "bucket", "checksum")


def _config_from(args: argparse.Namespace, extra: tuple[str, ...] = ()) -> DaemonConfig:
    """The daemon's settings from the flags given (``--config`` FILE, environment and defaults below them)."""
    flags = {key: getattr(args, key) for key in (*_DAEMON_SETTINGS, *extra)}
    return load_config(flags, config_file=Path(args.config) if args.config else None)


def cmd_run(args: argparse.Namespace) -> int:
    import asyncio

    from spotguard.daemon import heap
    from spotguard.daemon.app import build_and_run

    run_only = (
        "poll_interval", "state_dir", "peer_listen", "peers", "peer_advertise", "peer_token_file",
        "peer_token_previous_file", "peer_networks",
    )  # fmt: skip
    config = _config_from(args, run_only)
    # One line per record whatever a trainer, a bucket or a metadata service puts in its text: the
    # journal takes each line of stderr as an entry of the daemon's own (spotguard/oneline.py).
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=config.log_level.upper(), handlers=[handler])
    heap.use_one_heap()  # before any thread: what an idle trim gives back (spotguard/daemon/heap.py)
    try:
        return asyncio.run(build_and_run(config))
    except RuntimeError as exc:  # e.g. another daemon on the socket
        raise CommandError(str(exc)) from None


def cmd_drill(args: argparse.Namespace) -> int:
    # Without --deadline the daemon gives its own drill_deadline (config), and says which in its reply.
    fields: dict[str, Any] = {"deadline_s": args.deadline} if args.deadline is not None else {}
    reply = request(daemon_socket(args.socket), "drill", **fields)
    deadline_s = reply.get("deadline_s", args.deadline)
    told = f"drill {reply['event_id']}: {reply['trainers_told']} trainer(s) told"
    print(f"{told}, deadline in {deadline_s:.0f} s" if isinstance(deadline_s, int | float) else told)
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    reply = request(daemon_socket(args.socket), "status")
    reply.pop("v", None)
    reply.pop("type", None)
    if args.json:
        print(json.dumps(reply, indent=1))
        return EXIT_OK
    _say(f"spotguard {reply['version']} pid {reply['pid']}, provider {reply['provider']}")
    _say(f"checkpoints: {reply['checkpoint_dir']} -> {reply['uploads']['bucket'] or '(no bucket)'}")
    others = trainers_on_another_version(reply)
    _say(f"trainers connected: {len(reply['trainers'])}" + (f" ({others}: upgrade the older)" if others else ""))
    _say("notice: " + _notice_line(reply["pending"]))
    if reply.get("plan"):
        _say("deadline plan: " + _plan_line(reply["plan"]))
    peers = reply.get("peers")
    if peers:
        found = " (found in the bucket)" if peers.get("discovery") else ""
        _say(f"peers: listening on {peers.get('listen') or '-'}; sending to {', '.join(peers['peers']) or '-'}{found}")
        for replica in peers.get("replicas", []):
            _say(
                f"  replica {replica['name']} from {replica['sender']}: {replica['state']} ({_human(replica['bytes'])})"
            )
        handoff = peers.get("handoff")
        if handoff and handoff["state"] != "idle":
            moved = f", after {handoff['moves']} peer(s) failed mid-stream" if handoff.get("moves") else ""
            _say(
                f"  handoff of {handoff['name']} to {handoff['peer']}: {handoff['state']} "
                f"({_human(handoff['bytes_sent'])} sent{moved})"
            )
    if reply["last_notice"]:
        _say("last notice: " + ", ".join(f"{k}={v}" for k, v in reply["last_notice"].items()))
    for stalled in reply.get("stalled", []):
        _say(f"STALLED: {stalled['message']}")
    uploads = reply["uploads"]
    if uploads["current"]:
        _say(_upload_line(uploads["current"]))
    if uploads["last_committed"]:
        last = uploads["last_committed"]
        _say(f"last committed in bucket: {last['name']} at {last['at']} ({last['seconds']} s)")
    if newest := uploads.get("newest_in_bucket"):
        made = f", made {newest['made']}" if newest["made"] else ""
        _say(f"newest in bucket (what a replacement resumes from): step {newest['step']}{made}")
    for failure in uploads["failures"]:
        _say(f"upload failure: {failure['name']}: {failure['error']}")
    for failure in reply.get("save_failures", []):
        _say(f"save failed: step {failure['step']} ({failure['reason']}, {failure['error']}): {failure['message']}")
    for name, error in reply["monitor_errors"].items():
        _say(f"monitor {name}: {error}")
    return EXIT_OK


def _notice_line(notice: dict[str, Any] | None) -> str:
    if notice is None:
        return "none"
    line = f"{notice['kind']} ({notice['action']}), {notice.get('state', 'pending')}, "
    if notice["seconds_left"] > 0:
        return line + f"{notice['seconds_left']:.0f} s to the deadline"
    return line + f"deadline passed; over in {notice.get('over_in_s', 0):.0f} s"


def _plan_line(plan: dict[str, Any]) -> str:
    rate = "no rate measured" if plan["rate_bytes_s"] is None else f"{plan['rate_bytes_s'] / 1e6:.1f} MB/s"
    needed = "?" if plan["seconds_needed"] is None else f"{plan['seconds_needed']:.0f}"
    size = "? bytes" if plan.get("size_from") == "unknown" else _human(plan["bytes"])
    return f"{plan['route']}: {size} at {rate} needs {needed} s, {plan['seconds_left']:.0f} s left ({plan['why']})"


def _upload_line(cur: dict[str, Any]) -> str:
    total = _human(cur["bytes_total"]) + ("" if cur["total_known"] else "+ (still being written)")
    line = f"uploading {cur['name']}{' (urgent)' if cur['urgent'] else ''}: {_human(cur['bytes_done'])} of {total}"
    if cur["rate_bytes_s"]:
        line += f" at {cur['rate_bytes_s'] / 1e6:.0f} MB/s, done in ~{cur['eta_s']} s"
    if "deadline_s_left" in cur:
        verdict = {True: "on track", False: "will MISS it", None: "no rate yet"}[cur["will_meet_deadline"]]
        line += f"; deadline in {cur['deadline_s_left']:.0f} s: {verdict}"
    return line


def cmd_list(args: argparse.Namespace) -> int:
    infos = list_location(args.location, progress=True)
    if args.json:
        print(json.dumps([info.to_json() for info in infos], indent=1))
        return EXIT_OK
    if not infos:
        print(f"no checkpoints in {args.location}")
        return EXIT_OK
    print(f"{'NAME':<16} {'STEP':>10} {'SIZE':>10}  {'CREATED':<32} STATUS")
    for info in infos:
        print(f"{info.name:<16} {info.step:>10} {_human(info.bytes):>10}  {info.created or '-':<32} {info.status}")
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    """Check checkpoints against their manifests. A step that was never committed (no manifest: a save
    that failed or is still being written) is listed as incomplete; only a committed one whose files do
    not match fails the run, or an incomplete one named on its own."""
    root, single = split_checkpoint(args.location)
    names = [single] if single else [info.name for info in list_location(root)]
    if not names:
        raise CommandError(f"no checkpoints in {root}")
    storage = _open(root) if is_url(root) else None
    try:
        listing = {info.name: info for info in _list_remote(storage, True)} if storage else {}
        results = [_verify_one(storage, root, name, listing.get(name)) for name in names]
    finally:
        if storage is not None:
            storage.close()
    failed = sum(
        result["status"] == "failed" or (single is not None and result["status"] != "ok") for result in results
    )
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        for result in results:
            _say(f"{result['name']}: {_VERIFY_WORDS[result['status']]}")
            for problem in result["problems"]:
                _say(f"  {problem}")
    if failed:
        _say(f"{failed} of {len(names)} checkpoint(s) failed verification", file=sys.stderr)
    return EXIT_FAILURE if failed else EXIT_OK


_VERIFY_WORDS = {"ok": "ok", "failed": "FAILED", "incomplete": "incomplete (never committed: no manifest)"}


def _verify_one(storage: Storage | None, root: str, name: str, info: CheckpointInfo | None) -> dict[str, Any]:
    """One checkpoint's verdict: ok, failed (committed, and its files do not match), or incomplete."""
    if storage is not None:
        from spotguard.storage.checkpoints import verify_remote

        if storage.stat(f"{name}/{MANIFEST}") is None:
            return {"name": name, "status": "incomplete", "problems": [], "contents": None}
        progress = Progress(info.bytes if info else 0, f"verifying {name}")
        problems = verify_remote(storage, name, progress=progress)
        progress.finish()
        manifest = info.manifest if info else None
    else:
        if not (Path(root) / name / MANIFEST).exists():
            return {"name": name, "status": "incomplete", "problems": [], "contents": None}
        problems = verify_dir(Path(root) / name)
        manifest = load_manifest_or_none(Path(root) / name)
    return {
        "name": name,
        "status": "failed" if problems else "ok",
        "problems": problems,
        "contents": manifest.contents if manifest is not None else None,
    }


def cmd_restore(args: argparse.Namespace) -> int:
    from spotguard.storage.checkpoints import restore

    storage = _open(args.location)
    try:
        listing = _list_remote(storage, True)
        complete = [info for info in listing if info.status == "complete"]
        total = next((i.bytes for i in reversed(complete) if args.step in (None, i.step)), 0)
        progress = Progress(total, "restoring")
        target = restore(
            storage,
            Path(args.dest),
            step=args.step,
            progress=progress,
            log=lambda line: _say(line, file=sys.stderr),
            candidates=listing,
        )
        progress.finish()
    finally:
        storage.close()
    if target is None:
        raise CommandError(f"no complete checkpoint in {args.location}")
    print(target)
    return EXIT_OK


def cmd_prune(args: argparse.Namespace) -> int:
    if args.keep < 1:
        raise ConfigError("--keep", "must be >= 1")
    if args.grace < 0:
        raise ConfigError("--grace", f"must be >= 0, got {args.grace}")
    from spotguard.storage.checkpoints import prune_remote

    storage = _open(args.location)
    try:
        removed = prune_remote(storage, args.keep, grace=timedelta(seconds=args.grace))
    finally:
        storage.close()
    print("removed: " + (", ".join(removed) if removed else "nothing"))
    return EXIT_OK


def cmd_emulate(args: argparse.Namespace) -> int:
    from spotguard.emulate.registry import run_emulator_forever

    run_emulator_forever(args.provider, args.host, args.port, args.notice_after, args.action)
    return EXIT_OK


def cmd_doctor(args: argparse.Namespace) -> int:
    from spotguard.doctor import run_doctor

    if not args.checkpoint_gb > 0:
        raise ConfigError("--checkpoint-gb", f"must be > 0, got {args.checkpoint_gb}")
    config = _config_from(args)
    return run_doctor(config, checkpoint_gb=args.checkpoint_gb)


def cmd_peer_token(args: argparse.Namespace) -> int:
    if args.with_previous and args.from_secret is None:
        raise ConfigError("--with-previous", "reads a secret's previous version: give --from-secret too")
    if args.from_secret is None:
        from spotguard.peer.tokens import new_token

        print(new_token())  # 32 random bytes, hex: SPOTGUARD_PEER_TOKEN or peer_token_file (docs/security.md)
        return 0
    from spotguard.secretstore import SecretStoreError, read_secret

    try:
        current, previous = read_secret(args.from_secret, previous=args.with_previous)
    except SecretStoreError as exc:
        print(f"spotguard peer-token: {exc}", file=sys.stderr)
        return 1
    print(current)
    if args.with_previous:
        print(previous or "")  # an empty line: no previous version to accept
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from spotguard.demo import run_demo

    return run_demo(steps=args.steps, notice_at=args.notice_at, keep_dir=args.keep_dir)


# --- argv -------------------------------------------------------------------------------------

_CHECKSUM_HELP = "s3:// upload verification: auto (CRC32C, Content-MD5 if the store gets CRC32C wrong), crc32c, md5"


def _add_daemon_settings(parser: argparse.ArgumentParser) -> None:
    """The settings ``run`` and ``doctor`` share: where the daemon looks, listens, writes and uploads."""
    parser.add_argument("--config", help="TOML file (default /etc/spotguard/spotguard.toml if present)")
    parser.add_argument("--provider", help="|".join(providers.choices()))
    parser.add_argument("--metadata-url", help="metadata service base URL (scheme://host:port)")
    parser.add_argument("--socket", help="Unix socket path")
    parser.add_argument("--checkpoint-dir", help="local checkpoint root")
    parser.add_argument("--bucket", help="s3://bucket/prefix, gs://bucket/prefix or file:///dir")
    parser.add_argument("--checksum", help=_CHECKSUM_HELP)


def _add_run(sub: Any) -> None:
    run = sub.add_parser("run", help="the daemon")
    _add_daemon_settings(run)
    run.add_argument("--state-dir", help="where handled event ids are kept")
    run.add_argument("--poll-interval", help="seconds between metadata polls")
    run.add_argument("--peer-listen", help="HOST:PORT to take other daemons' urgent checkpoints on (the peer tier)")
    run.add_argument(
        "--peers",
        help="HOST:PORT[,HOST:PORT...]: the job's other daemons, for the peer route; or 'bucket': find them "
        "under the bucket's .spotguard-peers/",
    )
    run.add_argument(
        "--peer-advertise",
        help="HOST:PORT other daemons reach --peer-listen on (registered with --peers bucket); default: the listen "
        "address, or this host's own address when it listens on a wildcard",
    )
    run.add_argument("--peer-token-file", help="file holding the job's peer token (else $SPOTGUARD_PEER_TOKEN)")
    run.add_argument(
        "--peer-token-previous-file",
        help="while the job's token is rotated: file holding the token it replaces, still accepted (else "
        "$SPOTGUARD_PEER_TOKEN_PREVIOUS)",
    )
    run.add_argument(
        "--peer-networks",
        help="CIDR[,CIDR...] peers found in the bucket may be dialled on (default: 10/8, 172.16/12, 192.168/16, "
        "100.64/10, fc00::/7; loopback too unless --peer-listen is another address); link-local never",
    )
    run.set_defaults(func=cmd_run)


def _add_daemon_requests(sub: Any) -> None:
    """Commands that ask the running daemon over its socket."""
    drill = sub.add_parser("drill", help="inject a simulated hard notice into the running daemon")
    drill.add_argument(
        "--deadline", type=float, help="seconds until the simulated termination (default: the daemon's drill_deadline)"
    )
    drill.add_argument("--socket")
    drill.set_defaults(func=cmd_drill)

    status = sub.add_parser("status", help="what the daemon sees")
    status.add_argument("--json", action="store_true")
    status.add_argument("--socket")
    status.set_defaults(func=cmd_status)


def _add_location_commands(sub: Any) -> None:
    """Commands on the checkpoints at a root or bucket URL."""
    lister = sub.add_parser("list", help="checkpoints at a root or bucket URL")
    lister.add_argument("location")
    lister.add_argument("--json", action="store_true")
    lister.set_defaults(func=cmd_list)

    verify = sub.add_parser("verify", help="check checkpoints against their manifests")
    verify.add_argument("location", help="a root, a bucket URL, or one step-NNNNNNNNN inside either")
    verify.add_argument("--json", action="store_true", help="results and each checkpoint's recorded contents")
    verify.set_defaults(func=cmd_verify)

    restore = sub.add_parser("restore", help="download the newest (or given) complete checkpoint, verified")
    restore.add_argument("location")
    restore.add_argument("dest")
    restore.add_argument("--step", type=int)
    restore.set_defaults(func=cmd_restore)

    prune = sub.add_parser(
        "prune", help="keep the newest N complete checkpoints; remove incomplete ones untouched for --grace seconds"
    )
    prune.add_argument("location")
    prune.add_argument("--keep", type=int, required=True)
    prune.add_argument("--grace", type=float, default=3600.0, help="seconds (default 3600)")
    prune.set_defaults(func=cmd_prune)


def _add_tools(sub: Any) -> None:
    """The emulator, the demo and the readiness check."""
    emulate = sub.add_parser("emulate", help="a local metadata emulator")
    emulate.add_argument("provider", choices=providers.names())
    emulate.add_argument("--host", default="127.0.0.1")
    emulate.add_argument("--port", type=int, default=0)
    emulate.add_argument("--notice-after", type=float)
    emulate.add_argument("--action", help="aws: terminate|stop|hibernate; azure: Preempt|Terminate|...")
    emulate.set_defaults(func=cmd_emulate)

    demo = sub.add_parser("demo", help="the whole story on one machine")
    demo.add_argument("--steps", type=int, default=240)
    demo.add_argument("--notice-at", type=int, default=100)
    demo.add_argument("--keep-dir", help="keep the demo's files here instead of a temporary directory")
    demo.set_defaults(func=cmd_demo)

    doctor = sub.add_parser("doctor", help="check that this VM is ready: metadata, socket, disk, bucket, timing")
    _add_daemon_settings(doctor)
    doctor.add_argument("--checkpoint-gb", type=float, default=10.0, help="checkpoint size for the estimate (10)")
    doctor.set_defaults(func=cmd_doctor)

    token = sub.add_parser("peer-token", help="print a fresh peer token for a job (32 random bytes, hex)")
    token.add_argument(
        "--from-secret",
        metavar="NAME",
        help="print the job's token held in the cloud's secret store instead: a Secrets Manager ARN or a Secret "
        "Manager projects/P/secrets/N (a VM's bootstrap)",
    )
    token.add_argument(
        "--with-previous",
        action="store_true",
        help="with --from-secret: a second line, the secret's previous version (empty if none): a rotation",
    )
    token.set_defaults(func=cmd_peer_token)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spotguard", description="Survive spot/preemptible VM interruptions.")
    parser.add_argument("--version", action="version", version=f"spotguard {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_run(sub)
    _add_daemon_requests(sub)
    _add_location_commands(sub)
    _add_tools(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except ConfigError as exc:
        _say(f"spotguard: config: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (CommandError, protocol.ProtocolError) as exc:
        _say(f"spotguard: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return EXIT_FAILURE
    except Exception as exc:
        from spotguard.storage.base import StorageError

        if isinstance(exc, StorageError | OSError | ValueError):
            _say(f"spotguard: {exc}", file=sys.stderr)
            return EXIT_FAILURE
        raise
