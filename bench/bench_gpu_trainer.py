"""The trainer on a GPU, anyone can run it: the paper preset (`configs/qwen3-paper.yaml`) with random
Qwen3-8B / Qwen3-1.7B-shaped models built on the GPU (`bench.random_models`, Qwen3's vocabulary and
special-token ids), for a few iterations of `eopd run`, reporting per iteration: seconds, the
learner's collect time and idle share (time blocked on the rollouts stream), the weight sync
(the learner's publish, the worker's load; `weight_sync` auto = the mapped buffer in shared memory,
broadcast = NCCL from the learner's GPU to the worker's), and the peak memory of each process (RSS; GPU memory
from nvidia-smi where present).

    python -m bench.run_all gpu                  # or: python -m bench.bench_gpu_trainer
    python -m bench.bench_gpu_trainer --runs sync:auto async:auto async:broadcast --batch 64 --response-length 256
    python -m bench.bench_gpu_trainer --smoke    # the same run on the CPU, tiny shapes, ~1 min (CI)

Writes the `gpu_trainer` section of docs/benchmarks.md and bench/results/gpu_trainer.json (card,
commit, versions). Without a CUDA device it prints why and exits 0 having measured nothing.
The first iteration (compilation, allocator warm-up) is left out of the means.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.random_models import SHAPES, TINY, write_random_model
from bench.report import ROOT, markdown_table

SECTION = "gpu_trainer"
PAPER = ROOT / "configs" / "qwen3-paper.yaml"
ROLES = (("teacher", "eopd_teacher"), ("rollout", "eopd_trainer.rollout"), ("learner", "eopd_trainer.learner"))
_PUBLISHED = re.compile(r"published policy version (\d+) \((\w+), ([\d.]+) MB, ([\d.]+)s\)")
_LOADED = re.compile(r"loaded policy version (\d+) into \S+ in ([\d.]+)s")


def write_prompts(path: Path, n: int) -> Path:
    """`n` arithmetic problems with answers (records {"problem", "answer"}, as the preset's MATH files)."""
    with path.open("w") as fh:
        for i in range(n):
            a, b = 17 + 7 * i % 89, 3 + 11 * i % 97
            fh.write(json.dumps({"problem": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n")
    return path


class MemoryWatch:
    """Polls the descendants of a process: peak RSS (and GPU memory, from nvidia-smi) per role."""

    def __init__(self, pid: int, period_s: float = 0.5):
        self.pid, self.period_s = pid, period_s
        self.rss_gib: dict[str, float] = {}
        self.gpu_gib: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._smi = shutil.which("nvidia-smi")

    def __enter__(self) -> MemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _descendants(self) -> dict[int, str]:
        """pid -> role of every live descendant of `pid` that is one of ROLES."""
        parents: dict[int, int] = {}
        cmdlines: dict[int, str] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                parents[int(entry)] = int(stat[1])
                cmdlines[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, IndexError, ValueError):
                continue
        out = {}
        for pid in parents:
            p = pid
            while p in parents and p != self.pid and p > 1:
                p = parents[p]
            if p == self.pid:
                role = next((name for name, module in ROLES if module in cmdlines.get(pid, "")), None)
                if role:
                    out[pid] = role
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            procs = self._descendants()
            for pid, role in procs.items():
                try:
                    rss_kb = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                                  if line.startswith("VmRSS:"))
                except (OSError, StopIteration):
                    continue
                self.rss_gib[role] = max(self.rss_gib.get(role, 0.0), rss_kb / 2**20)
            if self._smi:
                self._poll_gpu(procs)

    def _poll_gpu(self, procs: dict[int, str]) -> None:
        try:
            out = subprocess.run([self._smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return
        for line in out.splitlines():
            parts = [x.strip() for x in line.split(",")]
            if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in procs:
                role = procs[int(parts[0])]
                self.gpu_gib[role] = max(self.gpu_gib.get(role, 0.0), float(parts[1]) / 1024)


def summarise(run_dir: Path) -> dict:
    """What one run measured, from its train_metrics.jsonl and its children's logs."""
    rows = [json.loads(line) for line in (run_dir / "train_metrics.jsonl").read_text().splitlines()]
    iters = [r for r in rows if r.get("kind") == "iteration"]
    window = iters[1:] or iters  # the first iteration warms up
    it_s = sum(r["iter/iteration_s"] for r in window)
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    worker_log = (run_dir / "logs" / "rollout-w0.log").read_text()
    found = _PUBLISHED.findall(learner_log)
    published = [(float(mb), float(s)) for _, _, mb, s in found][1:]  # version 0: the initial weights (and the group's forming)
    loaded = [float(s) for _, s in _LOADED.findall(worker_log)][1:]
    return {
        "iterations": len(iters), "measured": len(window),
        "iteration_s": it_s / len(window),
        "collect_s": sum(r["iter/collect_s"] for r in window) / len(window),
        "idle_frac": sum(r["iter/queue_wait_s"] for r in window) / it_s,
        "publish_format": found[-1][1] if found else None,
        "publish_mb": published[-1][0] if published else None,
        "publish_s": sum(s for _, s in published) / len(published) if published else None,
        "load_s": sum(loaded) / len(loaded) if loaded else None,
    }


def run_once(tmp: Path, run: str, teacher: Path, student: Path, prompts: Path, args, device: str) -> dict:
    mode, weight_sync = run.split(":")
    run_dir = tmp / f"run-{mode}-{weight_sync}"
    overrides = [f"run_dir={run_dir}", f"mode={mode}", f"weight_sync={weight_sync}", f"teacher.model={teacher}", f"student.model={student}",
                 f"student.device={device}", f"data.train_files=[{prompts}]", "data.eval_files=[]", "eval.enabled=false",
                 f"rollout.max_response_length={args.response_length}", f"rollout.generation_batch_size={args.batch}",
                 f"train.batch_size={args.batch}", f"train.mini_batch_size={max(1, args.batch // 4)}",
                 f"train.micro_batch_size={args.micro_batch}", f"train.iterations={args.iterations}",
                 f"checkpoint.every={args.iterations}", "logging.progress=false", *args.override]
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    started = time.perf_counter()
    with subprocess.Popen([sys.executable, "-m", "eopd_trainer.cli", "run", "--config", str(PAPER), *overrides], cwd=ROOT,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc, \
            MemoryWatch(proc.pid) as mem:
        output = proc.communicate(timeout=args.timeout)[0]
    if proc.returncode != 0:
        raise RuntimeError(f"eopd run ({run}) failed with exit code {proc.returncode}:\n{output[-4000:]}")
    out = {"mode": mode, "weight_sync": weight_sync, **summarise(run_dir), "wall_s": time.perf_counter() - started,
           "peak_rss_gib": {k: round(v, 2) for k, v in mem.rss_gib.items()},
           "peak_gpu_gib": {k: round(v, 2) for k, v in mem.gpu_gib.items()}}
    print(json.dumps(out), flush=True)
    return out


def table(rows: list[dict]) -> str:
    def fmt(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    body = [[r["mode"], f"{r['weight_sync']} ({r.get('publish_format') or '-'})", r["measured"], fmt(r["iteration_s"], ".1f"), fmt(r["collect_s"], ".1f"), f"{100 * r['idle_frac']:.0f}%",
             f"{fmt(r['publish_mb'], '.0f')} MB in {fmt(r['publish_s'])} s", fmt(r["load_s"]),
             ", ".join(f"{k} {v}" for k, v in sorted(r["peak_gpu_gib"].items())) or "-",
             ", ".join(f"{k} {v}" for k, v in sorted(r["peak_rss_gib"].items()))] for r in rows]
    return markdown_table(["mode", "weight_sync (published as)", "iterations measured", "s / iteration", "collect s", "learner idle",
                           "weights published", "worker load s", "peak GPU GiB", "peak RSS GiB"], body)


def section_text(data: dict) -> str:
    sw, a = data["software"], data["args"]
    return "\n".join([
        "## Trainer on a GPU: the paper preset (`python -m bench.run_all gpu`)", "",
        f"On {sw.get('device', '?')}, torch {sw['torch']} (CUDA {sw['cuda']}), transformers {sw['transformers']}, "
        f"eopd@{data['provenance'].get('describe', '?')}: `configs/qwen3-paper.yaml` with random Qwen3-8B / Qwen3-1.7B-shaped "
        f"models, {a['batch']} prompts per iteration, {a['response_length']}-token responses, {a['iterations']} iterations "
        "(the first left out), evaluation off.", "", table(data["results"]), ""]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", nargs="+", default=["sync:auto", "async:auto", "async:broadcast"],
                   help="mode:weight_sync of each run (mode sync or async; weight_sync auto, disk, mapped, broadcast)")
    p.add_argument("--batch", type=int, default=64, help="prompts per iteration (the preset's 128 halved to fit the time)")
    p.add_argument("--response-length", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--override", nargs="*", default=[], help="more run-config overrides (key=value)")
    p.add_argument("--smoke", action="store_true", help="on the CPU, tiny Qwen3-shaped models, 2 iterations; writes nothing")
    args = p.parse_args(argv)
    import torch

    from bench.bench_gpu_teacher import finish

    if args.smoke:
        args.runs, args.batch, args.response_length, args.micro_batch, args.iterations = ["sync:broadcast"], 4, 16, 1, 2
    for run in args.runs:
        mode, _, weight_sync = run.partition(":")
        if mode not in ("sync", "async") or weight_sync not in ("auto", "disk", "shm", "mapped", "broadcast"):
            p.error(f"--runs: {run!r} is not mode:weight_sync (sync|async):(auto|disk|shm|mapped|broadcast)")
    if not args.smoke and not torch.cuda.is_available():
        print("[gpu_trainer] skipped: no CUDA device here (torch.cuda.is_available() is False); "
              "`--smoke` runs the same code on the CPU", file=sys.stderr)
        return 0
    device, dtype = ("cpu", "float32") if args.smoke else ("cuda", "bfloat16")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="eopd-gpu-trainer-") as tmp_s:
        tmp = Path(tmp_s)
        teacher = write_random_model(tmp / "Qwen3-8B", TINY if args.smoke else SHAPES["qwen3-8b"], role="teacher",
                                     dtype=dtype, device=device)
        student = write_random_model(tmp / "Qwen3-1.7B-Base", TINY if args.smoke else SHAPES["qwen3-1.7b"], role="student",
                                     seed=1, dtype=dtype, device=device)
        if torch.cuda.is_available():  # the builders' copies, before the run's processes start
            torch.cuda.empty_cache()
        prompts = write_prompts(tmp / "train.jsonl", max(64, args.batch * args.iterations))
        rows = []
        for run in args.runs:  # written after each run: a run cut short by its time limit keeps the earlier ones
            rows.append(run_once(tmp, run, teacher, student, prompts, args, device))
            if len(rows) < len(args.runs):
                finish(SECTION, rows, args, t0, table, section_text, done=len(rows), planned=len(args.runs))
    return finish(SECTION, rows, args, t0, table, section_text)


if __name__ == "__main__":
    raise SystemExit(main())
