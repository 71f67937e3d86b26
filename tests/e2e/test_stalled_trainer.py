"""A trainer that never reaches a checkpoint point after a notice (a hand-written loop that does not call
``should_checkpoint``, as one stuck in evaluation or a long data-loader start would) is reported by the
daemon within its bound: log, ``status`` (text and ``--json``), a metric and a webhook message. A trainer
that asks in time is not."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from spotguard import Guard
from spotguard.harness import Vm, wait_for
from tests.integration.test_metrics_webhook import Receiver, drill, metrics_url, scrape, value

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 20.0  # 10 % of it is 2 s, below the 3 s floor: the bound is 3 s
BOUND_S = 3.0
SLACK_S = 1.5  # the daemon looks every 0.25 s; the status requests are polled on 2 shared cores


@pytest.fixture
def webhook() -> Iterator[Receiver]:
    server = Receiver()
    yield server
    server.close()


# Trains "steps" (each a little work) until told to stop by a file; asks should_checkpoint only once
# the test creates the "ask" file (a loop that finally leaves a long evaluation).
DEAF_LOOP = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from spotguard import Guard

    root, socket, stop, ask = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    guard = Guard(checkpoint_dir=root, socket=socket, handle_sigterm=False)
    guard.client.connected.wait(10)
    print("connected", flush=True)
    step = 0
    while not stop.exists():
        time.sleep(0.01)  # the step's work: a kernel the CPU waits for
        step += 1
        if ask.exists() and guard.should_checkpoint(step):
            ask.unlink()
    guard.close()
    """
)


def test_a_loop_that_never_calls_should_checkpoint_is_reported_within_the_bound(
    vm_factory: Callable[..., Vm], webhook: Receiver, tmp_path: Path
) -> None:
    vm = vm_factory("vm-s", env={"SPOTGUARD_METRICS_PORT": "0", "SPOTGUARD_WEBHOOK_URL": webhook.url})
    url = metrics_url(vm)
    stop, ask = tmp_path / "stop", tmp_path / "ask"
    deaf = subprocess.Popen(
        [sys.executable, "-c", DEAF_LOOP, str(vm.root), str(vm.socket), str(stop), str(ask)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    attentive = Guard(checkpoint_dir=vm.root, socket=vm.socket, handle_sigterm=False)
    try:
        assert deaf.stdout is not None and deaf.stdout.readline().strip() == "connected"
        wait_for(lambda: len(vm.status()["trainers"]) == 2, 10, "both trainers to connect")

        told = time.monotonic()
        event_id = drill(vm, DEADLINE_S)
        # The attentive loop reaches its step boundary at once and asks; it is not reported.
        wait_for(lambda: attentive.should_checkpoint(1), 10, "the notice to reach the attentive hook")
        stalled = wait_for(lambda: vm.status()["stalled"], BOUND_S + SLACK_S + 5, "the deaf trainer to be reported")
        waited = time.monotonic() - told
        assert BOUND_S - 0.3 <= waited <= BOUND_S + SLACK_S, waited

        assert [(s["pid"], s["event_id"]) for s in stalled] == [(deaf.pid, event_id)]
        message = stalled[0]["message"]
        assert re.fullmatch(
            rf"trainer pid {deaf.pid} has not reached a checkpoint point for [34] s; the deadline is in 1[5-7] s",
            message,
        ), message
        assert stalled[0]["bound_s"] == BOUND_S

        text = subprocess.run(
            [sys.executable, "-m", "spotguard", "status", "--socket", str(vm.socket)],
            capture_output=True,
            text=True,
            cwd=REPO,
            check=True,
        ).stdout
        assert f"STALLED: trainer pid {deaf.pid} has not reached a checkpoint point" in text

        assert message in vm.log.read_text()
        samples = scrape(url)
        assert value(samples, "spotguard_trainers_stalled") == 1
        assert value(samples, "spotguard_trainer_stalls_total") == 1
        wait_for(lambda: [m for m in webhook.messages(event_id) if m["type"] == "stalled"], 10, "the webhook message")
        (hook,) = [m for m in webhook.messages(event_id) if m["type"] == "stalled"]
        assert hook["pid"] == deaf.pid and hook["text"].startswith(message)

        # The attentive trainer's checkpoint is what the daemon got; the deaf one is still the only stall.
        attentive.save({"weights": list(range(100))}, 1)
        wait_for(lambda: vm.status()["last_notice"].get("saved_step") == 1, 10, "the attentive trainer's save")
        assert [s["pid"] for s in vm.status()["stalled"]] == [deaf.pid]

        # The deaf loop finally asks: the report clears while it is still connected.
        ask.touch()
        wait_for(lambda: not ask.exists() and vm.status()["stalled"] == [], 10, "the report to clear once asked")
        assert len(vm.status()["trainers"]) == 2
        late = rf"trainer pid {deaf.pid} reached a checkpoint point at step \d+ after all"
        assert re.search(late, vm.log.read_text())
    finally:
        stop.touch()
        attentive.close()
        try:
            deaf.wait(timeout=20)
        finally:
            deaf.kill()
    assert deaf.returncode == 0
