"""The peer tier's configuration, token and handshake pieces."""

from __future__ import annotations

from pathlib import Path

import pytest

from spotguard import peerwire
from spotguard.config import ConfigError, load_config


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
    ],
)
def test_bad_peer_settings_name_their_key(flags: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(flags, env={})
    assert caught.value.key == key


def test_the_token_comes_from_the_environment_first_then_the_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-the-file-0123456789\n")
    assert peerwire.load_token({}, token_file) == b"from-the-file-0123456789"
    assert (
        peerwire.load_token({peerwire.TOKEN_ENV: "from-the-env-0123456789"}, token_file) == b"from-the-env-0123456789"
    )
    with pytest.raises(ValueError, match="SPOTGUARD_PEER_TOKEN or peer_token_file"):
        peerwire.load_token({}, None)
    with pytest.raises(ValueError, match="shorter than 16") as caught:
        peerwire.load_token({peerwire.TOKEN_ENV: "short-secret"}, None)
    assert "short-secret" not in str(caught.value)  # errors name the source, never the value
    with pytest.raises(ValueError, match="cannot read"):
        peerwire.load_token({}, tmp_path / "missing")


def test_proofs_depend_on_the_role_both_nonces_and_the_token() -> None:
    token, a, b = b"k" * 16, "a" * 32, "b" * 32
    proof = peerwire.sender_proof(token, a, b)
    assert peerwire.proof_matches(proof, peerwire.sender_proof(token, a, b))
    assert proof != peerwire.receiver_proof(token, a, b)  # a receiver's answer is no sender's
    assert proof != peerwire.sender_proof(token, b, a) and proof != peerwire.sender_proof(b"j" * 16, a, b)
    assert not peerwire.proof_matches(proof, None) and not peerwire.proof_matches(proof, "\udcff")


def test_a_file_is_verified_from_its_ranges_crcs_in_any_order_and_read_back_when_they_do_not_tile() -> None:
    from spotguard.daemon.peers import _combined_crc
    from spotguard.manifest import crc32c_hex_to_int, crc32c_of_bytes

    data = bytes(range(256)) * 1000
    cuts = [(0, 100), (100, 150_000), (150_000, len(data))]
    ranges = [(start, end - start, crc32c_hex_to_int(crc32c_of_bytes(data[start:end]))) for start, end in cuts]
    assert _combined_crc(list(reversed(ranges)), len(data)) == crc32c_of_bytes(data)
    assert _combined_crc(ranges[:1] + ranges[2:], len(data)) is None  # a gap
    assert _combined_crc([*ranges, ranges[1]], len(data)) is None  # an overlap
    assert _combined_crc(ranges[:2], len(data)) is None  # short
    assert _combined_crc([(0, 0, 0)], 0) == crc32c_of_bytes(b"")
