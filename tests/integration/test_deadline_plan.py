"""The deadline plan of a real daemon: size and rate measured against moto behind a 1 MB/s relay."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import pytest

from spotguard.cli import main
from spotguard.control import request
from spotguard.crc32c import crc32c_of_bytes
from spotguard.daemon.plan import PROBE_PREFIX
from spotguard.harness import Vm, wait_for
from spotguard.localstore import CheckpointWriter
from spotguard.manifest import FileEntry, write_part
from tests.checkpoints import write_checkpoint
from tests.integration.test_metrics_webhook import Receiver, scrape, value
from tests.pacedrelay import PacedRelay
from tests.servers import S3Server, point_at

MiB = 1 << 20
RATE = 1_000_000  # bytes per second per connection to the bucket


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    yield server
    server.close()


def test_plan_routes_a_notice_by_the_measured_rate_and_shows_its_numbers(
    tmp_path: Path,
    server: S3Server,
    monkeypatch: pytest.MonkeyPatch,
    receiver: Receiver,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = point_at(server, monkeypatch)
    with PacedRelay(server.endpoint_url, RATE) as relay:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", relay.url)
        vm = Vm(tmp_path, "vm-plan", url)
        # The state's size before any trainer spoke: the newest checkpoint on local disk.
        write_checkpoint(vm.root, 3, {"weights.bin": os.urandom(3 * MiB)})
        env = {"SPOTGUARD_METRICS_PORT": "0", "SPOTGUARD_WEBHOOK_URL": receiver.url, "SPOTGUARD_NOTICE_GRACE": "0.5"}
        vm.start_daemon(env=env)
        try:
            metrics = vm.status()["metrics_url"]
            rate = wait_for(
                lambda: value(scrape(metrics), "spotguard_upload_rate_bytes_per_second"), 30, "a measured rate"
            )
            assert 0.2 * RATE < rate < 1.5 * RATE  # the probe went through the paced link
            assert vm.status()["plan"] is None  # no notice, no plan

            # 3 MiB at ~1 MB/s cannot make a 2 s deadline, and there is no peer: local.
            short = request(vm.socket, "drill", deadline_s=2.0)["event_id"]
            plan = vm.status()["plan"]
            assert plan["route"] == "local" and plan["event_id"] == short
            assert plan["bytes"] == 3 * MiB
            assert plan["seconds_needed"] == pytest.approx(3 * MiB / plan["rate_bytes_s"], rel=0.01)
            assert plan["seconds_needed"] > plan["seconds_left"] and 0 < plan["seconds_left"] <= 2.0
            assert main(["status", "--socket", str(vm.socket)]) == 0
            assert "deadline plan: local: 3.0 MiB at" in capsys.readouterr().out
            samples = scrape(metrics)
            assert value(samples, "spotguard_plan_route", route="local") == 1
            assert value(samples, "spotguard_plan_bytes") == 3 * MiB
            notice = wait_for(lambda: receiver.messages(short), 10, "the webhook's notice message")[0]
            assert notice["route"] == "local" and notice["plan_bytes"] == 3 * MiB and "plan: local" in notice["text"]
            wait_for(lambda: vm.status()["plan"] is None, 10, "the short notice to be over")
            assert value(scrape(metrics), "spotguard_plan_route", route="local") is None

            # The same state with a minute to go fits: bucket.
            request(vm.socket, "drill", deadline_s=60.0)
            plan = vm.status()["plan"]
            assert plan["route"] == "bucket" and plan["seconds_needed"] < 0.8 * plan["seconds_left"]
        finally:
            vm.kill_daemon()
    assert "deadline plan for" in vm.log.read_text() and "route local" in vm.log.read_text()
    # The probe object was removed after it was timed.
    client = boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1")
    prefix = url.removeprefix(f"s3://{server.bucket}/")
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=server.bucket, Prefix=prefix).get("Contents", [])]
    client.close()
    assert not [k for k in keys if PROBE_PREFIX in k] and any("step-000000003" in k for k in keys)


def test_in_a_multi_node_job_the_plan_counts_what_this_node_uploads(vm_factory: Callable[..., Vm]) -> None:
    """Node 0 holds the job's whole manifest but uploads only its share; node 1 holds only its share."""
    for node, mine in ((0, 3000), (1, 2000)):
        vm = vm_factory(f"node-{node}")
        writer = CheckpointWriter(vm.root, 5, reason="periodic")
        writer.prepare()
        writer.write_bytes(f"shard.rank{node}.pt", bytes(mine))
        write_part(writer.dir, node, 2, writer.files)
        if node == 0:  # node 0's leader also commits the job's manifest, which lists node 1's files
            writer.files["shard.rank1.pt"] = FileEntry(size=2000, crc32c=crc32c_of_bytes(bytes(2000)))
            writer.meta.update(nodes=2)
            writer.commit()
        request(vm.socket, "saved", path=str(writer.dir), step=5, reason="periodic")
        request(vm.socket, "drill", deadline_s=60)
        assert vm.status()["plan"]["bytes"] == mine
