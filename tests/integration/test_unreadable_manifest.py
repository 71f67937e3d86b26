"""A complete checkpoint whose manifest this process cannot read (a permission, an I/O error, the
process out of descriptors) is no leftover of a killed writer: the clean-up at each save removed it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotguard.manifest import MANIFEST, verify_dir
from tests.checkpoints import write_checkpoint

TRAINER_UID = 12345

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="reads the root as another uid (root only)")


@pytest.fixture
def shared_root() -> Iterator[Path]:
    """A checkpoint root another uid may write (root's pytest directories are 0700)."""
    base = Path(tempfile.mkdtemp(prefix="spotguard-shared-"))
    base.chmod(0o755)
    root = base / "root"
    root.mkdir(mode=0o777)
    root.chmod(0o777)
    try:
        yield root
    finally:
        shutil.rmtree(base)


def test_a_checkpoint_whose_manifest_cannot_be_read_is_not_removed_as_a_leftover(shared_root: Path) -> None:
    step_dir = write_checkpoint(shared_root, 7, {"w.bin": b"w" * 4096})
    step_dir.chmod(0o777)  # the other uid may remove what is in it
    (step_dir / MANIFEST).chmod(0o600)  # but not read the manifest (root's, say a restore run as root)
    script = "import sys; from pathlib import Path; from spotguard.localstore import remove_incomplete; "
    script += "print(remove_incomplete(Path(sys.argv[1])))"
    as_trainer = ["setpriv", f"--reuid={TRAINER_UID}", f"--regid={TRAINER_UID}", "--clear-groups", "--"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [*as_trainer, sys.executable, "-c", script, str(shared_root)],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
        timeout=60,
        check=False,
    )
    if done.returncode != 0 and "Permission denied" in done.stderr and "python" in done.stderr.lower():
        pytest.skip(f"this interpreter is out of uid {TRAINER_UID}'s reach: {done.stderr.strip()[-200:]}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    assert "its manifest cannot be read" in done.stderr and "not removed as a leftover" in done.stderr
    assert verify_dir(step_dir) == []  # still whole
