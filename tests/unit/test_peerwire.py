"""The peer tier's configuration, token and handshake pieces."""

from __future__ import annotations

from pathlib import Path

import pytest

from spotguard.config import ConfigError, load_config
from spotguard.peer import wire


def test_peer_keys_come_from_flags_env_and_file(tmp_path: Path) -> None:
    toml = tmp_path / "spotguard.toml"
    toml.write_text('bucket = "s3://b/run"\npeer_listen = "0.0.0.0:7140"\npeer_token_file = "/etc/sg/token"\n')
    config = load_config({"peers": "10.0.0.2:7140, [fd00::3]:7141"}, env={}, config_file=toml)
    assert config.peer_listen == "0.0.0.0:7140" and config.peer_token_file == Path("/etc/sg/token")
    assert config.peer_addresses() == [("10.0.0.2", 7140), ("fd00::3", 7141)]
    assert load_config({}, env={"SPOTGUARD_BUCKET": "s3://b/r", "SPOTGUARD_PEERS": "h:1"}).peers == "h:1"


@pytest.mark.parametrize(
    ("flags", "key"),
    [
        ({"bucket": "s3://b/r", "peers": "10.0.0.2"}, "peers"),
        ({"bucket": "s3://b/r", "peer_listen": "0.0.0.0:99999"}, "peer_listen"),
        ({"peer_listen": "127.0.0.1:7140"}, "peer_listen"),  # peers share a bucket
        ({"bucket": "s3://b/r", "peer_max_replicas": "0"}, "peer_max_replicas"),
        ({"bucket": "s3://b/r", "peer_io_timeout": "0"}, "peer_io_timeout"),
    ],
)
def test_bad_peer_settings_name_their_key(flags: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(flags, env={})
    assert caught.value.key == key


def test_the_token_comes_from_the_environment_first_then_the_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-the-file-0123456789\n")
    assert wire.load_token({}, token_file) == b"from-the-file-0123456789"
    assert wire.load_token({wire.TOKEN_ENV: "from-the-env-0123456789"}, token_file) == b"from-the-env-0123456789"
    with pytest.raises(ValueError, match="SPOTGUARD_PEER_TOKEN or peer_token_file"):
        wire.load_token({}, None)
    with pytest.raises(ValueError, match="shorter than 16") as caught:
        wire.load_token({wire.TOKEN_ENV: "short-secret"}, None)
    assert "short-secret" not in str(caught.value)  # errors name the source, never the value
    with pytest.raises(ValueError, match="cannot read"):
        wire.load_token({}, tmp_path / "missing")


def test_a_file_is_verified_from_its_ranges_crcs_in_any_order_and_read_back_when_they_do_not_tile() -> None:
    from spotguard.crc32c import crc32c_hex_to_int, crc32c_of_bytes
    from spotguard.peer.files import combined_crc

    data = bytes(range(256)) * 1000
    cuts = [(0, 100), (100, 150_000), (150_000, len(data))]
    ranges = [(start, end - start, crc32c_hex_to_int(crc32c_of_bytes(data[start:end]))) for start, end in cuts]
    assert combined_crc(list(reversed(ranges)), len(data)) == crc32c_of_bytes(data)
    assert combined_crc(ranges[:1] + ranges[2:], len(data)) is None  # a gap
    assert combined_crc([*ranges, ranges[1]], len(data)) is None  # an overlap
    assert combined_crc(ranges[:2], len(data)) is None  # short
    assert combined_crc([(0, 0, 0)], 0) == crc32c_of_bytes(b"")


def test_a_fetch_that_breaks_the_rules_leaves_nothing_in_the_checkpoint_root(tmp_path: Path) -> None:
    """A holder (a bare server on 127.0.0.1 speaking the protocol) that sends a file the manifest
    does not list, or stops before the end: the fetch fails and nothing counts as a checkpoint."""
    import asyncio

    from spotguard.crc32c import crc32c_of_bytes
    from spotguard.manifest import FileEntry, Manifest
    from spotguard.peer.client import PeerClient
    from spotguard.peer.fetch import STAGING, fetch_replica
    from spotguard.peer.handshake import accept
    from spotguard.peer.noise import derive_psk

    token = b"t" * 16
    manifest = Manifest(step=4, reason="urgent", world_size=1, files={"w.bin": FileEntry(3, crc32c_of_bytes(b"abc"))})
    head = {"t": "checkpoint", "id": "x", "name": "step-000000004", "manifest": manifest.to_json().decode()}

    async def attempt(*after_head: bytes) -> str:
        async def holder(stream: wire.FrameStream, writer: asyncio.StreamWriter) -> None:
            channel = await accept(stream, writer, derive_psk(token))
            assert (await wire.read_frame(channel))["t"] == "ping"  # the client's first record
            assert (await wire.read_frame(channel))["t"] == "fetch"
            channel.write(wire.encode(head) + b"".join(after_head))
            await channel.drain()
            writer.close()

        server = await wire.start_server(holder, "127.0.0.1", 0)
        client = await PeerClient.connect("127.0.0.1", server.sockets[0].getsockname()[1], token)
        try:
            with pytest.raises(wire.PeerError) as caught:
                await fetch_replica(client, "x", tmp_path)
            return caught.value.code
        finally:
            await client.close()
            server.close()

    def data(name: str, payload: bytes, size: int = 3) -> bytes:
        return wire.encode({"t": "data", "name": name, "size": size, "offset": 0, "len": len(payload)}) + payload

    assert asyncio.run(attempt(data("../w.bin", b"abc"))) == "bad-path"
    assert asyncio.run(attempt(data("other.bin", b"abc"))) == "bad-field"
    assert asyncio.run(attempt(data("w.bin", b"abcd", size=4))) == "bad-field"  # not the manifest's size
    assert asyncio.run(attempt(data("w.bin", b"abc"))) == "closed"  # no end frame
    assert asyncio.run(attempt(data("w.bin", b"abx"), wire.encode({"t": "end"}))) == "mismatch"
    assert list(tmp_path.iterdir()) == [] and not (tmp_path / STAGING).exists()


def test_a_previous_token_comes_from_its_own_variable_or_file_and_is_optional(tmp_path: Path) -> None:
    current = {wire.TOKEN_ENV: "the-new-token-of-the-job-0123456789"}
    alone = wire.load_job_token(current, None, None)
    assert alone.accepted == (b"the-new-token-of-the-job-0123456789",) and alone.previous is None
    previous_file = tmp_path / "previous"
    previous_file.write_text("the-old-token-of-the-job-0123456789\n")
    rotating = wire.load_job_token(current, None, previous_file)
    assert rotating.accepted == (b"the-new-token-of-the-job-0123456789", b"the-old-token-of-the-job-0123456789")
    from_env = wire.load_job_token({**current, wire.PREVIOUS_TOKEN_ENV: "old-from-the-env-0123456789"}, None, None)
    assert from_env.previous == b"old-from-the-env-0123456789"
    # The same token twice is no rotation: one to try, one to accept.
    same = wire.load_job_token({**current, wire.PREVIOUS_TOKEN_ENV: current[wire.TOKEN_ENV]}, None, None)
    assert len(same.accepted) == 1
    # Secrets stay out of reprs (a traceback's locals) and errors.
    assert "the-new-token" not in repr(rotating) and "the-old-token" not in repr(rotating)
    with pytest.raises(ValueError, match="previous peer token from SPOTGUARD_PEER_TOKEN_PREVIOUS is shorter") as short:
        wire.load_job_token({**current, wire.PREVIOUS_TOKEN_ENV: "old-and-short"}, None, None)
    assert "old-and-short" not in str(short.value)
    with pytest.raises(ValueError, match="cannot read the previous peer token file"):
        wire.load_job_token(current, None, tmp_path / "missing")
    with pytest.raises(ValueError, match="SPOTGUARD_PEER_TOKEN or peer_token_file"):  # a previous one alone is none
        wire.load_job_token({wire.PREVIOUS_TOKEN_ENV: "the-old-token-of-the-job-0123456789"}, None, None)


def test_the_previous_token_file_is_a_setting_of_run(tmp_path: Path) -> None:
    toml = tmp_path / "spotguard.toml"
    toml.write_text('bucket = "s3://b/run"\npeer_listen = "0.0.0.0:7140"\npeer_token_previous_file = "/etc/sg/old"\n')
    assert load_config({}, env={}, config_file=toml).peer_token_previous_file == Path("/etc/sg/old")
    env = {"SPOTGUARD_BUCKET": "s3://b/r", "SPOTGUARD_PEER_TOKEN_PREVIOUS_FILE": "/run/old"}
    assert load_config({}, env=env).peer_token_previous_file == Path("/run/old")
