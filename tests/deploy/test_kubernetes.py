"""Offline checks of kubernetes/: every overlay rendered with ``kubectl kustomize``, validated against the
Kubernetes schemas (kubernetes-validate), checkov on the rendered manifests, and the wiring between the
DaemonSet, its ConfigMap, the example trainer Job and the daemon's own settings, read from the rendered
YAML (not from the text of the sources).

Tools come from ``.ci/install-deploy-tools.sh``: kubectl (Debian ``kubernetes-client``, or any kubectl on
PATH), kubernetes-validate and checkov (in the tools venv). A missing tool skips, except under CI.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from spotguard.config import DaemonConfig, load_config
from spotguard.version import __version__
from tests.deploy.test_deploy_files import REPO, find_tool, run

KUBERNETES = REPO / "kubernetes"
OVERLAYS = ("eks", "gke", "aks")
TARGETS = (*(f"overlays/{name}" for name in OVERLAYS), "example-trainer")
# Kubernetes versions to validate against: the oldest and the newest minor the managed clouds run today
# (kubernetes-validate ships the schemas).
KUBERNETES_VERSIONS = ("1.33.0", "1.37.0")
# Where each cloud puts its spot capacity: (label, value) pairs, any one of which marks a spot node.
SPOT_LABELS = {
    "eks": {("eks.amazonaws.com/capacityType", "SPOT"), ("karpenter.sh/capacity-type", "spot")},
    "gke": {("cloud.google.com/gke-spot", "true")},
    "aks": {("kubernetes.azure.com/scalesetpriority", "spot")},
}
SPOT_TAINTS = {  # (key, value, effect) of the taint each cloud puts on spot nodes
    "gke": ("cloud.google.com/gke-spot", "true", "NoSchedule"),
    "aks": ("kubernetes.azure.com/scalesetpriority", "spot", "NoSchedule"),
}
IDENTITY_ANNOTATION = {
    "eks": "eks.amazonaws.com/role-arn",
    "gke": "iam.gke.io/gcp-service-account",
    "aks": "azure.workload.identity/client-id",
}
PROVIDER = {"eks": "aws", "gke": "gcp", "aks": "azure"}


# --- rendering -----------------------------------------------------------------------------


def kustomize(directory: Path) -> str:
    result = run([find_tool("kubectl"), "kustomize", str(directory)])
    assert result.returncode == 0, result.stderr
    return result.stdout


def documents(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def validate_schemas(paths: list[Path], version: str = KUBERNETES_VERSIONS[-1]) -> subprocess.CompletedProcess[str]:
    """kubernetes-validate --strict on rendered manifests, against one Kubernetes version's schemas."""
    return run([find_tool("kubernetes-validate"), "--strict", "--kubernetes-version", version, *map(str, paths)])


def patched_aks(tmp_path: Path, patches: list[str], resources: tuple[str, ...] = ()) -> str:
    """The AKS overlay (no hostNetwork) rendered with files of kubernetes/patches added, as a user adds
    them to an overlay: ``patches`` under patchesStrategicMerge, ``resources`` as resources."""
    tree = tmp_path / "kubernetes"
    shutil.copytree(KUBERNETES, tree)
    overlay = tree / "overlays" / "aks"
    for name in [*patches, *resources]:
        shutil.copy(tree / "patches" / name, overlay / name)
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    kustomization["patchesStrategicMerge"] += patches
    if resources:
        kustomization["resources"] = list(resources)
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return kustomize(overlay)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each target rendered once, to a file: {"eks": .../eks.yaml, ..., "example-trainer": ...}."""
    out = tmp_path_factory.mktemp("rendered")
    files = {}
    for target in TARGETS:
        name = target.rsplit("/", 1)[-1]
        files[name] = out / f"{name}.yaml"
        files[name].write_text(kustomize(KUBERNETES / target))
    return files


def load(rendered: dict[str, Path], name: str) -> dict[str, dict[str, Any]]:
    """The rendered objects by kind (each target has one object of each kind)."""
    by_kind: dict[str, dict[str, Any]] = {}
    for doc in documents(rendered[name].read_text()):
        assert doc["kind"] not in by_kind, f"{name}: two {doc['kind']}s"
        by_kind[doc["kind"]] = doc
    return by_kind


def container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in pod_spec["containers"] if c["name"] == name]
    return found


def env_of(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def host_paths(pod_spec: dict[str, Any], c: dict[str, Any]) -> dict[str, str]:
    """A container's mount path -> the host directory mounted there."""
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    return {
        m["mountPath"]: volumes[m["name"]]["hostPath"]["path"]
        for m in c["volumeMounts"]
        if "hostPath" in volumes[m["name"]]
    }


def daemon_config(
    objects: dict[str, dict[str, Any]], tmp_path: Path, env: dict[str, str] | None = None
) -> DaemonConfig:
    """What `spotguard run` in the DaemonSet's container would run with: its --config file (from the
    ConfigMap mounted there) and its environment, through the daemon's own config loader; ``env``
    stands for what the kubelet fills in (downward API, Secrets)."""
    pod = objects["DaemonSet"]["spec"]["template"]["spec"]
    daemon = container(pod, "spotguard")
    args = daemon["args"]
    config_path = Path(args[args.index("--config") + 1])
    (config_mount,) = [m for m in daemon["volumeMounts"] if config_path.parent == Path(m["mountPath"])]
    (volume,) = [v for v in pod["volumes"] if v["name"] == config_mount["name"]]
    configmap = objects["ConfigMap"]
    assert volume["configMap"]["name"] == configmap["metadata"]["name"], "the DaemonSet mounts this ConfigMap"
    local = tmp_path / config_path.name
    local.write_text(configmap["data"][config_path.name])
    return load_config(env={**env_of(daemon), **(env or {})}, config_file=local)


def dockerfile_arg(name: str) -> str:
    (value,) = re.findall(rf"^ARG {name}=(\S+)$", (REPO / "Dockerfile").read_text(), flags=re.MULTILINE)
    return value


# --- rendering, schemas, checkov -----------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_every_kustomization_renders(target: str) -> None:
    kinds = sorted(doc["kind"] for doc in documents(kustomize(KUBERNETES / target)))
    if target.startswith("overlays/"):
        assert kinds == ["ConfigMap", "DaemonSet", "Namespace", "NetworkPolicy", "ResourceQuota", "ServiceAccount"]
    else:
        assert kinds == ["Job", "Namespace", "NetworkPolicy", "ServiceAccount"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_rendered_manifests_match_the_kubernetes_schemas(rendered: dict[str, Path], version: str) -> None:
    result = validate_schemas(list(rendered.values()), version)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed for resource") == sum(
        len(documents(path.read_text())) for path in rendered.values()
    )


def test_schema_validation_catches_a_misspelt_field(tmp_path: Path, rendered: dict[str, Path]) -> None:
    """The check above can fail: an unknown field in the DaemonSet is rejected."""
    broken = tmp_path / "broken.yaml"
    broken.write_text(rendered["eks"].read_text().replace("hostNetwork: true", "hostNetwrok: true"))
    result = validate_schemas([broken])
    assert result.returncode != 0 and "hostNetwrok" in result.stdout + result.stderr


SKIP_ANNOTATION = re.compile(r"^checkov\.io/skip\d+$")


@pytest.mark.slow
def test_checkov_passes_on_the_rendered_manifests_and_every_skip_is_justified(
    rendered: dict[str, Path], tmp_path: Path
) -> None:
    justified = set()
    for path in rendered.values():
        for doc in documents(path.read_text()):
            for key, value in (doc["metadata"].get("annotations") or {}).items():
                if SKIP_ANNOTATION.match(key):
                    check, _, reason = value.partition("=")
                    assert "=" not in reason, f"{key}: checkov splits on '=': keep it out of the reason"
                    assert len(reason) >= 40, f"{doc['kind']} {check}: the skip needs its reason beside it"
                    justified.add(check)
    scan = tmp_path / "scan"
    scan.mkdir()
    for path in rendered.values():
        shutil.copy(path, scan / path.name)
    # One run for all targets (checkov is slow to start); --skip-download: offline.
    result = run(
        [find_tool("checkov"), "-d", str(scan), "--framework", "kubernetes", "--skip-download", "-o", "json"], cwd=scan
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    report = json.loads(result.stdout)
    reports = report if isinstance(report, list) else [report]
    failed = [c["check_id"] for r in reports for c in r["results"].get("failed_checks", [])]
    skipped = {c["check_id"] for r in reports for c in r["results"].get("skipped_checks", [])}
    assert failed == []
    assert sum(r["summary"]["passed"] for r in reports) > 100  # it did check the objects
    assert skipped == justified, f"stale: {justified - skipped}, unexplained: {skipped - justified}"


# --- wiring --------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_socket_and_checkpoint_root_are_the_same_for_daemon_configmap_trainer_and_hook(
    overlay: str, rendered: dict[str, Path], tmp_path: Path
) -> None:
    objects = load(rendered, overlay)
    config = daemon_config(objects, tmp_path)
    ds_pod = objects["DaemonSet"]["spec"]["template"]["spec"]
    daemon_mounts = host_paths(ds_pod, container(ds_pod, "spotguard"))
    job_pod = load(rendered, "example-trainer")["Job"]["spec"]["template"]["spec"]
    trainer = container(job_pod, "trainer")
    trainer_mounts = host_paths(job_pod, trainer)
    hook_env = env_of(trainer)

    # The socket: the daemon's setting, the hook's SPOTGUARD_SOCKET, and one host directory mounted at
    # the socket's directory in both pods.
    assert hook_env["SPOTGUARD_SOCKET"] == str(config.socket)
    socket_dir = str(config.socket.parent)
    assert daemon_mounts[socket_dir] == trainer_mounts[socket_dir]
    # The checkpoint root: the same host directory at the same path (the daemon accepts only paths
    # inside its own root, as the trainer reports them), the daemon's setting and the hook's.
    root = str(config.checkpoint_dir)
    assert hook_env["SPOTGUARD_CHECKPOINT_DIR"] == root
    assert daemon_mounts[root] == trainer_mounts[root]
    assert daemon_mounts[socket_dir] != daemon_mounts[root]
    # The handled-notice record survives a pod restart: on the node too.
    assert str(config.state_dir) in daemon_mounts
    # The init container prepares exactly these host directories.
    (init,) = ds_pod["initContainers"]
    assert set(host_paths(ds_pod, init).values()) == {daemon_mounts[socket_dir], daemon_mounts[root]} | {
        daemon_mounts[str(config.state_dir)]
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_trainer_runs_as_a_uid_the_daemon_accepts_and_in_its_group(
    overlay: str, rendered: dict[str, Path], tmp_path: Path
) -> None:
    objects = load(rendered, overlay)
    config = daemon_config(objects, tmp_path)
    ds_pod = objects["DaemonSet"]["spec"]["template"]["spec"]
    daemon_ctx = container(ds_pod, "spotguard")["securityContext"]
    # The daemon runs as the image's user (the Dockerfile's defaults).
    assert str(daemon_ctx["runAsUser"]) == dockerfile_arg("SPOTGUARD_UID")
    assert str(daemon_ctx["runAsGroup"]) == dockerfile_arg("SPOTGUARD_GID")
    job_ctx = load(rendered, "example-trainer")["Job"]["spec"]["template"]["spec"]["securityContext"]
    # Allowed by uid (a pod's supplementary groups are invisible to the daemon), and in the daemon's
    # group at the file level (the 0750 socket directory, the 0660 socket, the 2770 checkpoint root).
    assert job_ctx["runAsUser"] in config.trainer_uids
    assert job_ctx["runAsUser"] not in config.allowed_uids and job_ctx["runAsGroup"] not in config.allowed_gids
    assert daemon_ctx["runAsGroup"] in job_ctx["supplementalGroups"]
    # The liveness probe's `spotguard status` runs as the daemon's uid: allowed_uids keeps its default
    # (the daemon's own uid and root), set neither in the ConfigMap nor in the environment.
    configmap = objects["ConfigMap"]["data"]["spotguard.toml"]
    assert "allowed_uids" not in tomllib.loads(configmap)
    assert "SPOTGUARD_ALLOWED_UIDS" not in env_of(container(ds_pod, "spotguard"))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_period_covers_the_daemons_shutdown_budget(
    overlay: str, rendered: dict[str, Path], tmp_path: Path
) -> None:
    objects = load(rendered, overlay)
    config = daemon_config(objects, tmp_path)
    ds_pod = objects["DaemonSet"]["spec"]["template"]["spec"]
    grace = ds_pod["terminationGracePeriodSeconds"]
    # On SIGTERM the daemon uploads for up to shutdown_grace, then writes the last manifest and aborts
    # its multipart uploads: it must be done before the kubelet's SIGKILL (10 s, as in spotguard.service).
    assert config.shutdown_grace + 10 <= grace
    # Long enough for AWS's 120 s notice window, as TimeoutStopSec=150 under systemd.
    assert grace >= 120
    # Nothing else spends the budget first, and SIGTERM reaches `spotguard run` itself (the image's
    # ENTRYPOINT, no shell in between).
    daemon = container(ds_pod, "spotguard")
    assert "command" not in daemon and "lifecycle" not in daemon
    # Stopped after the trainers at graceful node shutdown; the trainer saves within its own grace.
    assert ds_pod["priorityClassName"] == "system-node-critical"
    job_pod = load(rendered, "example-trainer")["Job"]["spec"]["template"]["spec"]
    assert job_pod["terminationGracePeriodSeconds"] < grace
    assert (
        int(env_of(container(job_pod, "trainer"))["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
        < job_pod["terminationGracePeriodSeconds"]
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_image_is_the_projects_and_liveness_asks_the_daemon(
    overlay: str, rendered: dict[str, Path], tmp_path: Path
) -> None:
    objects = load(rendered, overlay)
    config = daemon_config(objects, tmp_path)
    ds_pod = objects["DaemonSet"]["spec"]["template"]["spec"]
    for c in [*ds_pod["initContainers"], *ds_pod["containers"]]:
        assert c["image"] == f"spotguard:{__version__}", "the image built from the Dockerfile, this release"
    daemon = container(ds_pod, "spotguard")
    assert 'ENTRYPOINT ["spotguard", "run"]' in (REPO / "Dockerfile").read_text()
    probe = daemon["livenessProbe"]["exec"]["command"]
    assert probe[:2] == ["spotguard", "status"]
    assert probe[probe.index("--socket") + 1] == str(config.socket)
    assert daemon["securityContext"]["readOnlyRootFilesystem"] is True
    assert daemon["securityContext"]["capabilities"]["drop"] == ["ALL"]
    requests, limits = daemon["resources"]["requests"], daemon["resources"]["limits"]
    assert requests["memory"] and limits["memory"] and requests["cpu"] and limits["cpu"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_selects_its_clouds_spot_nodes_and_identity(
    overlay: str, rendered: dict[str, Path], tmp_path: Path
) -> None:
    objects = load(rendered, overlay)
    config = daemon_config(objects, tmp_path)
    assert config.provider == PROVIDER[overlay]
    assert (config.bucket or "").startswith("gs://" if overlay == "gke" else "s3://")
    ds_pod = objects["DaemonSet"]["spec"]["template"]["spec"]
    assert spot_selection(ds_pod) == SPOT_LABELS[overlay]
    if overlay in SPOT_TAINTS:
        key, value, effect = SPOT_TAINTS[overlay]
        assert {"key": key, "operator": "Equal", "value": value, "effect": effect} in ds_pod["tolerations"]
    else:
        assert {"operator": "Exists"} in ds_pod["tolerations"], "EKS: no spot taint; tolerate the GPU nodes'"
    # The metadata service: IMDSv2's hop limit (EKS) and GKE's metadata server need the host network.
    assert ds_pod.get("hostNetwork", False) is (overlay in ("eks", "gke"))
    if ds_pod.get("hostNetwork"):
        assert ds_pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    account = objects["ServiceAccount"]
    assert ds_pod["serviceAccountName"] == account["metadata"]["name"]
    assert set(account["metadata"]["annotations"]) == {IDENTITY_ANNOTATION[overlay]}
    labels = objects["DaemonSet"]["spec"]["template"]["metadata"]["labels"]
    assert (labels.get("azure.workload.identity/use") == "true") is (overlay == "aks")
    # The example trainer lands on this cloud's spot nodes too (where the daemon runs).
    job_pod = load(rendered, "example-trainer")["Job"]["spec"]["template"]["spec"]
    assert SPOT_LABELS[overlay] <= spot_selection(job_pod)
    if overlay in SPOT_TAINTS:
        key, value, effect = SPOT_TAINTS[overlay]
        assert {"key": key, "operator": "Equal", "value": value, "effect": effect} in job_pod["tolerations"]


def spot_selection(pod: dict[str, Any]) -> set[tuple[str, str]]:
    """The (label, value) pairs a pod may be scheduled by: its nodeSelector, or the alternatives of its
    required node affinity (each term one label)."""
    if "nodeSelector" in pod:
        assert "affinity" not in pod
        return set(pod["nodeSelector"].items())
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    found = set()
    for term in terms:
        (expression,) = term["matchExpressions"]
        assert expression["operator"] == "In"
        found.update((expression["key"], value) for value in expression["values"])
    return found


def test_the_peers_patch_advertises_the_pod_ip_from_the_downward_api(tmp_path: Path) -> None:
    """kubernetes/patches/peers.yaml on an overlay without hostNetwork: the address the daemon registers
    for other daemons is the pod's IP, as the kubelet expands it."""
    objects = {doc["kind"]: doc for doc in documents(patched_aks(tmp_path, ["peers.yaml"]))}
    pod = objects["DaemonSet"]["spec"]["template"]["spec"]
    daemon = container(pod, "spotguard")
    names = [e["name"] for e in daemon["env"]]
    (pod_ip,) = [e for e in daemon["env"] if e["name"] == "POD_IP"]
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    # $(POD_IP) expands only if POD_IP is defined earlier in the list.
    assert names.index("POD_IP") < names.index("SPOTGUARD_PEER_ADVERTISE")
    # The kubelet's expansion, then the daemon's own loader, with the token from the Secret.
    env = {name: value.replace("$(POD_IP)", "10.244.3.17") for name, value in env_of(daemon).items()}
    config = daemon_config(objects, tmp_path, {**env, "SPOTGUARD_PEER_TOKEN": "a-token-of-at-least-16-bytes"})
    assert config.peer_advertise == "10.244.3.17:7140" and config.peer_discovery
    port = int(config.peer_listen.rsplit(":", 1)[1]) if config.peer_listen else None
    assert [p["containerPort"] for p in daemon["ports"]] == [port]
    (rule,) = objects["NetworkPolicy"]["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": port}]
    assert pod.get("hostNetwork") is None


def test_the_metrics_patch_serves_the_port_its_annotations_and_network_policy_name(tmp_path: Path) -> None:
    """kubernetes/patches/metrics.yaml and metrics-networkpolicy.yaml on an overlay beside the peers
    patch: the daemon's own loader reads the port and address the pod's annotations, container port
    and added NetworkPolicy name, and the peer port's rule is still there (policies add up)."""
    text = patched_aks(tmp_path, ["peers.yaml", "metrics.yaml"], ("metrics-networkpolicy.yaml",))
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(text)
    checked = validate_schemas([rendered])
    assert checked.returncode == 0, checked.stdout + checked.stderr
    docs = documents(text)
    policies = {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == "NetworkPolicy"}
    (daemonset,) = [doc for doc in docs if doc["kind"] == "DaemonSet"]
    (configmap,) = [doc for doc in docs if doc["kind"] == "ConfigMap"]
    objects = {"DaemonSet": daemonset, "ConfigMap": configmap}  # what daemon_config reads
    template = daemonset["spec"]["template"]
    daemon = container(template["spec"], "spotguard")
    config = daemon_config(
        objects, tmp_path, {"SPOTGUARD_PEER_ADVERTISE": "10.244.3.17:7140", "SPOTGUARD_PEER_TOKEN": "a" * 32}
    )
    assert (config.metrics_host, config.metrics_port) == ("0.0.0.0", 9464)
    annotations = template["metadata"]["annotations"]
    assert (
        annotations["prometheus.io/scrape"] == "true" and int(annotations["prometheus.io/port"]) == config.metrics_port
    )
    ports = {p["name"]: p["containerPort"] for p in daemon["ports"]}
    assert ports == {"peer": 7140, "metrics": config.metrics_port}
    (metrics_rule,) = policies["spotguard-metrics"]["spec"]["ingress"]
    assert metrics_rule["ports"] == [{"protocol": "TCP", "port": config.metrics_port}]
    (peer_rule,) = policies["spotguard"]["spec"]["ingress"]
    assert peer_rule["ports"] == [{"protocol": "TCP", "port": 7140}]


def test_configmap_toml_is_the_daemons_and_documents_its_keys() -> None:
    text = (KUBERNETES / "base" / "spotguard.toml").read_text()
    keys = set(tomllib.loads(text))
    assert keys <= {f for f in DaemonConfig.__dataclass_fields__}
    assert {"socket", "checkpoint_dir", "state_dir", "trainer_uids", "shutdown_grace"} <= keys


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) runs the command as the pod would")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_init_container_leaves_the_checkpoint_root_setgid_as_its_identity_and_capabilities_allow(
    overlay: str, rendered: dict[str, Path], tmp_path: Path
) -> None:
    """The kernel drops the setgid bit of a chmod by a process outside the file's group that lacks
    CAP_FSETID: run as 0:0 with CHOWN and FOWNER only, the init container's chmod 2770 left the root
    2770 without its s, so the trainer's step directories stayed in the trainer's group, unreadable
    by the daemon. Its own command, under its declared uid, gid and capabilities, on stand-in dirs."""
    if os.geteuid() != 0:
        pytest.skip("runs the command as uid 0 with only the init container's capabilities (root only)")
    ds_pod = load(rendered, overlay)["DaemonSet"]["spec"]["template"]["spec"]
    (init,) = ds_pod["initContainers"]
    ctx = init["securityContext"]
    assert ctx["capabilities"]["drop"] == ["ALL"]
    caps = ",".join(f"+{cap.lower()}" for cap in ctx["capabilities"]["add"])
    command = init["command"][-1]
    for mount in init["volumeMounts"]:
        stand_in = tmp_path / mount["name"]
        stand_in.mkdir()
        command = command.replace(mount["mountPath"], str(stand_in))
    identity = [f"--reuid={ctx['runAsUser']}", f"--regid={ctx['runAsGroup']}", "--clear-groups"]
    limits = [f"--inh-caps=-all,{caps}", f"--ambient-caps=-all,{caps}", f"--bounding-set=-all,{caps}"]
    done = subprocess.run(
        ["setpriv", *identity, *limits, "/bin/sh", "-c", command], check=False, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    root = tmp_path / "checkpoints"
    assert (root.stat().st_mode & 0o7777, root.stat().st_gid) == (0o2770, 10001)


def test_the_example_job_starts_a_new_pod_when_its_trainer_stops_for_a_notice(rendered: dict[str, Path]) -> None:
    """A trainer that saved for a hard notice and left its loop exited 0: the Job was complete, with
    the run unfinished and no replacement pod. It exits EXIT_STOPPED, which the Job ignores as a
    failure (no count against backoffLimit), and a new pod resumes from the bucket."""
    from spotguard import EXIT_STOPPED

    job = load(rendered, "example-trainer")["Job"]["spec"]
    trainer = container(job["template"]["spec"], "trainer")["name"]
    ignored = [
        rule["onExitCodes"]
        for rule in job["podFailurePolicy"]["rules"]
        if rule["action"] == "Ignore" and "onExitCodes" in rule
    ]
    assert {"containerName": trainer, "operator": "In", "values": [EXIT_STOPPED]} in ignored
    assert job["template"]["spec"]["restartPolicy"] == "Never"  # what podFailurePolicy requires


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_quota_scopes_the_daemon_s_priority_class_in_its_namespace(overlay: str, rendered: dict[str, Path]) -> None:
    """GKE admits a system-node-critical pod outside kube-system only where a ResourceQuota scopes that
    class: without one the DaemonSet created no pod ("insufficient quota to match these scopes")."""
    objects = load(rendered, overlay)
    daemonset = objects["DaemonSet"]
    priority = daemonset["spec"]["template"]["spec"]["priorityClassName"]
    quota = objects["ResourceQuota"]
    assert quota["metadata"]["namespace"] == daemonset["metadata"]["namespace"]
    (scope,) = quota["spec"]["scopeSelector"]["matchExpressions"]
    assert (scope["scopeName"], scope["operator"], scope["values"]) == ("PriorityClass", "In", [priority])
    assert int(quota["spec"]["hard"]["pods"]) >= 1000  # a pod per node of a large cluster
