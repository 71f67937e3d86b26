"""S3Storage against moto in server mode, over real HTTP, with and without injected faults."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import unquote

import boto3
import botocore.exceptions
import google_crc32c
import pytest

from spotguard.crc32c import crc32c_combine
from spotguard.daemon.plan import PROBE_PREFIX, sweep_rate_probes
from spotguard.harness import wait_for
from spotguard.safefile import SymlinkRefused
from spotguard.storage.base import ObjectNotFound, Storage, StorageError, TransientStorageError, put_bytes
from spotguard.storage.s3 import MiB, S3Storage
from tests.faultproxy import FaultProxy
from tests.servers import FAKE_AWS_ENV, S3Server, moto_s3


def crc_hex(data: bytes) -> str:
    return f"{google_crc32c.value(data):08x}"


def write(path: Path, size: int, seed: int) -> tuple[bytes, str]:
    data = random.Random(seed).randbytes(size)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data, crc_hex(data)


@pytest.fixture(scope="module")
def server() -> Iterator[S3Server]:
    with moto_s3() as srv:
        yield srv


@pytest.fixture
def env(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    for k, v in FAKE_AWS_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", server.endpoint_url)
    return server


@pytest.fixture
def url(env: S3Server) -> str:
    # One bucket per module (moto state is process-wide), one prefix per test.
    return f"s3://{env.bucket}/run-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def raw(env: S3Server) -> Iterator[object]:
    client = boto3.client("s3", endpoint_url=env.endpoint_url)
    yield client
    client.close()


def uploads_under(raw: object, bucket: str, prefix: str) -> list[dict[str, object]]:
    resp = raw.list_multipart_uploads(Bucket=bucket, Prefix=prefix)  # type: ignore[attr-defined]
    return list(resp.get("Uploads", []))


def test_crc32c_combine_matches_crc_of_concatenation() -> None:
    rng = random.Random(3)
    for a_len, b_len in [(0, 5), (5, 0), (1, 1), (1000, 777), (8 * MiB + 3, 12345)]:
        a, b = rng.randbytes(a_len), rng.randbytes(b_len)
        combined = crc32c_combine(google_crc32c.value(a), google_crc32c.value(b), len(b))
        assert combined == google_crc32c.value(a + b)


def test_s3_storage_satisfies_protocol(url: str) -> None:
    storage = S3Storage(url)
    assert isinstance(storage, Storage)
    storage.close()


def test_s3_connection_pool_covers_concurrency(url: str) -> None:
    # botocore's default pool of 10 would silently cap 32 parts in flight at 10.
    storage = S3Storage(url, max_concurrency=32)
    assert storage.client.meta.config.max_pool_connections >= 32
    assert storage.client.meta.config.retries["mode"] == "standard"


def test_s3_round_trip_small_files_and_40mib_multipart(url: str, env: S3Server, raw: object, tmp_path: Path) -> None:
    files = {
        "step-1/__0_0.distcp": 40 * MiB,  # 5 parts of 8 MiB
        "step-1/.metadata": 1234,
        "step-1/empty": 0,
        "step-1/manifest.json": 300,
    }
    storage = S3Storage(url, part_size=8 * MiB, max_concurrency=4)
    storage.warm()
    sent = {}
    for i, (key, size) in enumerate(files.items()):
        data, crc = write(tmp_path / "src" / key, size, seed=i)
        sent[key] = (data, crc)
        storage.put_file(tmp_path / "src" / key, key, crc32c=crc)

    for key, (data, crc) in sent.items():
        info = storage.stat(key)
        assert info is not None
        assert (info.key, info.size, info.crc32c) == (key, len(data), crc)
        storage.get_file(key, tmp_path / "dst" / key)
        assert (tmp_path / "dst" / key).read_bytes() == data
    assert storage.read_bytes("step-1/manifest.json") == sent["step-1/manifest.json"][0]
    assert sorted(o.key for o in storage.list()) == sorted(files)
    assert [o.key for o in storage.list("step-1/.")] == ["step-1/.metadata"]
    # the big one really went multipart (composite ETag "...-5") with a full-object checksum
    head = raw.head_object(  # type: ignore[attr-defined]
        Bucket=env.bucket, Key=storage.prefix + "step-1/__0_0.distcp", ChecksumMode="ENABLED"
    )
    assert head["ETag"].strip('"').endswith("-5")
    assert head["ChecksumType"] == "FULL_OBJECT"
    assert not list((tmp_path / "dst" / "step-1").glob(".*.part"))  # temp names renamed away
    storage.close()


def test_s3_endpoint_from_generic_AWS_ENDPOINT_URL(
    env: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.setenv("AWS_ENDPOINT_URL", env.endpoint_url)
    storage = S3Storage(f"s3://{env.bucket}/generic-endpoint")
    data, crc = write(tmp_path / "f", 10, seed=1)
    storage.put_file(tmp_path / "f", "f", crc32c=crc)
    assert storage.read_bytes("f") == data


@pytest.mark.parametrize("size", [1000, 20 * MiB], ids=["single-put", "multipart"])
def test_s3_put_file_rejects_crc32c_mismatch_and_leaves_nothing(
    url: str, env: S3Server, raw: object, tmp_path: Path, size: int
) -> None:
    storage = S3Storage(url, part_size=5 * MiB)
    _, crc = write(tmp_path / "f", size, seed=5)
    wrong = f"{int(crc, 16) ^ 1:08x}"
    with pytest.raises(StorageError, match="CRC32C") as excinfo:
        storage.put_file(tmp_path / "f", "step-2/f", crc32c=wrong)
    assert not storage.is_transient(excinfo.value)
    assert storage.stat("step-2/f") is None
    assert uploads_under(raw, env.bucket, storage.prefix) == []


def test_s3_verify_after_upload_deletes_object_the_store_reports_differently(
    url: str, env: S3Server, tmp_path: Path
) -> None:
    # Pinned: with checksum="auto" a store answering another CRC32C gets Content-MD5 instead
    # (tests/integration/test_checksum_fallback.py).
    storage = S3Storage(url, checksum="crc32c")
    _, crc = write(tmp_path / "f", 100, seed=6)

    def corrupt_head(parsed: dict[str, object], **_: object) -> None:
        # Play a store that kept other bytes than those we sent.
        if "ChecksumCRC32C" in parsed:
            parsed["ChecksumCRC32C"] = "AAAAAA=="

    storage.client.meta.events.register("after-call.s3.HeadObject", corrupt_head)
    with pytest.raises(StorageError, match="it answered 00000000"):
        storage.put_file(tmp_path / "f", "f", crc32c=crc)
    storage.client.meta.events.unregister("after-call.s3.HeadObject", corrupt_head)
    assert storage.stat("f") is None


def test_s3_stat_missing_is_none_and_get_missing_raises_not_found(url: str, tmp_path: Path) -> None:
    storage = S3Storage(url)
    assert storage.stat("nope") is None
    with pytest.raises(ObjectNotFound):
        storage.get_file("nope", tmp_path / "x")
    with pytest.raises(ObjectNotFound):
        storage.read_bytes("nope")
    assert not (tmp_path / "x").exists()


def test_s3_list_paginates_and_delete_batches_past_1000(url: str, env: S3Server, raw: object) -> None:
    storage = S3Storage(url)
    keys = [f"many/{i:05d}" for i in range(1005)]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: raw.put_object(Bucket=env.bucket, Key=storage.prefix + k, Body=b"x"), keys))  # type: ignore[attr-defined]
    raw.put_object(Bucket=env.bucket, Key=storage.prefix + "keep", Body=b"y")  # type: ignore[attr-defined]

    calls: list[int] = []
    storage.client.meta.events.register(
        "provide-client-params.s3.DeleteObjects", lambda params, **_: calls.append(len(params["Delete"]["Objects"]))
    )
    listed = [o.key for o in storage.list("many/")]
    assert listed == keys  # > 1000: needs a second page
    storage.delete([*keys, "never-existed"])
    assert calls == [1000, 6]
    assert [o.key for o in storage.list()] == ["keep"]


@pytest.mark.parametrize(
    ("code", "status", "transient"),
    [
        ("SlowDown", 503, True),
        ("InternalError", 500, True),
        ("Throttling", 400, True),
        ("RequestTimeout", 400, True),
        ("ServiceUnavailable", 503, True),
        ("", 502, True),
        ("", 429, True),
        ("AccessDenied", 403, False),
        ("403", 403, False),
        ("NoSuchKey", 404, False),
        ("NoSuchBucket", 404, False),
        ("InvalidAccessKeyId", 403, False),
        ("SignatureDoesNotMatch", 403, False),
        ("BadDigest", 400, False),
    ],
)
def test_s3_is_transient_classifies_client_errors(code: str, status: int, transient: bool) -> None:
    exc = botocore.exceptions.ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"
    )
    assert S3Storage("s3://b/p").is_transient(exc) is transient


def test_s3_is_transient_classifies_connection_errors() -> None:
    s = S3Storage("s3://b/p")
    assert s.is_transient(botocore.exceptions.EndpointConnectionError(endpoint_url="http://x"))
    assert s.is_transient(botocore.exceptions.ReadTimeoutError(endpoint_url="http://x"))
    assert s.is_transient(botocore.exceptions.ConnectTimeoutError(endpoint_url="http://x"))
    assert s.is_transient(botocore.exceptions.ConnectionClosedError(endpoint_url="http://x"))
    assert s.is_transient(ConnectionResetError())
    assert s.is_transient(TransientStorageError("x"))
    assert not s.is_transient(botocore.exceptions.NoCredentialsError())
    assert not s.is_transient(StorageError("x"))
    assert not s.is_transient(ObjectNotFound("x"))
    assert not s.is_transient(FileNotFoundError("x"))
    assert not s.is_transient(ValueError("x"))


def test_s3_missing_bucket_is_fatal_and_unreachable_endpoint_is_transient(env: S3Server, tmp_path: Path) -> None:
    _, crc = write(tmp_path / "f", 10, seed=7)
    with pytest.raises(StorageError) as excinfo:
        S3Storage("s3://no-such-bucket-sg/p").put_file(tmp_path / "f", "f", crc32c=crc)
    assert not S3Storage("s3://b").is_transient(excinfo.value)
    assert not isinstance(excinfo.value, ObjectNotFound)  # a missing bucket is not a missing object

    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"  # bound, not listening: refused
        storage = S3Storage(f"s3://{env.bucket}/p", endpoint_url=dead, max_attempts=1, attempts=1)
        with pytest.raises(TransientStorageError):
            storage.put_file(tmp_path / "f", "f", crc32c=crc)


def test_s3_warm_reaches_bucket_and_fails_fast_on_missing_bucket(env: S3Server) -> None:
    S3Storage(f"s3://{env.bucket}/p").warm()
    with pytest.raises(StorageError, match="does not exist") as excinfo:
        S3Storage("s3://no-such-bucket-sg/p").warm()
    assert not isinstance(excinfo.value, ObjectNotFound)


def test_s3_warm_needs_no_listing_outside_the_prefix(env: S3Server, url: str, tmp_path: Path) -> None:
    """A role allowed to list only its prefix (an ``s3:prefix`` condition, as the Terraform module's)
    is refused a HeadBucket (S3 authorises it as s3:ListBucket with no prefix): warm() raised at every
    start and the daemon exited. Here a proxy refuses, as S3 would, every request of the bucket itself
    that lists no key under the prefix."""
    storage = S3Storage(url)
    prefix = storage.prefix

    def outside_the_prefix(method: str, target: str) -> bool:
        path, _, query = target.partition("?")
        of_the_bucket = path.rstrip("/") == f"/{env.bucket}"
        params = dict(item.partition("=")[::2] for item in query.split("&") if item)
        return of_the_bucket and "uploads" not in params and not unquote(params.get("prefix", "")).startswith(prefix)

    _, crc = write(tmp_path / "f", 1000, seed=31)
    with FaultProxy(env.endpoint_url, fault_rate=0.0) as proxy:
        proxy.fail(outside_the_prefix, status=403)
        scoped = S3Storage(url, endpoint_url=proxy.url)
        try:
            scoped.warm()
            scoped.put_file(tmp_path / "f", "step-1/f", crc32c=crc)
            assert [o.key for o in scoped.list()] == ["step-1/f"]
            assert scoped.abort_stale_multipart_uploads() == 0
        finally:
            scoped.close()
        assert proxy.injected["403"] == 0, proxy.seen
        assert not any(method == "HEAD" and target.rstrip("/") == f"/{env.bucket}" for method, target in proxy.seen)


def test_s3_warm_fails_at_start_without_credentials(
    env: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no 1 s IMDS probe on a dev box
    with pytest.raises(StorageError, match="no AWS credentials"):
        S3Storage(f"s3://{env.bucket}/p").warm()


# Opens three stores in a fresh interpreter, counting the opens of botocore's model files (an audit
# hook: it cannot be removed, hence the process of its own). The third store's process has no
# credentials left: it must find none, not borrow the first store's.
_THREE_STORES = """
import json, os, sys
import botocore
from spotguard.storage.s3 import S3Storage
from spotguard.storage.base import StorageError
data = os.path.join(os.path.dirname(botocore.__file__), "data")
opened = []
sys.addaudithook(lambda event, args: event == "open" and str(args[0]).startswith(data) and opened.append(args[0]))
counts, paths = [], []
for url in sys.argv[1:3]:
    storage = S3Storage(url)
    storage.warm()
    counts.append(len(opened))
    paths.append(len(storage._api._session._session.get_component("data_loader").search_paths))
for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
    del os.environ[name]
try:
    S3Storage(sys.argv[1]).warm()
    found = "credentials"
except StorageError as exc:
    found = str(exc)
print(json.dumps({"opened": counts, "search_paths": paths, "third": found}))
"""


def test_s3_stores_of_one_process_read_the_sdks_models_once_and_keep_their_own_credentials(
    env: S3Server, tmp_path: Path
) -> None:
    urls = [f"s3://{env.bucket}/a", f"s3://{env.bucket}/b"]
    isolated = {
        **os.environ,
        **FAKE_AWS_ENV,
        "AWS_ENDPOINT_URL_S3": env.endpoint_url,
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    done = subprocess.run(
        [sys.executable, "-c", _THREE_STORES, *urls], capture_output=True, text=True, env=isolated, check=False
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    first, second = result["opened"]
    assert first > 0 and second == first  # the second store read no model file again
    assert result["search_paths"][0] == result["search_paths"][1]  # no folder added per session
    assert "no AWS credentials" in result["third"]


def test_s3_abort_stale_multipart_uploads_aborts_only_under_prefix(url: str, env: S3Server, raw: object) -> None:
    storage = S3Storage(url)
    for key in ("step-1/a", "step-2/b"):
        raw.create_multipart_upload(Bucket=env.bucket, Key=storage.prefix + key)  # type: ignore[attr-defined]
    outside = raw.create_multipart_upload(Bucket=env.bucket, Key="elsewhere/c")  # type: ignore[attr-defined]
    assert len(uploads_under(raw, env.bucket, storage.prefix)) == 2

    assert storage.abort_stale_multipart_uploads() == 2
    assert uploads_under(raw, env.bucket, storage.prefix) == []
    assert [u["Key"] for u in uploads_under(raw, env.bucket, "elsewhere/")] == ["elsewhere/c"]
    raw.abort_multipart_upload(Bucket=env.bucket, Key="elsewhere/c", UploadId=outside["UploadId"])  # type: ignore[attr-defined]


def test_s3_rate_probe_sweep_removes_only_probes_older_than_the_grace(url: str) -> None:
    """A probe a killed daemon never deleted goes; one put a moment later (another daemon probing
    now) stays. The store's own times decide: the grace is the time between the two puts."""
    storage = S3Storage(url)
    try:
        put_bytes(storage, f"{PROBE_PREFIX}/left.bin", b"p" * 1024)
        put_bytes(storage, "step-000000001/w.pt", b"w")
        [left] = storage.list(PROBE_PREFIX)
        assert left.modified is not None
        # The store's times are whole seconds: the next put must fall in a later one.
        wait_for(lambda: datetime.now(UTC) >= left.modified + timedelta(seconds=1.1), 5, "a second to pass")
        put_bytes(storage, f"{PROBE_PREFIX}/fresh.bin", b"p" * 1024)
        fresh = storage.stat(f"{PROBE_PREFIX}/fresh.bin")
        assert fresh is not None and fresh.modified is not None and fresh.modified > left.modified
        grace = (fresh.modified - left.modified) / 2
        assert sweep_rate_probes(storage, older_than=grace, now=fresh.modified) == 1
        assert [obj.key for obj in storage.list()] == [f"{PROBE_PREFIX}/fresh.bin", "step-000000001/w.pt"]
    finally:
        storage.close()


def test_s3_abort_stale_multipart_uploads_spares_recent_ones() -> None:
    # moto reports every upload as initiated in 2010, so the age filter is checked
    # against botocore's Stubber with real timestamps instead.
    import datetime as dt

    from botocore.stub import Stubber

    client = boto3.client("s3", region_name="us-east-1", aws_access_key_id="a", aws_secret_access_key="b")
    now = dt.datetime.now(dt.UTC)
    uploads = [
        {"Key": "p/old", "UploadId": "u-old", "Initiated": now - dt.timedelta(hours=3)},
        {"Key": "p/new", "UploadId": "u-new", "Initiated": now - dt.timedelta(minutes=1)},
    ]
    with Stubber(client) as stub:
        stub.add_response("list_multipart_uploads", {"Uploads": uploads}, {"Bucket": "b", "Prefix": "p/"})
        stub.add_response("abort_multipart_upload", {}, {"Bucket": "b", "Key": "p/old", "UploadId": "u-old"})
        storage = S3Storage("s3://b/p", client=client)
        assert storage.abort_stale_multipart_uploads(older_than=dt.timedelta(hours=1)) == 1
        stub.assert_no_pending_responses()  # exactly the old one was aborted


def test_s3_put_file_survives_10pct_503_500_reset_stall(url: str, env: S3Server, tmp_path: Path) -> None:
    seed = int(os.environ.get("SG_FAULT_SEED", "11"))
    with FaultProxy(env.endpoint_url, fault_rate=0.1, seed=seed, stall_seconds=1.0) as proxy:
        # A read timeout below the stall turns each stall into a timeout the client must retry.
        # botocore retries once (its standard backoff is up to seconds per retry), then our
        # retry, which only goes on if is_transient says so, takes over with short jittered waits.
        storage = S3Storage(
            url,
            max_attempts=2,
            attempts=8,
            endpoint_url=proxy.url,
            part_size=5 * MiB,
            max_concurrency=4,
            read_timeout=0.5,
            connect_timeout=1,
        )
        sent: dict[str, bytes] = {}
        deadline = time.monotonic() + 120
        i = 0
        # Keep uploading until every kind of fault has hit at least twice (bounded).
        kinds = ("503", "500", "reset", "stall")
        while min(proxy.injected[k] for k in kinds) < 2 and time.monotonic() < deadline and i < 60:
            size = 12 * MiB if i % 3 == 0 else 1000 + i  # multipart (3 parts) and single PUTs
            data, crc = write(tmp_path / f"f{i}", size, seed=100 + i)
            storage.put_file(tmp_path / f"f{i}", f"step-1/f{i}", crc32c=crc)
            sent[f"step-1/f{i}"] = data
            i += 1
        assert min(proxy.injected[k] for k in kinds) >= 2, proxy.injected
        for key, data in sent.items():
            info = storage.stat(key)
            assert info is not None and info.crc32c == crc_hex(data)
            storage.get_file(key, tmp_path / "back" / key)
            assert (tmp_path / "back" / key).read_bytes() == data


@pytest.mark.slow
def test_s3_256mib_upload_downloads_identical_bytes(url: str, tmp_path: Path) -> None:
    storage = S3Storage(url, part_size=16 * MiB, max_concurrency=8)
    storage.warm()
    sizes = {"big": 192 * MiB, "mid": 48 * MiB, "small": 16 * MiB}
    sent = {}
    for i, (name, size) in enumerate(sizes.items()):
        sent[name] = write(tmp_path / name, size, seed=200 + i)
    start = time.perf_counter()
    for name, (_, crc) in sent.items():
        storage.put_file(tmp_path / name, name, crc32c=crc)
    elapsed = time.perf_counter() - start
    total = sum(sizes.values())
    print(f"s3 (moto) upload: {total / MiB:.0f} MiB in {elapsed:.2f}s = {total / 1e6 / elapsed:.1f} MB/s")
    for name, (data, _) in sent.items():
        storage.get_file(name, tmp_path / "back" / name)
        assert (tmp_path / "back" / name).read_bytes() == data


def test_a_multipart_upload_whose_completion_keeps_failing_is_aborted_not_left_open(
    env: S3Server, raw: object, url: str, tmp_path: Path
) -> None:
    """The upload's id was dropped before the completion was sent: when the completion failed past
    every retry (an outage, the deadline), the abort that follows found no id and the upload, with
    every part's bytes, stayed open in the bucket; each attempt after it left one more."""
    _, crc = write(tmp_path / "f", 12 * MiB, seed=21)
    with FaultProxy(env.endpoint_url, fault_rate=0.0) as proxy:
        storage = S3Storage(url, endpoint_url=proxy.url, part_size=5 * MiB, max_attempts=1, attempts=2)
        try:
            proxy.fail(lambda method, target: method == "POST" and "uploadId=" in target)  # CompleteMultipartUpload
            for _ in range(2):
                with pytest.raises(TransientStorageError, match="complete_multipart_upload"):
                    storage.put_file(tmp_path / "f", "step-1/f", crc32c=crc)
            assert proxy.injected["503"] == 4  # two attempts of each put reached the completion
            assert uploads_under(raw, env.bucket, storage.prefix) == []
            proxy.fail(None)
            storage.put_file(tmp_path / "f", "step-1/f", crc32c=crc)  # the bucket is back
            assert storage.stat("step-1/f") is not None
            assert uploads_under(raw, env.bucket, storage.prefix) == []
        finally:
            storage.close()


@pytest.mark.parametrize("fault", ["503", "500", "reset", "stall"])
def test_s3_each_real_injected_fault_surfaces_as_transient(env: S3Server, fault: str, tmp_path: Path) -> None:
    _, crc = write(tmp_path / "f", 10, seed=8)
    with FaultProxy(env.endpoint_url, fault_rate=1.0, faults=(fault,), stall_seconds=1.0) as proxy:
        storage = S3Storage(
            f"s3://{env.bucket}/p", endpoint_url=proxy.url, max_attempts=1, attempts=2, read_timeout=0.3
        )
        with pytest.raises(TransientStorageError):
            storage.put_file(tmp_path / "f", "f", crc32c=crc)
        assert proxy.injected[fault] == 2  # our retry tried again once, then gave up


@pytest.mark.parametrize("size", [1000, 12 * MiB], ids=["single", "multipart"])
def test_s3_put_file_refuses_a_symlink_and_uploads_nothing(url: str, raw: object, tmp_path: Path, size: int) -> None:
    _, crc = write(tmp_path / "target", size, seed=4)
    (tmp_path / "link").symlink_to(tmp_path / "target")
    storage = S3Storage(url, part_size=5 * MiB)
    with pytest.raises(SymlinkRefused):
        storage.put_file(tmp_path / "link", "step-1/link", crc32c=crc)
    assert storage.stat("step-1/link") is None
    assert uploads_under(raw, storage.bucket, storage.prefix) == []


def test_a_cancelled_upload_stops_between_parts_and_leaves_no_multipart_upload(
    url: str, raw: object, env: S3Server, tmp_path: Path
) -> None:
    """An urgent checkpoint cancels a periodic upload after the part in flight, not after the whole file."""
    import threading

    from spotguard.manifest import FileEntry
    from spotguard.storage.base import Progress
    from spotguard.storage.checkpoints import UploadCancelled, UploadProgress, put_with_retry

    step_dir = tmp_path / "step-000000007"
    data, crc = write(step_dir / "big.bin", 8 * 5 * MiB, seed=7)  # eight parts of 5 MiB
    storage = S3Storage(url, part_size=5 * MiB, max_concurrency=1, multipart_threshold=5 * MiB)
    cancel = threading.Event()
    parts_sent = 0

    class CancelAfterTwoParts(UploadProgress):
        def sender(self, rel: str) -> Progress:
            counted = super().sender(rel)

            def sent(count: int) -> None:
                nonlocal parts_sent
                counted(count)
                parts_sent += 1
                if parts_sent == 2:
                    cancel.set()  # what the uploader does when an urgent checkpoint arrives

            return sent

    try:
        with pytest.raises(UploadCancelled, match="between parts"):
            put_with_retry(
                storage, step_dir, "big.bin", FileEntry(len(data), crc), progress=CancelAfterTwoParts(), cancel=cancel
            )
        # The part the one stream had already picked up may finish; the other five are never sent.
        assert parts_sent in (2, 3)
        assert storage.stat("step-000000007/big.bin") is None
        prefix = url.split("/", 3)[3]
        assert uploads_under(raw, env.bucket, prefix) == []  # aborted, not left open (and billed)
    finally:
        storage.close()


@pytest.mark.slow
def test_racing_a_deadline_the_sdk_gets_a_short_budget_and_retries_stop_at_the_deadline(env: S3Server) -> None:
    """A store answering 503 forever: without a deadline each request is tried many times (botocore's
    attempts times ours); with one, two per attempt, and the call gives up at the deadline."""
    with FaultProxy(env.endpoint_url, fault_rate=0.0) as proxy:
        url = f"s3://{env.bucket}/run-{uuid.uuid4().hex[:8]}"
        storage = S3Storage(url, endpoint_url=proxy.url, max_attempts=5, attempts=2)
        try:
            storage.warm()
            proxy.set_fault_rate(1.0)
            proxy.faults = ("503",)
            before = proxy.requests
            with pytest.raises(StorageError):
                storage.put_bytes_if_absent("a", b"x", crc32c=crc_hex(b"x"))
            unbounded = proxy.requests - before
            assert unbounded == 5 * 2  # botocore's 5 attempts within each of our 2

            storage.set_deadline(time.monotonic() + 1.5)
            assert storage.client.meta.config.retries["total_max_attempts"] == 2
            assert storage.client.meta.config.read_timeout <= 15
            before, started = proxy.requests, time.monotonic()
            with pytest.raises(StorageError):
                storage.put_bytes_if_absent("a", b"x", crc32c=crc_hex(b"x"))
            assert proxy.requests - before <= 2 * 2
            assert time.monotonic() - started < 5  # our own retries stopped at the deadline

            storage.set_deadline(None)  # the notice is over: the patient client again
            assert storage.client.meta.config.retries["total_max_attempts"] == 5
        finally:
            storage.close()


def test_leftover_uploads_of_a_checkpoints_keys_are_found_with_one_listing_per_folder(
    url: str, env: S3Server, raw: object, tmp_path: Path
) -> None:
    """Multipart uploads a killed run left open on keys of a checkpoint are aborted when this instance
    uploads those keys, another writer's upload of a key it does not write is left alone, and the
    whole folder costs one ListMultipartUploads, not one per file."""
    prefix = url.removeprefix(f"s3://{env.bucket}/")
    keys = {name: f"{prefix}/step-1/{name}" for name in ("a", "b", "theirs")}
    left = {name: raw.create_multipart_upload(Bucket=env.bucket, Key=key)["UploadId"] for name, key in keys.items()}  # type: ignore[attr-defined]
    # Leftovers are uploads opened before the instance, on S3's one-second clock: let it tick past.
    started = time.time()
    while time.time() < started + 2.1:
        time.sleep(0.05)
    storage = S3Storage(url, part_size=5 * MiB)
    listings: list[object] = []
    storage.client.meta.events.register("before-call.s3.ListMultipartUploads", lambda **kw: listings.append(kw))
    try:
        for name, seed in (("a", 21), ("b", 22)):
            data, crc = write(tmp_path / name, 6 * MiB + seed, seed=seed)
            storage.put_file(tmp_path / name, f"step-1/{name}", crc32c=crc)
            assert storage.read_bytes(f"step-1/{name}") == data
    finally:
        storage.close()
    assert len(listings) == 1
    still_open = {(u["Key"], u["UploadId"]) for u in uploads_under(raw, env.bucket, f"{prefix}/step-1/")}
    assert still_open == {(keys["theirs"], left["theirs"])}
