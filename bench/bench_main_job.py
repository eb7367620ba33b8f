"""The main job as a newcomer runs it (issue 50, asks 2 and 5): `eopd run --config
configs/smollm2-cpu.yaml` then `eopd report` (what `bash scripts/main.sh` runs after its install),
timed end to end, with every process's resident memory sampled as the head-to-head samples it.

Reports the wall time of the whole job and its parts (`run_summary.json`: training, evaluation, and
the rest: data, student build, teacher start), which evaluations came from the eval cache, the final
held-out and variants numbers, and per process (learner, rollout worker, teacher, eopd run, Redis)
its peak RSS split at that moment into anonymous memory (heap: weights, optimizer state,
activations), file-backed pages (mapped files: libraries, mapped weights; reclaimable) and shared
memory, plus the peak of the sum over all of them.

    .venv/bin/python -m bench.bench_main_job              # warm: the eval cache as this machine has it
    .venv/bin/python -m bench.bench_main_job --cold       # an empty eval cache: a first run's evaluation
    .venv/bin/python -m bench.bench_main_job --quick      # the tiny preset, 2 iterations: checks the wiring
    .venv/bin/python -m bench.bench_main_job --cold --label avx2   # another machine, kept beside the others
    .venv/bin/python -m bench.bench_main_job --trace t.json train.iterations=6 checkpoint.every=3 'eval.models=[]'
                                                          # every 0.5 s sample, for diagnosis (no section)

Run it alone (each job uses the whole machine). Writes the `main_job` section (`main_job_cold` with
--cold, `..._<label>` with --label) of docs/benchmarks.md and bench/results/main_job[_cold][_<label>].json
(not with --quick).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.report import ROOT, markdown_table, matmul_gflops, measure_and_report
from eopd_trainer.eval.evaluate import eval_path

SECTION = "main_job"
PRESETS = {"smollm2-cpu": ROOT / "configs" / "smollm2-cpu.yaml", "tiny": ROOT / "configs" / "tiny.yaml"}
ROLES = (("learner", "eopd_trainer.learner"), ("rollout", "eopd_trainer.rollout"), ("teacher", "eopd_teacher"),
         ("eopd run", "eopd_trainer.cli"), ("redis", "redis-server"))
STATUS_FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


def pss_mib(text: str) -> float | None:
    """The `Pss:` line of a /proc/<pid>/smaps_rollup text in MiB (None when absent): the process's
    resident pages with each shared page divided among the processes that map it."""
    for line in text.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024  # kB
    return None


def role_of(cmdline: str) -> str | None:
    """The job's role of a process from its command line (first match of ROLES), or None."""
    return next((role for role, needle in ROLES if needle in cmdline), None)


def status_mib(text: str) -> dict[str, float]:
    """STATUS_FIELDS of a /proc/<pid>/status text, in MiB (absent fields left out)."""
    out = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in STATUS_FIELDS:
            out[name] = int(rest.split()[0]) / 1024  # kB
    return out


class JobMemory:
    """Samples the process tree under `root` every `period_s`: per role, the peak RSS and its split
    (anonymous, file, shared) at that peak; the peak of the sum over the tree, and each role's RSS at
    that instant (`at_peak_total`: what the machine had to hold at once).

    The sum of RSS counts a page that several processes map once per process: the mapped weights
    buffer while the worker reads it (the learner maps it too), the libraries every torch process
    maps. The same peak taken over PSS (`peak_pss_total_mib`, `at_peak_pss`; /proc/<pid>/smaps_rollup,
    each shared page divided among its processes) is the physical memory the job holds. Pages the
    job shares with processes outside it (this benchmark's own torch libraries) are divided with
    them too: a few MiB."""

    def __init__(self, root: int, period_s: float = 0.5, *, keep_series: bool = False):
        self.root, self.period_s = root, period_s
        # With keep_series: every sample, {"t": seconds since the start, role: [anonymous, file, shared] MiB}.
        self.series: list[dict] | None = [] if keep_series else None
        self._t0 = time.monotonic()
        self.peaks: dict[str, dict[str, float]] = {}
        self.peak_total_mib = 0.0
        self.at_peak_total: dict[str, float] = {}
        self.peak_pss_total_mib = 0.0
        self.at_peak_pss: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> JobMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _tree(self) -> list[int]:
        parents = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
        tree, grew = {self.root}, True
        while grew:
            new = {pid for pid, ppid in parents.items() if ppid in tree} - tree
            tree |= new
            grew = bool(new)
        return sorted(tree)

    def sample(self) -> None:
        total, split, pss = 0.0, {}, {}
        for pid in self._tree():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                mib = status_mib(Path(f"/proc/{pid}/status").read_text())
                role = role_of(cmd)
                proportional = pss_mib(Path(f"/proc/{pid}/smaps_rollup").read_text()) if role else None
            except OSError:
                continue
            if role is None or "VmRSS" not in mib:
                continue
            total += mib["VmRSS"]
            if proportional is not None:
                pss[role] = pss.get(role, 0.0) + proportional
            split[role] = [a + mib.get(f, 0.0) for a, f in zip(split.get(role, [0.0] * 3), STATUS_FIELDS[1:], strict=True)]
            if mib["VmRSS"] > self.peaks.get(role, {}).get("VmRSS", 0.0):
                self.peaks[role] = mib
        if total > self.peak_total_mib:
            self.peak_total_mib, self.at_peak_total = total, {r: sum(v) for r, v in split.items()}  # VmRSS = the three
        if sum(pss.values()) > self.peak_pss_total_mib:
            self.peak_pss_total_mib, self.at_peak_pss = sum(pss.values()), pss
        if self.series is not None:
            self.series.append({"t": round(time.monotonic() - self._t0, 2), **{r: [round(x, 1) for x in v] for r, v in split.items()}})

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()


def _cold_cache_dir(tmp: Path) -> Path:
    """An EOPD_CACHE_DIR with no evaluations in it, sharing this machine's converted models."""
    real = Path(os.environ.get("EOPD_CACHE_DIR", Path.home() / ".cache" / "eopd"))
    cold = tmp / "cache"
    cold.mkdir()
    if real.is_dir():
        for entry in real.iterdir():
            if entry.name != "evals":
                (cold / entry.name).symlink_to(entry.resolve())
    return cold


def run_job(preset: str, run_dir: Path, *, cold: bool, overrides: list[str], trace: bool = False) -> dict:
    """The job, timed, its memory sampled; with `trace`, every sample is kept (`memory.series`)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "REDIS_URL")}
    with tempfile.TemporaryDirectory(prefix="eopd-main-job-") as tmp:
        if cold:
            env["EOPD_CACHE_DIR"] = str(_cold_cache_dir(Path(tmp)))
        eopd = [sys.executable, "-m", "eopd_trainer.cli"]
        speed = matmul_gflops()  # the machine's speed in one number, before the run, on the quiet machine
        t0 = time.monotonic()
        proc = subprocess.Popen([*eopd, "run", "--config", str(PRESETS[preset]), "--overwrite", f"run_dir={run_dir}",
                                 *overrides], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
        with JobMemory(proc.pid, keep_series=trace) as mem:
            _, err = proc.communicate()
        run_s = time.monotonic() - t0
        if proc.returncode != 0:
            raise SystemExit(f"eopd run failed ({proc.returncode}):\n{err[-4000:]}")
        report = subprocess.run([*eopd, "report", str(run_dir)], cwd=ROOT, env=env, capture_output=True, text=True)
        if report.returncode != 0:
            raise SystemExit(f"eopd report failed ({report.returncode}):\n{report.stderr[-4000:]}")
        total_s = time.monotonic() - t0
    summary = json.loads((run_dir / "run_summary.json").read_text())
    evals = {}
    for name, path in (("heldout", eval_path(run_dir)), ("variants", eval_path(run_dir, "variants"))):
        if path.is_file():
            for model, r in json.loads(path.read_text())["models"].items():
                evals.setdefault(model, {})[name] = {"avg_at_k": r.get("avg_at_k"), "reused": bool(r.get("cache", {}).get("reused")),
                                                     "eval_s": r.get("eval_s")}
    return {"preset": preset, "cold": cold, "overrides": overrides, "matmul_gflops": speed, "total_s": total_s, "run_s": run_s,
            "train_s": summary.get("train_s"), "eval_s": summary.get("eval_s"), "evals": evals,
            "memory": {"peak_total_mib": mem.peak_total_mib, "per_role": mem.peaks, "at_peak_total": mem.at_peak_total,
                       "peak_pss_total_mib": mem.peak_pss_total_mib, "at_peak_pss": mem.at_peak_pss,
                       **({"series": mem.series} if trace else {})}}


def section_text(data: dict) -> str:
    r = data["result"]
    rest = r["total_s"] - (r["train_s"] or 0) - (r["eval_s"] or 0)
    label = data.get("label")
    overrides = " ".join(r.get("overrides") or ())
    label_title = ""  # a label names another machine, or, with overrides, what they changed
    if label:
        label_title = f" ({label}: `{overrides}`)" if overrides else f" on another machine ({label})"
    command_tail = "".join((" --cold" if r["cold"] else "", f" --label {label}" if label else "",
                            f" {overrides}" if overrides else ""))
    speed = f", fp32 1024^3 matmul {r['matmul_gflops']:.0f} GFLOP/s" if r.get("matmul_gflops") else ""
    head = (f"`python -m bench.bench_main_job{command_tail}` on {data.get('machine', 'this machine')}{speed} "
            f"(load average {data.get('load_avg', '?')}): the `{r['preset']}` preset, "
            f"`eopd run` then `eopd report`, the eval cache {'empty (a first run)' if r['cold'] else 'as this machine had it'}.")
    times = markdown_table(["whole job", "training", "evaluation", "the rest (data, student build, teacher start, report)"],
                           [[f"{r['total_s']:.0f} s ({r['total_s'] / 60:.1f} min)", f"{r['train_s'] or 0:.0f} s",
                             f"{r['eval_s'] or 0:.0f} s", f"{rest:.0f} s"]])
    evals = markdown_table(["model", "held-out Avg@k", "variants Avg@k", "evaluated (s) or reused"],
                           [[m, _num(e.get("heldout", {}).get("avg_at_k")), _num(e.get("variants", {}).get("avg_at_k")),
                             ", ".join(f"{s}: " + ("reused" if v["reused"] else f"{v['eval_s'] or 0:.0f} s") for s, v in e.items())]
                            for m, e in r["evals"].items()])
    memory = markdown_table(["process", "peak RSS GiB", "anonymous", "file-backed", "shared"],
                            [[role, *(f"{p.get(f, 0) / 1024:.2f}" for f in STATUS_FIELDS)]
                             for role, p in sorted(r["memory"]["per_role"].items(), key=lambda kv: -kv[1]["VmRSS"])])
    return "\n".join([
        f"## The main job end to end{', a first run' if r['cold'] else ''}{label_title}: time and memory "
        f"(`python -m bench.bench_main_job{command_tail}`, issue 50 asks 2 and 5)", "",
        head, "", times, "", evals, "",
        f"Peak memory, the sum over the job's processes: **{r['memory']['peak_total_mib'] / 1024:.2f} GiB**"
        + (" (at that instant: " + ", ".join(f"{role} {mib / 1024:.2f}" for role, mib in
                                            sorted(r["memory"]["at_peak_total"].items(), key=lambda kv: -kv[1])) + " GiB)"
           if r["memory"].get("at_peak_total") else "") + ". Each process "
        "at its own peak (RSS = anonymous + file-backed + shared; file-backed pages are mapped files: libraries, and the "
        "teacher's weights):", "", memory, *_pss_lines(r["memory"])]) + "\n"


def _pss_lines(memory: dict) -> list[str]:
    """The peak of the summed PSS, where the run recorded it (runs before it did not)."""
    if not memory.get("peak_pss_total_mib"):
        return []
    at = ", ".join(f"{role} {mib / 1024:.2f}" for role, mib in sorted(memory["at_peak_pss"].items(), key=lambda kv: -kv[1]))
    return ["", f"The same peak in PSS, each page the processes share counted once (the mapped weights buffer, which "
            f"the learner and the worker both map while the worker loads a version; the libraries every torch process "
            f"maps), the physical memory the job held: **{memory['peak_pss_total_mib'] / 1024:.2f} GiB** "
            f"(at that instant: {at} GiB)."]


def _num(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _label(text: str) -> str:
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,31}", text):
        raise argparse.ArgumentTypeError(f"--label: lower-case letters, digits and '-' (at most 32), not {text!r}")
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=list(PRESETS), default="smollm2-cpu")
    p.add_argument("--cold", action="store_true", help="an empty eval cache (a first run's evaluation)")
    p.add_argument("--quick", action="store_true", help="the tiny preset, 2 iterations; writes no section")
    p.add_argument("--out", type=Path, help="with --quick: where to write the JSON")
    p.add_argument("--run-dir", type=Path, help="keep the run here (default: a temporary directory, removed)")
    p.add_argument("--label", type=_label, help="another machine's measurement, kept beside the default one: the "
                   "results go to main_job[_cold]_<label>.json and that section of docs/benchmarks.md")
    p.add_argument("--trace", type=Path, help="keep every memory sample (each role's anonymous, file-backed and shared "
                   "MiB every 0.5 s) and write the whole result to this JSON; writes no section (for diagnosis, "
                   "e.g. with train.iterations=4 'eval.models=[]')")
    p.add_argument("overrides", nargs="*", help="key=value for eopd run")
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.overrides = "tiny", ["train.iterations=2", *args.overrides]
    with tempfile.TemporaryDirectory(prefix="eopd-main-job-run-") as tmp:
        run_dir = args.run_dir or Path(tmp) / "run"
        if args.trace:
            result = run_job(args.preset, run_dir, cold=args.cold, overrides=args.overrides, trace=True)
            args.trace.write_text(json.dumps(result) + "\n")
            mem = result["memory"]
            print(f"peak of the sum {mem['peak_total_mib']:.0f} MiB: " + ", ".join(
                f"{role} {mib:.0f}" for role, mib in sorted(mem["at_peak_total"].items(), key=lambda kv: -kv[1])))
            return 0
        name = SECTION + ("_cold" if args.cold else "") + (f"_{args.label}" if args.label else "")
        return measure_and_report(name, lambda: {"result": run_job(args.preset, run_dir, cold=args.cold,
                                                                      overrides=args.overrides), "label": args.label},
                                  section_text, quick=args.quick, out=args.out)


if __name__ == "__main__":
    raise SystemExit(main())
