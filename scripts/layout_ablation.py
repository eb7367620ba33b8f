"""What the data layout costs each loss (issue 47, ask 1), measured on the TRAINING split only.

Every cell is one `eopd run` of a preset (default smollm2-cpu) with one loss and one layout, then its
final student evaluated on the first PROBE training problems (Avg@4, the preset's sampling settings);
the held-out and variants sets are never read. Every layout trains the same number of responses
(512 = the preset's 32 iterations x 16) in the same 64 optimizer steps of 8 responses at the same
learning rate, so a difference between two layouts is the layout, not the compute:

    layout          prompts x responses  steps/iteration  iterations  distinct prompts  what it separates
    preset          8 x 2                2                32          256               (today's preset)
    p4x2            4 x 2                1                64          256               preset vs p4x2: policy lag
    trl             8 x 1                1                64          512               TRL's layout
    trl-256         8 x 1 (256 problems) 1                64          256 (twice)       trl vs trl-256: distinct prompts
    p2x4            2 x 4                1                64          128               trl / p4x2 / p2x4: responses per prompt
    p16x1           16 x 1               2                32          512               trl vs p16x1: policy lag at 1 response
    preset-async    8 x 2, mode async    2                32          256               per-iteration costs hidden
    trl-async       8 x 1, mode async    1                64          512               trl vs trl-async: the same, at 1 step

A cell's small files (run.yaml, run_summary.json, train_metrics.jsonl, eval-<probe>.json) are archived
to ARCHIVE/<loss>-<layout>-s<seed>/ and a cell archived there is never run again, so the grid can be
run in parts, on several machines, one cell at a time (each uses the whole machine). The run's big
files are deleted once it is evaluated. The initial student is evaluated once per seed (cell
`initial-s<seed>`). `--table` only reads the archive and prints the table; `python -m
scripts.results_tables` writes it into docs/results.md (block `layout-ablation`) with the others.

    .venv/bin/python -m scripts.layout_ablation --losses eopd,gkd --layouts preset,trl --seeds 0
    .venv/bin/python -m scripts.layout_ablation --dry-run          # the whole grid, in the order it runs
    .venv/bin/python -m scripts.layout_ablation --table            # the table from the archive
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import string
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench.bench_divergences import MEMBERS
from bench.e2e_systems import EOPD_SYSTEMS, LAYOUTS  # LAYOUTS: the module docstring's table

ROOT = Path(__file__).resolve().parents[1]

#: loss name -> `eopd run` overrides, the head-to-head's and the divergence benchmark's own (one source:
#: bench/e2e_systems.py, bench/bench_divergences.py); gkd at lambda 1, every response the student's own,
#: as TRL's runs. EOPD's family (issue 48, asks 2 and 3): the paper's gated forward KL on top of an exact
#: reverse KL instead of the one-sample estimate, over the full vocabulary (the teacher's hidden states),
#: the teacher's top-k or the student's top-k, each with its tail bucket: which member is "eopd's best
#: EOPD-family loss" is chosen on this split, at the preset's layout.
LOSSES: dict[str, tuple[str, ...]] = {
    **{name: EOPD_SYSTEMS[system] for name, system in (("eopd", "eopd"), ("opd", "opd"), ("gkd", "eopd-gkd"))},
    # gkd with half of the responses teacher-generated: the preset's per_loss.gkd layout was chosen at
    # lambda 1, and on the held-out set (docs/results.md, GKD at three λ) it did not carry to lambda 0.5
    "gkd0.5": (*EOPD_SYSTEMS["eopd-gkd"][:1], "loss.gkd_lambda=0.5"),
    "kd": ("loss.variant=kd",),
    "eopd-rkl-full": EOPD_SYSTEMS["eopd-rkl-full"],
    "eopd-rkl-ttopk": MEMBERS["eopd_rkl_teacher"],
    "eopd-topk-rkl": EOPD_SYSTEMS["eopd-topk-rkl"],
}
PROBE = 128  # the first this many training problems
PROBE_SET = f"train{PROBE}"
ARCHIVE = ROOT / "docs" / "results" / "layout"
#: the far-student preset's cells (`--preset configs/smollm2-far.yaml --archive docs/results/layout-far`)
ARCHIVE_FAR = ROOT / "docs" / "results" / "layout-far"
SMALL_FILES = ("run.yaml", "run_summary.json", "train_metrics.jsonl", f"eval-{PROBE_SET}.json")


def cells(losses: list[str], layouts: list[str], seeds: list[int]) -> list[tuple[str, str, int]]:
    """The grid in the order it runs: seed by seed, and within a seed the first two layouts for
    every loss before the others, so that a partial grid answers the main comparison first."""
    out = []
    for seed in seeds:
        for group in (layouts[:2], layouts[2:]):
            for layout in group:
                out += [(loss, layout, seed) for loss in losses]
    return out


def cell_name(loss: str, layout: str, seed: int) -> str:
    return f"{loss}-{layout}-s{seed}"


def eopd(*args: str) -> None:
    exe = Path(sys.executable).parent / "eopd"
    subprocess.run([str(exe), *args], cwd=ROOT, check=True)


def probe_file(run_dir: Path) -> Path:
    """The first PROBE problems of the run's (first) training file: the same for every layout, as the
    generator's draws of 256 problems are the first 256 of its 512."""
    config = yaml.safe_load((run_dir / "run.yaml").read_text())
    lines = Path(config["data"]["train_files"][0]).read_text().splitlines()[:PROBE]
    path = run_dir / f"{PROBE_SET}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_cell(preset: Path, loss: str, layout: str, seed: int, work: Path, archive: Path) -> None:
    from bench.report import provenance, timing_machine

    name = cell_name(loss, layout, seed)
    run_dir = work / name
    # the machine, for the training seconds: cells run on several machines (the grid runs in parts)
    prov, machine, load_start = provenance(), timing_machine(), os.getloadavg()
    t0 = time.monotonic()
    # per_loss={}: a cell's layout is its LAYOUTS entry over the preset's general settings, never a
    # loss's own (config per_loss), whatever the preset says for that loss
    eopd("run", "--config", str(preset), f"run_dir={run_dir}", f"seed={seed}", *LOSSES[loss], *LAYOUTS[layout],
         "per_loss={}", "eval.enabled=false", "logging.progress=false", "--overwrite")
    probe = probe_file(run_dir)
    eopd("eval", "--run-dir", str(run_dir), "--model", "final", "--name", "final", "--data", str(probe),
         "--set", PROBE_SET)
    initial = archive / f"initial-s{seed}"
    if not (initial / f"eval-{PROBE_SET}.json").is_file():
        eopd("eval", "--run-dir", str(run_dir), "--model", "initial", "--name", "initial", "--data", str(probe),
             "--set", PROBE_SET)
        initial.mkdir(parents=True, exist_ok=True)
        shutil.copy(run_dir / f"eval-{PROBE_SET}.json", initial / f"eval-{PROBE_SET}.json")
        shutil.copy(probe, initial / f"{PROBE_SET}.jsonl")
    dest = archive / name
    dest.mkdir(parents=True, exist_ok=True)
    for f in SMALL_FILES:
        shutil.copy(run_dir / f, dest / f)
    (dest / "cell.json").write_text(json.dumps({"loss": loss, "layout": layout, "seed": seed, "preset": preset.name,
                                                "overrides": [*LOSSES[loss], *LAYOUTS[layout]],
                                                "wall_s": round(time.monotonic() - t0, 1),
                                                **{k: machine[k] for k in ("cpu", "boot_id", "matmul_gflops")},
                                                "commit": prov["commit"], "describe": prov["describe"],
                                                "load_avg_start": load_start,
                                                "load_avg_end": os.getloadavg()}, indent=1) + "\n")
    shutil.rmtree(run_dir, ignore_errors=True)


def read_cell(path: Path) -> dict | None:
    """A finished cell's numbers from its archived files (pure: reads files only), or None."""
    evals = path / f"eval-{PROBE_SET}.json"
    if not (path / "cell.json").is_file() or not evals.is_file():
        return None
    cell = json.loads((path / "cell.json").read_text())
    model = json.loads(evals.read_text())["models"]["final"]
    summary = json.loads((path / "run_summary.json").read_text())
    iters = [json.loads(x) for x in (path / "train_metrics.jsonl").read_text().splitlines()]
    iters = [r for r in iters if r.get("kind") == "iteration"]
    started = next((r["time"] for r in iters if "time" in r), None)  # when the cell's run trained
    return {**cell, "avg": model["avg_at_k"], "final": model, "train_s": summary.get("train_s"),
            "iterations": len(iters), "started": started}


def trained_prompts(config: dict) -> set[int] | None:
    """The training problems (indices into the run's training file) a cell's run sampled: task
    number s trains prompt `prompt_index(s)` (eopd_trainer.data), iterations x prompts per iteration
    tasks (a task dropped as stale and replaced is not counted); None when the run.yaml does not say
    how many problems the file held (`data.generate.train`)."""
    from eopd_trainer.data import prompt_index

    data, train, rollout = config.get("data") or {}, config.get("train") or {}, config.get("rollout") or {}
    num = (data.get("generate") or {}).get("train")
    if not num or not train.get("iterations"):
        return None
    tasks = train["iterations"] * (train["batch_size"] // rollout.get("n_samples", 1))
    return {prompt_index(s, num, seed=config.get("seed", 0), shuffle=data.get("shuffle", True)) for s in range(tasks)}


def seen_split(path: Path) -> dict | None:
    """A cell's Avg@4 on the probe problems its run trained on and on those it never saw (needs the
    evaluation's `correct_per_prompt`, recorded since 2026-12-04), or None."""
    final = json.loads((path / f"eval-{PROBE_SET}.json").read_text())["models"]["final"]
    per_prompt, n = final.get("correct_per_prompt"), final.get("n_samples")
    seen = trained_prompts(yaml.safe_load((path / "run.yaml").read_text())) if (path / "run.yaml").is_file() else None
    if per_prompt is None or seen is None:
        return None
    inside = [c / n for i, c in enumerate(per_prompt) if i in seen]
    outside = [c / n for i, c in enumerate(per_prompt) if i not in seen]
    return {"seen_n": len(inside), "seen_avg": statistics.fmean(inside) if inside else None,
            "unseen_n": len(outside), "unseen_avg": statistics.fmean(outside) if outside else None}


def seen_table(archive: Path) -> str:
    """Per cell with per-prompt results: Avg@4 on the probe problems its run trained on, and on the
    others (the probe is part of the training split: a layout that trains on more of it is favoured
    by memorising, not only by learning)."""
    rows = []
    for p in sorted(archive.glob("*-s*")):
        cell = read_cell(p)
        split = seen_split(p) if cell else None
        if split:
            f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
            rows.append(f"| {cell['loss']} | {cell['layout']} | {cell['seed']} | {cell['avg']:.3f} | "
                        f"{f(split['seen_avg'])} ({split['seen_n']}) | {f(split['unseen_avg'])} ({split['unseen_n']}) |")
    if not rows:
        return ""
    return "\n".join(["Avg@4 on the probe problems each run trained on and on those it never sampled (problem counts "
                      "in brackets):", "", "| loss | layout | seed | Avg@4 (all) | trained on | never sampled |",
                      "|---|---|---|---|---|---|", *rows]) + "\n"


def initial_models(archive: Path) -> dict[int, dict]:
    """Seed -> the initial student's evaluation on the probe (the archive's `initial-s<seed>` cells)."""
    return {int(p.name.rsplit("-s", 1)[1]): json.loads((p / f"eval-{PROBE_SET}.json").read_text())["models"]["initial"]
            for p in sorted(archive.glob("initial-s*"))}


def by_loss_and_layout(rows: list[dict]):
    """(loss, layout, that pair's cells by seed) in LOSSES' and LAYOUTS' order, pairs without cells left out."""
    for loss in LOSSES:
        for layout in LAYOUTS:
            got = sorted((r for r in rows if r["loss"] == loss and r["layout"] == layout), key=lambda r: r["seed"])
            if got:
                yield loss, layout, got


def distance_table(archive: Path) -> str:
    """Per loss x layout, the final student's distance to the teacher on its own answers to the probe
    problems (reverse KL, and forward KL at positions where the teacher's entropy is >= tau), mean over
    the seeds archived and per seed, beside the initial student's: where Avg@4 barely moves (a student
    far from its teacher), this is what the layout changes."""
    def distances(m: dict) -> tuple[float, float]:
        return m["reverse_kl"], m["fkl_high_entropy"]

    initial = {seed: distances(m) for seed, m in initial_models(archive).items()}
    rows = [c for p in sorted(archive.glob("*-s*")) if (c := read_cell(p))]
    if not rows:
        return ""
    f = lambda pairs: f"{statistics.fmean(v for v, _ in pairs):.3f} / {statistics.fmean(w for _, w in pairs):.3f}"  # noqa: E731
    lines = ["The final student's distance to the teacher on its own answers to the probe problems: reverse KL / "
             "forward KL at positions where the teacher's entropy is >= tau (nats; lower is closer):", "",
             "| loss | layout | seeds | mean | per seed |", "|---|---|---|---|---|"]
    if initial:
        lines.append(f"| initial student | - | {len(initial)} | {f(list(initial.values()))} | "
                     + ", ".join(f"s{s} {v:.3f} / {w:.3f}" for s, (v, w) in sorted(initial.items())) + " |")
    for loss, layout, got in by_loss_and_layout(rows):
        pairs = [distances(r["final"]) for r in got]
        lines.append(f"| {loss} | {layout} | {len(got)} | {f(pairs)} | "
                     + ", ".join(f"s{r['seed']} {v:.3f} / {w:.3f}" for r, (v, w) in zip(got, pairs)) + " |")
    return "\n".join(lines) + "\n"


def machine_of(cell: dict) -> tuple[str, str]:
    """A cell's machine: its CPU model and the kernel's boot id (two machines can share a CPU name;
    the matmul probe varies by a few percent from one cell to the next on one machine), or its
    recorded probe where the boot id was not recorded."""
    return cell.get("cpu", "?"), cell.get("boot_id") or f"{float(cell.get('matmul_gflops') or 0.0):.0f}"


def machine_legend(rows: list[dict]) -> dict[tuple[str, str], str]:
    """Each machine the cells ran on -> a letter, in the order the machines first ran a cell (a cell's
    first iteration's time; cells without one after those with, in the order of their names): a
    machine keeps its letter when later machines add cells, so prose that names a letter stays true."""
    legend: dict[tuple[str, str], str] = {}
    timed = sorted((r for r in rows if r.get("started") is not None), key=lambda r: r["started"])
    for r in [*timed, *(r for r in rows if r.get("started") is None)]:
        legend.setdefault(machine_of(r), machine_letter(len(legend)))
    return legend


def machine_letter(i: int) -> str:
    """The i-th machine's name, spreadsheet-style: A..Z, then AA, AB, ... (never two machines alike)."""
    name = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        name = string.ascii_uppercase[r] + name
    return name


def machine_text(rows: list[dict], key: tuple[str, str]) -> str:
    """'CPU, fp32 1024^3 matmul N GFLOP/s' (or 'N-M' over the machine's cells; a cell whose probe was
    not taken on an idle machine records none)."""
    probes = sorted(float(r["matmul_gflops"]) for r in rows if machine_of(r) == key and r.get("matmul_gflops"))
    if not probes:
        return f"{key[0]}, no matmul probe recorded"
    speed = f"{probes[0]:.0f}" if round(probes[0]) == round(probes[-1]) else f"{probes[0]:.0f}-{probes[-1]:.0f}"
    return f"{key[0]}, fp32 1024^3 matmul {speed} GFLOP/s"


def table(archive: Path) -> str:
    """The results block: per loss x layout, mean Avg@4 on the probe set over the seeds archived,
    every seed's value, and each seed's training seconds with the letter of the machine it ran on."""
    rows = [c for p in sorted(archive.glob("*-s*")) if (c := read_cell(p))]
    initial = {seed: m["avg_at_k"] for seed, m in initial_models(archive).items()}
    if not rows:
        return "No cell has been measured yet.\n"
    machines = machine_legend(rows)
    lines = [f"Avg@4 of the final student on the first {PROBE} *training* problems (the initial student: "
             + ", ".join(f"seed {s} {v:.3f}" for s, v in sorted(initial.items())) + "); "
             "each cell 512 responses in 64 optimizer steps of 8. Training seconds are per seed, with the machine "
             "the cell ran on (the grid runs in parts, on several 2-core machines): compare seconds within one machine.",
             "", "| loss | layout | seeds | Avg@4 mean | per seed | gain over initial (mean) | train s per seed (machine) |",
             "|---|---|---|---|---|---|---|"]
    for loss, layout, got in by_loss_and_layout(rows):
        avgs = [r["avg"] for r in got]
        gains = [r["avg"] - initial[r["seed"]] for r in got if r["seed"] in initial]
        per_seed = ", ".join(f"s{r['seed']} {r['avg']:.3f}" for r in got)
        seconds = ", ".join(f"s{r['seed']} {r['train_s']:.0f}{'*' if r.get('beside') else ''} ({machines[machine_of(r)]})"
                            for r in got)
        gain = f"{statistics.fmean(gains):+.3f}" if gains else "-"
        lines.append(f"| {loss} | {layout} | {len(got)} | {statistics.fmean(avgs):.3f} | {per_seed} | {gain} | {seconds} |")
    lines += ["", "Machines: " + "; ".join(f"{letter} = {machine_text(rows, key)}" for key, letter in machines.items()) + "."]
    if any(r.get("beside") for r in rows):
        lines.append("\\* Other work ran beside this cell's training (its cell.json says what): its seconds are not comparable.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", type=Path, default=ROOT / "configs" / "smollm2-cpu.yaml")
    p.add_argument("--losses", default=",".join(LOSSES))
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "layout")
    p.add_argument("--archive", type=Path, default=ARCHIVE)
    p.add_argument("--dry-run", action="store_true", help="print the cells that would run, in order")
    p.add_argument("--table", action="store_true", help="print the results table from the archive, run nothing")
    args = p.parse_args(argv)
    if args.table:
        print(table(args.archive))
        print(seen_table(args.archive))
        return 0
    losses, layouts = args.losses.split(","), args.layouts.split(",")
    bad = [x for x in losses if x not in LOSSES] + [x for x in layouts if x not in LAYOUTS]
    if bad:
        p.error(f"unknown loss or layout {bad}; losses {list(LOSSES)}, layouts {list(LAYOUTS)}")
    todo = [c for c in cells(losses, layouts, [int(s) for s in args.seeds.split(",")])
            if read_cell(args.archive / cell_name(*c)) is None]
    failed = 0
    for c in todo:
        print(("would run " if args.dry_run else "running ") + cell_name(*c), flush=True)
        if not args.dry_run:
            try:
                run_cell(args.preset.resolve(), *c, args.work, args.archive)
            except subprocess.CalledProcessError as e:  # the others still run; this one is not archived
                print(f"{cell_name(*c)} failed: {e}", file=sys.stderr, flush=True)
                failed += 1
            print(table(args.archive), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
