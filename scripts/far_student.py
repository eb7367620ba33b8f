"""Builds the far student of `configs/smollm2-far.yaml` (issue 35): SmolLM2-135M-Instruct with several
decoder layers removed, healed by KD on the teacher's generations until it writes in the answer
format again, chosen on the TRAINING split by the rule below (never the held-out sets).

    .venv/bin/python scripts/far_student.py [--candidates "12,14,16;10,12,14,16,18;..."]
        [--heal-iterations 8] [--out runs/far-student] [--probe 64] [--samples 4]
    .venv/bin/python scripts/far_student.py --build [LAYERS]   # the archived choice's student only

For each candidate (a `;`-separated list of comma-separated layer lists):

1. heal: `eopd run` of the default preset with `student.model: smollm2-135m[drop=...]`,
   `loss.variant: kd` (the KD warm-up's loss: forward KL on the teacher's own generations) for
   `--heal-iterations` iterations, no evaluation;
2. probe, on the first `--probe` problems of the training split, `--samples` answers each, as
   `eopd eval` grades them: accuracy (Avg@k, flexible), the share of answers holding a number
   (the answer format), entropy shares, and the distance to the teacher on the model's own answers
   (reverse KL, forward KL at positions where the teacher's entropy >= tau); the pruned student
   before healing and the default preset's student (`smollm2-135m[drop=14]`) are probed the same way.

**The rule**, fixed before any candidate was probed: the candidate with the most layers removed whose
healed student writes a number in at least 90% of its answers and whose reverse KL to the teacher
is at least twice the default student's (far, but still answering in the format); if none is twice
as far, the farthest that keeps the format. The choice, with every candidate's numbers, goes to
`<out>/choice.json`; the chosen healed student to `<out>/student/` (the preset's `student.model`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMAT_MIN = 0.9  # share of answers holding a number
FAR_FACTOR = 2.0  # reverse KL to the teacher, over the default student's
CHOICE = ROOT / "docs" / "results" / "far-student" / "choice.json"  # configs/smollm2-far.yaml's student


def heal(preset: Path, base: str, dropped: str, out: Path, iterations: int) -> Path:
    """`eopd run` with loss kd on the pruned student; returns the healed student's export."""
    run_dir = out / f"heal-{dropped.replace(',', '-')}"
    export = run_dir / "checkpoints"
    if not (export / "COMMITTED").is_file():
        args = [sys.executable, "-m", "eopd_trainer.cli", "run", "--config", str(preset), f"run_dir={run_dir}",
                f"student.model={base}[drop={dropped}]", "loss.variant=kd", f"train.iterations={iterations}",
                f"checkpoint.every={iterations}", "eval.enabled=false", "logging.progress=false", "--overwrite"]
        env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL",)}
        subprocess.run(args, cwd=ROOT, env=env, check=True)
    return export / (export / "COMMITTED").read_text().strip() / "hf"


def probe(run_dir: Path, models: list[str], names: list[str], probe_file: Path, samples: int) -> dict:
    """`eopd eval` of `models` on the training probe (results in <run_dir>/eval-train-probe.json)."""
    from eopd_trainer.eval.evaluate import evaluate_run

    result = evaluate_run(run_dir, models, [f"eval.n_samples={samples}"], names=names, data_files=[probe_file],
                          set_name="train-probe")
    keys = ("avg_at_k", "number_frac", "high_entropy_share_student", "high_entropy_share_teacher", "entropy_mean_student",
            "reverse_kl", "forward_kl", "fkl_high_entropy")
    return {n: {k: result["models"][n][k] for k in keys} for n in names}


def choose(candidates: dict[str, dict], reference: dict, format_min: float = FORMAT_MIN) -> str:
    """The rule of the module docstring over {dropped: {"layers_removed", "healed": probe}}."""
    keeps_format = {d: c for d, c in candidates.items() if c["healed"]["number_frac"] >= format_min}
    if not keeps_format:
        raise SystemExit(f"no healed candidate writes a number in {format_min:.0%} of its answers: heal longer or "
                         "remove fewer layers")
    far = {d: c for d, c in keeps_format.items() if c["healed"]["reverse_kl"] >= FAR_FACTOR * reference["reverse_kl"]}
    if far:
        return max(far, key=lambda d: (far[d]["layers_removed"], far[d]["healed"]["reverse_kl"]))
    return max(keeps_format, key=lambda d: keeps_format[d]["healed"]["reverse_kl"])


def install_student(export: Path | str, out: Path) -> Path:
    """Copies a healed student's export to <out>/student (the preset's student.model), replacing it."""
    target = out / "student"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(export, target)
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2-cpu.yaml")
    p.add_argument("--candidates", default="12,14,16;10,12,14,16,18;8,10,12,14,16,18,20")
    p.add_argument("--heal-iterations", type=int, default=8)
    p.add_argument("--probe", type=int, default=64, help="training problems probed (the first of the split)")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "far-student")
    p.add_argument("--format-min", type=float, default=FORMAT_MIN, help="the rule's answer-format share (tests: 0)")
    p.add_argument("--build", nargs="?", const=str(CHOICE), default=None, metavar="LAYERS|CHOICE.json",
                   help="only heal the student that drops LAYERS (default: the archived choice's, "
                        "docs/results/far-student/choice.json) into <out>/student: no probes, no choice "
                        "(what scripts/experiment.sh does for smollm2-far)")
    args = p.parse_args(argv)
    if args.build:
        from eopd_trainer.config import load_config

        dropped, iterations = args.build, args.heal_iterations
        if dropped.endswith(".json"):  # an archived choice: its layers and heal length
            choice = json.loads(Path(dropped).read_text())
            dropped, iterations = choice["chosen"], choice["heal_iterations"]
        healed = heal(args.config, load_config(args.config).teacher.model, dropped, args.out, iterations)
        target = install_student(healed, args.out)
        print(f"[far] built: drop {dropped} healed {iterations} iterations -> {target}", flush=True)
        return 0
    from eopd_trainer.config import load_config
    from eopd_trainer.data import read_records
    from eopd_trainer.job.prepare import prepare_and_write

    args.out.mkdir(parents=True, exist_ok=True)
    _, shared = prepare_and_write(load_config(args.config, [f"run_dir={args.out / 'shared'}"]))
    probe_file = args.out / "train-probe.jsonl"  # the training split only: the choice never sees held-out problems
    records = [r for f in shared.data.train_files for r in read_records(f)][: args.probe]
    probe_file.write_text("".join(json.dumps(r) + "\n" for r in records))
    base = load_config(args.config).teacher.model  # the students are pruned copies of the teacher
    default = load_config(args.config).student.model
    reference = probe(args.out / "shared", [default], ["default"], probe_file, args.samples)["default"]
    print(f"[far] default student {default}: {reference}", flush=True)
    candidates = {}
    for dropped in args.candidates.split(";"):
        healed = heal(args.config, base, dropped, args.out, args.heal_iterations)
        run_dir = healed.parents[2]
        got = probe(run_dir, ["initial", str(healed)], ["pruned", "healed"], probe_file, args.samples)
        candidates[dropped] = {"layers_removed": len(dropped.split(",")), "export": str(healed), **got}
        print(f"[far] drop {dropped}: {candidates[dropped]}", flush=True)
    chosen = choose(candidates, reference, args.format_min)
    target = install_student(candidates[chosen]["export"], args.out)
    (args.out / "choice.json").write_text(json.dumps({
        "rule": f"most layers removed with number_frac >= {args.format_min} and reverse KL >= {FAR_FACTOR}x the default "
                "student's (else the farthest keeping the format), on the training probe",
        "chosen": chosen, "heal_iterations": args.heal_iterations, "probe_problems": len(records), "samples": args.samples,
        "base": base, "default_student": {"model": default, **reference}, "candidates": candidates}, indent=1))
    print(f"[far] chosen: drop {chosen} -> {target}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
