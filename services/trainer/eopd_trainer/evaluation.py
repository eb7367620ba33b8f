"""`eopd eval`: accuracy and distance to the teacher on the held-out prompts.

    eopd eval --run-dir RUN_DIR [--model final|initial|teacher|SPEC ...] [key=value ...]

For each model, on every held-out prompt (records with `prompt` and `answer`, e.g. from
`eopd_trainer.tasks`), `eval.n_samples` responses at temperature 1.0 and top-p 0.8 (the paper's
evaluation), graded by `grading.is_correct` (last `\\boxed{}`, math-verify):

- `avg_at_k`: mean accuracy over all samples; `pass_at_k[k]`: the unbiased estimator, k = 1, 2,
  4, ..., n, averaged over prompts;
- on the first sample of each prompt (the model's own response), at every response position, the
  exact next-token entropies of the model and of the teacher (`evaluate.position_log_probs`, full
  vocabulary): their histograms (paper fig. 3), the share of tokens with entropy >= 1.0, the
  forward KL(teacher || model) averaged over positions where the teacher's entropy >= tau
  (`eval.high_entropy`), and the reverse/forward KL over all positions.

Results are merged into `<run_dir>/eval.json` under the model's name.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from .config import ConfigError, EvalConfig, RunConfig, load_config

HIST_BINS = np.linspace(0.0, 10.0, 51)  # nats


def ks_for(n: int) -> list[int]:
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


@torch.no_grad()
def evaluate_model(model, tokenizer, teacher, prompts: list[list[int]], answers: list[str], ecfg: EvalConfig, *,
                   seed: int = 1234) -> dict:
    from .evaluate import _pad, position_log_probs
    from .grading import avg_at_k, is_correct, pass_at_k
    from .sampling import generate

    n = ecfg.n_samples
    flat = [p for p in prompts for _ in range(n)]
    samples = []
    for start in range(0, len(flat), ecfg.batch_size):
        samples.extend(generate(model, tokenizer, flat[start : start + ecfg.batch_size], temperature=ecfg.temperature,
                                top_p=ecfg.top_p, max_new_tokens=ecfg.max_new_tokens, seed=seed + start))
    texts = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
    correct = [is_correct(t, answers[i // n]) for i, t in enumerate(texts)]
    per_prompt = [correct[i * n : (i + 1) * n] for i in range(len(prompts))]
    out: dict = {
        "n_samples": n, "prompts": len(prompts),
        "avg_at_k": float(np.mean([avg_at_k(c) for c in per_prompt])),
        "pass_at_k": {str(k): float(np.mean([pass_at_k(n, sum(c), k) for c in per_prompt])) for k in ks_for(n)},
        "response_length_mean": float(np.mean([len(s.response_ids) for s in samples])),
        "truncated_frac": float(np.mean([s.truncated for s in samples])),
        "boxed_frac": float(np.mean(["\\boxed" in t for t in texts])),
        "examples": [{"response": texts[i * n], "answer": answers[i], "correct": correct[i * n]}
                     for i in range(min(3, len(prompts)))],
    }
    if teacher is None:
        return out
    firsts = samples[::n]
    hs_all, ht_all, fkl_all, rkl_all = [], [], [], []
    for ls, lt in position_log_probs(model, teacher, firsts, _pad(tokenizer), temperature=1.0,
                                     batch_size=max(1, ecfg.batch_size // 2)):
        ps, pt = ls.exp(), lt.exp()
        hs_all.append(-(ps * ls).sum(-1))
        ht_all.append(-(pt * lt).sum(-1))
        fkl_all.append((pt * (lt - ls)).sum(-1))
        rkl_all.append((ps * (ls - lt)).sum(-1))
    hs, ht = torch.cat(hs_all).numpy(), torch.cat(ht_all).numpy()
    fkl, rkl = torch.cat(fkl_all).numpy(), torch.cat(rkl_all).numpy()
    high = ht >= ecfg.high_entropy
    out.update({
        "tokens": int(hs.size),
        "entropy_bins": HIST_BINS.tolist(),
        "entropy_hist_student": np.histogram(np.clip(hs, 0, HIST_BINS[-1]), HIST_BINS)[0].tolist(),
        "entropy_hist_teacher": np.histogram(np.clip(ht, 0, HIST_BINS[-1]), HIST_BINS)[0].tolist(),
        "entropy_mean_student": float(hs.mean()), "entropy_mean_teacher": float(ht.mean()),
        "high_entropy_share_student": float((hs >= 1.0).mean()),
        "high_entropy_share_teacher": float((ht >= 1.0).mean()),
        "high_entropy_threshold": ecfg.high_entropy,
        "high_entropy_positions": int(high.sum()),
        "fkl_high_entropy": float(fkl[high].mean()) if high.any() else float("nan"),
        "forward_kl": float(fkl.mean()), "reverse_kl": float(rkl.mean()),
    })
    return out


def committed_export(run_dir: Path) -> Path:
    tag = (run_dir / "checkpoints" / "COMMITTED").read_text().strip()
    return run_dir / "checkpoints" / tag / "hf"


def resolve_model(name: str, run_dir: Path, cfg: RunConfig) -> str:
    """`final` (the last committed HF export), `initial` (the run's starting student), `teacher`,
    or any model spec (a layer-subset spec is built into <run_dir>/eval-models)."""
    from eopd_common.models import materialise_spec

    if name == "final":
        return str(committed_export(run_dir))
    if name == "initial":
        return cfg.student.model
    if name == "teacher":
        if not cfg.teacher.model:
            raise ConfigError("teacher.model is not set")
        return cfg.teacher.model
    return materialise_spec(name, run_dir / "eval-models" / "".join(c if c.isalnum() else "_" for c in name))


def run_config(run_dir: Path, overrides: list[str] = ()) -> RunConfig:
    for name in ("run.yaml", "config.yaml"):
        if (run_dir / name).is_file():
            return load_config(run_dir / name, list(overrides))
    raise ConfigError(f"{run_dir}: no run.yaml (written by eopd run) or config.yaml")


def evaluate_run(run_dir: Path, models: list[str], overrides: list[str] = (), *, names: list[str] | None = None) -> dict:
    from eopd_common.models import load_causal_lm

    from .data import read_records, render_prompt

    run_dir = Path(run_dir)
    cfg = run_config(run_dir, overrides)
    ecfg = cfg.eval
    records = [r for f in cfg.data.eval_files for r in read_records(f)]
    if ecfg.max_prompts:
        records = records[: ecfg.max_prompts]
    if not records or "answer" not in records[0]:
        raise ConfigError("eval needs held-out records with an `answer` field (data.eval_files)")
    teacher = load_causal_lm(cfg.teacher.model).model if cfg.teacher.model else None
    path = run_dir / "eval.json"
    result = json.loads(path.read_text()) if path.is_file() else {"models": {}}
    result["eval"] = ecfg.model_dump(mode="json")
    for i, name in enumerate(models):
        label = names[i] if names else name
        spec = resolve_model(name, run_dir, cfg)
        loaded = load_causal_lm(spec)
        tok = loaded.tokenizer
        prompts = [render_prompt(tok, r[cfg.data.field], suffix=cfg.data.suffix, chat_template=cfg.data.chat_template,
                                 max_length=cfg.data.max_prompt_length) for r in records]
        t0 = time.monotonic()
        r = evaluate_model(loaded.model, tok, teacher, prompts, [str(r["answer"]) for r in records], ecfg,
                           seed=cfg.seed + 1234)
        r.update(model=spec, eval_s=time.monotonic() - t0)
        result["models"][label] = r
        path.write_text(json.dumps(result, indent=1))
        print(f"eopd eval: {label}: avg@{r['n_samples']} {r['avg_at_k']:.3f} pass@k {r['pass_at_k']} "
              f"fkl(high H) {r.get('fkl_high_entropy', float('nan')):.3f} ({r['eval_s']:.0f} s)", file=sys.stderr)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="eopd eval", description="Avg@k / Pass@k, entropies and KL to the teacher on "
                                "the held-out prompts of a run; results merged into <run_dir>/eval.json.")
    p.add_argument("--run-dir", type=Path, required=True, help="a run directory (its run.yaml gives data and teacher)")
    p.add_argument("--model", action="append", default=None,
                   help="final (default), initial, teacher, a local model directory or a spec; repeatable")
    p.add_argument("--name", action="append", default=None, help="label of each --model in eval.json")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the run config (e.g. eval.n_samples=8)")
    args = p.parse_args(argv)
    models = args.model or ["final"]
    if args.name and len(args.name) != len(models):
        print("eopd eval: give one --name per --model", file=sys.stderr)
        return 2
    try:
        evaluate_run(args.run_dir, models, args.overrides, names=args.name)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"eopd eval: {exc}", file=sys.stderr)
        return 2
    return 0
