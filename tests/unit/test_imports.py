"""The two sides' import boundaries: the hook pulls in no daemon deps, the daemon no torch."""

from __future__ import annotations

import json
import subprocess
import sys


def loaded_after(statement: str) -> set[str]:
    code = f"import sys, json\n{statement}\nprint(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return set(json.loads(result.stdout.strip().splitlines()[-1]))


def test_trainer_hook_imports_no_http_or_cloud_sdk() -> None:
    loaded = loaded_after("from spotguard import Guard\nimport spotguard.integrations")
    assert "torch" in loaded  # sanity: the statement really imported the hook
    assert not loaded & {"aiohttp", "boto3", "botocore", "google", "s3transfer", "prometheus_client"}


def test_daemon_imports_no_torch() -> None:
    loaded = loaded_after("import spotguard.cli, spotguard.daemon.app, spotguard.storage.file, spotguard.providers.aws")
    assert "aiohttp" in loaded or "spotguard" in loaded
    assert "torch" not in loaded and "numpy" not in loaded
