from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from spotguard.config import ConfigError, DaemonConfig, load_config, trainer_settings
from spotguard.notice import Action


def test_defaults_without_any_source(tmp_path: Path) -> None:
    config = load_config({}, env={}, config_file=None)
    assert config == DaemonConfig()
    assert config.socket == Path("/run/spotguard/spotguard.sock")
    assert config.on_rebalance is Action.CHECKPOINT


def test_flag_beats_env_beats_file(tmp_path: Path) -> None:
    file = tmp_path / "spotguard.toml"
    file.write_text(
        'poll_interval = 3.0\nprovider = "aws"\nkeep_local = 4\nkeep_remote = 4\nbucket = "s3://from-file/p"\n'
    )
    env = {"SPOTGUARD_POLL_INTERVAL": "2.0", "SPOTGUARD_PROVIDER": "gcp"}
    config = load_config({"poll_interval": "0.5"}, env=env, config_file=file)
    assert config.poll_interval == 0.5  # flag
    assert config.provider == "gcp"  # env
    assert config.keep_local == 4  # file
    assert config.bucket == "s3://from-file/p"
    assert config.max_connections == 64  # default


def test_config_file_from_environment_and_daemon_table(tmp_path: Path) -> None:
    file = tmp_path / "c.toml"
    file.write_text('[daemon]\nallowed_uids = [0, 1000]\non_rebalance = "ignore"\nimds_v1_fallback = true\n')
    config = load_config({}, env={"SPOTGUARD_CONFIG": str(file)})
    assert config.allowed_uids == (0, 1000)
    assert config.on_rebalance is Action.IGNORE
    assert config.imds_v1_fallback is True


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SPOTGUARD_ALLOWED_UIDS": "[true, 1000]"}, "not a whole number"),
        ({"SPOTGUARD_ALLOWED_UIDS": "0 1000.9"}, "not a whole number"),
        ({"SPOTGUARD_ALLOWED_UIDS": ""}, "refuses every client"),
    ],
)
def test_uid_lists_are_whole_numbers_and_never_empty(env: dict[str, str], message: str) -> None:
    """``[true, 1000.9]`` read as uids 1 and 1000, ids nobody asked for; an empty variable refused
    every client, the daemon's own status command and liveness probe too."""
    with pytest.raises(ConfigError, match=message):
        load_config({}, env=env)


def test_a_file_s_uid_list_of_booleans_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "c.toml"
    file.write_text("allowed_uids = [true, 1000]\n")
    with pytest.raises(ConfigError, match=r"allowed_uids.*booleans"):
        load_config({}, env={}, config_file=file)


def test_top_level_keys_and_a_daemon_table_after_them_are_read_together(tmp_path: Path) -> None:
    """As the Terraform boot script writes the file: its keys at the top, then a user's extra lines,
    which may open [daemon]. Every top-level key was dropped then: the bucket among them, silently."""
    file = tmp_path / "c.toml"
    file.write_text('bucket = "s3://fleet/run"\nlog_level = "debug"\n[other_tool]\nx = 1\n[daemon]\nkeep_local = 1\n')
    config = load_config({}, env={}, config_file=file)
    assert (config.bucket, config.log_level, config.keep_local) == ("s3://fleet/run", "debug", 1)
    file.write_text("keep_local = 2\n[daemon]\nkeep_local = 1\n")
    with pytest.raises(ConfigError, match="keep_local is set both at the top and in \\[daemon\\]"):
        load_config({}, env={}, config_file=file)


@pytest.mark.parametrize(
    ("flags", "env", "key"),
    [
        ({"poll_interval": "fast"}, {}, "--poll-interval"),
        ({}, {"SPOTGUARD_POLL_INTERVAL": "-1"}, "poll_interval"),
        ({"provider": "oracle"}, {}, "provider"),
        ({"bucket": "ftp://x"}, {}, "bucket"),
        ({"bucket": "s3://"}, {}, "bucket"),
        ({"metadata_url": "169.254.169.254"}, {}, "metadata_url"),
        ({}, {"SPOTGUARD_KEEP_LOCAL": "0"}, "keep_local"),
        ({}, {"SPOTGUARD_IMDS_V1_FALLBACK": "maybe"}, "SPOTGUARD_IMDS_V1_FALLBACK"),
        ({}, {"SPOTGUARD_ON_REBALANCE": "panic"}, "SPOTGUARD_ON_REBALANCE"),
        ({}, {"SPOTGUARD_STALL_FRACTION": "1.5"}, "stall_fraction"),
        ({}, {"SPOTGUARD_STALL_MIN_SECONDS": "0"}, "stall_min_seconds"),
    ],
)
def test_bad_values_name_the_key(flags: dict[str, str], env: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(flags, env=env)
    assert str(info.value).startswith(key)


def test_keep_local_above_keep_remote_is_rejected_with_a_bucket_only() -> None:
    # The bucket would prune what the disk keeps, and the rescan would send it again, forever.
    with pytest.raises(ConfigError, match=r"^keep_local: 4 is more than keep_remote = 3.*raise keep_remote"):
        load_config({"keep_local": "4", "bucket": "s3://b/run"}, env={}, config_file=None)
    assert load_config({"keep_local": "4", "keep_remote": "4", "bucket": "s3://b/run"}, env={}).keep_local == 4
    assert load_config({"keep_local": "4"}, env={}).keep_local == 4  # nothing to prune remotely


def test_stale_upload_age_defaults_to_an_hour_and_must_be_positive() -> None:
    assert DaemonConfig().stale_upload_age == 3600.0
    assert load_config({}, env={"SPOTGUARD_STALE_UPLOAD_AGE": "7200"}).stale_upload_age == 7200.0
    with pytest.raises(ConfigError, match=r"^stale_upload_age: must be > 0"):
        load_config({}, env={"SPOTGUARD_STALE_UPLOAD_AGE": "0"})


@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "1e999"])
def test_a_number_of_seconds_must_be_finite(text: str) -> None:
    """float() takes these; a poll interval of infinity left the monitor deaf after its first look."""
    with pytest.raises(ConfigError, match=rf"^SPOTGUARD_POLL_INTERVAL: cannot use '{text}': not a finite number"):
        load_config({}, env={"SPOTGUARD_POLL_INTERVAL": text})
    with pytest.raises(ConfigError, match=r"^--shutdown-grace: cannot use .*: not a finite number"):
        load_config({"shutdown_grace": float(text)}, env={})


@pytest.mark.parametrize(
    ("key", "text", "says"),
    [
        ("notice_grace", "1e308", "must be at most 3153600000 s (a century; longer overflows the times computed)"),
        ("incomplete_grace", "1e308", "must be at most 3153600000 s"),
        ("shutdown_grace", "1e12", "must be at most 3153600000 s"),
        ("poll_interval", "31", "must be at most 30 s (a GCP or Azure notice gives 30 s"),
        ("http_timeout", "60", "must be at most 30 s"),
        ("drill_deadline", "3601", "must be at most 3600 s (the longest deadline a drill may give)"),
        ("peer_io_timeout", "7200", "must be at most 3600 s (a peer silent this long is gone)"),
    ],
)
def test_a_number_of_seconds_has_a_ceiling(key: str, text: str, says: str) -> None:
    """notice_grace = 1e308 passed every check and stopped the daemon at start (OverflowError); a
    drill_deadline over an hour made every drill fail; a poll interval of a minute misses 30 s notices."""
    with pytest.raises(ConfigError) as info:
        load_config({}, env={f"SPOTGUARD_{key.upper()}": text})
    assert str(info.value).startswith(f"{key}: {says}")


def test_the_ceilings_themselves_are_allowed() -> None:
    config = load_config(
        {}, env={"SPOTGUARD_POLL_INTERVAL": "30", "SPOTGUARD_DRILL_DEADLINE": "3600", "SPOTGUARD_NOTICE_GRACE": "0"}
    )
    assert (config.poll_interval, config.drill_deadline, config.notice_grace) == (30.0, 3600.0, 0.0)


@pytest.mark.parametrize(
    ("line", "says"),
    [
        # urlparse's own "Invalid IPv6 URL" was all the daemon said, naming no setting.
        (
            'webhook_url = "http://[::1"',
            "webhook_url: 'http://[::1' is not an http:// or https:// URL: Invalid IPv6 URL",
        ),
        (
            'metadata_url = "http://[fd00::1"',
            "metadata_url: 'http://[fd00::1' is not scheme://host[:port]: Invalid IPv6",
        ),
        (
            'webhook_url = "http://hooks:99999/x"',
            "webhook_url: 'http://hooks:99999/x' is not an http:// or https:// URL",
        ),
        # int() cut these to 1 and to 70000 (which the port check then reported).
        ("keep_local = 1.7", "keep_local: cannot use 1.7: not a whole number"),
        ("metrics_port = 70000.5", "metrics_port: cannot use 70000.5: not a whole number"),
        ('peer_max_replicas = "eight"', "peer_max_replicas: cannot use 'eight': not a whole number"),
        ('poll_interval = "soon"', "poll_interval: cannot use 'soon': not a number"),
        # str() made a table the Auto Scaling group "{'a': 1}".
        ("asg_name = {a=1}", "asg_name: cannot use {'a': 1}: a table, where a string is wanted; quote it"),
        ("metrics_host = 5", "metrics_host: cannot use 5: an integer, where a string is wanted"),
        ("checkpoint_dir = [1]", "checkpoint_dir: cannot use [1]: an array, where a string is wanted"),
        # Accepted, with no ceiling: a busy loop, a socket read of 1e30 bytes, a billion streams.
        ("max_message_bytes = 1e30", "max_message_bytes: must be in 1024..67108864 (a socket message is read whole"),
        ("poll_interval = 1e-300", "poll_interval: must be at least 0.01 s (less is a busy loop), got 1e-300"),
        ("scan_interval = 0.001", "scan_interval: must be at least 0.01 s"),
        ("max_connections = 1e11", "max_connections: must be in 1..65536 (each connection is a descriptor"),
        ("upload_concurrency = 1e9", "upload_concurrency: must be in 1..1024 (each stream is a thread"),
        ("keep_remote = 2000000", "keep_remote: must be in 1..1000000"),
        ("peer_max_replicas = 65", "peer_max_replicas: must be in 1..64"),
        ("peer_max_flows = 1000", "peer_max_flows: must be in 1..256"),
        ("peer_max_replica_bytes = 1e18", "peer_max_replica_bytes: must be in 1..1125899906842624 (1 PiB)"),
    ],
)
def test_a_setting_of_the_wrong_kind_or_out_of_its_range_is_refused_naming_it(
    tmp_path: Path, line: str, says: str
) -> None:
    file = tmp_path / "spotguard.toml"
    file.write_text(line + "\n")
    with pytest.raises(ConfigError) as info:
        load_config({}, env={}, config_file=file)
    assert str(info.value).startswith(says), str(info.value)


def test_whole_numbers_written_as_floats_or_text_are_taken() -> None:
    env = {"SPOTGUARD_KEEP_REMOTE": "1e3", "SPOTGUARD_KEEP_LOCAL": " 3 ", "SPOTGUARD_UPLOAD_CONCURRENCY": "1024"}
    config = load_config({"max_connections": 2.0}, env=env)
    assert (config.keep_remote, config.keep_local, config.upload_concurrency, config.max_connections) == (
        1000,
        3,
        1024,
        2,
    )
    assert isinstance(config.keep_remote, int) and isinstance(config.max_connections, int)
    with pytest.raises(ConfigError, match=r"^SPOTGUARD_KEEP_LOCAL: cannot use '2\.5': not a whole number"):
        load_config({}, env={"SPOTGUARD_KEEP_LOCAL": "2.5"})
    assert load_config({}, env={"SPOTGUARD_POLL_INTERVAL": "0.01"}).poll_interval == 0.01


@pytest.mark.parametrize(
    ("bucket", "root", "where"),
    [
        ("ckpt", "ckpt", "is"),
        ("ckpt/remote", "ckpt", "lies inside"),
        ("data", "data/ckpt", "holds"),
        ("link", "ckpt", "is"),  # through a symlink to the root
    ],
)
def test_a_file_bucket_on_the_checkpoint_root_is_refused(tmp_path: Path, bucket: str, root: str, where: str) -> None:
    """Uploads were copies on the same disk, with no warning: nothing ever left the VM."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "ckpt")
    url = (tmp_path / bucket).as_uri()
    with pytest.raises(ConfigError) as info:
        load_config({"bucket": url, "checkpoint_dir": str(tmp_path / root)}, env={})
    assert str(info.value).startswith(f"bucket: {url!r} {where} the checkpoint root {tmp_path / root}: nothing"), str(
        info.value
    )
    beside = load_config({"bucket": (tmp_path / "bucket").as_uri(), "checkpoint_dir": str(tmp_path / "ckpt")}, env={})
    assert beside.bucket == (tmp_path / "bucket").as_uri()


def test_a_daemon_with_its_bucket_on_its_root_exits_2_in_one_line(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    line = run_refused("--checkpoint-dir", str(root), "--bucket", root.as_uri(), "--socket", str(tmp_path / "s"))
    assert line.startswith(f"spotguard: config: bucket: '{root.as_uri()}' is the checkpoint root {root}: "), line


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"SPOTGUARD_CHECKPOINT_DIR": ""}, "SPOTGUARD_CHECKPOINT_DIR: cannot use '': an empty path"),
        ({"SPOTGUARD_SOCKET": "  "}, "SPOTGUARD_SOCKET: cannot use '  ': an empty path"),
        ({"SPOTGUARD_STATE_DIR": "/var/\x00lib"}, "SPOTGUARD_STATE_DIR: cannot use '/var/\\x00lib': a path with a NUL"),
        ({"SPOTGUARD_ALLOWED_UIDS": "0 -1"}, "allowed_uids: -1 is not a uid or gid (0 to 4294967294)"),
        ({"SPOTGUARD_TRAINER_UIDS": "4294967295"}, "trainer_uids: 4294967295 is not a uid or gid"),
        ({"SPOTGUARD_SOCKET": "/run/" + "d" * 100 + "/s.sock"}, "socket: '/run/ddd"),
    ],
)
def test_paths_and_ids_that_name_nothing_are_refused(env: dict[str, str], says: str) -> None:
    """An empty checkpoint_dir was the working directory: under systemd, the root of the disk."""
    with pytest.raises(ConfigError) as info:
        load_config({}, env=env)
    assert str(info.value).startswith(says)


def test_a_socket_path_longer_than_a_unix_socket_takes_is_refused(tmp_path: Path) -> None:
    """The daemon stopped with "spotguard: AF_UNIX path too long", naming neither the setting nor the limit."""
    path = tmp_path / ("d" * (107 - len(str(tmp_path)))) / "s.sock"
    refused = run_refused("--socket", str(path))
    assert refused.endswith(f"is {len(str(path))} bytes; a Unix socket's path holds at most 107")
    at_the_limit = "/" + "d" * 106
    assert load_config({}, env={"SPOTGUARD_SOCKET": at_the_limit}).socket == Path(at_the_limit)


def test_a_daemon_with_a_setting_past_its_ceiling_exits_2_in_one_line(tmp_path: Path) -> None:
    """It started, then ended at its first notice-book arithmetic with a traceback (exit 1)."""
    config = tmp_path / "spotguard.toml"
    config.write_text(f'provider = "none"\nnotice_grace = 1e308\nstate_dir = "{tmp_path / "state"}"\n')
    assert run_refused("--config", str(config), "--socket", str(tmp_path / "s")) == (
        "spotguard: config: notice_grace: must be at most 3153600000 s "
        "(a century; longer overflows the times computed), got 1e+308"
    )


def test_unknown_and_broken_files_are_config_errors(tmp_path: Path) -> None:
    typo = tmp_path / "typo.toml"
    typo.write_text("pol_interval = 1\n")
    with pytest.raises(ConfigError, match="pol_interval: unknown key"):
        load_config({}, env={}, config_file=typo)
    broken = tmp_path / "broken.toml"
    broken.write_text("provider = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config({}, env={}, config_file=broken)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config({}, env={}, config_file=tmp_path / "missing.toml")
    # An editor's Latin-1 comment, and nesting past the parser's depth: the file named, no traceback.
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b'bucket = "s3://b/r"\n# caf\xe9\n')
    with pytest.raises(ConfigError, match=r"latin1.toml: not UTF-8 text \(byte 25\): save it as UTF-8"):
        load_config({}, env={}, config_file=latin1)
    deep = tmp_path / "deep.toml"
    deep.write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match=r"deep\.toml: not valid TOML: arrays or tables nested too deeply"):
        load_config({}, env={}, config_file=deep)


def run_refused(*args: str) -> str:
    """``spotguard run ARGS``, which must exit 2 with one line on stderr: that line."""
    result = subprocess.run(
        [sys.executable, "-m", "spotguard", "run", *args], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    return line


def test_cli_exits_2_with_one_line_naming_the_key(tmp_path: Path) -> None:
    assert run_refused("--poll-interval", "soon", "--socket", str(tmp_path / "s")) == (
        "spotguard: config: --poll-interval: cannot use 'soon': not a number"
    )


def test_trainer_settings_argument_beats_environment() -> None:
    env = {"SPOTGUARD_CHECKPOINT_DIR": "/env/ckpt", "SPOTGUARD_BUCKET": "gs://b/p", "SPOTGUARD_SOCKET": "/env.sock"}
    from_env = trainer_settings(None, None, None, env=env)
    assert (from_env.checkpoint_dir, from_env.bucket, from_env.socket) == (
        Path("/env/ckpt"),
        "gs://b/p",
        Path("/env.sock"),
    )
    explicit = trainer_settings("/arg", "s3://a/b", "/arg.sock", env=env)
    assert (explicit.checkpoint_dir, explicit.bucket, explicit.socket) == (Path("/arg"), "s3://a/b", Path("/arg.sock"))
    with pytest.raises(ConfigError, match="bucket"):
        trainer_settings(None, "http://nope", None, env={})
    # Empty variables are unset ones: a socket of "" was the working directory.
    empty = trainer_settings(None, None, None, env=dict.fromkeys(env, ""))
    assert (empty.checkpoint_dir, empty.bucket, empty.socket) == (None, None, Path("/run/spotguard/spotguard.sock"))


def test_checksum_setting_from_file_env_and_flag_and_into_the_s3_options(tmp_path: Path) -> None:
    assert DaemonConfig().checksum == "auto"
    file = tmp_path / "spotguard.toml"
    file.write_text('bucket = "s3://b/run1"\nchecksum = "md5"\n')
    assert load_config({}, env={}, config_file=file).checksum == "md5"
    assert load_config({}, env={"SPOTGUARD_CHECKSUM": "crc32c"}, config_file=file).checksum == "crc32c"
    config = load_config({"checksum": "auto"}, env={"SPOTGUARD_CHECKSUM": "crc32c"}, config_file=file)
    assert config.checksum == "auto"
    assert config.storage_options() == {"max_concurrency": config.upload_concurrency, "checksum": "auto"}
    # Only the S3 backend takes it; GCS always verifies CRC32C.
    assert "checksum" not in DaemonConfig(bucket="gs://b/run1").storage_options()
    assert DaemonConfig(bucket="file:///tmp/b").storage_options() == {}


@pytest.mark.parametrize(
    ("flags", "env", "key", "says"),
    [
        ({"checksum": "sha1"}, {}, "checksum", "'sha1' is not one of auto, crc32c, md5"),
        ({}, {"SPOTGUARD_CHECKSUM": "CRC32C"}, "checksum", "is not one of"),
        ({"checksum": "md5", "bucket": "gs://b/p"}, {}, "checksum", "gs:// always verifies CRC32C"),
    ],
)
def test_bad_checksum_settings_name_the_key(flags: dict[str, str], env: dict[str, str], key: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(flags, env=env)
    assert str(info.value).startswith(key) and says in str(info.value)


def test_run_and_doctor_take_the_checksum_flag(tmp_path: Path) -> None:
    from spotguard.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["run", "--checksum", "md5"]).checksum == "md5"
    assert parser.parse_args(["doctor", "--checksum", "crc32c"]).checksum == "crc32c"
    file = tmp_path / "spotguard.toml"
    file.write_text('bucket = "s3://b/run1"\n')
    bad = subprocess.run(
        [sys.executable, "-m", "spotguard", "run", "--checksum", "sha1", "--config", str(file)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 2 and "config: checksum: 'sha1' is not one of auto, crc32c, md5" in bad.stderr, bad.stderr


def test_peer_networks_from_flag_env_and_file(tmp_path: Path) -> None:
    base = {"bucket": "file:///b", "peers": "bucket"}
    assert load_config(base, env={}).peer_networks == (
        "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7",
    )  # fmt: skip
    flagged = load_config({**base, "peer_networks": "10.1.0.0/16, 192.168.5.0/24"}, env={})
    assert flagged.peer_networks == ("10.1.0.0/16", "192.168.5.0/24")
    toml = tmp_path / "spotguard.toml"
    toml.write_text('peer_networks = ["10.2.0.0/16"]\n')
    assert load_config(base, env={}, config_file=toml).peer_networks == ("10.2.0.0/16",)
    from_env = load_config(base, env={"SPOTGUARD_PEER_NETWORKS": "fd00::/8"})
    assert from_env.peer_networks == ("fd00::/8",)
    with pytest.raises(ConfigError, match="peer_networks"):
        load_config({**base, "peer_networks": "10.0.0.0/8,not-a-network"}, env={})
    # Loopback: when this daemon listens on loopback or nowhere; never when it listens elsewhere.
    policy = load_config({**base, "peer_listen": "0.0.0.0:7140"}, env={}).peer_network_policy()
    assert policy.resolve("127.0.0.1", 7140)[0] is None and policy.resolve("10.0.0.9", 7140)[0] == "10.0.0.9"
    policy = load_config({**base, "peer_listen": "127.0.0.1:0"}, env={}).peer_network_policy()
    assert policy.resolve("127.0.0.1", 7140)[0] == "127.0.0.1"
    # Link-local and the metadata service never, even when named.
    named = load_config({**base, "peer_networks": "169.254.0.0/16,0.0.0.0/0"}, env={}).peer_network_policy()
    assert named.resolve("169.254.169.254", 80)[0] is None and named.resolve("8.8.8.8", 80)[0] == "8.8.8.8"
