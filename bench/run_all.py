"""`eopd bench all [--quick] [--require-all]`: every benchmark side by side in one run, a summary
section (which sections ran, machine, commit, minutes, every target met or not) and a clearly
labelled capacity projection of the paper's setting computed from the measured JSON.

Each benchmark runs in its own process, one after the other (they would distort each other's
timings if run together), and rewrites its own section of docs/benchmarks.md and its JSON under
bench/results/. A benchmark that is skipped (e.g. no .venv-vllm) or fails keeps its old numbers but
its section is marked stale ("not re-run in this run; last measured at ..."); `--require-all` turns
a skip into a failure before anything runs.

`--quick` runs small shapes in a few minutes and never touches docs/benchmarks.md or the published
JSON: its output goes to bench/results/quick/ (each benchmark's log, and the JSON / sections of
those that write any, through EOPD_BENCH_RESULTS / EOPD_BENCH_DOC) and is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import report
from bench.report import ROOT, markdown_table


@dataclass(frozen=True)
class Bench:
    name: str
    module: str
    full: list[str] = field(default_factory=list)
    quick: list[str] = field(default_factory=lambda: ["--quick"])
    python: Path | None = None  # None: this interpreter
    sections: tuple[str, ...] = ()  # the doc sections (and results JSON names) it writes; default (name,)
    quick_out: bool = False  # takes `--out FILE` for its quick results JSON

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.sections or (self.name,)

    def interpreter(self) -> Path:
        return Path(self.python or sys.executable)


VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
BENCHES = [
    Bench("teacher", "bench.bench_teacher"),
    Bench("loss", "bench.bench_loss"),
    Bench("dense_loss", "bench.bench_dense", quick_out=True),
    Bench("hidden_precision", "bench.bench_hidden_precision", quick_out=True),
    Bench("vllm", "bench.bench_vllm", python=VLLM_PY),
    Bench("teacher_vllm", "bench.bench_teacher", ["--engine", "vllm"], ["--quick", "--engine", "vllm"], python=VLLM_PY),
    Bench("load", "bench.load_test", [], ["--clients", "16", "--seconds", "10", "--overload-seconds", "5"]),
    Bench("trl_peer", "bench.bench_trl_peer", quick_out=True),
    Bench("pipeline", "bench.bench_pipeline", quick_out=True),
    Bench("rollout", "bench.bench_rollout", python=VLLM_PY, quick_out=True),
    Bench("candidates", "bench.bench_candidates"),
    Bench("generate", "bench.bench_generate", [], ["--smoke"]),
    Bench("weight_sync", "bench.bench_weight_sync", quick_out=True),
    Bench("threads", "bench.bench_threads", quick_out=True),
    Bench("busy_job", "bench.bench_busy_job", quick_out=True),
    Bench("overlap", "bench.bench_overlap", sections=("overlap_smollm2_cpu",), quick_out=True),
]

# The GPU benchmarks (`eopd bench gpu`): random models of real shapes built on the GPU; each prints why
# and measures nothing where no CUDA device is present; `--quick` runs their CPU smoke mode.
GPU_BENCHES = [
    Bench("gpu_teacher", "bench.bench_gpu_teacher", [], ["--smoke"]),
    Bench("gpu_trainer", "bench.bench_gpu_trainer", [], ["--smoke"]),
]

# The head-to-head with TRL (`eopd bench e2e`, issue 34): hours of training runs (3 seeds x 5 systems, one at a
# time), so not part of `all`; its own section and figure. The orchestrator runs here, TRL in .venv-vllm.
E2E_BENCHES = [Bench("e2e_trl", "bench.bench_e2e", quick_out=True)]

# Per-token FLOPs of the paper's models (2 x parameters for a forward pass, 6 x for training).
PAPER = {"teacher_params": 8.2e9, "student_params": 1.7e9, "smollm2_params": 0.135e9, "response_tokens": 4096,
         "batch": 128, "mini_batch": 32}


def _tee(cmd: list[str], env: dict, log: Path | None) -> int:
    """Runs cmd, its output to the console (and to `log`)."""
    if log is None:
        return subprocess.run(cmd, cwd=ROOT, env=env).returncode
    with log.open("w") as fh, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                               text=True) as proc:
        for line in proc.stdout:
            sys.stdout.write(line)
            fh.write(line)
        return proc.wait()


def run_benchmarks(benches: list[Bench], quick: bool, quick_dir: Path | None = None) -> list[dict]:
    """Runs each bench; returns one status per bench: ok, failed (code) or skipped (reason)."""
    status = []
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in [str(ROOT), env.get("PYTHONPATH", "")] if x)
    if quick:
        quick_dir.mkdir(parents=True, exist_ok=True)
        env.update(EOPD_BENCH_RESULTS=str(quick_dir), EOPD_BENCH_DOC=str(quick_dir / "benchmarks.md"))
    for b in benches:
        py = b.interpreter()
        if not py.exists():
            status.append({"bench": b.name, "status": "skipped", "reason": f"{py} missing (bash scripts/vllm_env.sh --setup-only)"})
            continue
        args = list(b.quick if quick else b.full)
        if quick and b.quick_out:
            args += ["--out", str(quick_dir / f"{b.name}.json")]
        started = time.perf_counter()
        print(f"[bench] {b.name}: {py} -m {b.module} {' '.join(args)}", flush=True)
        code = _tee([str(py), "-m", b.module, *args], env, quick_dir / f"{b.name}.log" if quick else None)
        s = {"bench": b.name, "status": "ok" if code == 0 else "failed", "seconds": round(time.perf_counter() - started, 1)}
        if code:
            s["reason"] = f"exit code {code}"
        status.append(s)
    return status


# ----------------------------------------------------------------------------------------------
# Targets, from each section's results JSON.
# ----------------------------------------------------------------------------------------------
def targets(name: str, data: dict) -> list[dict]:
    """[{"target", "value", "met"}] of one section's JSON (issues 2, 3, 9); [] if it has none."""
    out = []

    def add(target, value, met):
        out.append({"target": target, "value": value, "met": bool(met)})

    if name in ("teacher", "teacher_vllm") and data.get("results"):
        rs = data["results"]
        if all("server_vs_own_engine" in r for r in rs):  # both in the server's process (bench_teacher's reading)
            w = min(rs, key=lambda r: r["server_vs_own_engine"])
            add("server >= 0.9x the in-process engine (same process)", f"worst {w['server_vs_own_engine']:.2f}x",
                w["server_vs_own_engine"] >= 0.9)
        else:
            w = min(rs, key=lambda r: r["server_vs_engine"])
            add("server >= 0.9x the in-process engine", f"worst {w['server_vs_engine']:.2f}x", w["server_vs_engine"] >= 0.9)
        w = max(rs, key=lambda r: r["stats_overhead_vs_bare"])
        add("statistics <= +15% over the bare forward", f"worst {100 * w['stats_overhead_vs_bare']:+.0f}%",
            w["stats_overhead_vs_bare"] <= 0.15)
        b = max(r["response_bytes_per_token"] for r in rs)
        add("response bytes per scored token <= 140 (k = 16)", f"worst {b:.1f}", b <= 140)
    elif name == "loss" and data.get("timing"):
        from bench.bench_loss import render

        rows = render(data)[3]
        by = {(r["path"], r["variant"]): r for r in rows}
        floor = max(1.0, 0.01 * data["shape"]["batch"] * data["shape"]["seq"] * data["shape"]["vocab"] * 4 / 2**20)
        for path in ("chunked", "hidden"):
            e = by.get((path, "eopd"))
            if e and e["cpu_vs_opd"] is not None:
                add(f"[{path}] eopd <= 1.10x opd (CPU time, paired median)", f"{e['cpu_vs_opd']:.3f}", e["cpu_vs_opd"] <= 1.10)
            for suffix in ("", "+metrics"):
                e, f = by.get((path, "eopd" + suffix)), by.get((path, "full_fkl" + suffix))
                if e and f and e["fkl_extra_mib"] is not None and f["fkl_extra_mib"] is not None:
                    label = f"[{path}{', vocab_metrics' if suffix else ''}] eopd's FKL extra memory <= 0.2x full_fkl's"
                    if f["fkl_extra_mib"] > floor:
                        ratio = max(e["fkl_extra_mib"], 0.0) / f["fkl_extra_mib"]
                        add(label, f"{ratio:.2f}", ratio <= 0.2)
                    else:
                        add(label, f"both under {floor:.0f} MiB (RSS noise: no vocabulary-sized FKL memory)", True)
    elif name == "pipeline" and data.get("summary"):
        rows = [a for a in data["summary"] if a["mode"] == "async"]
        if rows:
            idle = max(a["learner_idle_frac"] for a in rows)
            add("learner idle <= 10% in async mode", f"worst {100 * idle:.0f}%", idle <= 0.10)
    elif name == "trl_peer" and data.get("summary"):
        e = next((s for s in data["summary"] if s["path"] == "eopd gRPC"), None)
        if e:
            add("eopd response bytes per scored token <= 140 (k = 16)", f"{e['response_bytes_per_token']:.1f}",
                e["response_bytes_per_token"] <= 140)
    return out


def _load(results: Path, name: str) -> dict | None:
    p = results / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


# ----------------------------------------------------------------------------------------------
# Projection: a model fed by the measured JSON.
# ----------------------------------------------------------------------------------------------
def projection(results: Path | None = None) -> tuple[str, dict]:
    """Capacity model of the paper's setting (Qwen3-8B teacher, Qwen3-1.7B student, 4096-token
    responses, B = 128), scaled by FLOPs from rates measured on this machine: the teacher's from
    teacher.json / teacher_vllm.json (the server's rate), the learner's from loss.json (the
    hidden-state loss, a matmul-bound forward + backward like training). A model, not a measurement."""
    results = results or report.results_dir()
    sources, teacher = [], {}
    for name in ("teacher", "teacher_vllm"):
        d = _load(results, name)
        if not d or not d.get("results"):
            continue
        rows = [r for r in d["results"] if r["workload"] == "all positions"] or d["results"]
        # The learner basis (bench_loss) is float32: compare like with like where the teacher has float32 rows.
        rows = [r for r in rows if r["dtype"] == "float32"] or rows
        best = max(rows, key=lambda r: r["server_tok_s"])
        teacher[name] = {"server_tok_s": best["server_tok_s"], "dtype": best["dtype"],
                         "shape": f"{best['sequences']} x {best['length']}"}
        sources.append((name, d))
    loss = _load(results, "loss")
    learner = None
    if loss and "hidden" in loss.get("timing", {}):
        s = loss["shape"]
        n = s["batch"] * s["seq"]
        t = loss["timing"]["hidden"]
        key = "eopd+metrics" if "eopd+metrics" in t else "eopd"
        sec = statistics.median(t[key]["all_s"])
        flops = 6 * n * s["vocab"] * s["hidden"]  # logits forward 2NVD + backward 4NVD (nominal)
        learner = {"variant": key, "seconds": sec, "tokens": n, "flop_s": flops / sec}
        sources.append(("loss", loss))
    pipeline = _load(results, "pipeline")
    if pipeline:
        sources.append(("pipeline", pipeline))
    if not teacher or not learner:
        missing = [f for f, ok in (("teacher.json or teacher_vllm.json", teacher), ("loss.json with the hidden path", learner)) if not ok]
        return (f"## Projection: the paper's setting (a model, not a measurement)\n\nNot computed: {' and '.join(missing)} "
                "missing under bench/results/; run those benchmarks first.\n", {})

    src_name, t_best = max(teacher.items(), key=lambda kv: kv[1]["server_tok_s"])
    t_flop_s = t_best["server_tok_s"] * 2 * PAPER["smollm2_params"]
    teacher_tok_s = t_flop_s / (2 * PAPER["teacher_params"])
    learner_tok_s = learner["flop_s"] / (6 * PAPER["student_params"])
    ratio = learner_tok_s / teacher_tok_s
    tokens = PAPER["batch"] * PAPER["response_tokens"]
    learner_s = tokens / learner_tok_s
    table, rows = [], []
    balance = float(f"{ratio:.3g}")
    for r in sorted({0.25, 0.5, 1, 2, 4, balance}):
        teacher_s = tokens / (r * teacher_tok_s)
        row = {"teacher_devices_per_learner_device": r, "teacher_s_per_iteration": teacher_s,
               "learner_s_per_iteration": learner_s, "bottleneck": "teacher" if teacher_s > learner_s else "learner",
               "learner_idle_async": max(0.0, 1 - learner_s / teacher_s), "teacher_busy": min(1.0, teacher_s / learner_s)}
        rows.append(row)
        table.append([f"{r:g}" + (" (balance)" if r == balance else ""), f"{teacher_s / 3600:.2f}", f"{learner_s / 3600:.2f}", row["bottleneck"],
                      f"{100 * row['learner_idle_async']:.0f}%", f"{100 * row['teacher_busy']:.0f}%"])
    data = {"inputs": {n: {"time": report.provenance_of(d)["time"], "describe": report.provenance_of(d)["describe"],
                           "cpu": report.provenance_of(d)["cpu"]} for n, d in sources},
            "teacher_basis": {"file": f"{src_name}.json", **t_best, "achieved_flop_s": t_flop_s},
            "learner_basis": {"file": "loss.json", **learner}, "teacher_tok_s_per_device": teacher_tok_s,
            "learner_tok_s_per_device": learner_tok_s, "teacher_devices_per_learner_device": ratio,
            "tokens_per_iteration": tokens, "queue_bound_rollouts": PAPER["batch"], "rows": rows, "paper": PAPER}
    measured = ""
    if pipeline and pipeline.get("summary"):
        a = min((x for x in pipeline["summary"] if x["mode"] == "async"), key=lambda x: x["teachers"], default=None)
        if a:
            measured = (f"\n\nFor scale, measured end to end on this machine (`pipeline.json`, preset {pipeline.get('preset')}, "
                        f"async, {a['teachers']} teacher(s)): {a['trained_tok_s']:.1f} trained tok/s, learner idle "
                        f"{100 * a['learner_idle_frac']:.0f}%, every process sharing the same cores; not an input of the model.")
            data["pipeline_measured"] = {k: a[k] for k in ("mode", "teachers", "trained_tok_s", "learner_idle_frac")}
    inputs = "\n".join(f"- `bench/results/{n}.json`: measured {p['time']} on {p['cpu']}, eopd@{p['describe']}"
                       for n, p in data["inputs"].items())
    other = "; ".join(f"{n}.json {v['server_tok_s']:.0f} tok/s ({v['dtype']}, {v['shape']})"
                      for n, v in teacher.items() if n != src_name)
    text = f"""## Projection: the paper's setting (a model, not a measurement)

**A model**: every number below is computed by `bench/run_all.py` from measured JSON, scaled by FLOPs
to Qwen3-8B (teacher, 2 x 8.2e9 FLOP per scored token) and Qwen3-1.7B (student, 6 x 1.7e9 FLOP per
trained token), assuming each model reaches the FLOP rate measured here on the same device. It ignores
memory bandwidth, attention's quadratic term and student generation (the paper measured 37.7 s of a
47.8 s step in generation on 4 x A100), so it says where scoring and training balance, not a wall time.

Computed by `eopd bench projection` (also at the end of `eopd bench all`) at eopd@{report.provenance()['describe']},
{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, from these inputs:
{inputs}

- teacher basis: the best server rate over all-positions float32 rows (the learner basis is float32), {t_best['server_tok_s']:.0f} scored tok/s
  (`{src_name}.json`, {t_best['dtype']}, {t_best['shape']}{'; also ' + other if other else ''}), i.e.
  {t_flop_s / 1e9:.1f} GFLOP/s on SmolLM2-135M -> Qwen3-8B scoring {teacher_tok_s:.1f} tok/s per device;
- learner basis: the hidden-state loss (`loss.json`, {learner['variant']}, median of its rounds {learner['seconds']:.2f} s for
  {learner['tokens']} tokens, nominal 6 N V D FLOP) = {learner['flop_s'] / 1e9:.1f} GFLOP/s -> Qwen3-1.7B training
  {learner_tok_s:.1f} tok/s per device;
- so **{ratio:.2f} teacher devices per learner device** balance scoring and training;
- one iteration (B = {PAPER['batch']} x {PAPER['response_tokens']} = {tokens} tokens) takes the learner {learner_s / 3600:.2f} device-hours;
- queue bound: **{PAPER['batch']} rollouts** (one iteration; the async mode's staleness bound of 1). With at least
  {ratio:.2f} teacher devices per learner device the teachers fill it within one learner step, so the learner never
  waits and a larger bound would only add staleness; with fewer, the queue stays empty and the learner idles
  the share shown below, whatever the bound.

| teacher devices per learner device | teacher h / iteration | learner h / iteration | bottleneck | learner idle (async) | teacher busy |
|---|---|---|---|---|---|
""" + "\n".join("| " + " | ".join(map(str, r)) + " |" for r in table) + f"""

The bottleneck moves from the teacher to the learner at {ratio:.2f} teacher devices per learner device; past
that point the next limit is student generation, which this model does not include. Re-run `eopd bench all`
on the target hardware to replace the CPU basis.{measured}
"""
    return text, data


# ----------------------------------------------------------------------------------------------
# Summary and main.
# ----------------------------------------------------------------------------------------------
def summary(status: list[dict], benches: list[Bench], minutes: float, results: Path) -> str:
    """The summary section: every benchmark of the registry, those of this run (`status`) with what
    happened to them, the others (an `--only` run) with when they were last measured."""
    prov = report.provenance()
    ran = {s["bench"]: s for s in status}
    scope = "every benchmark" if len(ran) == len(benches) else f"only {', '.join(ran)}"
    lines = ["## Summary of the last `eopd bench all` run", "",
             f"On {report.machine_description(prov)}; {scope}; {minutes:.1f} min in all, finished "
             f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}.", ""]
    rows = []
    for b in benches:
        s = ran.get(b.name)
        for sec in b.outputs:
            d = _load(results, sec)
            p = report.provenance_of(d) if d else None
            when = f"{p['time']} (eopd@{p['describe']})" if p else "never"
            if s is None:
                state = f"not in this run: last measured {when}"
            elif s["status"] == "ok":
                state = "re-run"
            else:
                state = f"{s['status']} ({s['reason']}): stale, last measured {when}"
            ts = targets(sec, d) if d else []
            tt = "; ".join(f"{t['target']}: {t['value']} ({'met' if t['met'] else '**not met**'})" for t in ts) or "-"
            rows.append([sec, state, s.get("seconds", "-") if s else "-", tt])
    lines.append(markdown_table(["section", "this run", "seconds", "targets"], rows))
    bad = [r[0] for r in rows if "**not met**" in r[3]]
    lines += ["", f"Targets not met: {', '.join(bad)}." if bad else "Every target of the sections above is met.",
              "Targets of sections not re-run in this run are those of their last run."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None, benches: list[Bench] | None = None) -> int:
    p = argparse.ArgumentParser(prog="eopd bench", description=__doc__.splitlines()[0])
    p.add_argument("what", nargs="?", default="all", choices=["all", "projection", "gpu", "e2e"],
                   help="all: every CPU benchmark; gpu: the GPU benchmarks (skipped, saying why, without a GPU); "
                   "e2e: the head-to-head with TRL (hours); projection: recompute the paper-scale projection")
    p.add_argument("--quick", action="store_true",
                   help="small shapes, a few minutes; output to bench/results/quick/ and the console, the doc untouched")
    p.add_argument("--only", nargs="*", help="subset of: " + ", ".join(b.name for b in (benches or BENCHES)))
    p.add_argument("--require-all", action="store_true", help="fail (before running anything) if any benchmark would be skipped")
    args = p.parse_args(argv)
    benches = benches or {"gpu": GPU_BENCHES, "e2e": E2E_BENCHES}.get(args.what, BENCHES)
    results = report.results_dir()
    if args.what == "projection":
        text, data = projection(results)
        if data:
            report.write_results("projection", data)
            report.write_section("projection", text)
        print(text)
        return 0 if data else 1
    unknown = set(args.only or []) - {b.name for b in benches}
    if unknown:
        p.error(f"--only: unknown benchmark(s) {', '.join(sorted(unknown))}")
    chosen = [b for b in benches if not args.only or b.name in args.only]
    missing = [b for b in chosen if not b.interpreter().exists()]
    if args.require_all and missing:
        for b in missing:
            print(f"[bench] {b.name}: {b.interpreter()} missing: --require-all refuses to skip it", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    quick_dir = results / "quick"
    status = run_benchmarks(chosen, args.quick, quick_dir)
    minutes = (time.perf_counter() - t0) / 60
    table = markdown_table(["benchmark", "status", "seconds", "reason"],
                           [[s["bench"], s["status"], s.get("seconds", "-"), s.get("reason", "")] for s in status])
    print(table)
    failed = [s for s in status if s["status"] == "failed"]
    if args.quick:
        print(f"\nquick run: nothing in docs/benchmarks.md or bench/results/*.json changed; logs and results in {quick_dir}")
        return 1 if failed else 0
    for s in status:
        if s["status"] != "ok":
            for sec in next(b for b in benches if b.name == s["bench"]).outputs:
                report.mark_stale(sec, f"{s['status']}: {s['reason']}")
    if args.what in ("gpu", "e2e"):  # their own sections; the summary and projection are the CPU registry's
        return 1 if failed else 0
    text, data = projection(results)
    if data:
        report.write_results("projection", data)
        report.write_section("projection", text)
    report.write_section("summary", summary(status, benches, minutes, results))
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
