"""Metrics scraped over HTTP from a real daemon, and webhook messages received by a real local server."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable, Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from spotguard import Guard
from spotguard.cli import main
from spotguard.config import ConfigError, DaemonConfig, parse_webhook_template
from spotguard.control import request
from spotguard.daemon.webhook import render
from spotguard.harness import Vm, wait_for
from spotguard.manifest import load_manifest
from tests.scrape import Samples, scrape, value


class Receiver:
    """A webhook endpoint on 127.0.0.1 that keeps every JSON body it gets, in order."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        received = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with received.lock:
                    received.bodies.append(json.loads(body))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def messages(self, event_id: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            return [b for b in self.bodies if event_id is None or b.get("event_id") == event_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    yield server
    server.close()


def metrics_url(vm: Vm) -> str:
    url = vm.status()["metrics_url"]
    assert url and url.startswith("http://127.0.0.1:"), url
    return str(url)


def drill(vm: Vm, deadline_s: float) -> str:
    return str(request(vm.socket, "drill", deadline_s=deadline_s)["event_id"])


def uploads_committed(url: str, count: int) -> Callable[[], Samples | None]:
    def check() -> Samples | None:
        samples = scrape(url)
        return samples if value(samples, "spotguard_upload_bytes_count") == count else None

    return check


def save_when_told(guard: Guard, step: int) -> Path:
    wait_for(lambda: guard.should_checkpoint(step), 10, "the checkpoint-now message to reach the hook")
    return guard.save({"weights": list(range(1000)), "step": step}, step)


def test_metrics_and_webhook_follow_a_drill_a_save_and_a_missed_deadline(
    vm_factory: Callable[..., Vm], receiver: Receiver
) -> None:
    vm = vm_factory("vm-m", env={"SPOTGUARD_METRICS_PORT": "0", "SPOTGUARD_WEBHOOK_URL": receiver.url})
    url = metrics_url(vm)
    before = scrape(url)
    assert value(before, "spotguard_trainers_connected") == 0
    assert value(before, "spotguard_upload_bytes_count") == 0
    assert value(before, "spotguard_pending_notice_seconds_left") is None  # absent: nothing pending

    guard = Guard(checkpoint_dir=vm.root, socket=vm.socket, handle_sigterm=False)
    try:
        wait_for(lambda: value(scrape(url), "spotguard_trainers_connected") == 1, 10, "the trainer to show up")

        # Event 1: drill, the hook saves, the uploader commits well before the deadline.
        first = drill(vm, 60)
        saved = save_when_told(guard, 1)

        samples = wait_for(uploads_committed(url, 1), 15, "the drill's checkpoint to be committed in the bucket")
        assert value(samples, "spotguard_notices_total", provider="none", kind="drill", action="stop") == 1
        assert value(samples, "spotguard_checkpoints_saved_total", reason="urgent") == 1
        assert value(samples, "spotguard_checkpoint_bytes") == value(samples, "spotguard_upload_bytes_sum") > 0
        assert 0 < value(samples, "spotguard_upload_duration_seconds_sum") < 15  # type: ignore[operator]
        assert 40 < value(samples, "spotguard_deadline_margin_seconds") < 60  # type: ignore[operator]
        assert 40 < value(samples, "spotguard_pending_notice_seconds_left") <= 60  # type: ignore[operator]
        assert value(samples, "spotguard_upload_failures_total") == 0

        wait_for(lambda: len(receiver.messages(first)) == 2, 10, "the notice and the outcome of the drill")
        notice, outcome = receiver.messages(first)
        assert notice["type"] == "notice" and notice["kind"] == "drill" and notice["action"] == "stop"
        assert outcome["type"] == "outcome" and outcome["outcome"] == "committed"
        assert outcome["checkpoint"] == saved.name and outcome["step"] == 1
        assert 40 < outcome["margin_s"] < 60 and "s to spare" in outcome["text"] and vm.bucket in outcome["text"]

        # Event 2: a 1 s drill nobody saves for in time: "missed" at the deadline, and a late commit
        # of its checkpoint afterwards sends nothing more but shows a negative margin.
        second = drill(vm, 1)
        wait_for(lambda: len(receiver.messages(second)) == 2, 10, "the missed drill's notice and outcome")
        notice, outcome = receiver.messages(second)
        assert notice["type"] == "notice" and outcome["outcome"] == "missed"
        assert "no trainer committed a checkpoint" in outcome["message"]
        save_when_told(guard, 2)
        samples = wait_for(uploads_committed(url, 2), 15, "the late checkpoint to be committed")
        assert value(samples, "spotguard_deadline_margin_seconds") < 0  # type: ignore[operator]
        assert value(samples, "spotguard_checkpoints_saved_total", reason="urgent") == 2

        # Event 3 goes through the same ordered queue: once its notice is in, nothing from event 2 is pending.
        third = drill(vm, 60)
        wait_for(lambda: receiver.messages(third), 10, "the third drill's notice")
        assert [m["type"] for m in receiver.messages(second)] == ["notice", "outcome"]
        assert [m["type"] for m in receiver.messages(first)] == ["notice", "outcome"]
        assert value(scrape(url), "spotguard_notices_total", provider="none", kind="drill", action="stop") == 3
    finally:
        guard.close()
    wait_for(lambda: value(scrape(url), "spotguard_trainers_connected") == 0, 10, "the trainer to be gone")


def test_the_newest_checkpoint_in_the_bucket_is_dated_by_the_committing_vm_and_by_its_replacement(
    vm_factory: Callable[..., Vm], capsys: pytest.CaptureFixture[str]
) -> None:
    """``time() - spotguard_newest_bucket_checkpoint_timestamp_seconds`` is the training a preemption
    would cost now: the daemon that commits a checkpoint sets it, and a replacement VM's daemon reads it
    from the bucket at its start, before any trainer of its own has saved."""
    metrics = {"SPOTGUARD_METRICS_PORT": "0"}
    first = vm_factory("vm-n1", env=metrics)
    newest = "spotguard_newest_bucket_checkpoint_timestamp_seconds"
    assert value(scrape(metrics_url(first)), newest) is None  # an empty bucket: nothing to resume from
    guard = Guard(checkpoint_dir=first.root, socket=first.socket, handle_sigterm=False)
    try:
        wait_for(guard.client.welcomed.is_set, 10, "the trainer to be welcomed")
        made = [load_manifest(guard.save({"w": [s] * 100}, s, reason="final")).created for s in (2, 1)]
    finally:
        guard.close()
    two = datetime.fromisoformat(made[0]).timestamp()
    # Step 1 came last, but step 2 is what a resume loads.
    wait_for(lambda: value(scrape(metrics_url(first)), "spotguard_upload_bytes_count") == 2, 15, "both commits")
    assert value(scrape(metrics_url(first)), newest) == pytest.approx(two, abs=1e-3)
    first.kill_daemon()

    replacement = vm_factory("vm-n2", env={**metrics, "SPOTGUARD_BUCKET_SCAN_INTERVAL": "0.5"})
    found = wait_for(lambda: value(scrape(metrics_url(replacement)), newest), 15, "the replacement's first listing")
    assert found == pytest.approx(two, abs=1e-3)
    said = replacement.status()["uploads"]["newest_in_bucket"]
    assert said["step"] == 2 and datetime.fromisoformat(said["made"]).timestamp() == pytest.approx(two, abs=1e-3)
    assert main(["status", "--socket", str(replacement.socket)]) == 0
    assert f"newest in bucket (what a replacement resumes from): step 2, made {said['made']}" in capsys.readouterr().out
    # The job starts over in an emptied prefix: what the bucket holds now, not what it once held.
    shutil.rmtree(Path(replacement.bucket.removeprefix("file://")))
    wait_for(lambda: value(scrape(metrics_url(replacement)), newest) is None, 15, "a listing of the emptied bucket")
    assert replacement.status()["uploads"]["newest_in_bucket"] is None


def test_failures_show_in_metrics_and_the_webhook_uses_the_template(
    vm_factory: Callable[..., Vm], receiver: Receiver, tmp_path: Path
) -> None:
    not_a_dir = tmp_path / "not-a-directory"
    not_a_dir.write_text("uploads into this 'bucket' fail")
    template = '{"text": "[${host}] ${message}", "what": "${outcome}", "id": "${event_id}", "margin": "${margin_s}"}'
    env = {
        "SPOTGUARD_METRICS_PORT": "0",
        "SPOTGUARD_WEBHOOK_URL": receiver.url,
        "SPOTGUARD_WEBHOOK_TEMPLATE": template,
        "SPOTGUARD_VM_NAME": "vm-f",
        "SPOTGUARD_HTTP_TIMEOUT": "0.5",
        "SPOTGUARD_POLL_INTERVAL": "0.2",
    }
    # Port 1 refuses connections: every metadata check fails.
    args = ["--provider", "aws", "--metadata-url", "http://127.0.0.1:1", "--bucket", not_a_dir.as_uri()]
    vm = vm_factory("vm-f", env=env, extra_args=args)
    url = metrics_url(vm)
    guard = Guard(checkpoint_dir=vm.root, socket=vm.socket, handle_sigterm=False)
    try:
        event_id = drill(vm, 3)
        save_when_told(guard, 1)
        wait_for(lambda: len(receiver.messages()) == 2, 15, "the notice and the outcome")
    finally:
        guard.close()
    notice, outcome = receiver.messages()
    assert set(notice) == {"text", "what", "id", "margin"}
    assert notice["id"] == outcome["id"] == event_id
    assert notice["what"] is None and notice["margin"] is None  # a lone placeholder keeps the JSON value
    assert notice["text"].startswith("[vm-f] aws drill notice on vm-f")
    assert outcome["what"] == "upload-failed" and outcome["text"].startswith("[vm-f] upload failed")
    samples = scrape(url)
    assert value(samples, "spotguard_upload_failures_total") >= 1  # type: ignore[operator]
    assert value(samples, "spotguard_monitor_errors_total", monitor="aws") >= 1  # type: ignore[operator]
    assert value(samples, "spotguard_upload_bytes_count") == 0
    assert value(samples, "spotguard_deadline_margin_seconds") == 0  # never set: nothing committed


def test_metrics_are_off_by_default_and_registries_are_injected(vm_factory: Callable[..., Vm]) -> None:
    from spotguard.daemon.metrics import DaemonMetrics

    vm = vm_factory("vm-plain")
    assert vm.status()["metrics_url"] is None
    # A fresh registry per instance: two never collide (no process-wide default registry).
    first, second = CollectorRegistry(), CollectorRegistry()
    DaemonMetrics(first).upload_failures.inc()
    DaemonMetrics(second)
    assert first.get_sample_value("spotguard_upload_failures_total") == 1
    assert second.get_sample_value("spotguard_upload_failures_total") == 0


def test_webhook_templates_are_checked_at_config_time_and_render_valid_json() -> None:
    parsed = parse_webhook_template('{"text": "$$5 on ${host}: ${message}", "n": "${step}", "${kind}": ["${step}"]}')
    body = render(parsed, {"host": 'vm "1"', "message": "done", "step": 7, "kind": "drill"})
    assert body == {"text": '$5 on vm "1": done', "n": 7, "drill": [7]}
    assert json.loads(json.dumps(body)) == body
    for bad, problem in (
        ('{"text": "${nope}"}', "unknown placeholder"),
        ('{"text": "$"}', "bad placeholder"),
        ("{text: 1}", "not valid JSON"),
    ):
        with pytest.raises(ConfigError, match=problem):
            DaemonConfig(webhook_template=bad)
    with pytest.raises(ConfigError, match="webhook_url"):
        DaemonConfig(webhook_url="ftp://example.com/hook")
    with pytest.raises(ConfigError, match="metrics_port"):
        DaemonConfig(metrics_port=70000)
