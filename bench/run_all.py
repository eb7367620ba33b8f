"""`eopd bench all [--quick]`: every benchmark side by side in one run, then a summary table and a
clearly labelled capacity projection of the paper's setting, written to docs/benchmarks.md.

Each benchmark runs in its own process, one after the other (they would distort each other's
timings if run together), and rewrites its own section of docs/benchmarks.md and its JSON under
bench/results/. `--quick` runs small shapes in a few minutes; quick runs of the teacher, loss, vLLM, TRL-peer and pipeline
benchmarks write no results (their full runs do; the quick pipeline uses the tiny preset).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.report import RESULTS, ROOT, machine_description, markdown_table, write_results, write_section

# (name, module, full args, quick args, python) -- python None means this interpreter.
BENCHES = [
    ("teacher", "bench.bench_teacher", [], ["--quick"], None),
    ("loss", "bench.bench_loss", [], ["--quick"], None),
    ("vllm", "bench.bench_vllm", [], ["--quick"], ROOT / ".venv-vllm" / "bin" / "python"),
    ("teacher_vllm", "bench.bench_teacher", ["--engine", "vllm"], ["--quick", "--engine", "vllm"], ROOT / ".venv-vllm" / "bin" / "python"),
    ("load", "bench.load_test", [], ["--seconds", "20", "--overload-seconds", "10"], None),
    ("trl_peer", "bench.bench_trl_peer", [], ["--quick"], None),
    ("pipeline", "bench.bench_pipeline", [], ["--quick"], None),
]

# Per-token FLOPs of the paper's models (2 x parameters for a forward pass, 6 x for training).
PAPER = {"teacher_params": 8.2e9, "student_params": 1.7e9, "smollm2_params": 0.135e9, "response_tokens": 4096,
         "batch": 128, "mini_batch": 32}


def run_benchmarks(quick: bool, only: list[str] | None) -> list[dict]:
    status = []
    for name, module, full, quick_args, python in BENCHES:
        if only and name not in only:
            continue
        py = python or Path(sys.executable)
        if not Path(py).exists():
            status.append({"bench": name, "status": f"skipped: {py} missing (bash scripts/vllm_env.sh --setup-only)"})
            continue
        started = time.perf_counter()
        print(f"[bench] {name}: {py} -m {module} {' '.join(quick_args if quick else full)}", flush=True)
        proc = subprocess.run([str(py), "-m", module, *(quick_args if quick else full)], cwd=ROOT)
        status.append({"bench": name, "status": "ok" if proc.returncode == 0 else f"failed ({proc.returncode})",
                       "seconds": round(time.perf_counter() - started, 1)})
    return status


def projection() -> tuple[str, dict]:
    """Capacity model of the paper's setting from the measured per-token teacher cost on this
    machine, scaled by FLOPs. A projection, not a measurement."""
    path = RESULTS / "teacher.json"
    if not path.exists():
        return "No teacher results yet: run `python -m bench.bench_teacher` first.", {}
    rows = json.loads(path.read_text())["results"]
    best = max(rows, key=lambda r: r["engine_tok_s"])
    smol_flops = 2 * PAPER["smollm2_params"]
    achieved = best["engine_tok_s"] * smol_flops  # FLOP/s the engine reached on SmolLM2
    teacher_tok_s = achieved / (2 * PAPER["teacher_params"])
    learner_tok_s = achieved / (6 * PAPER["student_params"])
    replicas = learner_tok_s / teacher_tok_s
    tokens_per_iter = PAPER["batch"] * PAPER["response_tokens"]
    data = {"measured_engine_tok_s": best["engine_tok_s"], "measured_dtype": best["dtype"], "achieved_flop_s": achieved,
            "teacher_tok_s_per_device": teacher_tok_s, "learner_tok_s_per_device": learner_tok_s,
            "teacher_replicas_per_learner_device": replicas, "tokens_per_iteration": tokens_per_iter}
    text = f"""## Projection: the paper's setting (a model, not a measurement)

Scaled by FLOPs from the best in-process teacher rate measured above ({best['engine_tok_s']:.0f} scored tok/s on
SmolLM2-135M, {best['dtype']}, i.e. {achieved / 1e9:.1f} GFLOP/s achieved on this machine), assuming the same
efficiency for every model on the same device:

- teacher Qwen3-8B scoring (2 x 8.2e9 FLOP/token): {teacher_tok_s:.1f} tok/s per device;
- student Qwen3-1.7B training (6 x 1.7e9 FLOP/token, forward + backward): {learner_tok_s:.1f} tok/s per device;
- so about **{replicas:.2f} teacher devices per learner device** keep the learner busy (scoring is
  2 x 8.2 = 16.4 GFLOP/token vs training 6 x 1.7 = 10.2 GFLOP/token);
- one iteration (B = {PAPER['batch']} responses x {PAPER['response_tokens']} tokens = {tokens_per_iter} tokens) needs
  {tokens_per_iter / teacher_tok_s / 3600:.1f} device-hours of teacher scoring at this rate; a queue bound of one
  iteration ({PAPER['batch']} rollouts) lets the async mode overlap scoring of iteration i+1 with training on i;
- the bottleneck moves to student generation (memory-bound decoding, not modelled here: the paper measured
  37.7 s of a 47.8 s step in generation on 4 x A100) once teacher replicas exceed this ratio.
On GPUs the efficiency differs per model size; re-run `eopd bench all` there to replace the CPU basis.
"""
    return text, data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="eopd bench", description=__doc__.splitlines()[0])
    p.add_argument("what", nargs="?", default="all", choices=["all", "projection"])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", nargs="*", help="subset of: " + ", ".join(b[0] for b in BENCHES))
    args = p.parse_args(argv)
    status = run_benchmarks(args.quick, args.only) if args.what == "all" else []
    text, data = projection()
    write_section("projection", text)
    write_results("projection", data)
    if status:
        table = markdown_table(["benchmark", "status", "seconds"], [[s["bench"], s["status"], s.get("seconds", "")] for s in status])
        write_section("summary", f"""## Last `eopd bench all{' --quick' if args.quick else ''}` run

On {machine_description()}.

{table}
""")
        print(table)
    print(text)
    return 0 if all(s["status"] == "ok" or s["status"].startswith("skipped") for s in status) else 1


if __name__ == "__main__":
    raise SystemExit(main())
