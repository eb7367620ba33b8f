"""Shared helpers for benchmarks: machine description, JSON results, docs/benchmarks.md sections.

Each benchmark owns one section of docs/benchmarks.md, delimited by HTML comments, and rewrites
only that section, so benchmarks can run separately without clobbering each other.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "bench" / "results"

_HEADER = """# Benchmarks

Every number here is measured by a script in `bench/`, side by side in one run on the machine
described in each section. Re-run a section with the command it names; the section is rewritten.
"""


def machine_description() -> str:
    """One line describing the CPU, core count, memory and torch build."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    try:
        import torch

        tv = f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    except ImportError:  # pragma: no cover
        tv = "no torch"
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:  # pragma: no cover
        rev = "?"
    return f"{cpu}, {os.cpu_count()} cores, {mem_gib:.0f} GiB, {tv}, eopd@{rev or '?'}"


def write_results(name: str, payload: dict) -> Path:
    """Writes bench/results/<name>.json (with the machine and a timestamp) and returns its path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"machine": machine_description(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **payload}
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return path


def write_section(name: str, markdown: str) -> Path:
    """Replaces (or appends) the `name` section of docs/benchmarks.md with `markdown`."""
    DOC.parent.mkdir(parents=True, exist_ok=True)
    text = DOC.read_text() if DOC.exists() else _HEADER
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    block = f"{begin}\n{markdown.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    DOC.write_text(text)
    return DOC


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub markdown table; floats are printed with 4 significant digits."""

    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(out)
