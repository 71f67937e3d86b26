"""The deadline plan of a job that never saved: the trainer announces its state's size, a real daemon plans
with it, and status, metrics and webhook say where the size came from.

Real daemons in subprocesses, a real ``Guard`` in this process, a real webhook endpoint on 127.0.0.1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from spotguard import Guard, protocol
from spotguard.control import request
from spotguard.harness import Vm, wait_for
from spotguard.trainer.announce import MIN_INTERVAL_S, SizeAnnouncer, measure_state
from spotguard.trainer.client import DaemonClient
from tests.integration.test_daemon_notices import status_text
from tests.integration.test_daemon_socket import exchange
from tests.integration.test_metrics_webhook import Receiver, scrape, value

MiB = 1 << 20


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    yield server
    server.close()


def observed_vm(vm_factory: Callable[..., Vm], receiver: Receiver, name: str) -> Vm:
    return vm_factory(name, env={"SPOTGUARD_METRICS_PORT": "0", "SPOTGUARD_WEBHOOK_URL": receiver.url})


def heard_of(vm: Vm, name: str) -> bool:
    """Whether the daemon has heard ``name``'s commit (queued for upload, or in the bucket already); an
    upload under way says less: files go up as they are written, before the commit."""
    uploads = vm.status()["uploads"]
    return name in uploads["queued"] or name in uploads["committed"]


def announced(vm: Vm) -> list[int | None]:
    return [trainer["state_bytes"] for trainer in vm.status()["trainers"]]


def test_a_notice_before_the_first_save_is_planned_with_the_announced_state(
    vm_factory: Callable[..., Vm], receiver: Receiver
) -> None:
    vm = observed_vm(vm_factory, receiver, "never-saved")
    model = torch.nn.Linear(2048, 4096, bias=False)  # 32 MiB of float32 weights
    state = {"model": model, "epoch": 0}
    guard = Guard(checkpoint_dir=vm.root, socket=vm.socket, handle_sigterm=False)
    try:
        assert guard.resume(state) == 0  # nothing to resume: the trainer has never saved
        sizes = wait_for(lambda: [b for b in announced(vm) if b], 10, "the trainer to announce its state")
        assert sizes[0] >= 32 * MiB and vm.status()["trainers"][0]["sharded"] is False
        wait_for(lambda: vm.status()["upload_rate_bytes_s"], 20, "the start-up probe's rate")

        event_id = request(vm.socket, "drill", deadline_s=60.0)["event_id"]
        plan = vm.status()["plan"]
        assert plan["event_id"] == event_id and plan["size_from"] == "announced"
        assert plan["bytes"] >= 32 * MiB and plan["bytes"] == sizes[0]
        assert plan["seconds_needed"] is not None and plan["seconds_needed"] > 0
        assert "(announced) at" in vm.log.read_text()
        assert "deadline plan: bucket: 32." in status_text(vm)

        samples = scrape(vm.status()["metrics_url"])
        assert value(samples, "spotguard_plan_bytes") == plan["bytes"]
        assert value(samples, "spotguard_plan_size_known", source="announced") == 1
        notice = wait_for(lambda: receiver.messages(event_id), 10, "the webhook's notice message")[0]
        assert notice["plan_bytes"] == plan["bytes"] and notice["plan_size_from"] == "announced"
        assert "(announced)" in notice["text"]
    finally:
        guard.close()
    # Gone with its trainer: the next plan does not count a state nobody holds.
    wait_for(lambda: not vm.status()["trainers"], 10, "the trainer to disconnect")


def test_state_created_at_the_first_step_is_announced_again_and_survives_a_reconnect(
    vm_factory: Callable[..., Vm], receiver: Receiver
) -> None:
    vm = observed_vm(vm_factory, receiver, "grows")
    model = torch.nn.Linear(1024, 2048, bias=False)  # 8 MiB; Adam adds twice that at its first step
    optimizer = torch.optim.Adam(model.parameters())
    state = {"model": model, "optimizer": optimizer}
    guard = Guard(checkpoint_dir=vm.root, socket=vm.socket, handle_sigterm=False)
    try:
        guard.resume(state)
        first = wait_for(lambda: [b for b in announced(vm) if b], 10, "the first announcement")[0]
        assert 8 * MiB <= first < 9 * MiB
        # The loop's first step creates the optimizer's state; a re-measure (every 30 s of wall time by
        # default, at once here) finds it at the next step boundary.
        model(torch.ones(4, 1024)).sum().backward()
        optimizer.step()
        guard.state_size.remeasure_s = 0.0
        guard.state_size.min_interval_s = 0.0
        assert not guard.should_checkpoint(1)
        grown = wait_for(lambda: [b for b in announced(vm) if b and b > first], 10, "the grown state")[0]
        assert grown >= 24 * MiB

        # A restarted daemon hears the size in the hello of the reconnection, without a new measurement.
        guard.state_size.remeasure_s = 3600.0
        vm.stop_daemon()
        vm.start_daemon(env={"SPOTGUARD_METRICS_PORT": "0", "SPOTGUARD_WEBHOOK_URL": receiver.url})
        assert wait_for(lambda: [b for b in announced(vm) if b], 20, "the hello to carry the size") == [grown]
        # Each save measures what it saved.
        state["ema"] = torch.zeros(2 * MiB)  # 8 MiB more
        guard.save(state, 1)
        guard.wait()
        saved = wait_for(lambda: [b for b in announced(vm) if b and b > grown], 10, "the size at the save")[0]
        assert saved >= grown + 8 * MiB
        # The measure of a background save is told as it starts, its commit ("saved") only after it:
        # the plan counts the checkpoint once the daemon has heard of it.
        wait_for(lambda: heard_of(vm, "step-000000001"), 10, "the daemon to hear of the commit")
        request(vm.socket, "drill", deadline_s=60.0)
        plan = vm.status()["plan"]
        assert plan["bytes"] >= saved and plan["size_from"] == "announced+checkpoint"
    finally:
        guard.close()


def test_a_plan_with_nothing_known_says_it_is_a_guess(vm_factory: Callable[..., Vm], receiver: Receiver) -> None:
    vm = observed_vm(vm_factory, receiver, "nothing-known")
    event_id = request(vm.socket, "drill", deadline_s=60.0)["event_id"]
    plan = vm.status()["plan"]
    assert plan["size_from"] == "unknown" and plan["seconds_needed"] is None and plan["route"] == "bucket"
    assert "size unknown: no trainer announced its state and no checkpoint exists yet" in plan["why"]
    assert "is a guess: size unknown" in vm.log.read_text()
    assert "deadline plan: bucket: ? bytes at" in status_text(vm)
    assert value(scrape(vm.status()["metrics_url"]), "spotguard_plan_size_known", source="unknown") == 0
    notice = wait_for(lambda: receiver.messages(event_id), 10, "the webhook's notice message")[0]
    assert notice["plan_size_from"] == "unknown" and "size unknown" in notice["text"]


def test_the_size_is_told_again_only_when_it_moves_by_more_than_5_percent_and_not_too_often(
    vm_factory: Callable[..., Vm],
) -> None:
    vm = vm_factory("throttled")
    now = [1000.0]
    client = DaemonClient(vm.socket, {"rank": 0, "world_size": 1, "pid": os.getpid()}, lambda _m: None).start()
    sizes = SizeAnnouncer(client, clock=lambda: now[0])
    state = {"weights": torch.zeros(MiB // 4)}  # 1 MiB
    try:
        sizes.remember(state)
        first = measure_state(state).bytes
        wait_for(lambda: announced(vm) == [first], 10, "the first size")
        state["weights"] = torch.zeros(MiB // 2)  # doubled, 1 s after the last message: held back
        now[0] += 1
        sizes.remember(state)
        assert announced(vm) == [first]
        now[0] += MIN_INTERVAL_S - 1
        sizes.poll()  # the change held back goes now, without measuring again
        doubled = measure_state(state).bytes
        wait_for(lambda: announced(vm) == [doubled], 10, "the doubled size")
        state["weights"] = torch.zeros(MiB // 2 + MiB // 50)  # +4 %: not worth a message
        now[0] += 100
        sizes.poll()  # measures again (30 s passed) and tells nothing
        state["weights"] = torch.zeros(MiB)
        now[0] += 100
        sizes.poll()
        quadrupled = measure_state(state).bytes
        wait_for(lambda: announced(vm) == [quadrupled], 10, "the quadrupled size")
    finally:
        client.close()
    told = [line for line in vm.log.read_text().splitlines() if "its state takes" in line]
    assert [int(line.split("its state takes ")[1].split()[0]) for line in told] == [first, doubled, quadrupled]


def test_measuring_counts_each_storage_once_and_never_raises() -> None:
    weights = torch.zeros(1024)
    both = measure_state({"a": weights, "view": weights[:10], "copy": {"again": [weights]}})
    assert both.bytes == measure_state({"a": weights}).bytes + 2 * (64 << 10) and not both.sharded

    class Broken(torch.optim.SGD):
        @property
        def state(self) -> Any:  # type: ignore[override]
            raise RuntimeError("not readable")

        @state.setter
        def state(self, _value: Any) -> None:
            pass

    client = DaemonClient(Path("/nonexistent/spotguard.sock"), {"rank": 0, "world_size": 1, "pid": 1}, print)
    try:
        SizeAnnouncer(client).remember({"opt": Broken([torch.nn.Parameter(torch.zeros(1))], lr=0.1)})
    finally:
        client.close()


def test_a_dtensor_counts_its_local_shard_and_makes_the_state_sharded(tmp_path: Path) -> None:
    """One gloo process: a DTensor sharded over a mesh of one is still a rank's share."""
    script = f"""
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from spotguard.trainer.announce import measure_state
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
tensor = distribute_tensor(torch.zeros(1 << 18), init_device_mesh("cpu", (1,)), [Shard(0)])
size = measure_state({{"model": {{"w": tensor}}}})
print(size.bytes, size.sharded)
dist.destroy_process_group()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    nbytes, sharded = done.stdout.split()
    assert int(nbytes) >= 1 << 20 and sharded == "True"


def test_a_state_size_before_hello_is_refused_and_two_sharded_trainers_add_up(vm_factory: Callable[..., Vm]) -> None:
    vm = vm_factory("raw")
    replies = exchange(vm.socket, protocol.encode("state-size", bytes=5, sharded=False) + protocol.encode("status"))
    assert replies[0]["type"] == "error" and replies[0]["code"] == "no-hello"
    assert replies[1]["type"] == "status" and replies[1]["trainers"] == []
    # Two ranks of one node, each holding its share (their hellos carry it), while a notice is pending.
    hello = {"world_size": 2, "checkpoint_dir": str(vm.root), "state_bytes": 40 * MiB, "sharded": True}
    clients = [
        DaemonClient(vm.socket, {**hello, "rank": rank, "pid": os.getpid()}, lambda _m: None).start() for rank in (0, 1)
    ]
    try:
        wait_for(lambda: announced(vm) == [40 * MiB, 40 * MiB], 10, "both ranks' shares")
        request(vm.socket, "drill", deadline_s=60.0)
        assert vm.status()["plan"]["bytes"] == 80 * MiB
        clients[1].send("state-size", bytes=60 * MiB, sharded=True)  # the pending plan is revised at once
        wait_for(lambda: vm.status()["plan"]["bytes"] == 100 * MiB, 10, "the revised plan")
    finally:
        for client in clients:
            client.close()
