"""Acceptance: cloud notice monitors at the daemon level.

A real daemon subprocess per test watches a provider's metadata emulator on 127.0.0.1 and a real
``Guard`` in this process stands for the trainer. Faults (timeouts, 5xx, garbage bodies, dropped
connections, 401s and expired tokens for AWS, 503 and a missing ``Metadata-Flavor`` for GCP) are
injected before and after the notice: nothing is acted on before it, exactly one action after it,
and the daemon stays up and says what it saw. Restarts mid-incident neither miss nor repeat a
notice; Azure is acknowledged only once the checkpoint is committed in the bucket.

The daemons poll every 0.2 s with a 0.3 s HTTP timeout so that a fault shows within a second.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from spotguard import Guard
from spotguard.daemon.notices import EventLog
from spotguard.daemon.plan import PROBE_PREFIX
from spotguard.emulate.common import RunningEmulator
from spotguard.emulate.gcp import GcpEmulator
from spotguard.emulate.registry import start_emulator
from spotguard.harness import Vm, wait_for
from spotguard.providers.base import MAX_ANSWER
from spotguard.storage.checkpoints import list_remote
from spotguard.storage.file import FileStorage
from spotguard.trainer.notices import NoticeFlags
from tests.checkpoints import write_checkpoint
from tests.emulators import assert_lead_of_skew

POLL_INTERVAL = "0.2"
HTTP_TIMEOUT = 0.3
LATENCY = 0.8  # > HTTP_TIMEOUT: the request times out on the daemon's side
DAEMON_ENV = {"SPOTGUARD_HTTP_TIMEOUT": str(HTTP_TIMEOUT)}
WAIT = 15.0  # seconds; a deadline for things that take one or a few polls
NOTICE_S = 120  # a spot interruption's two-minute warning


# --- what differs between providers ------------------------------------------------------------


@dataclass(frozen=True)
class FaultCase:
    fault: dict[str, Any]
    error: str  # a regex that the daemon's monitor_errors[provider] matches while the fault lasts


@dataclass(frozen=True)
class ProviderCase:
    name: str
    notice: dict[str, Any]  # the emulator's trigger spec
    polled_path: str  # part of the path the monitor reads on every poll
    faults_at_start: tuple[FaultCase, ...]  # before any good read (no token / name / ETag yet)
    faults: tuple[FaultCase, ...]  # once the monitor has read the service (before and after the notice)


# A request that got no answer says why: how long it waited, or what the connection did. A token PUT
# that timed out also names the hop limit, the commonest cause in a container.
WAITED = rf"no answer within {HTTP_TIMEOUT:g} s"
DROPPED = rf"(?!{WAITED})\S.*"  # the connection's own error, e.g. "Server disconnected"
AWS_TIMED_OUT = (
    rf"^aws: (reading [\w/-]+: {WAITED}|getting an IMDSv2 token: {WAITED} \(if a plain GET answers, "
    r"the token's reply is dropped one hop short: .*--http-put-response-hop-limit 2.*`spotguard doctor` tells\))$"
)
AWS_DROPPED = rf"^aws: (reading [\w/-]+|getting an IMDSv2 token): {DROPPED}$"
GCP_TIMED_OUT, GCP_DROPPED = rf"^gcp: reading instance/: {WAITED}$", rf"^gcp: reading instance/: {DROPPED}$"
# A proxy gone wrong that streams without end: the monitor stops at MAX_ANSWER bytes and says so.
FLOODED = rf": an answer of more than {MAX_ANSWER} bytes, which no metadata service sends$"
AZURE_TIMED_OUT, AZURE_DROPPED = rf"^azure: reading [\w/]+: {WAITED}$", rf"^azure: reading [\w/]+: {DROPPED}$"

AWS_FAULTS = (
    FaultCase({"kind": "latency", "seconds": LATENCY}, AWS_TIMED_OUT),
    FaultCase({"kind": "status", "status": 500}, r"HTTP 500"),
    # Garbage on the token PUT (no token yet) or on a GET.
    FaultCase({"kind": "garbage"}, r"not UTF-8|not a token"),
    FaultCase({"kind": "drop"}, AWS_DROPPED),
    FaultCase({"kind": "flood"}, FLOODED),
    # 401 on every GET and on the token PUT: the monitor renews its token and still gets 401.
    FaultCase({"kind": "status", "status": 401}, r"IMDSv2 token: HTTP 401"),
)
GCP_FAULTS = (
    FaultCase({"kind": "status", "status": 500}, r"HTTP 500"),
    FaultCase({"kind": "garbage"}, r"not UTF-8"),
    FaultCase({"kind": "drop"}, GCP_DROPPED),
    FaultCase({"kind": "flood"}, FLOODED),
    FaultCase({"kind": "no_flavor"}, r"Metadata-Flavor"),
    # Persistent 503: retried (1 s apart) max_retries times, then an error.
    FaultCase({"kind": "status", "status": 503}, r"HTTP 503"),
)
# A long-poll is timed out only after timeout + long_poll_timeout (60 s): latency shows as an error
# only on plain reads, i.e. before the first good answer. So GCP's latency case runs from the start.
GCP_LATENCY = FaultCase({"kind": "latency", "seconds": LATENCY}, GCP_TIMED_OUT)
AZURE_FAULTS = (
    FaultCase({"kind": "latency", "seconds": LATENCY}, AZURE_TIMED_OUT),
    FaultCase({"kind": "status", "status": 500}, r"HTTP 500"),
    FaultCase({"kind": "drop"}, AZURE_DROPPED),
    FaultCase({"kind": "flood"}, FLOODED),
    FaultCase({"kind": "garbage"}, r"not UTF-8"),
    FaultCase({"kind": "status", "status": 503}, r"HTTP 503"),
)

CASES = {
    "aws": ProviderCase(
        "aws", {"kind": "spot", "action": "terminate", "in": 120}, "spot/instance-action", AWS_FAULTS, AWS_FAULTS
    ),
    "gcp": ProviderCase(
        "gcp", {"preempted": True}, "/computeMetadata/v1/instance/", (GCP_LATENCY, *GCP_FAULTS), GCP_FAULTS
    ),
    "azure": ProviderCase(
        "azure", {"type": "Preempt", "in": 60}, "/metadata/scheduledevents", AZURE_FAULTS, AZURE_FAULTS
    ),
}
PROVIDERS = sorted(CASES)


# --- the trainer side ----------------------------------------------------------------------------


class RecordingFlags(NoticeFlags):
    """The real notice flags, also keeping every ``checkpoint-now`` the daemon sent (its own dedup aside)."""

    def __init__(self) -> None:
        super().__init__()
        self.told: list[dict[str, Any]] = []

    def on_daemon_message(self, message: dict[str, Any]) -> None:
        if message["type"] == "checkpoint-now":
            self.told.append(message)
        super().on_daemon_message(message)


class RecordingGuard(Guard):
    """The real hook, with flags that record what the daemon told it."""

    flags_type = RecordingFlags

    def __init__(self, vm: Vm) -> None:
        super().__init__(checkpoint_dir=vm.root, socket=vm.socket, handle_sigterm=False)

    @property
    def told(self) -> list[dict[str, Any]]:
        flags = self._flags
        assert isinstance(flags, RecordingFlags)
        return flags.told

    def told_ids(self) -> list[str]:
        return [str(m["notice"]["event_id"]) for m in self.told]


# --- fixtures and helpers ------------------------------------------------------------------------


@pytest.fixture
def emulators() -> Iterator[Callable[..., RunningEmulator]]:
    running: list[RunningEmulator] = []

    def start(provider: str, **options: Any) -> RunningEmulator:
        emu = start_emulator(provider, **options)
        running.append(emu)
        return emu

    yield start
    for emu in running:
        emu.stop()


@pytest.fixture
def guards() -> Iterator[Callable[[Vm], RecordingGuard]]:
    made: list[RecordingGuard] = []

    def connect(vm: Vm) -> RecordingGuard:
        guard = RecordingGuard(vm)
        made.append(guard)
        wait_for(guard.client.connected.is_set, WAIT, "the Guard to connect to the daemon")
        return guard

    yield connect
    for guard in made:
        guard.close()


def daemon_args(provider: str, emu: RunningEmulator) -> list[str]:
    return ["--provider", provider, "--metadata-url", emu.url, "--poll-interval", POLL_INTERVAL]


def handled_events(vm: Vm) -> dict[str, Any]:
    """The daemon's event log (of its checkpoint root): event ids it acted on."""
    path = EventLog.path_for(vm.dir / "state", vm.root)
    if not path.exists():
        return {}
    events: dict[str, Any] = json.loads(path.read_text())["events"]
    return events


def actions_logged(vm: Vm, event_id: str) -> int:
    """How many times the daemon's log says it told the trainers about ``event_id``."""
    return sum(1 for line in vm.log.read_text().splitlines() if event_id in line and "telling" in line)


def assert_alive(vm: Vm) -> dict[str, Any]:
    assert vm.process is not None and vm.process.poll() is None, f"the daemon died; see {vm.log}"
    return vm.status()


def monitor_error(vm: Vm, provider: str) -> str | None:
    error: str | None = assert_alive(vm)["monitor_errors"].get(provider)
    return error


def error_matching(vm: Vm, provider: str, pattern: str) -> str | None:
    error = monitor_error(vm, provider)
    return error if error is not None and re.search(pattern, error) else None


def polls(emu: RunningEmulator, path_part: str) -> int:
    return sum(1 for r in emu.requests() if r["method"] == "GET" and path_part in r["path"])


def polled_at_least(emu: RunningEmulator, path_part: str, count: int) -> bool:
    return polls(emu, path_part) >= count


_renames = itertools.count(1)


def release_long_poll(emu: RunningEmulator) -> None:
    """GCP: answer the monitor's long-poll in flight, without a notice.

    A long-poll admitted before a fault was injected waits for a change (up to 60 s); renaming the
    instance changes the watched document and nothing else, so it answers and the next request
    meets the fault. Setting ``maintenance_event`` to its current value wakes the waiters.
    """
    if not isinstance(emu.emulator, GcpEmulator):
        return
    emu.emulator.instance_name = f"spotguard-vm-{next(_renames)}"
    emu.trigger(maintenance_event=emu.state()["maintenance_event"])


def wait_until(condition: Callable[[], Any], what: str, *, quiet: RecordingGuard | None = None) -> Any:
    """``wait_for`` that, with ``quiet``, also fails at once if the trainer is told to checkpoint."""

    def check() -> Any:
        if quiet is not None:
            assert not quiet.should_checkpoint(1), f"the trainer was told to checkpoint while waiting for {what}"
            assert quiet.told == [], quiet.told
        return condition()

    return wait_for(check, WAIT, what)


def ride_out_faults(
    vm: Vm, emu: RunningEmulator, provider: str, faults: tuple[FaultCase, ...], *, quiet: RecordingGuard | None
) -> None:
    """Inject each fault until the daemon reports it, then clear them and wait for a clean read.

    With ``quiet``, asserts throughout that no notice got through to the trainer and that the
    daemon has no last notice.
    """
    for case in faults:
        emu.clear_faults()
        emu.inject(case.fault)
        release_long_poll(emu)
        wait_until(
            functools.partial(error_matching, vm, provider, case.error),
            f"the daemon to report {case.fault} as an error matching {case.error!r}",
            quiet=quiet,
        )
        if quiet is not None:
            assert assert_alive(vm)["last_notice"] is None
    emu.clear_faults()
    release_long_poll(emu)
    wait_until(lambda: monitor_error(vm, provider) is None, "the monitor to read cleanly again", quiet=quiet)


def more_reads(emu: RunningEmulator, case: ProviderCase, count: int) -> None:
    """Wait until the monitor has read the metadata ``count`` more times (GCP: released long-polls)."""
    for _ in range(count if case.name == "gcp" else 1):
        start = polls(emu, case.polled_path)
        release_long_poll(emu)
        wanted = start + (1 if case.name == "gcp" else count)
        wait_for(functools.partial(polled_at_least, emu, case.polled_path, wanted), WAIT, f"{count} more reads")


def save_for_notice(guard: Guard, step: int) -> Path:
    path = guard.save({"progress": {"step": step}}, step)
    assert json.loads((path / "manifest.json").read_text())["reason"] == "urgent"
    return path


def remote_complete(bucket: str) -> list[str]:
    return [info.name for info in list_remote(FileStorage(bucket)) if info.status == "complete"]


# --- the tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("provider", PROVIDERS)
def test_faults_before_and_after_a_notice_give_no_action_then_exactly_one(
    provider: str,
    vm_factory: Callable[..., Vm],
    emulators: Callable[..., RunningEmulator],
    guards: Callable[[Vm], RecordingGuard],
) -> None:
    case = CASES[provider]
    emu = emulators(provider)
    # Faulty from the very first request: the monitor never had a good answer yet.
    emu.inject(case.faults_at_start[0].fault)
    vm = vm_factory(f"faults-{provider}", env=DAEMON_ENV, extra_args=daemon_args(provider, emu))
    guard = guards(vm)

    ride_out_faults(vm, emu, provider, case.faults_at_start, quiet=guard)
    ride_out_faults(vm, emu, provider, case.faults, quiet=guard)
    if provider == "aws":
        # Expired tokens: the monitor renews on the 401 and reads on, without an error or a notice.
        tokens_before = sum(1 for r in emu.requests() if r["method"] == "PUT")
        emu.control("POST", "expire-tokens", {})
        wait_until(
            lambda: sum(1 for r in emu.requests() if r["method"] == "PUT") > tokens_before,
            "a new IMDSv2 token after the old ones expired",
            quiet=guard,
        )
        start = polls(emu, case.polled_path)
        wait_until(lambda: polls(emu, case.polled_path) >= start + 3, "three more polls", quiet=guard)
        assert monitor_error(vm, provider) is None
    status = assert_alive(vm)
    assert status["last_notice"] is None and status["pending"] is None
    assert handled_events(vm) == {}
    assert not guard.should_checkpoint(1) and not guard.stop_requested

    emu.trigger(**case.notice)
    wait_for(lambda: guard.should_checkpoint(2), WAIT, "the trainer to be told about the notice")
    assert guard.stop_requested
    [event_id] = wait_for(lambda: handled_events(vm), WAIT, "the daemon to record the notice")
    assert guard.told_ids() == [event_id]
    status = assert_alive(vm)
    assert status["last_notice"]["event_id"] == event_id
    assert status["last_notice"]["trainers_told"] == 1
    assert status["pending"]["kind"] == "terminate"

    # The monitor keeps reporting the notice on every good read, with faults in between.
    ride_out_faults(vm, emu, provider, case.faults, quiet=None)
    more_reads(emu, case, 5)
    assert list(handled_events(vm)) == [event_id]
    assert guard.told_ids() == [event_id], "the daemon told the trainer more than once"
    assert actions_logged(vm, event_id) == 1
    assert assert_alive(vm)["last_notice"]["trainers_told"] == 1

    save_for_notice(guard, 2)
    wait_for(lambda: handled_events(vm)[event_id].get("saved_step") == 2, WAIT, "the daemon to record the save")
    more_reads(emu, case, 2)
    assert not guard.should_checkpoint(3)
    assert guard.told_ids() == [event_id]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_restarted_daemon_acts_on_a_notice_that_came_while_it_was_down(
    provider: str,
    vm_factory: Callable[..., Vm],
    emulators: Callable[..., RunningEmulator],
    guards: Callable[[Vm], RecordingGuard],
) -> None:
    case = CASES[provider]
    emu = emulators(provider)
    vm = vm_factory(f"pending-{provider}", env=DAEMON_ENV, extra_args=daemon_args(provider, emu))
    guard = guards(vm)
    wait_for(lambda: polls(emu, case.polled_path) >= 1, WAIT, "the first poll")
    assert vm.stop_daemon() == 0
    wait_for(lambda: not guard.client.connected.is_set(), WAIT, "the Guard to see the daemon go")
    assert handled_events(vm) == {}
    assert not guard.should_checkpoint(1)

    emu.trigger(**case.notice)
    # A slow metadata service (1 s a request, within the 2 s timeout) makes the first check take
    # seconds: the daemon must still have acted on the notice before it tells systemd READY=1.
    emu.inject({"kind": "latency", "seconds": 1.0})
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(vm.dir / "notify.sock"))
        notify.settimeout(WAIT)
        vm.start_daemon(env={"SPOTGUARD_HTTP_TIMEOUT": "2", "NOTIFY_SOCKET": str(vm.dir / "notify.sock")})
        while b"READY=1" not in notify.recv(4096):
            pass
        at_ready = handled_events(vm)
    emu.clear_faults()
    assert len(at_ready) == 1, "READY=1 was sent before the pending notice was acted on"
    wait_for(lambda: guard.should_checkpoint(2), WAIT, "the restarted daemon to tell the trainer")
    assert guard.stop_requested
    [event_id] = wait_for(lambda: handled_events(vm), WAIT, "the daemon to record the notice")
    assert list(at_ready) == [event_id]
    assert guard.told_ids() == [event_id]
    assert assert_alive(vm)["last_notice"]["event_id"] == event_id


@pytest.mark.parametrize("provider", PROVIDERS)
def test_restarted_daemon_does_not_act_twice_on_a_notice_it_handled(
    provider: str,
    vm_factory: Callable[..., Vm],
    emulators: Callable[..., RunningEmulator],
    guards: Callable[[Vm], RecordingGuard],
) -> None:
    case = CASES[provider]
    emu = emulators(provider)
    vm = vm_factory(f"handled-{provider}", env=DAEMON_ENV, extra_args=daemon_args(provider, emu))
    guard = guards(vm)
    emu.trigger(**case.notice)
    wait_for(lambda: guard.should_checkpoint(1), WAIT, "the trainer to be told about the notice")
    [event_id] = wait_for(lambda: handled_events(vm), WAIT, "the daemon to record the notice")
    save_for_notice(guard, 1)
    wait_for(lambda: handled_events(vm)[event_id].get("saved_step") == 1, WAIT, "the daemon to record the save")
    assert not guard.should_checkpoint(2)

    assert vm.stop_daemon() == 0
    connections = guard.client.connections
    start = polls(emu, case.polled_path)
    vm.start_daemon(env=DAEMON_ENV)  # the emulator still reports the same notice
    wait_for(
        lambda: guard.client.connections > connections and guard.client.connected.is_set(),
        WAIT,
        "the Guard to reconnect",
    )
    if provider == "gcp":
        # One plain read, then a long-poll held by the emulator: the notice was read after the restart.
        wait_for(lambda: polls(emu, case.polled_path) >= start + 2 and emu.state()["waiting"] == 1, WAIT, "reads")
    else:
        wait_for(lambda: polls(emu, case.polled_path) >= start + 3, WAIT, "three polls after the restart")
    status = assert_alive(vm)
    assert status["monitor_errors"] == {}
    assert status["pending"]["event_id"] == event_id
    assert not guard.should_checkpoint(3), "the reconnected trainer was asked to checkpoint the same event again"
    assert list(handled_events(vm)) == [event_id]
    # The entry from before the restart is still the one (a second action would have replaced it)...
    assert handled_events(vm)[event_id]["saved_step"] == 1
    # ...and the daemon announced telling the trainers once over both lifetimes (the log is appended to).
    assert actions_logged(vm, event_id) == 1
    # A reconnecting trainer is reminded of the pending notice; it is the same event, so the hook ignores it.
    assert set(guard.told_ids()) == {event_id}


def test_azure_acknowledges_only_after_the_checkpoint_is_committed_in_the_bucket(
    tmp_path: Path, emulators: Callable[..., RunningEmulator], guards: Callable[[Vm], RecordingGuard]
) -> None:
    emu = emulators("azure")
    # Uploads fail until the bucket directory can be made: a file stands where its parent should be.
    # (chmod would not stop the root user these tests may run as.)
    blocker = tmp_path / "blocked"
    blocker.write_text("not a directory")
    bucket = (blocker / "bucket").as_uri()
    vm = Vm(tmp_path, "azure-ack", bucket, extra_args=daemon_args("azure", emu))
    try:
        vm.start_daemon(env=DAEMON_ENV)
        guard = guards(vm)
        event = emu.trigger(type="Preempt", **{"in": 60})
        wait_for(lambda: guard.should_checkpoint(1), WAIT, "the trainer to be told about the notice")
        [event_id] = wait_for(lambda: handled_events(vm), WAIT, "the daemon to record the notice")
        path = save_for_notice(guard, 1)
        wait_for(lambda: assert_alive(vm)["uploads"]["failures"], WAIT, "the first upload attempt to fail")
        start = polls(emu, "/metadata/scheduledevents")
        wait_for(lambda: polls(emu, "/metadata/scheduledevents") >= start + 5, WAIT, "more polls")
        status = assert_alive(vm)
        assert status["last_notice"]["checkpoint"] == path.name  # committed locally...
        assert remote_complete(bucket) == []  # ...not in the bucket...
        assert emu.control("GET", "acks") == []  # ...so Azure must not be told to go ahead
        assert emu.state()["Events"][0]["EventStatus"] == "Scheduled"

        blocker.unlink()  # the uploader's next retry (2 s) can make the directories and commit

        def acknowledged() -> bool:
            acks: list[dict[str, Any]] = emu.control("GET", "acks")
            if acks:
                assert remote_complete(bucket) == [path.name], "acknowledged before the bucket had the checkpoint"
            return bool(acks)

        wait_for(acknowledged, WAIT, "the StartRequests acknowledgement")
        assert emu.control("GET", "acks") == [{"StartRequests": [{"EventId": event["EventId"]}]}]
        # The event log is written off the daemon's loop, after the trainers are told: wait for it.
        wait_for(lambda: handled_events(vm)[event_id].get("committed") == path.name, WAIT, "the commit in the log")
        assert emu.state()["Events"][0]["EventStatus"] == "Started"
        # Started (blank NotBefore) is still the same event: no second action, no second ack.
        start = polls(emu, "/metadata/scheduledevents")
        wait_for(lambda: polls(emu, "/metadata/scheduledevents") >= start + 3, WAIT, "polls of the started event")
        assert not guard.should_checkpoint(2)
        assert guard.told_ids() == [event_id]
        assert len(emu.control("GET", "acks")) == 1
    finally:
        vm.kill_daemon()


def test_aws_completes_the_asg_lifecycle_hook_only_after_the_bucket_commit(
    tmp_path: Path, emulators: Callable[..., RunningEmulator], guards: Callable[[Vm], RecordingGuard]
) -> None:
    emu = emulators("aws")
    blocker = tmp_path / "blocked"  # uploads fail until this file goes (see the Azure test above)
    blocker.write_text("not a directory")
    bucket = (blocker / "bucket").as_uri()
    vm = Vm(tmp_path, "asg-hook", bucket, extra_args=daemon_args("aws", emu))
    env = {
        **DAEMON_ENV,
        "SPOTGUARD_ASG_LIFECYCLE_HOOK": "drain-then-go",
        # boto3's own endpoint override sends the Auto Scaling call to the emulator.
        "AWS_ENDPOINT_URL_AUTO_SCALING": emu.url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
    }
    try:
        vm.start_daemon(env=env)
        guard = guards(vm)
        emu.trigger(kind="lifecycle", state="Terminated")
        wait_for(lambda: guard.should_checkpoint(1), WAIT, "the trainer to be told about the notice")
        assert guard.stop_requested
        path = save_for_notice(guard, 1)
        wait_for(lambda: assert_alive(vm)["uploads"]["failures"], WAIT, "the first upload attempt to fail")
        assert emu.control("GET", "lifecycle-actions") == []  # not committed in the bucket: the group waits

        blocker.unlink()

        def completed() -> bool:
            calls: list[dict[str, str]] = emu.control("GET", "lifecycle-actions")
            if calls:
                assert remote_complete(bucket) == [path.name], "completed before the bucket had the checkpoint"
            return bool(calls)

        wait_for(completed, WAIT, "CompleteLifecycleAction")
        assert emu.control("GET", "lifecycle-actions") == [
            {
                "LifecycleHookName": "drain-then-go",
                "AutoScalingGroupName": "spotguard-trainers",  # found with DescribeAutoScalingInstances
                "InstanceId": "i-0123456789abcdef0",
                "LifecycleActionResult": "CONTINUE",
            }
        ]
    finally:
        vm.kill_daemon()


# GCP answers the same way (one read_answer for the three), but holds its long-poll up to a minute
# between answers: its repeated polls are not waited for here.
@pytest.mark.parametrize("provider", ["aws", "azure"])
def test_a_vm_clock_far_from_the_metadata_services_is_warned_about_before_any_notice(
    provider: str, vm_factory: Callable[..., Vm], emulators: Callable[..., RunningEmulator]
) -> None:
    """A VM clock minutes off the cloud's made the daemon take a spot interruption for one long over;
    the metadata services' Date header tells it before any notice comes."""
    case = CASES[provider]
    emu = emulators(provider)
    vm = vm_factory(f"skew-{provider}", env=DAEMON_ENV, extra_args=daemon_args(provider, emu))
    wait_for(lambda: polls(emu, case.polled_path) >= 2, WAIT, "two polls")

    def warned() -> list[str]:
        return [line for line in vm.log.read_text().splitlines() if "(its answers' Date header)" in line]

    assert warned() == []  # the emulator's clock is this host's
    emu.inject({"kind": "skew", "seconds": 200})
    injected = time.monotonic()
    [line] = wait_for(warned, WAIT, "the clock warning")
    assert_lead_of_skew(line, f"{provider}: this VM's clock is ", 200, waited=time.monotonic() - injected)
    seen = polls(emu, case.polled_path)
    wait_for(lambda: polls(emu, case.polled_path) >= seen + 3, WAIT, "three more polls")
    assert len(warned()) == 1  # once an hour while it lasts, not at every poll


def test_a_vm_clock_hours_ahead_of_the_clouds_ages_no_other_writers_objects_into_leftovers(
    tmp_path: Path, emulators: Callable[..., RunningEmulator]
) -> None:
    """The daemon deletes upload-rate probes and incomplete checkpoints from the bucket once they are
    ``incomplete_grace`` (an hour) untouched, by the store's stamps. Counted on a VM clock two hours
    ahead of the cloud's, another daemon's probe and another node's checkpoint, both five minutes
    old, were an hour past it and deleted; now their age is counted on the cloud's time, which the
    metadata service's Date header gives (the emulator's, two hours behind this host's clock)."""
    ahead = 7200.0
    emu = emulators("aws")
    emu.inject({"kind": "skew", "seconds": ahead})  # before the daemon's first poll
    bucket = tmp_path / "bucket"
    cloud_now = time.time() - ahead

    def left_in_the_bucket(rel: str, age: float) -> Path:
        path = bucket / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 1024)
        os.utime(path, (cloud_now - age, cloud_now - age))
        return path

    young_probe = left_in_the_bucket(f"{PROBE_PREFIX}/another-daemons.bin", 300)
    old_probe = left_in_the_bucket(f"{PROBE_PREFIX}/a-killed-daemons.bin", 3 * 3600)
    young_share = left_in_the_bucket("step-000000005/__1_0.distcp", 300)  # another node's, uploading
    old_share = left_in_the_bucket("step-000000003/__1_0.distcp", 3 * 3600)  # a node that died mid-upload
    vm = Vm(tmp_path, "ahead", bucket.as_uri(), extra_args=daemon_args("aws", emu))
    write_checkpoint(vm.root, 7, {"model.pt": b"w" * 4096})  # its commit runs the bucket's retention
    try:
        vm.start_daemon(env=DAEMON_ENV)
        wait_for(lambda: remote_complete(bucket.as_uri()) == ["step-000000007"], WAIT, "the commit")
        wait_for(lambda: not old_share.exists(), WAIT, "the retention after the commit")
        assert not old_probe.exists()  # the leftovers go as before
        assert young_probe.exists() and young_share.exists()
        assert re.search(r"aws: this VM's clock is 7\d{3} s ahead of the metadata service's", vm.log.read_text())
        assert vm.status()["clock_ahead_s"] == pytest.approx(ahead, abs=2)
    finally:
        vm.kill_daemon()


def test_an_interruption_behind_the_vms_clock_is_acted_on_with_a_short_window(
    vm_factory: Callable[..., Vm],
    emulators: Callable[..., RunningEmulator],
    guards: Callable[[Vm], RecordingGuard],
) -> None:
    """A VM whose clock runs 5 minutes ahead of EC2's sees a spot interruption's "time" 200 s in its
    past: the daemon took it for a notice long over ("the VM outlived its deadline"), told nobody,
    and training went on until the VM was gone."""
    emu = emulators("aws")
    vm = vm_factory("clock-ahead", env=DAEMON_ENV, extra_args=daemon_args("aws", emu))
    guard = guards(vm)
    emu.trigger(kind="spot", action="terminate", **{"in": -200})
    wait_for(lambda: guard.should_checkpoint(1), WAIT, "the daemon to tell the trainer")
    assert guard.stop_requested
    notice = assert_alive(vm)["pending"]
    assert notice["kind"] == "terminate" and notice.get("state", "pending") == "pending"
    assert 15 < notice["seconds_left"] <= 30  # the untimed window from when it was seen, not -200 s
    assert re.search(r"its deadline \S+ is 20\d s behind this VM's clock, yet the VM runs", vm.log.read_text())


def test_an_interruption_on_a_vm_clock_minutes_ahead_gets_its_true_two_minutes(
    vm_factory: Callable[..., Vm],
    emulators: Callable[..., RunningEmulator],
    guards: Callable[[Vm], RecordingGuard],
) -> None:
    """The same VM clock 200 s ahead of EC2's, now measured: the metadata service's Date header says
    so, and the interruption's "time" is moved onto this clock. The race gets the two minutes EC2
    gives, not the 30 s window of a notice that looks long over."""
    ahead = 200
    emu = emulators("aws")
    emu.inject({"kind": "skew", "seconds": ahead})  # EC2's clock, as its Date header gives it
    vm = vm_factory("clock-ahead-measured", env=DAEMON_ENV, extra_args=daemon_args("aws", emu))
    guard = guards(vm)
    emu.trigger(kind="spot", action="terminate", **{"in": NOTICE_S - ahead})  # two minutes on EC2's clock
    wait_for(lambda: guard.should_checkpoint(1), WAIT, "the daemon to tell the trainer")
    notice = assert_alive(vm)["pending"]
    assert NOTICE_S - 15 < notice["seconds_left"] <= NOTICE_S  # before: the untimed 30 s window
    assert "behind this VM's clock, yet the VM runs" not in vm.log.read_text()


def test_aws_without_a_lifecycle_hook_never_calls_auto_scaling(
    tmp_path: Path, emulators: Callable[..., RunningEmulator], guards: Callable[[Vm], RecordingGuard]
) -> None:
    emu = emulators("aws")
    bucket = (tmp_path / "bucket").as_uri()
    vm = Vm(tmp_path, "asg-no-hook", bucket, extra_args=daemon_args("aws", emu))
    try:
        vm.start_daemon(env=DAEMON_ENV)
        guard = guards(vm)
        emu.trigger(kind="lifecycle", state="Terminated")
        wait_for(lambda: guard.should_checkpoint(1), WAIT, "the trainer to be told about the notice")
        path = save_for_notice(guard, 1)
        wait_for(lambda: remote_complete(bucket) == [path.name], WAIT, "the commit in the bucket")
        wait_for(
            lambda: handled_events(vm) and all(e.get("committed") for e in handled_events(vm).values()),
            WAIT,
            "the daemon to record the commit",
        )
        assert emu.control("GET", "lifecycle-actions") == []
    finally:
        vm.kill_daemon()


@pytest.mark.parametrize(
    ("value", "action", "stops"),
    [("TERMINATE_ON_HOST_MAINTENANCE", "stop", True), ("MIGRATE_ON_HOST_MAINTENANCE", "checkpoint", False)],
)
def test_gcp_terminate_on_host_maintenance_is_a_stop(
    value: str,
    action: str,
    stops: bool,
    vm_factory: Callable[..., Vm],
    emulators: Callable[..., RunningEmulator],
    guards: Callable[[Vm], RecordingGuard],
) -> None:
    emu = emulators("gcp")
    vm = vm_factory("gcp-maintenance", env=DAEMON_ENV, extra_args=daemon_args("gcp", emu))
    guard = guards(vm)
    wait_for(lambda: emu.state()["waiting"] == 1, WAIT, "the daemon's long-poll")
    emu.trigger(maintenance_event=value)
    wait_for(lambda: guard.should_checkpoint(1), WAIT, "the trainer to be told about the maintenance event")
    assert guard.stop_requested is stops
    [entry] = wait_for(lambda: handled_events(vm), WAIT, "the daemon to record the notice").values()
    assert entry["action"] == action
    assert entry["notice"]["kind"] == "maintenance"
    assert entry["notice"]["raw"] == {"maintenance_event": value, "terminates": stops}
    notice = assert_alive(vm)["last_notice"]
    assert (notice["kind"], notice["action"]) == ("maintenance", action)
    assert guard.told[0]["stop"] is stops


def test_a_metadata_service_failing_at_every_poll_is_logged_once_then_its_recovery(
    emulators: Callable[..., RunningEmulator], tmp_path: Path, bucket: str
) -> None:
    """An unreachable or broken metadata service (a container's IMDS hop limit) fails every poll for
    the daemon's life: its error is logged once (again only when it changes, or ten minutes on), not
    at every poll, and its end is logged once."""
    emu = emulators("aws")
    emu.inject({"kind": "status", "status": 500})
    vm = Vm(tmp_path, "vm", bucket, extra_args=daemon_args("aws", emu))
    vm.start_daemon(env=DAEMON_ENV)
    try:
        wait_for(lambda: error_matching(vm, "aws", r"HTTP 500"), WAIT, "the daemon to report the failing service")
        start = len(emu.requests())  # every path fails, the token's PUT included
        wait_for(lambda: len(emu.requests()) >= start + 20, WAIT, "20 more failed requests")
        assert error_matching(vm, "aws", r"HTTP 500")  # still failing, still in the status
        warned = [line for line in vm.log.read_text().splitlines() if "WARNING" in line and "HTTP 500" in line]
        assert len(warned) == 1, warned
        emu.clear_faults()
        wait_for(lambda: monitor_error(vm, "aws") is None, WAIT, "the monitor to read cleanly again")
        assert vm.log.read_text().count("aws: the metadata service answers again") == 1
    finally:
        vm.kill_daemon()


def test_a_rebalance_posted_after_a_spot_interruption_still_ends_the_loop_after_one_urgent_save(
    vm_factory: Callable[..., Vm],
    emulators: Callable[..., RunningEmulator],
    guards: Callable[[Vm], RecordingGuard],
) -> None:
    """AWS may post a rebalance recommendation with, or after, the interruption notice. Both reached
    the hook between two steps, the soft one took the hard one's place, and the loop never stopped."""
    emu = emulators("aws")
    vm = vm_factory("spot-then-rebalance", env=DAEMON_ENV, extra_args=daemon_args("aws", emu))
    guard = guards(vm)
    emu.trigger(kind="spot", action="terminate", **{"in": 120})
    wait_for(lambda: len(guard.told) == 1, WAIT, "the interruption to reach the hook")
    emu.trigger(kind="rebalance")
    wait_for(lambda: len(guard.told) == 2, WAIT, "the rebalance recommendation to reach the hook")
    assert [m["stop"] for m in guard.told] == [True, False]
    assert guard.should_checkpoint(1)
    save_for_notice(guard, 1)  # urgent, not soft
    assert guard.stop_requested
    spot_id = guard.told_ids()[0]
    wait_for(lambda: handled_events(vm)[spot_id].get("saved_step") == 1, WAIT, "the daemon to record the save")
    assert not guard.should_checkpoint(2)
