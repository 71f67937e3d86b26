"""Fixtures of the integration tests that talk to S3: a fresh moto server per test, a prefix of its
bucket that this process and the daemons it starts point at, and a daemon listening for peers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from spotguard.harness import Vm
from tests.peers import receiving_daemon
from tests.servers import S3Server, moto_s3, point_at


@pytest.fixture
def server() -> Iterator[S3Server]:
    with moto_s3() as s3:
        yield s3


@pytest.fixture
def url(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    return point_at(server, monkeypatch)


@pytest.fixture
def receiver_vm(tmp_path: Path, url: str) -> Iterator[Vm]:
    """A daemon taking other daemons' checkpoints on its peer port (tests/peers.py), committing to ``url``."""
    with receiving_daemon(tmp_path, url) as vm:
        yield vm
