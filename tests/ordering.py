"""The order the suite's files are handed to the workers (tests/conftest.py): longest first.

A file's seconds come from tests/durations.json (`python -m scripts.test_durations DIR --write
tests/durations.json`, a fresh-clone run's per-file sums). A file it does not name (added since) goes
first if it holds a `slow` test (assumed long: better early than last), else after every measured file
(assumed short). Pure: the caller reads the file and the markers."""

from __future__ import annotations

import json
from pathlib import Path


def measured_seconds(path: Path) -> dict[str, float]:
    """The per-file seconds kept in `path`; {} when it is absent or unreadable (then the order is the
    slow-marker rule alone)."""
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text())["seconds"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def file_rank(file: str, slow_files: set[str], seconds: dict[str, float]) -> tuple[int, float]:
    """Sort key of a test file, smallest first: unmeasured files with a slow test, then measured files
    longest first, then the other unmeasured files (a stable sort keeps their collection order)."""
    if file in seconds:
        return (1, -seconds[file])
    return (0, 0.0) if file in slow_files else (2, 0.0)
