"""Time (forward + backward) and peak memory of the distillation loss: naive vs chunked vs hidden.

    .venv/bin/python -m bench.bench_loss            # 8 x 1024 tokens, V = 49152, D = 576 (minutes)
    .venv/bin/python -m bench.bench_loss --quick    # a small shape (seconds), writes nothing
    .venv/bin/python -m bench.bench_loss --shape cpu --paths naive_hidden,hidden_recompute,hidden
                                                    # 2 x 512 tokens: the fused path vs its naive baseline
    python -m bench.bench_loss --device cuda --shape paper --tf32 --paths naive_hidden,hidden_recompute,hidden
                                                    # the paper's shape on a GPU (8 x 4096, V 151936, D 1536)

Variants: opd, eopd, full_fkl (paper sec. 5.6), at a 20% gate ratio (exactly 20% of tokens have a
teacher entropy above tau). Paths:

* naive         full [N, V] logits in, plain autograd: one log-softmax over all rows for the OPD
                term, and for the FKL its own log-softmax over the selected rows (the design the
                paper measures in app. A: per-selected-token tensors kept for backward);
* chunked       `compute_loss` on the same [N, V] logits (chunked, analytic recomputing backward);
* naive_hidden  hidden [N, D] and lm_head [V, D] in: logits = hidden @ W.T, then the naive loss;
* hidden        `compute_loss_from_hidden` on the same inputs (logits never materialised; the gradients
                w.r.t. hidden and lm_head computed in the forward chunk loop: `objective.fused`);
* hidden_recompute  the same with `fused_backward=False`: statistics in forward, each chunk's
                logits recomputed in backward (the path before issue 31).

Device (`--device cuda`): inputs on the GPU, each timed run between `torch.cuda.synchronize()`s,
memory = `torch.cuda.max_memory_allocated()` minus the allocated memory before the loss. `--tf32`
sets `torch.set_float32_matmul_precision("high")` (TF32 matmuls, fp32 accumulation) in the
children, as the learner does on CUDA (`train.matmul_precision`).

Memory: each (variant, path) runs in a fresh subprocess that builds its inputs, resets the
kernel's RSS high-water mark (/proc/self/clear_refs), runs forward + backward once and reads VmHWM:
"extra peak" is VmHWM minus the RSS before the loss (inputs excluded; the gradients the loss
produces included). tracemalloc cannot see torch's allocations; RSS sees everything.
Time: one subprocess per path holds the inputs and runs the variants interleaved (opd, eopd,
full_fkl, ... in every round, the order rotated), a warm-up round then `--reps` rounds. The ratios
"time / opd" are paired: the ratio is taken within each round and the median over rounds is
reported (load from other jobs hits the variants of one round alike), with the process's CPU time
beside the wall time; the times themselves are medians over rounds, every round is in the JSON.
"time / naive" compares a path with its own naive baseline (chunked vs naive, hidden vs
naive_hidden) and is printed only when both were measured in the same run on the same machine.
The chunked and hidden paths run with `vocab_metrics=False` (the loss alone, like naive);
`+metrics` rows run `vocab_metrics=True`, the learner's default (the vocabulary-wide diagnostics on
top), and `+T0.7` a student temperature of 0.7 instead of 1, so the memory claims cover what the
learner runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "full": {"batch": 8, "seq": 1024, "vocab": 49152, "hidden": 576, "k": 16, "chunk": 1024},
    "quick": {"batch": 2, "seq": 256, "vocab": 8192, "hidden": 128, "k": 16, "chunk": 256},
    # the fused path vs its naive baseline on a shared 2-core CPU (the full shape takes an hour there)
    "cpu": {"batch": 2, "seq": 512, "vocab": 49152, "hidden": 576, "k": 16, "chunk": 256},
    # issue 31's GPU shape: the paper's 8 x 4096 response tokens, Qwen3's vocabulary, Qwen3-1.7B's hidden size
    "paper": {"batch": 8, "seq": 4096, "vocab": 151936, "hidden": 1536, "k": 16, "chunk": 1024},
}
VARIANTS = ("opd", "eopd", "full_fkl")
# Memory rows of the learner's default configuration (vocab_metrics=True) and of T != 1 (fast paths only).
LEARNER_VARIANTS = ("opd+metrics", "eopd+metrics", "full_fkl+metrics", "eopd+metrics+T0.7")
PATHS = ("naive", "chunked", "naive_hidden", "hidden_recompute", "hidden")
BASELINE = {"chunked": "naive", "hidden": "naive_hidden", "hidden_recompute": "naive_hidden"}  # the naive path each fast path replaces
DEFAULT_REPS = 5
GATE_RATIO = 0.2
TAU = 0.8


# ----------------------------------------------------------------------------------------------
# Child side: inputs, the naive reference, one measured run.
# ----------------------------------------------------------------------------------------------
def _status_kib(key: str) -> int:
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _inputs(shape: dict, path: str, device: str = "cpu"):
    import torch

    inp = _cpu_inputs(shape, path)
    return {k: (t.detach().to(device).requires_grad_(t.requires_grad) if device != "cpu" else t) for k, t in inp.items()}


def _cpu_inputs(shape: dict, path: str):
    import torch

    g = torch.Generator().manual_seed(0)
    n, v, k = shape["batch"] * shape["seq"], shape["vocab"], shape["k"]
    inp = {
        "sampled": torch.randint(0, v, (n,), generator=g),
        "old": torch.randn(n, generator=g) - 3.0,
        "teacher": torch.randn(n, generator=g) - 3.0,
        "topk_ids": torch.randint(0, v, (n, k), generator=g),
        "topk_lp": torch.log_softmax(torch.randn(n, k, generator=g), -1) - 0.5,
        "mask": torch.ones(n, dtype=torch.bool),
    }
    ent = torch.full((n,), TAU - 0.5)
    ent[torch.randperm(n, generator=g)[: round(GATE_RATIO * n)]] = TAU + 1.0
    inp["entropy"] = ent
    if path in ("naive", "chunked"):
        inp["logits"] = (2.0 * torch.randn(n, v, generator=g)).requires_grad_(True)
    else:
        inp["hidden_states"] = torch.randn(n, shape["hidden"], generator=g).requires_grad_(True)
        inp["weight"] = (torch.randn(v, shape["hidden"], generator=g) / shape["hidden"] ** 0.5).requires_grad_(True)
    return inp


def naive_loss(logits, sampled, old, teacher, entropy, topk_ids, topk_lp, mask, variant: str, alpha: float = 1.0):
    """The straightforward implementation: full-vocabulary log-softmax tensors kept by autograd."""
    import torch

    w = mask.float() / mask.sum()
    logp_all = torch.log_softmax(logits.float(), dim=-1)  # [N, V], saved for backward
    logp = logp_all.gather(1, sampled[:, None]).squeeze(1)
    adv = teacher - old
    ratio = torch.exp(logp - old)
    pg = torch.maximum(-ratio * adv, -ratio.clamp(0.8, 1.2) * adv)
    loss = (w * pg).sum()
    if variant in ("eopd", "full_fkl"):
        sel = mask & (entropy >= TAU) if variant == "eopd" else mask
        idx = sel.nonzero().squeeze(1)
        lsm = torch.log_softmax(logits[idx].float(), dim=-1)  # [G, V]: the FKL's own pass
        lq = lsm.gather(1, topk_ids[idx])
        p = torch.softmax(topk_lp[idx], dim=-1)
        fkl = (p * (p.log() - lq)).sum(-1)
        loss = loss + alpha * (w[idx] * fkl).sum()
    return loss


def parse_variant(variant: str) -> tuple[str, bool, float]:
    """'eopd+metrics+T0.7' -> ('eopd', True, 0.7): loss variant, vocab_metrics, student temperature."""
    name, *mods = variant.split("+")
    metrics, temperature = False, 1.0
    for m in mods:
        if m == "metrics":
            metrics = True
        elif m.startswith("T"):
            temperature = float(m[1:])
        else:
            raise ValueError(f"variant {variant!r}: unknown modifier {m!r}")
    return name, metrics, temperature


def _run(path: str, variant: str, inp: dict, chunk: int) -> None:
    from eopd_trainer.objective import LossConfig, LossInputs, compute_loss, compute_loss_from_hidden

    name, metrics, temperature = parse_variant(variant)
    tok = (inp["sampled"], inp["old"], inp["teacher"], inp["entropy"], inp["topk_ids"], inp["topk_lp"], inp["mask"])
    cfg = LossConfig(variant=name, tau=TAU, chunk_size=chunk, vocab_metrics=metrics, temperature=temperature)
    if path.startswith("naive") and (metrics or temperature != 1.0):
        raise ValueError(f"variant {variant!r}: the naive paths measure the loss alone at T = 1")
    if path == "naive":
        loss = naive_loss(inp["logits"], *tok, variant=name)
    elif path == "chunked":
        loss, _ = compute_loss(inp["logits"], LossInputs(*tok), config=cfg)
    elif path == "naive_hidden":
        loss = naive_loss(inp["hidden_states"] @ inp["weight"].t(), *tok, variant=name)
    elif path in ("hidden", "hidden_recompute"):
        cfg = LossConfig(**{**cfg.model_dump(), "fused_backward": path == "hidden"})
        loss, _ = compute_loss_from_hidden(inp["hidden_states"], inp["weight"], LossInputs(*tok), config=cfg)
    else:
        raise ValueError(path)
    loss.backward()
    del loss


def _clear_grads(inp: dict) -> None:
    for t in inp.values():
        if getattr(t, "grad", None) is not None:
            t.grad = None


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def child(mode: str, path: str, variants: list[str], shape: dict, reps: int, device: str = "cpu",
          tf32: bool = False) -> dict:
    import torch

    if tf32:
        torch.set_float32_matmul_precision("high")
    inp = _inputs(shape, path, device)
    if mode == "memory" and device == "cuda":
        (variant,) = variants
        _sync(device)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        _run(path, variant, inp, shape["chunk"])
        _sync(device)
        seconds = time.perf_counter() - t0
        return {"extra_peak_mib": (torch.cuda.max_memory_allocated() - base) / 2**20, "cold_seconds": seconds,
                "hwm_reset": True, "device": torch.cuda.get_device_name()}
    if mode == "memory":
        (variant,) = variants
        exact = _reset_peak()
        base = _status_kib("VmRSS")
        t0 = time.perf_counter()
        _run(path, variant, inp, shape["chunk"])
        seconds = time.perf_counter() - t0
        peak = _status_kib("VmHWM")
        return {"extra_peak_mib": (peak - base) / 1024, "cold_seconds": seconds, "hwm_reset": exact,
                "threads": torch.get_num_threads()}
    times: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    for rep in range(reps + 1):
        order = variants[rep % len(variants):] + variants[: rep % len(variants)]
        for v in order:
            _sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            _run(path, v, inp, shape["chunk"])
            _sync(device)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            _clear_grads(inp)
            if rep:  # round 0 is the warm-up
                times[v].append(dt)
                cpu[v].append(dc)
    # all_s[i] / all_cpu_s[i] of every variant belong to round i: the rows pair them per round.
    return {v: {"best_s": min(times[v]), "median_s": statistics.median(times[v]), "all_s": times[v],
                "best_cpu_s": min(cpu[v]), "all_cpu_s": cpu[v]} for v in variants}


# ----------------------------------------------------------------------------------------------
# Parent side: spawn, collect, report.
# ----------------------------------------------------------------------------------------------
def _spawn(args: list[str]) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "services" / "trainer"), str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-m", "bench.bench_loss", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"benchmark child {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _timing_variants(path: str) -> list[str]:
    return list(VARIANTS) + ([] if path.startswith("naive") else ["eopd+metrics"])


def _memory_variants(path: str) -> list[str]:
    return list(VARIANTS) + ([] if path.startswith("naive") else list(LEARNER_VARIANTS))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small shape, a few seconds; writes no results")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="full (default; section 'loss'), cpu or paper (sections 'loss_cpu', 'loss_paper'), quick")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the loss runs")
    p.add_argument("--tf32", action="store_true",
                   help='torch.set_float32_matmul_precision("high") in the children (TF32 matmuls on CUDA)')
    p.add_argument("--only", default="", help="comma-separated subset of the variants (default all)")
    p.add_argument("--reps", type=int, default=DEFAULT_REPS, help=f"timed rounds after the warm-up (default {DEFAULT_REPS})")
    p.add_argument("--paths", default=",".join(PATHS), help="comma-separated subset of " + ",".join(PATHS))
    p.add_argument("--merge", action="store_true",
                   help="keep the other paths' measurements of bench/results/loss.json (re-measure only --paths); "
                        "refused unless that file was measured on this CPU model with the same shape and --reps")
    p.add_argument("--render", "--from-json", dest="render", action="store_true",
                   help="rewrite the docs/benchmarks.md section from bench/results/loss.json without measuring")
    p.add_argument("--child", choices=["memory", "time"], help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--variants", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    shape_name = args.shape or ("quick" if args.quick else "full")
    args.quick = shape_name == "quick"
    shape = SHAPES[shape_name]
    section = "loss" if shape_name == "full" else f"loss_{shape_name}"
    if args.device == "cuda":
        section += "_cuda"

    if args.child:
        print(json.dumps(child(args.child, args.path, args.variants.split(","), shape, args.reps, args.device,
                               args.tf32)))
        return 0
    from bench.report import RESULTS, provenance, write_results

    if args.render:
        payload = json.loads((RESULTS / f"{section}.json").read_text())
        payload.setdefault("paths", [p_ for p_ in PATHS if p_ in payload["timing"]])
        headers, table, verdicts, rows = render(payload)
        payload.update(rows=rows, verdicts=verdicts)  # same measurements, re-derived rows and verdicts
        (RESULTS / f"{section}.json").write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
        _write_doc(payload, headers, table, verdicts, section)
        print("\n".join(verdicts))
        return 0

    paths = [x for x in args.paths.split(",") if x]
    common = ["--shape", shape_name, "--device", args.device] + (["--tf32"] if args.tf32 else [])
    only = [x for x in args.only.split(",") if x]

    def keep(vs: list[str]) -> list[str]:
        return [v for v in vs if not only or v in only or v == "opd"]  # opd: the denominator of every row

    old = None
    if args.merge and not args.quick:  # checked before measuring: a refused merge costs nothing
        old = json.loads((RESULTS / f"{section}.json").read_text())
        check_merge(old, shape, args.reps, provenance()["cpu"])
    n = shape["batch"] * shape["seq"]
    print(f"loss benchmark: {shape['batch']} x {shape['seq']} tokens, V = {shape['vocab']}, D = {shape['hidden']}, "
          f"k = {shape['k']}, chunk = {shape['chunk']}, gate ratio {GATE_RATIO:.0%}, {args.reps} paired rounds, "
          f"{args.device}{', TF32' if args.tf32 else ''}", flush=True)
    run = {"run_id": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **provenance()}
    load_start = os.getloadavg()[0]
    memory: dict[str, dict[str, dict]] = {}
    timing: dict[str, dict[str, dict]] = {}
    for path in paths:
        memory[path] = {}
        for v in keep(_memory_variants(path)):
            memory[path][v] = _spawn([*common, "--child", "memory", "--path", path, "--variants", v])
            print(f"  memory {path:12s} {v:18s} extra peak {memory[path][v]['extra_peak_mib']:9.1f} MiB", flush=True)
        timing[path] = _spawn([*common, "--child", "time", "--path", path, "--reps", str(args.reps),
                               "--variants", ",".join(keep(_timing_variants(path)))])
        med = ", ".join(f"{v} {t['median_s']:.3f}s" for v, t in timing[path].items())
        print(f"  time   {path:12s} {med}", flush=True)

    runs = {p_: run for p_ in paths}
    if old is not None:
        kept = [p_ for p_ in old["paths"] if p_ not in paths]
        memory = {**{p_: old["memory"][p_] for p_ in kept}, **memory}
        timing = {**{p_: old["timing"][p_] for p_ in kept}, **timing}
        runs = {**{p_: path_run(old, p_) for p_ in kept}, **runs}
        paths = [p_ for p_ in PATHS if p_ in memory]
    payload = {"shape": shape, "gate_ratio": GATE_RATIO, "tokens": n, "reps": args.reps, "paths": paths,
               "memory": memory, "timing": timing, "runs": runs, "device": args.device, "tf32": args.tf32,
               "load_average": [load_start, os.getloadavg()[0]], "cores": os.cpu_count(),
               "device_name": next((m.get("device") for mm in memory.values() for m in mm.values()
                                    if m.get("device")), None)}
    headers, table, verdicts, rows = render(payload)
    payload.update(rows=rows, verdicts=verdicts)
    _print_table(headers, table)
    for line in verdicts:
        print(line)
    if args.quick:
        return 0
    written = write_results(section, payload)
    _write_doc(json.loads(written.read_text()), headers, table, verdicts, section)
    print(f"wrote bench/results/{section}.json and the '{section}' section of docs/benchmarks.md")
    return 0


def path_run(payload: dict, path: str) -> dict:
    """Which run measured `path`: {"run_id", "cpu", "commit", "describe"}. JSONs written before runs
    were recorded have `measured_at` strings ("<time> (<machine line>)") or only the file's own
    machine and time."""
    if path in payload.get("runs", {}):
        return payload["runs"][path]
    from bench.report import provenance_of

    at = payload.get("measured_at", {}).get(path)
    if at:
        when, _, machine = at.partition(" (")
        prov = provenance_of({"machine": machine.rstrip(")"), "time": when})
    else:
        prov = provenance_of(payload)
    return {"run_id": prov["time"], "cpu": prov["cpu"], "commit": prov["commit"], "describe": prov["describe"]}


def check_merge(old: dict, shape: dict, reps: int, cpu: str) -> None:
    """Refuses a merge with measurements of another shape, --reps or CPU model."""
    if old["shape"] != shape or old["reps"] != reps:
        raise SystemExit("--merge: bench/results/loss.json was measured with another shape or --reps")
    other = sorted({path_run(old, p_)["cpu"] for p_ in old["paths"]} - {cpu})
    if other:
        raise SystemExit(f"--merge: bench/results/loss.json holds paths measured on another machine ({', '.join(other)}; "
                         f"this one is {cpu}): ratios across machines mean nothing; re-measure every path")


def comparable(a: dict, b: dict) -> bool:
    """Two paths' rows may be divided by each other: the same run on the same machine."""
    return a["run_id"] == b["run_id"] and a["cpu"] == b["cpu"]


def paired(num: list[float], den: list[float]) -> float:
    """Median over rounds of the per-round ratio num[i] / den[i]."""
    if len(num) != len(den) or not num:
        raise ValueError(f"paired ratio needs the same rounds on both sides ({len(num)} vs {len(den)})")
    return statistics.median(a / b for a, b in zip(num, den))


def render(payload: dict) -> tuple[list[str], list[list[str]], list[str], list[dict]]:
    """Rows, a text table and the verdicts against the issue's targets, from measured results."""
    memory, timing, paths = payload["memory"], payload["timing"], payload["paths"]
    runs = {p_: path_run(payload, p_) for p_ in paths}
    rows, table = [], []
    for path in paths:
        mem, tim = memory[path], timing[path]
        base = BASELINE.get(path)
        base_ok = base in timing and comparable(runs[path], runs[base])
        variants = list(dict.fromkeys([*_timing_variants(path), *(v for v in _memory_variants(path) if v in mem)]))
        for v in variants:
            name, metrics, temperature = parse_variant(v)
            opd_key = "opd+metrics" if metrics else "opd"
            m = mem.get(v, {}).get("extra_peak_mib")
            fkl = (m - mem[opd_key]["extra_peak_mib"]) if (m is not None and name != "opd" and opd_key in mem) else None
            t = tim.get(v)
            if t is None and m is None:
                continue  # not measured in this run (--only)
            row = {"path": path, "variant": v, "extra_peak_mib": m, "fkl_extra_mib": fkl, "rounds": None,
                   "time_s": None, "time_vs_opd": None, "cpu_s": None, "cpu_vs_opd": None, "time_vs_naive": None,
                   "cpu_vs_naive": None, "mem_vs_naive": None}
            base_m = memory.get(base, {}).get(v, {}).get("extra_peak_mib") if base_ok else None
            if m is not None and base_m:
                row["mem_vs_naive"] = m / base_m
            if t:
                row.update(rounds=len(t["all_s"]), time_s=statistics.median(t["all_s"]),
                           cpu_s=statistics.median(t["all_cpu_s"]),
                           time_vs_opd=paired(t["all_s"], tim["opd"]["all_s"]),
                           cpu_vs_opd=paired(t["all_cpu_s"], tim["opd"]["all_cpu_s"]))
                if base_ok and v in timing[base]:
                    row["time_vs_naive"] = paired(t["all_s"], timing[base][v]["all_s"])
                    row["cpu_vs_naive"] = paired(t["all_cpu_s"], timing[base][v]["all_cpu_s"])
            rows.append(row)
            f = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
            naive_cell = f(row["time_vs_naive"], ".3f")
            if t and base and row["time_vs_naive"] is None and v in timing.get(base, {}):
                naive_cell = "- (1)"
            table.append([path, v, f(row["time_s"], ".3f"), f(row["time_vs_opd"], ".3f"), f(row["cpu_s"], ".2f"),
                          f(row["cpu_vs_opd"], ".3f"), naive_cell, f(row["cpu_vs_naive"], ".3f"), f(m, ".1f"),
                          f(fkl, ".1f"), f(None if row["mem_vs_naive"] is None else 100 * row["mem_vs_naive"], ".1f")])
    headers = ["path", "variant", "time (s)", "time / opd (paired)", "CPU (s)", "CPU / opd (paired)",
               "time / own naive (paired)", "CPU / own naive (paired)", "extra peak (MiB)", "FKL extra vs opd (MiB)",
               "peak / own naive (%)"]
    shape = payload["shape"]
    logits_mib = shape["batch"] * shape["seq"] * shape["vocab"] * 4 / 2**20  # one [N, V] float32 buffer
    grads_mib = (shape["vocab"] + shape["batch"] * shape["seq"]) * shape["hidden"] * 4 / 2**20  # fp32 dW + dh
    return headers, table, _verdicts(rows, paths, logits_mib, grads_mib), rows


def _write_doc(payload: dict, headers: list[str], table: list[list[str]], verdicts: list[str],
               section: str = "loss") -> None:
    from bench.report import header_line, markdown_table, write_section

    shape = payload["shape"]
    runs = {p_: path_run(payload, p_) for p_ in payload["paths"]}
    rounds = sorted({r["rounds"] for r in payload.get("rows", []) if r.get("rounds")} or {payload["reps"]})
    missing = [p_ for p_ in payload["paths"] if not p_.startswith("naive")
               and not all(v in payload["memory"][p_] for v in LEARNER_VARIANTS)]
    cross = [p_ for p_, b in BASELINE.items() if p_ in runs and b in runs and not comparable(runs[p_], runs[b])]
    device = payload.get("device", "cpu")
    where = "" if device == "cpu" else f" on {payload.get('device_name') or device}"
    title = {"loss": "Loss: time and peak memory", "loss_cpu": "Loss, fused hidden-state path vs naive (issue 31)",
             }.get(section, f"Loss: {section.removeprefix('loss_')}{where}")
    lm_head = {49152: "SmolLM2-135M's lm_head", 151936: "Qwen3's vocabulary"}.get(shape["vocab"], "random lm_head")
    md = [
        f"## {title} (`bench/bench_loss.py`)",
        "",
        header_line("`.venv/bin/python -m bench.bench_loss" + ("" if section == "loss" else
                    f" --shape {section.split('_')[1]}" + (" --device cuda" if device == "cuda" else "")
                    + (" --tf32" if payload.get("tf32") else "")) + "`", payload),
        f"{shape['batch']} x {shape['seq']} tokens, vocabulary {shape['vocab']}, hidden size {shape['hidden']} "
        f"({lm_head}), teacher top-k {shape['k']}, chunk {shape['chunk']} tokens, "
        f"{payload['gate_ratio']:.0%} of tokens gated, fp32{' (TF32 matmuls)' if payload.get('tf32') else ''}, "
        f"forward + backward{where}. Time: "
        f"{' / '.join(map(str, rounds))} interleaved rounds after a warm-up, every variant of a path in every round; "
        "the times are medians over rounds and every ratio is the median of the per-round ratios (paired: load from "
        "other jobs hits the variants of one round alike; every round is in the JSON). CPU = the process's CPU "
        "time (both threads), which other jobs inflate less than wall time. Memory: RSS high-water mark of a "
        "fresh process per row, minus the RSS before the loss (inputs excluded, the gradients produced included).",
    ]
    if len({(r["run_id"], r["cpu"]) for r in runs.values()}) > 1:
        md += [""] + [f"Path *{p_}* measured in run {r['run_id']} on {r['cpu']}, eopd@{r['describe']}."
                      for p_, r in runs.items()]
    if payload.get("load_average"):
        md += ["", f"Load average (1 min) {payload['load_average'][0]:.1f} at the start and "
                   f"{payload['load_average'][1]:.1f} at the end of the run, on {payload.get('cores')} cores: the machine "
                   "was shared with other jobs, so wall times are inflated and noisy; the paired ratios and the CPU-time "
                   "columns are the numbers to read."]
    md += ["", markdown_table(headers, table), ""]
    if cross:
        md.append("(1) not shown: " + "; ".join(f"*{p_}* and its naive baseline *{BASELINE[p_]}* were measured in "
                                                 f"different runs ({runs[p_]['cpu']} vs {runs[BASELINE[p_]]['cpu']})"
                                                 for p_ in cross)
                  + ". Ratios across runs or machines are not printed; re-run both paths together "
                    "(`python -m bench.bench_loss`).")
        md.append("")
    if missing:
        md.append(f"Not in this JSON (an older run, or one restricted with --only): the memory rows of the learner's default "
                  f"configuration ({', '.join(LEARNER_VARIANTS)}) for {', '.join(missing)}; a full run adds them.")
        md.append("")
    md += [
        "Targets (issues 3 and 31):",
        "",
        *[f"- {v}" for v in verdicts],
        "",
        "Paths: *naive* = full log-softmax tensors with plain autograd (the FKL takes its own log-softmax over "
        "the selected rows, as in the paper's app. A; the backward of that row selection allocates a full "
        "[N, V] buffer, so the gate saves no memory there); *chunked* = `compute_loss`; *naive_hidden* = "
        "`hidden @ W.T` then naive; *hidden* = `compute_loss_from_hidden` (fused: gradients w.r.t. hidden and "
        "lm_head computed in the forward chunk loop, issue 31); *hidden_recompute* = the same with "
        "`fused_backward=False` (each chunk's logits recomputed in backward: four matmuls per chunk instead of "
        "three). Variants: `+metrics` = "
        "`vocab_metrics=True`, the learner's default (vocabulary-wide diagnostics: student entropy, top-k overlap); "
        "`+T0.7` = student temperature 0.7; without a modifier the loss alone at T = 1 (`vocab_metrics=False`). "
        "\"FKL extra vs opd\" subtracts the opd row of the same configuration (`opd+metrics` for `+metrics` rows).",
    ]
    write_section(section, "\n".join(md))


def _verdicts(rows: list[dict], paths: list[str], logits_mib: float, grads_mib: float = 0.0) -> list[str]:
    """The time target is judged on CPU time (the work this process does; wall time on a shared
    machine also counts other jobs' slices), both as medians of per-round paired ratios; the wall
    ratio is shown beside it. The memory ratio is judged only where full_fkl's FKL memory is
    measurable: above 1% of one [N, V] float32 buffer (`logits_mib`); below that, RSS noise (a few
    MiB) dominates both numbers and the FKL adds no vocabulary-sized memory at all, which is what
    the target is about. Memory is judged for the loss alone and for the learner's default
    configuration (`+metrics`) where measured."""
    floor = max(1.0, 0.01 * logits_mib)
    by = {(r["path"], r["variant"]): r for r in rows}
    out = []
    for path in ("hidden", "hidden_recompute"):  # issue 31: within 1.2x of the naive time at <= 5% of its memory
        for v in VARIANTS:
            r = by.get((path, v))
            if not r or r["cpu_vs_naive"] is None:
                continue
            naive_mib = by.get(("naive_hidden", v), {}).get("extra_peak_mib")
            mem = "" if r["mem_vs_naive"] is None else (
                f", peak memory {100 * r['mem_vs_naive']:.1f}% of naive_hidden's (target <= 5%: "
                f"{'met' if r['mem_vs_naive'] <= 0.05 else 'NOT met'}; the hidden and lm_head gradients that every "
                f"path returns are {grads_mib:.0f} MiB = {100 * grads_mib / naive_mib:.0f}% of naive_hidden's peak "
                "at this shape)")
            out.append(f"[{path} vs naive_hidden, {v}] CPU time {r['cpu_vs_naive']:.3f}, wall time "
                       f"{r['time_vs_naive']:.3f} (target <= 1.2: {'met' if r['cpu_vs_naive'] <= 1.2 else 'NOT met'} "
                       f"on CPU time, {'met' if r['time_vs_naive'] <= 1.2 else 'not met'} on wall time){mem}.")
    for path in paths:
        e = by.get((path, "eopd"))
        if not e or e["cpu_vs_opd"] is None:
            continue
        ok_t = e["cpu_vs_opd"] <= 1.10
        line = (f"[{path}] eopd / opd (median of {e['rounds']} paired rounds): CPU time {e['cpu_vs_opd']:.3f}, wall time "
                f"{e['time_vs_opd']:.3f} (target <= 1.10: {'met' if ok_t else 'NOT met'} on CPU time, "
                f"{'met' if e['time_vs_opd'] <= 1.10 else 'not met'} on wall time);")
        for suffix, label in (("", "loss alone"), ("+metrics", "learner default, vocab_metrics=True")):
            e_, f_ = by.get((path, "eopd" + suffix)), by.get((path, "full_fkl" + suffix))
            if not (e_ and f_) or e_["fkl_extra_mib"] is None or f_["fkl_extra_mib"] is None:
                continue
            ef, ff = e_["fkl_extra_mib"], f_["fkl_extra_mib"]
            if ff > floor:
                ratio = max(ef, 0.0) / ff  # a small negative difference is RSS noise: count it as 0
                line += (f" [{label}] eopd's FKL extra peak {ef:.1f} MiB vs full_fkl's {ff:.1f} MiB = {ratio:.2f} "
                         f"(target <= 0.20: {'met' if ratio <= 0.2 else 'NOT met'}).")
            else:
                line += (f" [{label}] FKL extra peak: eopd {ef:.1f} MiB, full_fkl {ff:.1f} MiB: both under {floor:.0f} MiB "
                         f"(1% of one [N, V] float32 buffer, {logits_mib:.0f} MiB), within the noise of RSS: the FKL "
                         "adds no vocabulary-sized memory here, gated or not (target <= 0.20 met in that sense; the "
                         "ratio itself is not measurable at this resolution).")
        out.append(line)
    return out


def _print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


if __name__ == "__main__":
    raise SystemExit(main())
