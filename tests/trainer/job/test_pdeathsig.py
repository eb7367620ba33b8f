"""Children that end with their parent (issue 49, job/pdeathsig.py): real processes. A parent that
starts children with `supervisor.spawn` is SIGKILLed; its children, one of which ignores SIGTERM,
are gone within two seconds. The whole `eopd run` (tiny preset, four children) is
test_run_e2e.py's `test_a_killed_eopd_run_takes_its_children_down`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from eopd_trainer.job import pdeathsig
from tests.procs import ROOT
from tests.trainer.job.test_run_e2e import _alive, survivors_of_a_kill

PARENT = """
import sys
from pathlib import Path
from eopd_trainer.job.supervisor import spawn
log = Path(sys.argv[1])
a = spawn("sleeper", ["sleep", "300"], log)
b = spawn("stubborn", ["sh", "-c", "trap '' TERM; while :; do sleep 1; done"], log)
print(a.popen.pid, b.popen.pid, flush=True)
sys.stdin.read()  # until the test kills this process
"""


def test_the_children_of_a_killed_parent_are_gone_within_two_seconds(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path / "child.log")], cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2
        deadline = time.monotonic() + 30  # the guard execs the command in the same pid
        while not all(open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")[0] in (b"sleep", b"sh") for p in pids):
            assert time.monotonic() < deadline, "the children never exec'd their commands"
            time.sleep(0.05)
        assert all(_alive(p) for p in pids)
        assert not survivors_of_a_kill(parent, pids, 2), "children outlived their parent by 2 s"
    finally:
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()


def test_a_child_whose_parent_died_before_the_guard_does_not_run(tmp_path):
    """The race the prctl cannot close alone: the parent gone between the fork and the prctl. The
    guard sees another parent than the one it was started for and exits without running the command."""
    marker = tmp_path / "ran"
    not_the_parent = os.getpid() + 1_000_000  # no such pid: this test process is the real parent
    res = subprocess.run(pdeathsig.guarded(["touch", str(marker)], parent_pid=not_the_parent), capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == pdeathsig.EXIT_ORPHANED and f"parent {not_the_parent} is gone" in res.stderr
    assert not marker.exists()
    ok = subprocess.run(pdeathsig.guarded(["touch", str(marker)]), capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and marker.exists()


def test_a_command_that_cannot_run_says_so():
    res = subprocess.run(pdeathsig.guarded(["/nonexistent/eopd-binary"]), capture_output=True, text=True, timeout=60)
    assert res.returncode == pdeathsig.EXIT_NOT_RUN
    assert "cannot run /nonexistent/eopd-binary: No such file or directory" in res.stderr
