"""scripts/torch_source.sh: which torch index the install commands add (PyTorch's CPU index on hosts
without a GPU, only when it can be reached)."""

from __future__ import annotations

import os
import socket
import subprocess

from tests.procs import ROOT, free_port


def _run(url: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "EOPD_TORCH_INDEX_URL": url}
    return subprocess.run(["bash", "scripts/torch_source.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)


def test_reachable_index_is_added():
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        url = f"http://127.0.0.1:{srv.getsockname()[1]}/whl/cpu"
        r = _run(url)
    assert r.returncode == 0 and r.stdout.split() == ["--extra-index-url", url, "--retries", "1"]


def test_unreachable_index_is_skipped_with_a_message():
    url = f"http://127.0.0.1:{free_port()}/whl/cpu"  # nothing listens there
    r = _run(url)
    assert r.returncode == 0 and r.stdout == ""
    assert "unreachable" in r.stderr and url in r.stderr


def test_none_adds_nothing():
    r = _run("none")
    assert r.returncode == 0 and r.stdout == "" and r.stderr == ""
