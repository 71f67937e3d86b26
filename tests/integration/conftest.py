"""Fixtures of the integration tests that talk to S3: a fresh moto server per test, and a prefix of
its bucket that this process and the daemons it starts point at."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.servers import S3Server, moto_s3, point_at


@pytest.fixture
def server() -> Iterator[S3Server]:
    with moto_s3() as s3:
        yield s3


@pytest.fixture
def url(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    return point_at(server, monkeypatch)
