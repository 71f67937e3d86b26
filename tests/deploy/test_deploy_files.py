"""Offline validation of the deployment files: systemd units, Dockerfile, Terraform, bootstrap scripts.

The external tools come from ``.ci/install-deploy-tools.sh``: systemd-analyze (Debian ``systemd``),
hadolint and checkov (in ``.venv-tools/``, or ``$SPOTGUARD_TOOLS_VENV``, or on PATH) and python-hcl2
(importable here). A missing tool skips its test with the reason, except under CI (``$CI`` set),
where it fails: CI must never pass by skipping.

The bootstrap scripts (AWS cloud-init, GCP startup script) are rendered the way Terraform's
templatefile() would and run with bash in a scratch root (``SPOTGUARD_ROOT``) with stand-ins for
every command that would change the machine (pip, systemctl, spotguard, useradd, mount, ...).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SYSTEMD = REPO / "systemd"
TERRAFORM = REPO / "terraform"
MODULES = TERRAFORM / "modules"
EXAMPLES = TERRAFORM / "examples"
TOOLS_BIN = Path(os.environ.get("SPOTGUARD_TOOLS_VENV", str(REPO / ".venv-tools"))) / "bin"

AWS_TEMPLATE = MODULES / "aws-spot-fleet" / "templates" / "cloud-init.sh.tftpl"
GCP_TEMPLATE = MODULES / "gcp-spot-fleet" / "templates" / "startup-script.sh.tftpl"
UNITS = ("spotguard.service", "example-trainer.service")


# --- finding tools -----------------------------------------------------------------------


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def missing(reason: str) -> None:
    """Fail under CI, skip (with the reason) elsewhere."""
    hint = "; run .ci/install-deploy-tools.sh"
    if in_ci():
        pytest.fail(f"{reason}{hint} (CI is set, so a missing tool fails instead of skipping)")
    pytest.skip(reason + hint)


def find_tool(name: str) -> str:
    candidate = TOOLS_BIN / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        missing(f"{name} not found in {TOOLS_BIN} or on PATH")
        raise AssertionError("unreachable")
    return found


def load_hcl(path: Path) -> dict[str, Any]:
    try:
        import hcl2
    except ImportError:
        missing("python-hcl2 is not installed")
        raise AssertionError("unreachable") from None
    with path.open() as handle:
        return clean(hcl2.load(handle))


def clean(value: Any) -> Any:
    """python-hcl2 >= 7 keeps quotes around names and strings and adds ``__comments__`` keys;
    drop both so the checks read like the HCL."""
    if isinstance(value, dict):
        return {unquote(k): clean(v) for k, v in value.items() if not str(k).startswith("__")}
    if isinstance(value, list):
        return [clean(v) for v in value]
    if isinstance(value, str):
        return unquote(value)
    return value


def unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] == '"':
        return text[1:-1]
    return text


def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False, **kwargs)


# --- (a) systemd units -------------------------------------------------------------------


@pytest.fixture
def units_dir(tmp_path: Path) -> Path:
    """The units, with ExecStart pointing at an executable that exists (verify checks that)."""
    stub = tmp_path / "spotguard"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    out = tmp_path / "units"
    out.mkdir()
    for name in UNITS:
        text = (SYSTEMD / name).read_text()
        (out / name).write_text(text.replace("/usr/local/bin/spotguard", str(stub)))
    return out


def test_systemd_units_pass_systemd_analyze_verify(units_dir: Path) -> None:
    tool = find_tool("systemd-analyze")
    result = run([tool, "verify", "--man=no", *(str(units_dir / n) for n in UNITS)])
    # verify exits 0 on unknown keys and bad values ("..., ignoring"), so its messages about our
    # units count as failures too. Messages about the host's own units are not ours to fix.
    ours = [
        line for line in result.stderr.splitlines() if str(units_dir) in line or any(line.startswith(n) for n in UNITS)
    ]
    assert result.returncode == 0, result.stderr
    assert ours == [], "\n".join(ours)


def test_systemd_verify_catches_a_broken_unit(units_dir: Path) -> None:
    """The check above can fail: a typo'd key is reported."""
    tool = find_tool("systemd-analyze")
    broken = units_dir / "spotguard.service"
    broken.write_text(broken.read_text().replace("KillMode=mixed", "KillMode=mixed\nKillModee=mixed"))
    result = run([tool, "verify", "--man=no", str(broken)])
    assert "KillModee" in result.stderr


def test_spotguard_unit_exposure_is_low(units_dir: Path) -> None:
    tool = find_tool("systemd-analyze")
    # --threshold is exposure x10: 25 means "2.5 OK" or better on systemd's 0-10 scale.
    result = run([tool, "security", "--offline=yes", "--no-pager", "--threshold=25", str(units_dir / UNITS[0])])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr


def unit_settings(name: str) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for raw in (SYSTEMD / name).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", "[")):
            continue
        key, _, value = line.partition("=")
        settings.setdefault(key, []).append(value)
    return settings


def test_spotguard_unit_has_the_settings_the_design_relies_on() -> None:
    s = unit_settings("spotguard.service")
    assert s["Type"] == ["notify"] and s["NotifyAccess"] == ["main"]
    assert s["WatchdogSec"] == ["30"] and s["Restart"] == ["always"]
    assert s["ExecStart"] == ["/usr/local/bin/spotguard run"]
    assert s["KillMode"] == ["mixed"]
    # Long enough for AWS's 120 s notice window.
    assert int(s["TimeoutStopSec"][0]) >= 120
    assert s["RuntimeDirectory"] == ["spotguard"] and s["RuntimeDirectoryMode"] == ["0750"]
    # The event log's and journal's spares live there while the state directory refuses writes.
    assert s["RuntimeDirectoryPreserve"] == ["restart"]
    assert "spotguard" in s["StateDirectory"][0].split()
    assert s["ProtectSystem"] == ["strict"] and s["CapabilityBoundingSet"] == [""]
    families = set(s["RestrictAddressFamilies"][0].split())
    assert families == {"AF_UNIX", "AF_INET", "AF_INET6"}
    # The metadata service must stay reachable and DMI readable.
    for forbidden in ("PrivateNetwork", "IPAddressDeny", "PrivateUsers", "InaccessiblePaths"):
        assert forbidden not in s


def test_trainer_unit_is_ordered_after_spotguard_and_gets_the_hook_environment() -> None:
    s = unit_settings("example-trainer.service")
    assert "spotguard.service" in " ".join(s["After"]).split()
    assert "spotguard.service" in " ".join(s["Wants"]).split()
    assert s["KillSignal"] == ["SIGTERM"]
    # Stopped first at shutdown, and its save must fit inside AWS's 120 s window.
    assert int(s["TimeoutStopSec"][0]) < int(unit_settings("spotguard.service")["TimeoutStopSec"][0])
    env = dict(e.split("=", 1) for e in s["Environment"])
    assert set(env) >= {"SPOTGUARD_SOCKET", "SPOTGUARD_CHECKPOINT_DIR", "SPOTGUARD_BUCKET"}
    assert s["Group"] == ["spotguard"], "the daemon's peer check sees the primary gid"


def test_toml_example_is_accepted_by_the_daemon_config() -> None:
    from spotguard.config import load_config

    example = SYSTEMD / "spotguard.toml.example"
    config = load_config(env={}, config_file=example)
    assert config.bucket == "s3://my-training-bucket/runs/run-1"
    assert str(config.socket) == "/run/spotguard/spotguard.sock"
    documented = set(tomllib.loads(example.read_text()))
    commented = set(re.findall(r"^# ?([a-z_]+) = ", example.read_text(), flags=re.MULTILINE))
    from dataclasses import fields

    from spotguard.config import DaemonConfig

    assert documented | commented == {f.name for f in fields(DaemonConfig)}, "every key documented"


def test_daemon_shutdown_grace_fits_in_the_unit_stop_timeout() -> None:
    from spotguard.config import DaemonConfig

    stop_timeout = int(unit_settings("spotguard.service")["TimeoutStopSec"][0])
    example = tomllib.loads((SYSTEMD / "spotguard.toml.example").read_text())
    for grace in (DaemonConfig().shutdown_grace, example["shutdown_grace"]):
        assert grace + 10 <= stop_timeout, "the daemon must finish (and exit) before systemd kills it"


# --- (b) Dockerfile ----------------------------------------------------------------------


def test_dockerfile_passes_hadolint() -> None:
    tool = find_tool("hadolint")
    result = run([tool, "--no-color", str(REPO / "Dockerfile")])
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_shape() -> None:
    text = (REPO / "Dockerfile").read_text()
    images = re.findall(r"^ARG PYTHON_IMAGE=(\S+)$", text, flags=re.MULTILINE)
    assert images and re.fullmatch(r"python:3\.11\.\d+-slim(-\w+)?", images[0]), "pinned 3.11 slim tag"
    assert len(re.findall(r"^FROM ", text, flags=re.MULTILINE)) == 2
    assert re.search(r"^USER \S+", text, flags=re.MULTILINE)
    assert 'ENTRYPOINT ["spotguard", "run"]' in text
    assert re.search(r'HEALTHCHECK .*\\\n\s+CMD \["spotguard", "status", "--json"\]', text)
    instructions = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert '"spotguard[aws,gcp]"' in text and not any("torch" in line for line in instructions)
    ignore = (REPO / ".dockerignore").read_text().split()
    assert ignore[ignore.index("*") :][:1] == ["*"] and "!spotguard/" in ignore


# --- (c) Terraform conventions -----------------------------------------------------------

TF_DIRS = sorted({p.parent for p in TERRAFORM.rglob("*.tf")})


def test_terraform_tree_has_both_modules_and_examples() -> None:
    names = {str(d.relative_to(TERRAFORM)) for d in TF_DIRS}
    assert names == {"modules/aws-spot-fleet", "modules/gcp-spot-fleet", "examples/aws", "examples/gcp"}
    for module in ("aws-spot-fleet", "gcp-spot-fleet"):
        for name in ("main.tf", "variables.tf", "outputs.tf", "versions.tf", "README.md"):
            assert (MODULES / module / name).is_file(), f"{module}/{name}"


@pytest.mark.parametrize("path", sorted(TERRAFORM.rglob("*.tf")), ids=lambda p: str(p.relative_to(TERRAFORM)))
def test_every_tf_file_parses(path: Path) -> None:
    assert isinstance(load_hcl(path), dict)


def variables(directory: Path) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(directory.glob("*.tf")):
        for block in load_hcl(path).get("variable", []):
            found.update(block)
    return found


@pytest.mark.parametrize("directory", TF_DIRS, ids=lambda p: str(p.relative_to(TERRAFORM)))
def test_every_variable_is_typed_and_described(directory: Path) -> None:
    for name, spec in variables(directory).items():
        assert spec.get("type"), f"{directory.name}: variable {name} has no type"
        assert len(spec.get("description", "")) >= 10, f"{directory.name}: variable {name} has no description"


@pytest.mark.parametrize("directory", TF_DIRS, ids=lambda p: str(p.relative_to(TERRAFORM)))
def test_every_output_is_described(directory: Path) -> None:
    for path in directory.glob("*.tf"):
        for block in load_hcl(path).get("output", []):
            for name, spec in block.items():
                assert spec.get("description"), f"{directory.name}: output {name} has no description"


@pytest.mark.parametrize("directory", TF_DIRS, ids=lambda p: str(p.relative_to(TERRAFORM)))
def test_versions_are_pinned(directory: Path) -> None:
    terraform = load_hcl(directory / "versions.tf")["terraform"][0]
    assert re.fullmatch(r">= ?1\.\d+\.\d+, ?< ?2\.0\.0", terraform["required_version"])
    providers = {k: v for block in terraform["required_providers"] for k, v in block.items()}
    assert providers
    for name, spec in providers.items():
        assert spec["source"] == f"hashicorp/{name}"
        # "~> X.Y" allows only X.* from Y on: bounded above, no surprise major upgrade.
        assert re.fullmatch(r"~> ?\d+\.\d+", spec["version"]), f"{name}: {spec['version']}"


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_examples_use_the_local_module_with_valid_arguments(cloud: str) -> None:
    example = EXAMPLES / cloud
    calls = [c for path in example.glob("*.tf") for block in load_hcl(path).get("module", []) for c in block.values()]
    assert len(calls) == 1
    call = calls[0]
    assert call["source"] == f"../../modules/{cloud}-spot-fleet"
    module_vars = variables((example / call["source"]).resolve())
    arguments = {k for k in call if k not in ("source", "version", "providers", "depends_on", "count", "for_each")}
    assert arguments <= set(module_vars), f"unknown module arguments: {sorted(arguments - set(module_vars))}"
    required = {name for name, spec in module_vars.items() if "default" not in spec}
    assert required <= arguments, f"missing required arguments: {sorted(required - arguments)}"


def test_aws_module_security_settings() -> None:
    main = load_hcl(MODULES / "aws-spot-fleet" / "main.tf")
    resources = {(t, n): body for block in main["resource"] for t, named in block.items() for n, body in named.items()}
    lt = resources[("aws_launch_template", "this")]
    metadata = lt["metadata_options"][0]
    assert metadata["http_tokens"] == "required" and metadata["http_put_response_hop_limit"] == 2
    assert lt["block_device_mappings"][0]["ebs"][0]["encrypted"] is True
    asg = resources[("aws_autoscaling_group", "this")]
    assert asg["capacity_rebalance"] is True
    dist = asg["mixed_instances_policy"][0]["instances_distribution"][0]
    assert dist["on_demand_base_capacity"] == 0
    assert dist["spot_allocation_strategy"] == "price-capacity-optimized"
    lifecycle = resources[("aws_s3_bucket_lifecycle_configuration", "checkpoints")]
    aborts = [r for r in lifecycle["rule"] if "abort_incomplete_multipart_upload" in r]
    assert aborts[0]["abort_incomplete_multipart_upload"][0]["days_after_initiation"] == 1
    # Least privilege: no wildcard actions and every object statement scoped to the prefix.
    text = (MODULES / "aws-spot-fleet" / "main.tf").read_text()
    policy = text[text.index('data "aws_iam_policy_document" "checkpoints"') :]
    policy = policy[: policy.index('resource "aws_iam_role"')]
    assert '"s3:*"' not in policy and "s3:prefix" in policy
    assert "${local.bucket_arn}/${var.checkpoint_prefix}/*" in policy


def test_gcp_module_spot_settings() -> None:
    main = load_hcl(MODULES / "gcp-spot-fleet" / "main.tf")
    resources = {(t, n): body for block in main["resource"] for t, named in block.items() for n, body in named.items()}
    template = resources[("google_compute_instance_template", "this")]
    scheduling = template["scheduling"][0]
    assert scheduling["provisioning_model"] == "SPOT" and scheduling["preemptible"] is True
    assert scheduling["automatic_restart"] is False and scheduling["on_host_maintenance"] == "TERMINATE"
    assert "instance_termination_action" in scheduling
    assert template["shielded_instance_config"][0]["enable_vtpm"] is True
    bucket = resources[("google_storage_bucket", "checkpoints")]
    assert bucket["uniform_bucket_level_access"] is True and bucket["public_access_prevention"] == "enforced"
    actions = [rule["action"][0]["type"] for rule in bucket["lifecycle_rule"]]
    assert "AbortIncompleteMultipartUpload" in actions
    member = resources[("google_storage_bucket_iam_member", "checkpoints")]
    assert member["role"] == "roles/storage.objectUser" and "startsWith" in member["condition"][0]["expression"]


# --- optional: the terraform binary ------------------------------------------------------
# Not installable offline (no registry for it), so these skip when it is absent, CI or not.


def terraform_binary() -> str:
    found = shutil.which("terraform")
    if found is None:
        pytest.skip("terraform is not installed (optional: .ci/install-deploy-tools.sh cannot fetch it offline)")
    return found


def test_terraform_fmt_is_clean() -> None:
    result = run([terraform_binary(), "fmt", "-recursive", "-check", "-diff", "-no-color", str(TERRAFORM)])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(("cloud", "provider"), [("aws", "aws"), ("gcp", "google")])
def test_terraform_validate_example(cloud: str, provider: str, tmp_path: Path) -> None:
    terraform = terraform_binary()
    mirror = Path(os.environ.get("SPOTGUARD_TF_PLUGIN_MIRROR", "/opt/tf-plugins"))
    if not (mirror / "registry.terraform.io" / "hashicorp" / provider).is_dir():
        pytest.skip(
            f"no hashicorp/{provider} provider in the local plugin mirror {mirror}"
            " (providers cannot be fetched offline)"
        )
    # init writes .terraform/ and a lock file next to the configuration: work on a copy.
    shutil.copytree(TERRAFORM, tmp_path / "terraform")
    shutil.copytree(SYSTEMD, tmp_path / "systemd")
    cli_config = tmp_path / "terraformrc"
    cli_config.write_text(f'provider_installation {{\n  filesystem_mirror {{\n    path = "{mirror}"\n  }}\n}}\n')
    env = {**os.environ, "TF_CLI_CONFIG_FILE": str(cli_config), "TF_IN_AUTOMATION": "1", "CHECKPOINT_DISABLE": "1"}
    workdir = tmp_path / "terraform" / "examples" / cloud
    init = run([terraform, "init", "-backend=false", "-input=false", "-no-color"], cwd=workdir, env=env)
    assert init.returncode == 0, init.stdout + init.stderr
    validate = run([terraform, "validate", "-no-color"], cwd=workdir, env=env)
    assert validate.returncode == 0, validate.stdout + validate.stderr


# --- (d) checkov -------------------------------------------------------------------------


def checkov(*args: str) -> subprocess.CompletedProcess[str]:
    # --skip-download: no calls to the vendor's platform (unreachable offline, and slow to fail).
    return run([find_tool("checkov"), "-d", str(TERRAFORM), "--skip-download", *args], cwd=REPO)


SKIP_COMMENT = re.compile(r"#\s*checkov:skip=([A-Z0-9_]+)(?::(.*))?")


@pytest.mark.slow
def test_checkov_finds_no_failures_and_every_skip_is_justified_and_used() -> None:
    comments = {}
    for path in TERRAFORM.rglob("*.tf"):
        for match in SKIP_COMMENT.finditer(path.read_text()):
            reason = (match.group(2) or "").strip()
            assert len(reason) >= 30, f"{path.name}: skip of {match.group(1)} needs a reason beside it"
            comments[match.group(1)] = reason
    result = checkov("-o", "json")  # one run (seconds of CPU): its report says both
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    report = json.loads(result.stdout)
    reports = report if isinstance(report, list) else [report]
    skipped = {c["check_id"] for r in reports for c in r["results"].get("skipped_checks", [])}
    failed = [c["check_id"] for r in reports for c in r["results"].get("failed_checks", [])]
    assert failed == []
    assert sum(r["summary"]["passed"] for r in reports) > 0  # it did check something
    # A skip checkov does not report any more is stale: the check passes or vanished.
    assert skipped == set(comments), f"stale: {set(comments) - skipped}, unexplained: {skipped - set(comments)}"


# --- (e) bootstrap scripts ---------------------------------------------------------------

PLACEHOLDER = re.compile(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def render(template: Path, values: dict[str, str]) -> str:
    """What templatefile() does with a template that uses only ${name} and $${ escapes."""
    text = template.read_text()
    assert "%{" not in text, "template directives are not rendered by this test"
    placeholders = set(PLACEHOLDER.findall(text))
    assert placeholders == set(values), f"template vs values: {placeholders ^ set(values)}"
    text = PLACEHOLDER.sub(lambda m: values[m.group(1)], text)
    return text.replace("$${", "${")


def template_keys(module: str, local_name: str) -> set[str]:
    main = load_hcl(MODULES / module / "main.tf")
    merged = {k: v for block in main["locals"] for k, v in block.items()}
    return set(merged[local_name])


def test_both_clouds_run_the_same_bootstrap_script() -> None:
    assert AWS_TEMPLATE.read_text() == GCP_TEMPLATE.read_text()


def test_aws_user_data_fits_the_16_kib_limit() -> None:
    # EC2 rejects user data over 16 KiB (before base64); leave room for trainer_env and extra_config.
    rendered = render(AWS_TEMPLATE, bootstrap_values("aws"))
    assert len(rendered.encode()) < 14 * 1024


@pytest.mark.parametrize(
    ("module", "local_name", "template"),
    [
        ("aws-spot-fleet", "cloud_init_vars", AWS_TEMPLATE),
        ("gcp-spot-fleet", "startup_script_vars", GCP_TEMPLATE),
    ],
)
def test_module_passes_exactly_the_template_placeholders(module: str, local_name: str, template: Path) -> None:
    text = (MODULES / module / "main.tf").read_text()
    assert f'templatefile("${{path.module}}/templates/{template.name}", local.{local_name})' in text
    assert template_keys(module, local_name) == set(PLACEHOLDER.findall(template.read_text()))


STUB = """#!/bin/bash
printf '%s\\n' "$(basename "$0") $*" >> "$CALLS"
"""

STUBS = {
    # Everything the script could use to change this machine is a recorder.
    "systemctl": "",
    "apt-get": "",
    # A tiny user database, so "already exists" paths are exercised on a second run.
    "groupadd": 'touch "$STUBS/group-${*: -1}"\n',
    "useradd": 'touch "$STUBS/user-${*: -1}"\n',
    "chown": "",
    "mount": "",
    "mkfs.ext4": "",
    "getent": '[[ $1 == group && -e $STUBS/group-$2 ]] || exit 2\necho "$2:x:995:"\n',
    "id": "[[ -e $STUBS/user-${*: -1} ]] || exit 1\necho 1000\n",
    "blkid": "exit 2\n",  # no filesystem on the device yet
    "mountpoint": "exit 1\n",
    "python3": """if [[ $1 == -m && $2 == venv ]]; then
    mkdir -p "$3/bin"
    for tool in pip spotguard python; do cp "$STUBS/venv-$tool" "$3/bin/$tool"; done
fi
""",
    "venv-pip": "",
    "venv-python": "",
    # The peer token read from the cloud's secret store (spotguard peer-token --from-secret).
    "venv-spotguard": """if [[ $1 == restore ]]; then exit "${STUB_RESTORE_RC:-0}"; fi
if [[ $1 == peer-token ]]; then
    [[ -z ${STUB_PEER_TOKEN_FAILS:-} ]] || exit 1
    echo "${STUB_PEER_TOKEN:-a-peer-token-from-the-secret-store}"
fi
""",
}


@dataclass
class Bootstrap:
    root: Path
    calls_file: Path
    stubs: Path
    script: Path
    values: dict[str, str]

    def run(self, **env: str) -> subprocess.CompletedProcess[str]:
        base = {
            "PATH": f"{self.stubs}:/usr/bin:/bin",
            "SPOTGUARD_ROOT": str(self.root),
            "CALLS": str(self.calls_file),
            "STUBS": str(self.stubs),
            "HOME": str(self.root),
        }
        return run(["bash", str(self.script)], env={**base, **env})

    @property
    def calls(self) -> list[str]:
        return self.calls_file.read_text().splitlines() if self.calls_file.exists() else []

    def index(self, call: str) -> int:
        assert call in self.calls, f"{call!r} not in {self.calls}"
        return self.calls.index(call)


def bootstrap_values(cloud: str) -> dict[str, str]:
    bucket = "s3://ckpt-bucket/runs/r1" if cloud == "aws" else "gs://ckpt-bucket/runs/r1"
    glob = (
        "/dev/disk/by-id/nvme-Amazon_EC2_NVMe_Instance_Storage_*"
        if cloud == "aws"
        else "/dev/disk/by-id/google-local-nvme-ssd-*"
    )
    return {
        "provider": "aws" if cloud == "aws" else "gcp",
        "spotguard_package": f"spotguard[{cloud}]==0.1.0",
        "bucket_url": bucket,
        "checkpoint_dir": "/mnt/nvme/spotguard",
        "local_nvme_mount": "/mnt/nvme",
        "nvme_device_glob": glob,
        "trainer_user": "ubuntu",
        "trainer_command": "/opt/conda/bin/python /home/ubuntu/train.py --lr 3e-4 $NOT_EXPANDED",
        "trainer_env": "HF_HOME=/mnt/nvme/hf\nWANDB_MODE=offline",
        "extra_config": 'on_rebalance = "stop"\nkeep_local = 3',
        "peer_port": "",
        "peer_secret": "",
        "peer_previous": "",
        "spotguard_unit": (SYSTEMD / "spotguard.service").read_text().rstrip("\n"),
        "trainer_unit": (SYSTEMD / "example-trainer.service").read_text().rstrip("\n"),
    }


@pytest.fixture(params=["aws", "gcp"])
def bootstrap(request: pytest.FixtureRequest, tmp_path: Path) -> Bootstrap:
    cloud = request.param
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    for name, body in STUBS.items():
        path = stubs / name
        path.write_text(STUB + body)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    values = bootstrap_values(cloud)
    script = tmp_path / "bootstrap.sh"
    script.write_text(render(AWS_TEMPLATE if cloud == "aws" else GCP_TEMPLATE, values))
    root = tmp_path / "root"
    root.mkdir()
    return Bootstrap(root=root, calls_file=tmp_path / "calls.log", stubs=stubs, script=script, values=values)


def test_bootstrap_writes_config_installs_units_and_restores_before_training(bootstrap: Bootstrap) -> None:
    result = bootstrap.run()
    assert result.returncode == 0, result.stderr
    root, values = bootstrap.root, bootstrap.values

    # spotguard installed into its own venv, pinned, and linked onto PATH.
    assert bootstrap.index(f"python3 -m venv {root}/opt/spotguard") < bootstrap.index(
        f"pip install --quiet --disable-pip-version-check {values['spotguard_package']}"
    )
    assert os.readlink(root / "usr/local/bin/spotguard") == "/opt/spotguard/bin/spotguard"
    assert "groupadd --system spotguard" in bootstrap.calls
    assert "useradd --create-home --shell /bin/bash ubuntu" in bootstrap.calls

    # The config the daemon reads, with the group's gid allowed on the socket.
    config_path = root / "etc/spotguard/spotguard.toml"
    config = tomllib.loads(config_path.read_text())
    assert config["provider"] == values["provider"]
    assert config["bucket"] == values["bucket_url"]
    assert config["checkpoint_dir"] == "/mnt/nvme/spotguard"
    assert config["allowed_gids"] == [995]
    assert config["on_rebalance"] == "stop" and config["keep_local"] == 3
    from spotguard.config import load_config

    assert load_config(env={}, config_file=config_path).bucket == values["bucket_url"]

    # Units: the repository's files verbatim, plus drop-ins for this VM.
    units = root / "etc/systemd/system"
    assert (units / "spotguard.service").read_text() == (SYSTEMD / "spotguard.service").read_text()
    assert (units / "trainer.service").read_text() == (SYSTEMD / "example-trainer.service").read_text()
    assert "ReadWritePaths=/mnt/nvme/spotguard" in (units / "spotguard.service.d/checkpoint-dir.conf").read_text()
    trainer_dropin = (units / "trainer.service.d/spotguard.conf").read_text()
    assert f"Environment=SPOTGUARD_BUCKET={values['bucket_url']}" in trainer_dropin
    assert "Environment=SPOTGUARD_CHECKPOINT_DIR=/mnt/nvme/spotguard" in trainer_dropin
    assert "User=ubuntu" in trainer_dropin
    command = (units / "trainer.service.d/command.conf").read_text()
    assert f"ExecStart=\nExecStart={values['trainer_command']}\n" in command, "no shell expansion of $"
    assert (root / "etc/spotguard/trainer.env").read_text() == values["trainer_env"] + "\n"

    # Order: units installed and enabled, restore, then the daemon, then the trainer.
    reload = bootstrap.index("systemctl daemon-reload")
    enable = bootstrap.index("systemctl enable spotguard.service trainer.service")
    restore = bootstrap.index(f"spotguard restore {values['bucket_url']} /mnt/nvme/spotguard")
    start_daemon = bootstrap.index("systemctl restart spotguard.service")
    start_trainer = bootstrap.index("systemctl start trainer.service")
    assert reload < enable < restore < start_daemon < start_trainer
    assert f"chown -R ubuntu:spotguard {root}/mnt/nvme/spotguard" in bootstrap.calls
    # No NVMe device in the scratch root: nothing formatted or mounted.
    assert not any(c.startswith(("mkfs.ext4", "mount ")) for c in bootstrap.calls)
    # The peer tier is off: no token, no peer keys, no credential for the unit.
    assert not (root / "etc/spotguard/peer-token").exists() and "peer_listen" not in config
    assert not (units / "spotguard.service.d/peer-token.conf").exists()


def test_bootstrap_formats_and_mounts_local_nvme(bootstrap: Bootstrap) -> None:
    pattern = bootstrap.values["nvme_device_glob"]
    device = bootstrap.root / pattern.lstrip("/").replace("*", "0")
    device.parent.mkdir(parents=True)
    device.touch()
    result = bootstrap.run()
    assert result.returncode == 0, result.stderr
    mkfs = bootstrap.index(f"mkfs.ext4 -q -F -L spotguard {device}")
    mount = bootstrap.index(f"mount -o noatime,discard {device} {bootstrap.root}/mnt/nvme")
    assert mkfs < mount < bootstrap.index(f"spotguard restore {bootstrap.values['bucket_url']} /mnt/nvme/spotguard")


def test_bootstrap_starts_the_trainer_when_nothing_can_be_restored(bootstrap: Bootstrap) -> None:
    result = bootstrap.run(STUB_RESTORE_RC="1")
    assert result.returncode == 0, result.stderr
    assert "nothing restored" in result.stderr
    assert bootstrap.calls[-1] == "systemctl start trainer.service"


def test_bootstrap_is_idempotent(bootstrap: Bootstrap) -> None:
    assert bootstrap.run().returncode == 0
    first = bootstrap.calls
    bootstrap.calls_file.unlink()
    second = bootstrap.run()
    assert second.returncode == 0, second.stderr
    # The venv and the users exist now: not created again; everything else is redone the same way
    # (the pinned package re-checked, units rewritten, restore, start).
    created_once = ("python3 -m venv", "groupadd", "useradd")
    assert not any(c.startswith(created_once) for c in bootstrap.calls)
    assert [c for c in first if not c.startswith(created_once)] == bootstrap.calls


def test_bootstrap_fails_loudly_when_install_fails(bootstrap: Bootstrap) -> None:
    (bootstrap.stubs / "venv-pip").write_text(STUB + "exit 1\n")
    result = bootstrap.run()
    assert result.returncode != 0
    assert not any(c.startswith("systemctl") for c in bootstrap.calls)


def test_bootstrap_with_peers_writes_the_token_root_only_and_the_peer_config(bootstrap: Bootstrap) -> None:
    cloud = bootstrap.values["provider"]
    secret = (
        "arn:aws:secretsmanager:eu-west-1:123456789012:secret:peer-token-AbCdEf"
        if cloud == "aws"
        else "projects/p/secrets/peer-token"
    )
    values = {**bootstrap.values, "peer_port": "7140", "peer_secret": secret}
    bootstrap.script.write_text(render(AWS_TEMPLATE if cloud == "aws" else GCP_TEMPLATE, values))
    result = bootstrap.run()
    assert result.returncode == 0, result.stderr
    root = bootstrap.root
    assert f"spotguard peer-token --from-secret {secret}" in bootstrap.calls  # read through the venv's SDK
    token = root / "etc/spotguard/peer-token"
    assert token.read_text() == "a-peer-token-from-the-secret-store\n"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and token.stat().st_uid == 0
    config_path = root / "etc/spotguard/spotguard.toml"
    config = tomllib.loads(config_path.read_text())
    assert config["peer_listen"] == "0.0.0.0:7140" and config["peers"] == "bucket"
    assert config["on_rebalance"] == "stop", "extra_config still applies"
    # The daemon (user spotguard) gets the root-only file from systemd, under the credential's name.
    credential = (root / "etc/systemd/system/spotguard.service.d/peer-token.conf").read_text()
    assert "LoadCredential=peer-token:/etc/spotguard/peer-token" in credential
    assert config["peer_token_file"] == "/run/credentials/spotguard.service/peer-token"
    from spotguard.config import load_config

    loaded = load_config(env={}, config_file=config_path)
    assert loaded.peer_discovery and loaded.peer_listen == "0.0.0.0:7140"

    assert not (root / "etc/spotguard/peer-token-previous").exists() and "peer_token_previous_file" not in config
    assert "peer-token-previous" not in credential

    # A rotation: the secret's previous version is read as well, into a second root-only credential.
    bootstrap.script.write_text(
        render(AWS_TEMPLATE if cloud == "aws" else GCP_TEMPLATE, {**values, "peer_previous": "previous"})
    )
    result = bootstrap.run(STUB_PEER_TOKEN="the-new-token-0123456789\nthe-old-token-0123456789")
    assert result.returncode == 0, result.stderr
    assert f"spotguard peer-token --from-secret {secret} --with-previous" in bootstrap.calls
    previous = root / "etc/spotguard/peer-token-previous"
    assert token.read_text() == "the-new-token-0123456789\n"
    assert previous.read_text() == "the-old-token-0123456789\n"
    assert stat.S_IMODE(previous.stat().st_mode) == 0o600 and previous.stat().st_uid == 0
    credential = (root / "etc/systemd/system/spotguard.service.d/peer-token.conf").read_text()
    assert "LoadCredential=peer-token-previous:/etc/spotguard/peer-token-previous" in credential
    loaded = load_config(env={}, config_file=config_path)
    assert loaded.peer_token_previous_file == Path("/run/credentials/spotguard.service/peer-token-previous")
    assert not list((root / "etc/spotguard").glob("*.read")), "the secrets' scratch file is removed"
    # No previous version in the store (a secret never rotated): the second file goes.
    assert bootstrap.run(STUB_PEER_TOKEN="the-new-token-0123456789").returncode == 0
    assert not previous.exists() and "peer_token_previous_file" not in tomllib.loads(config_path.read_text())

    # Turned off again (GCP reruns the script on every boot): the token and the credential go.
    bootstrap.script.write_text(render(AWS_TEMPLATE if cloud == "aws" else GCP_TEMPLATE, bootstrap.values))
    assert bootstrap.run().returncode == 0
    assert not token.exists() and "peer_listen" not in tomllib.loads(config_path.read_text())
    assert not (root / "etc/systemd/system/spotguard.service.d/peer-token.conf").exists()


def test_bootstrap_fails_loudly_when_the_peer_token_cannot_be_read(bootstrap: Bootstrap) -> None:
    values = {**bootstrap.values, "peer_port": "7140", "peer_secret": "projects/p/secrets/peer-token"}
    bootstrap.script.write_text(render(GCP_TEMPLATE, values))
    result = bootstrap.run(STUB_PEER_TOKEN_FAILS="1")
    assert result.returncode != 0
    assert not (bootstrap.root / "etc/spotguard/peer-token").exists()
    assert not any(c.startswith("systemctl") for c in bootstrap.calls)


def resources_of(module: str) -> dict[tuple[str, str], Any]:
    main = load_hcl(MODULES / module / "main.tf")
    found = {}
    for kind in ("resource", "data"):
        for block in main.get(kind, []):
            for type_, named in block.items():
                for name, body in named.items():
                    found[(type_, name)] = body
    return found


def test_aws_peer_tier_opens_the_port_only_within_the_fleet_and_reads_one_secret() -> None:
    resources = resources_of("aws-spot-fleet")
    group = resources[("aws_security_group", "peers")]
    assert group["count"] == "${var.enable_peers ? 1 : 0}"
    for kind in ("ingress", "egress"):
        rule = resources[(f"aws_vpc_security_group_{kind}_rule", "peers")]
        # From (and to) the fleet's own group, on the peer port only; no address range at all.
        assert rule["referenced_security_group_id"] == rule["security_group_id"] == "${aws_security_group.peers[0].id}"
        assert rule["ip_protocol"] == "tcp" and rule["from_port"] == rule["to_port"] == "${var.peer_port}"
        assert not {"cidr_ipv4", "cidr_ipv6", "prefix_list_id"} & set(rule)
    template = resources[("aws_launch_template", "this")]
    assert "aws_security_group.peers[*].id" in template["vpc_security_group_ids"]
    assert "var.peer_token_secret_arn != null" in template["lifecycle"][0]["precondition"][0]["condition"]
    policy = resources[("aws_iam_policy_document", "peer_token")]
    assert policy["statement"] == [
        {
            "sid": "ReadPeerToken",
            "actions": ["secretsmanager:GetSecretValue"],
            "resources": ["${var.peer_token_secret_arn}"],
        }
    ]
    assert resources[("aws_iam_role_policy", "peer_token")]["role"] == "${aws_iam_role.this.id}"


def test_gcp_peer_tier_opens_the_port_only_between_tagged_vms_and_reads_one_secret() -> None:
    resources = resources_of("gcp-spot-fleet")
    rule = resources[("google_compute_firewall", "peers")]
    assert rule["direction"] == "INGRESS"
    assert rule["source_tags"] == rule["target_tags"] == ["${local.peer_tag}"]
    assert rule["allow"] == [{"protocol": "tcp", "ports": ["${tostring(var.peer_port)}"]}]
    assert "source_ranges" not in rule
    template = resources[("google_compute_instance_template", "this")]
    assert "[local.peer_tag]" in template["tags"]
    member = resources[("google_secret_manager_secret_iam_member", "peer_token")]
    assert member["role"] == "roles/secretmanager.secretAccessor"
    assert member["secret_id"] == "${var.peer_token_secret}"
    assert member["member"] == "serviceAccount:${google_service_account.this.email}"
