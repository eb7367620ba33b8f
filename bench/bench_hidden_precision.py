"""What the teacher's bf16 hidden states change in the full-vocabulary objective (issue 47 ask 4,
issue 48 ask 1): `loss.support: full` builds the teacher's distribution from the final hidden states
it sends, bfloat16 by default (`teacher.hidden_states`), where TRL's GKDTrainer computes its teacher's
logits in float32 in-process. On the preset's real models (SmolLM2-135M-Instruct, the pruned
initial student) and the student's own samples of the first training problems (the preset's
sampling settings), the teacher scores every sample once with float32 and once with bfloat16 hidden
states, and the two full-vocabulary distributions are compared per response token:

- the teacher's log-prob of the sampled token, |bf16 - fp32|;
- KL(p_fp32 || p_bf16): the floor of the objective: a student that matched the bf16 teacher exactly
  is this far from the fp32 one;
- the reverse KL KL(q || p) (TRL's beta 1, the objective `eopd-trl-gkd` trains) at the initial
  student with each teacher, and its gradient with respect to the student's logits
  (q * (log q - log p - KL) per token): relative difference and cosine between the two.

    .venv/bin/python -m bench.bench_hidden_precision               # 64 problems x 2 samples; writes the section
    .venv/bin/python -m bench.bench_hidden_precision --quick       # tiny-random models, seconds; writes nothing

Writes bench/results/hidden_precision.json and the `hidden_precision` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from bench.report import ROOT, markdown_table, measure_and_report

PRESET = ROOT / "configs" / "smollm2-cpu.yaml"
DTYPES = ("float32", "bfloat16")


def token_comparison(q_logits: torch.Tensor, p32_logits: torch.Tensor, p16_logits: torch.Tensor,
                     tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token comparison of one response's teacher distributions (pure).

    Args: q_logits, p32_logits, p16_logits `[n, V]` the student's and the teacher's (fp32 and bf16
    hidden states) logits at the response's n positions; tokens `[n]` the sampled ids.
    Returns `[n]` tensors: `dlogp` |log p16(token) - log p32(token)|, `kl_32_16` KL(p32 || p16),
    `rkl32` / `rkl16` KL(q || p) with each teacher; and `[n, V]` `grad32` / `grad16`, the gradient of
    each reverse KL with respect to the student's logits. All in float64.
    """
    lq = torch.log_softmax(q_logits.double(), -1)
    l32 = torch.log_softmax(p32_logits.double(), -1)
    l16 = torch.log_softmax(p16_logits.double(), -1)
    q = lq.exp()
    idx = tokens.long().unsqueeze(-1)
    out = {"dlogp": (l16.gather(-1, idx) - l32.gather(-1, idx)).abs().squeeze(-1),
           "kl_32_16": (l32.exp() * (l32 - l16)).sum(-1)}
    for name, lp in (("32", l32), ("16", l16)):
        rkl = (q * (lq - lp)).sum(-1)
        out[f"rkl{name}"] = rkl
        out[f"grad{name}"] = q * (lq - lp - rkl.unsqueeze(-1))
    return out


def summarise(parts: list[dict[str, torch.Tensor]]) -> dict:
    """The per-token comparisons of every response, pooled into the section's numbers (pure)."""
    cat = {k: torch.cat([p[k] for p in parts]) for k in parts[0] if not k.startswith("grad")}
    # the gradients' norms and dot product part by part: their [tokens, V] concatenation is ~1 GB at SmolLM2's V
    dot, n32, n16 = (sum(float((p[a] * p[b]).sum()) for p in parts)
                     for a, b in (("grad16", "grad32"), ("grad32", "grad32"), ("grad16", "grad16")))
    return {
        "tokens": int(cat["dlogp"].numel()),
        "dlogp_mean": float(cat["dlogp"].mean()), "dlogp_p99": float(cat["dlogp"].quantile(0.99)),
        "dlogp_max": float(cat["dlogp"].max()),
        "kl_32_16_mean": float(cat["kl_32_16"].mean()), "kl_32_16_p99": float(cat["kl_32_16"].quantile(0.99)),
        "kl_32_16_max": float(cat["kl_32_16"].max()),
        "rkl32_mean": float(cat["rkl32"].mean()), "rkl16_mean": float(cat["rkl16"].mean()),
        "grad_rel_diff": math.sqrt(max(n16 - 2 * dot + n32, 0.0) / n32),
        "grad_cosine": dot / math.sqrt(n16 * n32),
    }


def measure(preset: Path, n_problems: int, seed: int, overrides: list[str]) -> dict:
    from eopd_common.models import load_causal_lm
    from eopd_common.output_head import TeacherLogitRows, unpack_hidden
    from eopd_teacher.engines.transformers_engine import TransformersEngine
    from eopd_teacher.settings import TeacherSettings
    from eopd_teacher.types import ScoreItem
    from eopd_trainer.config import load_config
    from eopd_trainer.data import load_prompts, render_prompt
    from eopd_trainer.job.prepare import prepare_and_write
    from eopd_trainer.rollout.samplers.transformers_sampler import generate

    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory(prefix="eopd-hidden-precision-") as tmp:
        _, cfg = prepare_and_write(load_config(preset, [f"run_dir={tmp}/run", *overrides]))
        student = load_causal_lm(cfg.student.model, dtype="float32")
        tok, d, r = student.tokenizer, cfg.data, cfg.rollout
        texts = load_prompts(d.train_files, d.field)[:n_problems]
        prompts = [render_prompt(tok, t, suffix=d.suffix, chat_template=d.chat_template, max_length=d.max_prompt_length)
                   for t in texts for _ in range(r.n_samples)]
        samples = []
        for start in range(0, len(prompts), r.generation_batch_size):
            batch = prompts[start : start + r.generation_batch_size]
            samples += generate(student.model, tok, batch, temperature=r.temperature, top_p=r.top_p,
                                max_new_tokens=r.max_response_length, seed=seed + start, keep_logits=range(len(batch)))
        samples = [s for s in samples if s.response_ids]
        engine = TransformersEngine(TeacherSettings(model=cfg.teacher.model, dtype="float32",
                                                    compile_statistics=False).engine_settings())
        engine.load()
        head = engine.output_head()
        parts = []
        for s in samples:
            ids = np.asarray(s.prompt_ids + s.response_ids, dtype=np.int64)
            items = [ScoreItem(f"{i}", ids, len(s.prompt_ids), cfg.teacher.top_k, cfg.teacher.temperature,
                               hidden_dtype=dt) for i, dt in enumerate(DTYPES)]
            rows = []
            for it, sc in zip(items, engine.score(items), strict=True):
                h = unpack_hidden(sc.hidden_states, sc.hidden_size, sc.hidden_dtype, rows=it.num_scored)
                n = h.shape[0]
                rows.append(TeacherLogitRows(head, h, torch.full((n,), 1.0 / it.temperature))(0, n))
            parts.append(token_comparison(s.logits, rows[0], rows[1], torch.tensor(s.response_ids)))
        out = summarise(parts)
        out.update(problems=len(texts), samples=len(samples), seed=seed, preset=preset.name,
                   teacher=cfg.teacher.model, student=str(cfg.student.model), overrides=overrides)
        return out


def section_text(data: dict) -> str:
    rows = [
        ["teacher log-prob of the sampled token, abs(bf16 - fp32) (nats)",
         f"{data['dlogp_mean']:.2e}", f"{data['dlogp_p99']:.2e}", f"{data['dlogp_max']:.2e}"],
        ["KL(p_fp32 ‖ p_bf16) per token (nats)",
         f"{data['kl_32_16_mean']:.2e}", f"{data['kl_32_16_p99']:.2e}", f"{data['kl_32_16_max']:.2e}"],
    ]
    return ("## The teacher's bf16 hidden states against fp32: what they change in TRL's objective "
            "(`python -m bench.bench_hidden_precision`, issues 47 and 48)\n\n"
            f"`loss.support: full` builds the teacher's distribution from the hidden states it sends (bfloat16 by "
            f"default; TRL's GKDTrainer computes its teacher's logits in float32 in-process). Preset "
            f"`{data['preset']}`: teacher {data['teacher']} (float32 weights), the initial student's own samples of the "
            f"first {data['problems']} training problems ({data['samples']} responses, {data['tokens']} response tokens, "
            f"seed {data['seed']}), each scored once with float32 and once with bfloat16 hidden states "
            f"(load {data.get('load_avg')}).\n\n"
            + markdown_table(["per response token", "mean", "99th percentile", "max"], rows) + "\n\n"
            f"The reverse KL, KL(q ‖ p), at the initial student (TRL's beta 1): {data['rkl32_mean']:.4f} nats a token with "
            f"the fp32 teacher, {data['rkl16_mean']:.4f} with the bf16 one; its gradient with respect to the student's "
            f"logits differs by {100 * data['grad_rel_diff']:.2f}% (relative L2 norm over every token), cosine "
            f"{data['grad_cosine']:.6f}. KL(p_fp32 ‖ p_bf16) is the floor the bf16 rows put under the objective: a student "
            "that matched the bf16 teacher exactly would be that far from the fp32 one.\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_hidden_precision", description=__doc__.splitlines()[0])
    p.add_argument("--preset", type=Path, default=PRESET)
    p.add_argument("--problems", type=int, default=None, help="training problems sampled (default 64; --quick 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny-random models, 4 problems; writes nothing (or --out)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("overrides", nargs="*", help="key=value overrides of the preset")
    args = p.parse_args(argv)
    overrides = (["teacher.model=tiny-random", "student.model=tiny-random@1", "data.chat_template=false"]
                 if args.quick else []) + args.overrides
    n = args.problems or (4 if args.quick else 64)
    return measure_and_report("hidden_precision", lambda: measure(args.preset, n, args.seed, overrides), section_text,
                              quick=args.quick, out=args.out)


if __name__ == "__main__":
    sys.exit(main())
