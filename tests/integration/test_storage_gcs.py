"""GcsStorage against gcp-storage-emulator over real HTTP, with and without injected faults."""

from __future__ import annotations

import base64
import logging
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import google.api_core.exceptions as gexc
import google_crc32c
import pytest
import requests

from spotguard.safefile import SymlinkRefused
from spotguard.storage.base import ChecksumMismatch, ObjectNotFound, Storage, StorageError, TransientStorageError
from spotguard.storage.checkpoints import upload_checkpoint, verify_remote
from spotguard.storage.gcs import PARTS_DIR, GcsStorage, gcs_crc_to_hex, part_plan
from tests.checkpoints import write_checkpoint
from tests.faultproxy import FaultProxy
from tests.servers import GcsServer, gcs_emulator

MiB = 1024 * 1024


def crc_hex(data: bytes) -> str:
    return f"{google_crc32c.value(data):08x}"


def write(path: Path, size: int, seed: int) -> tuple[bytes, str]:
    data = random.Random(seed).randbytes(size)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data, crc_hex(data)


@pytest.fixture(scope="module")
def server() -> Iterator[GcsServer]:
    with gcs_emulator() as srv:
        yield srv


@pytest.fixture
def env(server: GcsServer, monkeypatch: pytest.MonkeyPatch) -> GcsServer:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.endpoint_url)
    return server


@pytest.fixture
def url(env: GcsServer) -> str:
    return f"gs://{env.bucket}/run-{uuid.uuid4().hex[:8]}"


def all_names(storage: GcsStorage) -> list[str]:
    """Every object under the storage's prefix, upload parts included (list() hides those)."""
    return sorted(
        b.name[len(storage.prefix) :] for b in storage.client.list_blobs(storage.bucket_name, prefix=storage.prefix)
    )


def test_gcs_crc_to_hex_is_big_endian_hex() -> None:
    data = b"123456789"
    b64 = base64.b64encode(google_crc32c.Checksum(data).digest()).decode()
    assert gcs_crc_to_hex(b64) == "e3069283"  # the CRC32C check value
    assert gcs_crc_to_hex(None) is None
    assert gcs_crc_to_hex("not base64!") is None


def test_gcs_storage_satisfies_protocol(url: str) -> None:
    assert isinstance(GcsStorage(url), Storage)


def test_gcs_connection_pool_covers_concurrency(url: str) -> None:
    # requests' default pool of 10 per host would silently cap 32 parts in flight at 10.
    storage = GcsStorage(url, max_concurrency=32)
    adapter = storage.client._http.get_adapter("http://127.0.0.1/")
    assert adapter._pool_maxsize >= 32


def test_files_composed_together_stay_within_the_connection_pool(
    url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each composed file deleted its parts with a pool of max_concurrency threads of its own; files
    finishing together (a checkpoint of several) made more connections than the pool keeps, each made
    for one request and dropped after it: a new handshake and slow start for the next, and one urllib3
    warning each. Deletes now take the instance's budget, and the pool covers it and a file-level
    request per file in flight."""
    files = {f"f{i:02d}.bin": random.Random(i).randbytes(2 * MiB) for i in range(12)}
    step_dir = write_checkpoint(tmp_path / "nvme", 1, files)
    storage = GcsStorage(url, max_concurrency=8, parallel_threshold=512 * 1024, part_size=256 * 1024)
    with caplog.at_level(logging.WARNING, logger="urllib3"):
        upload_checkpoint(storage, step_dir, concurrency=8)
    assert [r.getMessage() for r in caplog.records if r.name.startswith("urllib3")] == []
    assert verify_remote(storage, "step-000000001") == []
    assert not [name for name in all_names(storage) if PARTS_DIR in name]  # every part deleted


def test_gcs_round_trip_small_files_and_40mib_resumable(url: str, tmp_path: Path) -> None:
    files = {"step-1/model.pt": 40 * MiB, "step-1/.metadata": 1234, "step-1/empty": 0, "step-1/manifest.json": 300}
    storage = GcsStorage(url, chunk_size=8 * MiB, parallel_threshold=1 << 40)  # no compose here
    storage.warm()
    sent = {}
    for i, (key, size) in enumerate(files.items()):
        sent[key] = write(tmp_path / "src" / key, size, seed=i)
        storage.put_file(tmp_path / "src" / key, key, crc32c=sent[key][1])
    for key, (data, crc) in sent.items():
        info = storage.stat(key)
        assert info is not None
        assert (info.key, info.size, info.crc32c) == (key, len(data), crc)
        storage.get_file(key, tmp_path / "dst" / key)
        assert (tmp_path / "dst" / key).read_bytes() == data
    assert storage.read_bytes("step-1/manifest.json") == sent["step-1/manifest.json"][0]
    listed = {o.key: o for o in storage.list()}
    assert sorted(listed) == sorted(files)
    assert all(listed[k].crc32c == sent[k][1] for k in files)  # GCS lists CRC32C too
    assert [o.key for o in storage.list("step-1/.")] == ["step-1/.metadata"]
    assert not list((tmp_path / "dst" / "step-1").glob(".*.part"))


def test_gcs_large_file_goes_up_as_parallel_parts_then_compose(
    env: GcsServer, url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    data, crc = write(tmp_path / "big", 40 * MiB, seed=9)
    with FaultProxy(env.endpoint_url, fault_rate=0.0, flavor="gcs") as recorder:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", recorder.url)
        storage = GcsStorage(url, parallel_threshold=16 * MiB, part_size=8 * MiB, max_concurrency=4)
        storage.put_file(tmp_path / "big", "step-1/big", crc32c=crc)
        composes = [t for m, t in recorder.seen if m == "POST" and "/compose" in t]
        uploads = [t for m, t in recorder.seen if m == "POST" and "uploadType=" in t]
        assert len(composes) == 1
        assert len(uploads) == 5  # five 8 MiB parts, one request each
        info = storage.stat("step-1/big")
        assert info is not None and (info.size, info.crc32c) == (len(data), crc)
        assert all_names(storage) == ["step-1/big"]  # parts deleted
        storage.get_file("step-1/big", tmp_path / "back")  # >= parallel_threshold: ranged reads
        assert (tmp_path / "back").read_bytes() == data
        ranged = [t for m, t in recorder.seen if m == "GET" and "alt=media" in t]
        assert len(ranged) == 4  # one 10 MiB range per stream (never under the 8 MiB part size)


def test_parts_the_failing_store_would_not_delete_are_deleted_once_it_answers_again(
    env: GcsServer, url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The outage that fails a composed upload also fails the delete of its parts: they stayed in the
    bucket for the daemon's life (hidden from listings, so retention never saw them) until a restart."""
    _, crc = write(tmp_path / "big", 24 * MiB, seed=12)
    with FaultProxy(env.endpoint_url, fault_rate=0.0, flavor="gcs") as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        storage = GcsStorage(url, parallel_threshold=16 * MiB, part_size=8 * MiB, max_concurrency=4, retry_deadline=1.0)
        storage.parts.failed_deletes.interval = 0.0  # the daemon's rescans call it; a minute apart at most
        try:
            proxy.fail(lambda method, target: (method == "POST" and "/compose" in target) or method == "DELETE")
            with pytest.raises(StorageError):
                storage.put_file(tmp_path / "big", "step-1/big", crc32c=crc)
            parts = [name for name in all_names(storage) if name.startswith(PARTS_DIR)]
            assert len(parts) == 3
            assert storage.retry_aborts() == 0  # the store still fails: kept for the next try
            proxy.fail(None)
            assert storage.retry_aborts() == 3
            assert all_names(storage) == []
            assert storage.retry_aborts() == 0
        finally:
            storage.close()


@pytest.mark.parametrize("size", [1000, 20 * MiB, 40 * MiB], ids=["multipart", "resumable", "composed"])
def test_gcs_put_file_rejects_crc32c_mismatch_and_leaves_nothing(url: str, tmp_path: Path, size: int) -> None:
    storage = GcsStorage(url, parallel_threshold=32 * MiB, part_size=8 * MiB)
    _, crc = write(tmp_path / "f", size, seed=5)
    wrong = f"{int(crc, 16) ^ 1:08x}"
    with pytest.raises(StorageError) as excinfo:
        storage.put_file(tmp_path / "f", "step-2/f", crc32c=wrong)
    assert not storage.is_transient(excinfo.value)
    assert storage.stat("step-2/f") is None
    assert all_names(storage) == []  # no object, no parts


class WrongCrcGcs(GcsStorage):
    """Plays a GCS-compatible store that takes the bytes and answers another CRC32C for them."""

    def _put_one(self, local: Path, full: str, expected: int) -> object:
        blob = super()._put_one(local, full, expected)
        blob._properties["crc32c"] = base64.b64encode((expected ^ 0xFFFF).to_bytes(4, "big")).decode()
        return blob


def test_gcs_store_answering_another_crc32c_is_a_checksum_mismatch_not_a_transient_fault(
    url: str, tmp_path: Path
) -> None:
    storage = WrongCrcGcs(url)
    _, crc = write(tmp_path / "f", 1000, seed=8)
    with pytest.raises(ChecksumMismatch) as excinfo:
        storage.put_file(tmp_path / "f", "step-3/f", crc32c=crc)
    # The uploader does not retry a ChecksumMismatch; the backend's own retry does not either.
    assert not storage.is_transient(excinfo.value)
    assert excinfo.value.sent == crc and excinfo.value.answered == f"{int(crc, 16) ^ 0xFFFF:08x}"
    assert storage.stat("step-3/f") is None


def test_gcs_stat_missing_is_none_and_get_missing_raises_not_found(url: str, tmp_path: Path) -> None:
    storage = GcsStorage(url)
    assert storage.stat("nope") is None
    with pytest.raises(ObjectNotFound):
        storage.get_file("nope", tmp_path / "x")
    with pytest.raises(ObjectNotFound):
        storage.read_bytes("nope")
    assert not (tmp_path / "x").exists()


def test_gcs_delete_removes_keys_and_ignores_missing(url: str, tmp_path: Path) -> None:
    storage = GcsStorage(url)
    for i in range(5):
        _, crc = write(tmp_path / f"f{i}", 10 + i, seed=i)
        storage.put_file(tmp_path / f"f{i}", f"step-1/f{i}", crc32c=crc)
    storage.delete(["step-1/f0", "step-1/f1", "step-1/f2", "never-existed"])
    assert [o.key for o in storage.list()] == ["step-1/f3", "step-1/f4"]


def test_gcs_list_stays_inside_prefix(url: str) -> None:
    # (The emulator ignores maxResults, so paging itself, which google-api-core's
    # HTTPIterator does by nextPageToken, cannot be exercised here.)
    storage = GcsStorage(url)
    sibling = GcsStorage(url + "2")  # "run-x2/" must not show up under "run-x/"
    for i in range(3):
        storage.bucket.blob(f"{storage.prefix}p/{i}").upload_from_string(b"x")
        sibling.bucket.blob(f"{sibling.prefix}p/{i}").upload_from_string(b"y")
    assert [o.key for o in storage.list("p/")] == ["p/0", "p/1", "p/2"]
    assert [(o.size, o.crc32c) for o in storage.list("p/0")] == [(1, crc_hex(b"x"))]


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (gexc.TooManyRequests("slow down"), True),
        (gexc.InternalServerError("boom"), True),
        (gexc.ServiceUnavailable("busy"), True),
        (gexc.BadGateway("bad"), True),
        (gexc.GatewayTimeout("slow"), True),
        (requests.exceptions.ConnectionError("reset"), True),
        (requests.exceptions.ReadTimeout("timeout"), True),
        (ConnectionResetError(), True),
        (TransientStorageError("x"), True),
        (gexc.Forbidden("no"), False),
        (gexc.Unauthorized("no"), False),
        (gexc.NotFound("no"), False),
        (gexc.BadRequest("crc mismatch"), False),
        (gexc.PreconditionFailed("gen"), False),
        (StorageError("x"), False),
        (ValueError("x"), False),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_gcs_is_transient_classification(exc: BaseException, transient: bool) -> None:
    assert GcsStorage("gs://b/p").is_transient(exc) is transient


def test_gcs_missing_bucket_is_fatal_and_unreachable_emulator_is_transient(
    env: GcsServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _, crc = write(tmp_path / "f", 10, seed=7)
    with pytest.raises(StorageError) as excinfo:
        GcsStorage("gs://no-such-bucket-sg/p").warm()
    assert not GcsStorage("gs://b").is_transient(excinfo.value)
    with pytest.raises(StorageError) as excinfo:
        GcsStorage("gs://no-such-bucket-sg/p").put_file(tmp_path / "f", "f", crc32c=crc)
    assert not GcsStorage("gs://b").is_transient(excinfo.value)
    assert not isinstance(excinfo.value, ObjectNotFound)  # a missing bucket is not a missing object

    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{sock.getsockname()[1]}")
        storage = GcsStorage(f"gs://{env.bucket}/p", retry_deadline=0.5)
        with pytest.raises(TransientStorageError):
            storage.put_file(tmp_path / "f", "f", crc32c=crc)


def test_gcs_abort_stale_multipart_uploads_deletes_leftover_parts(url: str, tmp_path: Path) -> None:
    storage = GcsStorage(url)
    _, crc = write(tmp_path / "f", 10, seed=1)
    storage.put_file(tmp_path / "f", "step-1/f", crc32c=crc)
    for name in ("abc/00000", "abc/00001", "def/00000"):
        storage.bucket.blob(f"{storage.prefix}{PARTS_DIR}/{name}").upload_from_string(b"part")
    assert [o.key for o in storage.list()] == ["step-1/f"]  # parts are never listed
    assert storage.abort_stale_multipart_uploads() == 3
    assert all_names(storage) == ["step-1/f"]


def test_gcs_put_file_survives_10pct_503_500_reset_stall(
    env: GcsServer, url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seed = int(os.environ.get("SG_FAULT_SEED", "5"))
    with FaultProxy(env.endpoint_url, fault_rate=0.1, seed=seed, stall_seconds=1.0, flavor="gcs") as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        # One part at a time: the emulator serves one request at a time, so parallel parts
        # would queue behind each other and time out on their own, hiding injected stalls.
        storage = GcsStorage(
            url, timeout=0.5, chunk_size=1 * MiB, parallel_threshold=8 * MiB, part_size=4 * MiB, max_concurrency=1
        )
        sent: dict[str, bytes] = {}
        deadline = time.monotonic() + 120
        i = 0
        # Keep uploading until every kind of fault has hit at least twice (bounded).
        kinds = ("503", "500", "reset", "stall")
        while min(proxy.injected[k] for k in kinds) < 2 and time.monotonic() < deadline and i < 60:
            # resumable in 1 MiB chunks, single-request uploads, and 3 parts + compose
            size = (3 * MiB, 1000 + i, 10 * MiB)[i % 3]
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


def test_gcs_a_chunk_whose_answer_is_lost_starts_the_object_again_in_a_new_session(
    env: GcsServer, url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The session takes a chunk and its answer is lost: the library sends the chunk again at the
    offset it knows, which the session refuses (400). The object starts again in a new session and
    arrives whole."""
    with FaultProxy(env.endpoint_url, fault_rate=0.0, flavor="gcs") as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        storage = GcsStorage(url, timeout=5, chunk_size=1 * MiB, parallel_threshold=64 * MiB, max_concurrency=1)
        data, crc = write(tmp_path / "f", 10 * MiB, seed=3)  # over 8 MiB: a resumable session
        proxy.lose_answer(lambda method, target: method == "PUT" and "upload_id=" in target)
        storage.put_file(tmp_path / "f", "step-1/f", crc32c=crc)
        assert proxy.answers_lost == 1
        assert storage.read_bytes("step-1/f") == data
    assert "refused a chunk" in caplog.text


@pytest.mark.slow
def test_gcs_256mib_upload_downloads_identical_bytes(url: str, tmp_path: Path) -> None:
    storage = GcsStorage(url)
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
    print(f"gcs (emulator) upload: {total / MiB:.0f} MiB in {elapsed:.2f}s = {total / 1e6 / elapsed:.1f} MB/s")
    for name, (data, _) in sent.items():
        storage.get_file(name, tmp_path / "back" / name)
        assert (tmp_path / "back" / name).read_bytes() == data


@pytest.mark.parametrize("fault", ["503", "500", "reset", "stall"])
def test_gcs_each_real_injected_fault_surfaces_as_transient(
    env: GcsServer, fault: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _, crc = write(tmp_path / "f", 10, seed=8)
    with FaultProxy(env.endpoint_url, fault_rate=1.0, faults=(fault,), stall_seconds=1.0, flavor="gcs") as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        storage = GcsStorage(f"gs://{env.bucket}/p", timeout=0.3, retry_deadline=0.5)
        with pytest.raises(TransientStorageError):
            storage.put_file(tmp_path / "f", "f", crc32c=crc)
        assert proxy.injected[fault] >= 2  # retried while the deadline allowed


def test_gcs_parts_over_the_cap_are_composed_in_rounds_of_32(url: str, tmp_path: Path) -> None:
    # 40 parts of 256 KiB (the cap): more than one compose call takes, so they are joined in rounds.
    data, crc = write(tmp_path / "big", 40 * 256 * 1024 - 7, seed=12)
    storage = GcsStorage(
        url, parallel_threshold=1 * MiB, part_size=256 * 1024, max_part_size=256 * 1024, max_concurrency=4
    )
    assert len(part_plan(len(data), storage.part_size, storage.max_part_size)) == 40
    storage.put_file(tmp_path / "big", "step-1/big", crc32c=crc)
    info = storage.stat("step-1/big")
    assert info is not None and (info.size, info.crc32c) == (len(data), crc)
    assert all_names(storage) == ["step-1/big"]  # parts and intermediate joins deleted
    assert storage.read_bytes("step-1/big") == data


# Uploads a file in a process of its own and prints that process's peak RSS in KiB: VmHWM, the high
# water mark of its own memory since exec. (Not ru_maxrss: Linux carries the parent's peak across
# exec into it, and the parent here holds the emulator's objects.) Default sizes and concurrency;
# long timeouts only because the emulator serves one request at a time and composes by repeated
# concatenation (its cost grows with the square of the size: minutes for 2 GiB on a busy machine).
_UPLOAD_AND_REPORT_RSS = """
import re, sys
from pathlib import Path
from spotguard.storage.gcs import GcsStorage
url, path, crc = sys.argv[1:4]
GcsStorage(url, timeout=600, retry_deadline=900).put_file(Path(path), "step-1/huge", crc32c=crc)
print(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1))
"""


@pytest.mark.slow
def test_gcs_upload_of_512mib_keeps_the_uploader_rss_under_480mb(url: str, tmp_path: Path) -> None:
    # 512 MiB: more than the bound, so an upload that held the whole file fails; the memory in use is
    # the stream budget's requests, the same for any bigger file (371 MB measured for 1 and 2 GiB).
    # Not 1 GiB: the emulator composes by repeated concatenation, its cost the square of the size.
    size = 512 * MiB
    path = tmp_path / "huge"
    with path.open("wb") as out:  # sparse: fast to make, and read back as zeros like any other bytes
        out.truncate(size)
    crc = _crc_of_zeros(size)
    result = subprocess.run(
        [sys.executable, "-c", _UPLOAD_AND_REPORT_RSS, url, str(path), crc],
        check=False,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert result.returncode == 0, result.stderr
    peak_mb = int(result.stdout.split()[-1]) * 1024 / 1e6
    print(f"gcs upload of 512 MiB: peak RSS {peak_mb:.0f} MB")
    assert peak_mb < 480
    storage = GcsStorage(url)
    info = storage.stat("step-1/huge")
    assert info is not None and (info.size, info.crc32c) == (size, crc)
    storage.delete(["step-1/huge"])  # the emulator keeps objects in this process's memory


def _crc_of_zeros(size: int) -> str:
    block = bytes(8 * MiB)
    crc = 0
    for _ in range(size // len(block)):
        crc = google_crc32c.extend(crc, block)
    return f"{crc:08x}"


@pytest.mark.parametrize("size", [1000, 40 * MiB], ids=["one-request", "composed"])
def test_gcs_put_file_refuses_a_symlink_and_uploads_nothing(url: str, tmp_path: Path, size: int) -> None:
    _, crc = write(tmp_path / "target", size, seed=3)
    (tmp_path / "link").symlink_to(tmp_path / "target")
    storage = GcsStorage(url, parallel_threshold=32 * MiB, part_size=8 * MiB)
    with pytest.raises(SymlinkRefused):
        storage.put_file(tmp_path / "link", "step-1/link", crc32c=crc)
    assert all_names(storage) == []


def test_gcs_part_plan_caps_parts_of_a_very_large_file() -> None:
    storage = GcsStorage("gs://b/p")
    size = 100 * 1024 * MiB + 3
    plan = part_plan(size, storage.part_size, storage.max_part_size)
    assert max(length for _, _, length in plan) == 1024 * MiB  # not size/32 = 3.2 GiB
    assert sum(length for _, _, length in plan) == size and len(plan) == 101
    under_the_cap = part_plan(2 * 1024 * MiB, storage.part_size, storage.max_part_size)
    assert under_the_cap[0][2] == 64 * MiB  # still 32 parts


def test_racing_a_deadline_the_librarys_retries_stop_at_it(
    url: str, env: GcsServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A store answering 503 forever: google-cloud-storage would retry one request for retry_deadline
    (120 s); racing a notice's deadline it stops there."""
    with FaultProxy(env.endpoint_url, fault_rate=1.0, faults=("503",), flavor="gcs") as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        storage = GcsStorage(url, retry_deadline=120.0)
        try:
            storage.set_deadline(time.monotonic() + 2.0)
            started = time.monotonic()
            with pytest.raises(StorageError):
                storage.stat("step-000000001/manifest.json")
            assert time.monotonic() - started < 8  # not 120 s
            assert proxy.injected["503"] >= 2  # it did retry, within the deadline
        finally:
            storage.close()


def _streaming(url: str) -> GcsStorage:
    return GcsStorage(url, parallel_threshold=8 * MiB, part_size=4 * MiB, max_concurrency=2)


def test_gcs_stream_composes_the_parts_announced_while_writing(url: str, tmp_path: Path) -> None:
    storage = _streaming(url)
    data, crc = write(tmp_path / "f", 18 * MiB + 7, seed=11)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        stream = storage.begin_stream("step-1/f", len(data), fd)
        assert stream is not None
        stream.add(4 * MiB, 4 * MiB)  # part 2 is whole: it goes up now
        deadline = time.monotonic() + 30
        while not any(PARTS_DIR in name for name in all_names(storage)):
            assert time.monotonic() < deadline, "no part uploaded before the file was finished"
            time.sleep(0.05)
        assert [o.key for o in storage.list()] == []  # nothing visible yet
        stream.add(0, 4 * MiB)
        stream.finish(crc)  # the rest was never announced: sent at the finish
    finally:
        os.close(fd)
    assert all_names(storage) == ["step-1/f"]  # parts deleted
    assert storage.read_bytes("step-1/f") == data


def test_gcs_streamed_parts_shrink_toward_the_end_and_compose_to_the_same_bytes(url: str, tmp_path: Path) -> None:
    """A streamed file's last part is 5 MiB and the ones before it grow back to the part size (little
    left to send once the last byte is written); the composed object is the file, byte for byte."""
    storage = GcsStorage(url, parallel_threshold=8 * MiB, part_size=16 * MiB, max_concurrency=4)
    data, crc = write(tmp_path / "f", 75 * MiB + 7, seed=14)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        stream = storage.begin_stream("step-1/f", len(data), fd)
        assert stream is not None
        stream.add(0, len(data))  # every part whole: all go before the finish
        deadline = time.monotonic() + 60

        def parts() -> list[tuple[str, int]]:
            return sorted(
                (b.name, b.size)
                for b in storage.client.list_blobs(storage.bucket_name, prefix=storage.prefix)
                if PARTS_DIR in b.name
            )

        while sum(size for _, size in parts()) < len(data):
            assert time.monotonic() < deadline, "the parts did not all go up before the finish"
            time.sleep(0.05)
        sizes = [size for _, size in parts()]  # names sort in part order
        stream.finish(crc)
    finally:
        os.close(fd)
    assert sum(sizes) == len(data)  # every byte in exactly one part
    assert sizes[0] == 16 * MiB and sizes[-1] == 5 * MiB
    assert sizes[-3:] == sorted(sizes[-3:], reverse=True) and sizes[-3] < 16 * MiB
    assert all_names(storage) == ["step-1/f"]  # parts deleted
    assert storage.read_bytes("step-1/f") == data


def test_gcs_stream_abort_and_a_wrong_crc32c_leave_nothing(url: str, tmp_path: Path) -> None:
    storage = _streaming(url)
    data, _ = write(tmp_path / "f", 12 * MiB, seed=12)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        stream = storage.begin_stream("step-1/f", len(data), fd)
        assert stream is not None
        stream.add(0, 8 * MiB)
        stream.abort()
        assert all_names(storage) == []
        stream = storage.begin_stream("step-1/f", len(data), fd)
        assert stream is not None
        stream.add(0, len(data))
        with pytest.raises(StorageError, match="CRC32C"):
            stream.finish(crc_hex(data + b"!"))
        assert all_names(storage) == []
    finally:
        os.close(fd)


def test_gcs_upload_deletes_parts_of_the_same_key_left_by_an_earlier_run(url: str, tmp_path: Path) -> None:
    killed = GcsStorage(url)
    leftover = f"{killed.prefix}{PARTS_DIR}/step-1/f/0123abcd/00000"
    killed.bucket.blob(leftover).upload_from_string(b"part")
    other = f"{killed.prefix}{PARTS_DIR}/step-1/g/0123abcd/00000"
    killed.bucket.blob(other).upload_from_string(b"part")
    storage = GcsStorage(url, parallel_threshold=8 * MiB, part_size=4 * MiB, max_concurrency=2)
    data, crc = write(tmp_path / "f", 9 * MiB, seed=13)
    storage.put_file(tmp_path / "f", "step-1/f", crc32c=crc)
    names = all_names(storage)
    assert leftover[len(storage.prefix) :] not in names  # that key's leftover: gone
    assert other[len(storage.prefix) :] in names  # another key's: not this upload's business
    assert storage.read_bytes("step-1/f") == data
