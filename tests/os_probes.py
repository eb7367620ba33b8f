"""What tests read of the operating system: a process's memory from /proc, and whether a server has
closed a socket (importable as `tests.os_probes`)."""

from __future__ import annotations

import socket


def status_mib(pid: int, field: str) -> float:
    """A /proc/PID/status memory field (VmRSS, VmHWM, ...) in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def reset_peak(pid: int) -> None:
    """Resets the process's VmHWM to its current RSS (Linux: `echo 5 > /proc/PID/clear_refs`)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def closed_by_server(s: socket.socket) -> bool:
    """Whether the peer closed or reset `s` (anything it sent first is read and dropped)."""
    s.settimeout(0.01)
    try:
        return s.recv(65536) == b""
    except (TimeoutError, BlockingIOError):
        return False
    except OSError:  # reset
        return True


def has_ipv6_loopback() -> bool:
    """Whether this machine can bind ::1."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False
