"""Shared helpers for benchmarks: machine and commit provenance, JSON results, docs/benchmarks.md
sections.

Each benchmark owns one section of docs/benchmarks.md, delimited by HTML comments, and rewrites
only that section, so benchmarks can run separately without clobbering each other.

Where things go: bench/results/<name>.json and docs/benchmarks.md by default; the environment
variables `EOPD_BENCH_RESULTS` (a directory) and `EOPD_BENCH_DOC` (a file) redirect both. `eopd
bench all --quick` uses them to send quick results to bench/results/quick/, so a quick run never
overwrites published numbers, whichever benchmark it runs.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "bench" / "results"

_HEADER = """# Benchmarks

Every number here is measured by a script in `bench/`, side by side in one run on the machine
described in each section. Re-run a section with the command it names; the section is rewritten.
"""


def results_dir() -> Path:
    """Where write_results writes (EOPD_BENCH_RESULTS, else bench/results)."""
    return Path(os.environ.get("EOPD_BENCH_RESULTS") or RESULTS)


def doc_path() -> Path:
    """The document write_section rewrites (EOPD_BENCH_DOC, else docs/benchmarks.md)."""
    return Path(os.environ.get("EOPD_BENCH_DOC") or DOC)


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):  # pragma: no cover
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def cpu_model() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # pragma: no cover
        pass
    return cpu


def boot_id() -> str | None:
    """The kernel's boot id: tells apart two machines (or two boots) that report the same CPU name."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:  # pragma: no cover
        return None


def matmul_gflops(n: int = 1024, reps: int = 20) -> float:
    """This machine's speed in one number: the best of `reps` fp32 [n, n] @ [n, n] matmuls on torch's
    default threads, in GFLOP/s. Recorded beside timings that will be compared with other machines'."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # first call: allocation and thread start-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return round(2 * n**3 / best / 1e9, 1)


def timing_machine() -> dict:
    """The machine a timing is recorded on, measured now (call it on the quiet machine, just before
    the timed run): CPU model, cores, memory, the kernel's boot id (tells apart machines of one CPU
    name), the matmul probe (how far apart they are) and when (`timed_at`, UTC: the head-to-head pairs
    a seed's systems on the machine that timed both most recently). Stored beside every training time
    that will be compared across machines (the head-to-head's runs, the layout grid's cells)."""
    return machine_facts() | {"matmul_gflops": matmul_gflops(),
                              "timed_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def machine_facts() -> dict:
    """CPU model, cores, memory (GiB) and the kernel's boot id: what provenance and timing_machine
    both record."""
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "mem_gib": round(mem_gib), "boot_id": boot_id()}


# What the benchmarks write: a run rewrites them section by section, so a change there is not a
# change to what the numbers were measured with (else every section after the first of an
# `eopd bench all` run would call its checkout dirty). Figures are written before the results JSON.
BENCH_OUTPUTS = ("docs/benchmarks.md", "docs/figures", "bench/results")


def dirty_files() -> list[str]:
    """Tracked files changed in the checkout, the benchmarks' own outputs excluded."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                              *(f":(exclude){p}" for p in BENCH_OUTPUTS)], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):  # pragma: no cover
        return []
    return [line[3:] for line in out.stdout.splitlines() if len(line) > 3] if out.returncode == 0 else []


def provenance() -> dict:
    """This machine and checkout: CPU model, cores, memory, the kernel's boot id (two machines can share
    a CPU name), torch, `git describe --always` (with
    `-dirty` when tracked files other than the benchmarks' outputs are changed, which are listed
    in `dirty_files`) and the full commit hash. Stored in every results JSON."""
    if "torch" in sys.modules:  # the benchmark ran torch: its version and thread count
        torch = sys.modules["torch"]
        tv = f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    else:
        try:
            from importlib.metadata import version

            tv = f"torch {version('torch')}"
        except Exception:  # pragma: no cover
            tv = "no torch"
    machine = machine_facts() | {"torch": tv}
    commit = os.environ.get("EOPD_COMMIT")
    if commit:  # a copy of the checkout whose .git may be stale or absent (a lent device machine) is named
        # by whoever sent it (scripts/device_bench.sh)
        return {**machine, "commit": commit, "describe": os.environ.get("EOPD_DESCRIBE") or commit[:7], "dirty_files": [],
                "named_by": "EOPD_COMMIT"}
    dirty = dirty_files()
    describe = _git("describe", "--always")
    return {**machine, "commit": _git("rev-parse", "HEAD") or "?",
            "describe": (describe + ("-dirty" if dirty else "")) if describe else "?", "dirty_files": dirty[:20]}


def machine_description(prov: dict | None = None) -> str:
    """One line describing the CPU, core count, memory, torch build and the checkout."""
    p = prov or provenance()
    return (f"{p['cpu']}, {p['cores']} cores, {p['mem_gib']} GiB, {p['torch']}, "
            f"eopd@{p['describe']} (commit {p['commit']})")


def provenance_of(payload: dict) -> dict:
    """The provenance of a results JSON: its recorded fields, or for JSONs written before they
    were recorded, what its `machine` line says (CPU model; the short commit as `describe`)."""
    if "commit" in payload and "cpu" in payload:
        return {k: payload[k] for k in ("cpu", "cores", "mem_gib", "torch", "commit", "describe")} | {
            "time": payload.get("time", "?"), "machine": payload.get("machine", "")}
    machine = payload.get("machine", "")
    rev = re.search(r"eopd@([0-9a-zA-Z_.\-]+)", machine)
    return {"cpu": machine.split(",")[0].strip() or "?", "commit": None, "describe": rev.group(1) if rev else "?",
            "time": payload.get("time", "?"), "machine": machine}


def same_machine_and_commit(a: dict, b: dict) -> bool:
    """Whether two results JSONs were measured on the same CPU model and the same clean commit
    (a dirty tree or an unknown commit never compares)."""
    pa, pb = provenance_of(a), provenance_of(b)
    if pa["cpu"] != pb["cpu"] or not pa["commit"] or pa["commit"] != pb["commit"]:
        return False
    return not (pa["describe"].endswith("-dirty") or pb["describe"].endswith("-dirty"))


def header_line(command: str, payload: dict) -> str:
    """`command` on <machine>, eopd@<describe> (commit <hash>), <time>: the first line of a section."""
    p = provenance_of(payload)
    if p.get("commit"):
        where = machine_description(p)
    else:
        where = f"{p['machine']} (full commit hash not recorded by this older run)"
    return f"{command} on {where}, {p['time']}."


CHECKOUT_FIELDS = ("commit", "describe", "dirty_files")


def write_results(name: str, payload: dict, *, started: dict | None = None) -> Path:
    """Writes <results dir>/<name>.json (with the machine, the commit and a timestamp) and returns its path.
    `started`: the provenance taken when the measurement began; its checkout (the code the measured
    processes loaded) is recorded, and the checkout at the end under `checkout_at_end` if it differs."""
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    prov = provenance()
    if started is not None:
        end = {k: prov[k] for k in CHECKOUT_FIELDS}
        prov = {**prov, **{k: started[k] for k in CHECKOUT_FIELDS}}
        if end != {k: started[k] for k in CHECKOUT_FIELDS}:
            prov["checkout_at_end"] = end
    payload = {**payload, "machine": machine_description(prov), **prov,
               "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return path


def measure_and_report(name: str, measure, section_text, *, quick: bool, out: Path | None) -> int:
    """Runs `measure()` (a dict) with the load average before and after it recorded as `load_avg`,
    prints `section_text(data)`; quick: writes the JSON to `out` (if given) and nothing else; else
    the results file and the `name` section of docs/benchmarks.md. Returns 0."""
    load_start = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    started = provenance()  # the checkout the measured processes load
    data = measure()
    data["load_avg"] = f"{load_start} -> " + ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(section_text(data))
    if quick:
        if out:
            out.write_text(json.dumps(data))
        return 0
    path = write_results(name, data, started=started)
    write_section(name, section_text(json.loads(path.read_text())))
    return 0


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"


def read_section(name: str) -> str | None:
    """The current body of the `name` section, or None."""
    path = doc_path()
    if not path.exists():
        return None
    begin, end = _markers(name)
    m = re.search(re.escape(begin) + r"\n?(.*?)\n?" + re.escape(end), path.read_text(), re.S)
    return m.group(1) if m else None


def print_section(name: str, markdown: str, *, write: bool) -> int:
    """Prints a section computed from archived results; with `write`, also replaces the `name`
    section of the document with it (the `--write` of the report-only commands). Returns 0."""
    print(markdown)
    if write:
        write_section(name, markdown)
    return 0


def write_section(name: str, markdown: str) -> Path:
    """Replaces (or appends) the `name` section of the document with `markdown`."""
    path = doc_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else _HEADER
    begin, end = _markers(name)
    block = f"{begin}\n{markdown.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)
    return path


STALE_PREFIX = "> **Stale:**"


def mark_stale(name: str, reason: str) -> bool:
    """Puts a stale note under the heading of the `name` section (replacing an older note):
    "not re-run in this run (<reason>); last measured at <time of its JSON>". Returns False if the
    section does not exist (nothing to mark)."""
    body = read_section(name)
    if body is None:
        return False
    res = results_dir() / f"{name}.json"
    if res.exists():
        p = provenance_of(json.loads(res.read_text()))
        last = f"{p['time']} on {p['cpu']}, eopd@{p['describe']}"
    else:
        last = "an unknown time (no results JSON)"
    lines = [ln for ln in body.splitlines() if not ln.startswith(STALE_PREFIX)]
    note = f"{STALE_PREFIX} not re-run in this run ({reason}); last measured at {last}."
    at = 1 if lines and lines[0].startswith("#") else 0
    lines[at:at] = ["", note] if at else [note, ""]
    write_section(name, "\n".join(lines))
    return True


def clear_stale(name: str) -> None:
    body = read_section(name)
    if body is not None and STALE_PREFIX in body:
        lines = [ln for ln in body.splitlines() if not ln.startswith(STALE_PREFIX)]
        write_section(name, re.sub(r"\n{3,}", "\n\n", "\n".join(lines)))


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub markdown table; floats are printed with 4 significant digits."""

    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(out)
