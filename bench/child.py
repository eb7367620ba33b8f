"""One benchmark path in its own process, driven line by line by the parent, so that paths can be
loaded once and their timed rounds interleaved (whatever else runs on a shared machine then weighs
on every path alike). Used by bench_vllm and bench_rollout.

Protocol: the child prints `MARK <json>` once loaded (its hello), then answers each command line
from stdin with one `MARK <json>` line; `quit` answers with the process's final numbers and exits.
Other lines on the child's stdout (library logs) are skipped; its stderr goes to the console.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "BENCH_CHILD_RESULT "


def status_mib(key: str) -> float:
    """A /proc/self/status memory field in MiB (VmRSS, VmHWM)."""
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) / 1024


def cpu_seconds() -> float:
    """User + system CPU time of this process (all threads): less sensitive than wall time to
    other work on a shared machine."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def reset_peak() -> None:
    """Resets the process's RSS high-water mark (VmHWM) where the kernel allows it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def rotated(items: list, r: int) -> list:
    """`items` starting at index r (mod len): round r's order, so who goes first rotates."""
    k = r % len(items)
    return items[k:] + items[:k]


def reply(payload: dict) -> None:
    print(MARK + json.dumps(payload), flush=True)


def serve(hello: dict, handle: Callable[[str, str], dict], final: Callable[[], dict]) -> None:
    """The child's loop: hello, then `handle(command, argument)` per line until `quit` (`final()`)."""
    reply(hello)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "quit":
            reply(final())
            return
        reply(handle(cmd, arg))


class ChildProc:
    """The parent's handle on one child: `python -m <module> <args> --child <path>`."""

    def __init__(self, module: str, path: str, args: list[str], env: dict[str, str] | None = None):
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
               "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"), "TOKENIZERS_PARALLELISM": "false",
               **(env or {})}
        self.path = path
        self.popen = subprocess.Popen([sys.executable, "-m", module, *args, "--child", path], cwd=ROOT, env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.hello = self._reply()

    def _reply(self) -> dict:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        raise RuntimeError(f"bench child {self.path} exited with {self.popen.wait()}")

    def ask(self, command: str) -> dict:
        assert self.popen.stdin is not None
        self.popen.stdin.write(command + "\n")
        self.popen.stdin.flush()
        return self._reply()

    def close(self) -> dict:
        out = self.ask("quit")
        self.popen.wait(60)
        return out

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(30)
