"""Children that end with `eopd run` (issue 49): every process `eopd run` starts (the learner, the
rollout workers, the teachers, a redis-server) is killed by the kernel the moment `eopd run` dies
without stopping it (SIGKILL, OOM, a crash): PR_SET_PDEATHSIG with SIGKILL, set through ctypes'
`prctl` in the child before it execs its command (so the pid `eopd run` knows is the command's).

    python -I -S pdeathsig.py PARENT_PID -- COMMAND [ARG ...]

This file runs by its path with the standard library only (`-I -S`: no site-packages, no package
import; tens of milliseconds), from `supervisor.spawn` (`guarded`). After the prctl it checks that
its parent is still PARENT_PID: a parent that died between the fork and the prctl would never
send the signal, so the child exits instead of running as an orphan.

SIGKILL, not SIGTERM: a child's clean stop needs the `eopd run` that is gone (a learner on the
embedded queue retried its lost connection for ~110 s, a teacher drains for 30 s); nothing
committed is lost (a checkpoint is committed by one rename, a redis-server has written every
reply's change before it answers). Ctrl-C / SIGTERM of `eopd run` still stop the children cleanly
(`Supervisor.stop_all`). The signal follows the parent *thread* that started the child: `eopd run`
starts its children from its main thread. A child's own children are not covered (the learner
and the workers of `eopd run` start none; vLLM runs in process)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Sequence

PR_SET_PDEATHSIG = 1  # linux/prctl.h
SIGNAL = signal.SIGKILL
EXIT_ORPHANED = 125  # the parent died before the guard was set: the command never ran
EXIT_NOT_RUN = 127  # the command could not be executed (as a shell says)


def guarded(args: Sequence[str], parent_pid: int | None = None) -> list[str]:
    """The command line that runs `args` behind the guard, for a child of `parent_pid` (this
    process by default). PR_SET_PDEATHSIG is Linux's: elsewhere `args` as they are (the child
    would outlive a killed parent)."""
    if not sys.platform.startswith("linux"):
        return list(args)
    parent = os.getpid() if parent_pid is None else parent_pid
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), str(parent), "--", *args]


def set_pdeathsig(sig: int = SIGNAL) -> None:
    """`prctl(PR_SET_PDEATHSIG, sig)` for this process; OSError when the kernel refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(int(sig)), ctypes.c_ulong(0), ctypes.c_ulong(0),
                  ctypes.c_ulong(0)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")


def main(argv: Sequence[str]) -> int:
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        print("usage: pdeathsig.py PARENT_PID -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    parent, command = int(argv[0]), list(argv[2:])
    set_pdeathsig()
    if os.getppid() != parent:  # it died before the prctl: the kernel will not tell us
        print(f"pdeathsig: parent {parent} is gone; not starting {command[0]}", file=sys.stderr, flush=True)
        return EXIT_ORPHANED
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"pdeathsig: cannot run {command[0]}: {exc.strerror or exc}", file=sys.stderr, flush=True)
    return EXIT_NOT_RUN


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
