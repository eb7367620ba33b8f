"""Shared prefill: each part of the main job with the tokens its rows share run once vs the plain pass,
side by side in one process, at the default preset's shapes (issue 50, ask 2).

    .venv/bin/python -m bench.bench_shared_prefill [--rounds 5] [--quick]

Workload: the preset's (configs/smollm2-cpu.yaml) first 8 training prompts in its chat template
(their first 35 tokens, of 54-68, are shared), the student (the teacher minus one layer) and
the teacher (SmolLM2-135M), fp32, on this CPU. Parts, each timed plain (`share_prefill` off) and
shared (on), interleaved in every round; medians over the rounds, the ratio the median of the
per-round ratios:

- *rollout sampling*: the worker's `generate` of 8 prompts x 2 samples, 16 new tokens, temperature 1,
  old log-probs recorded;
- *teacher scoring*: the transformers engine's scoring of those 16 sequences (top-16, bf16 hidden
  states), in chunked-prefill steps of 512 padded tokens as the CPU default (a batch whose shared work
  fits one step runs in one);
- *learner micro-batch*: forward and backward of the student over 8 of those rollouts (shuffled, as
  the learner's mini-batches are), the output projection at the response positions
  (`response_hidden`, as `train.share_prefill`);
- *evaluation sampling*: `generate` of 8 held-out prompts x 4 samples at top-p 0.8, as `eopd eval`.

And the top-p filter of one decode step ([32, V] logits of the student at the evaluation's
settings): transformers' `TopPLogitsWarper` (sorts the vocabulary) vs `Nucleus` (top-k candidates).
Each part also reports the largest difference between the two paths' outputs (sampled ids must be
equal; log-probs, statistics, hidden states and gradients to float rounding).

`--quick` (CI): tiny-random for both models, 1 round; prints, writes nothing.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.report import ROOT, markdown_table, measure_and_report


def _workload(quick: bool, tmp: Path) -> dict:
    from eopd_common.models import load_causal_lm, materialise_spec
    from eopd_trainer.config import load_config
    from eopd_trainer.data import read_records, render_prompt
    from eopd_trainer.problems.generator import write_splits

    cfg = load_config(ROOT / "configs" / "smollm2-cpu.yaml", [])
    gen = cfg.data.generate
    train, heldout = write_splits(tmp / "data", gen.train, gen.heldout, gen.seed)[:2]
    teacher_spec = "tiny-random" if quick else cfg.teacher.model
    student_spec = "tiny-random" if quick else materialise_spec(cfg.student.model, tmp / "student")
    student = load_causal_lm(student_spec)
    tok = load_causal_lm(cfg.teacher.model).tokenizer if not quick else student.tokenizer

    def prompts(path: Path, n: int) -> list[list[int]]:
        return [render_prompt(tok, r[cfg.data.field], suffix=cfg.data.suffix, chat_template=cfg.data.chat_template,
                              max_length=cfg.data.max_prompt_length) for r in read_records(path)[:n]]

    return {"cfg": cfg, "teacher_spec": teacher_spec, "student": student,
            "train": prompts(train, 8), "heldout": prompts(heldout, 8)}


def _engine(spec: str, share: bool):
    from eopd_teacher.engines.transformers_engine import TransformersEngine
    from eopd_teacher.settings import TeacherSettings

    eng = TransformersEngine(TeacherSettings(model=spec, dtype="float32", device="cpu", compile_statistics=False,
                                             prefill_chunk_tokens=512, share_prefill=share).engine_settings())
    eng.load()
    return eng


def _score(eng, items):
    out = None
    for out in eng.score_steps(items):
        pass
    return out


def measure(rounds: int, quick: bool) -> dict:
    from transformers.generation.logits_process import TopPLogitsWarper

    from eopd_common.shared_prefill import response_hidden
    from eopd_teacher.types import ScoreItem
    from eopd_trainer.rollout.samplers.nucleus import Nucleus
    from eopd_trainer.rollout.samplers.transformers_sampler import generate

    with tempfile.TemporaryDirectory() as tmp:
        w = _workload(quick, Path(tmp))
        model, tok = w["student"].model, w["student"].tokenizer
        pad = 0
        rollout_prompts = [p for p in w["train"] for _ in range(2)]
        eval_prompts = [p for p in w["heldout"] for _ in range(4)]
        samples = generate(model, tok, rollout_prompts, temperature=1.0, top_p=1.0, max_new_tokens=16, seed=0)
        items = [ScoreItem(f"s{i}", np.array(s.prompt_ids + s.response_ids, dtype=np.int64), len(s.prompt_ids), 16, 1.0,
                           hidden_dtype="bfloat16") for i, s in enumerate(samples)]
        micro = random.Random(0).sample(samples, 8)
        engines = {share: _engine(w["teacher_spec"], share) for share in (False, True)}
        head = model.get_output_embeddings()

        def rollout(share):
            out = generate(model, tok, rollout_prompts, temperature=1.0, top_p=1.0, max_new_tokens=16, seed=1,
                           record_logprobs=True, share_prefill=share)
            return [s.response_ids for s in out], np.concatenate([s.logprobs for s in out])

        def scoring(share):
            out = _score(engines[share], items)
            return None, np.concatenate([np.concatenate([o.token_logprobs, o.entropies]) for o in out])

        def learner(share):
            model.train()
            model.zero_grad(set_to_none=True)
            h = response_hidden(model, [s.prompt_ids for s in micro], [s.response_ids for s in micro], pad, "cpu",
                                share=share)
            torch.logsumexp(torch.nn.functional.linear(h, head.weight), dim=-1).mean().backward()
            model.eval()
            return None, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).numpy()

        def evaluation(share):
            out = generate(model, tok, eval_prompts, temperature=1.0, top_p=0.8, max_new_tokens=16, seed=2,
                           share_prefill=share)
            return [s.response_ids for s in out], None

        parts = {"rollout sampling": rollout, "teacher scoring": scoring, "learner micro-batch": learner,
                 "evaluation sampling": evaluation}
        times = {name: {False: [], True: []} for name in parts}
        diffs = {name: 0.0 for name in parts}
        same_ids = {name: True for name in parts}
        for _ in range(rounds):
            for name, fn in parts.items():
                got = {}
                for share in (False, True):
                    with torch.no_grad() if name != "learner micro-batch" else torch.enable_grad():
                        t = time.perf_counter()
                        got[share] = fn(share)
                        times[name][share].append(time.perf_counter() - t)
                if got[False][0] is not None:
                    same_ids[name] &= got[False][0] == got[True][0]
                if got[False][1] is not None and got[False][1].shape == got[True][1].shape:
                    diffs[name] = max(diffs[name], float(np.abs(got[False][1] - got[True][1]).max()))
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p[-1:] for p in eval_prompts])).logits[:, -1]
        warpers = {"transformers TopPLogitsWarper": TopPLogitsWarper(0.8), "Nucleus": Nucleus(1.0, 0.8)}
        top_p = {}
        for name, warper in warpers.items():
            ts = []
            for _ in range(max(3, rounds)):
                t = time.perf_counter()
                warper(None, logits.clone())
                ts.append(time.perf_counter() - t)
            top_p[name] = statistics.median(ts)
        kept = {name: torch.isfinite(warper(None, logits.clone())) for name, warper in warpers.items()}
    rows = {}
    for name in parts:
        plain, shared = times[name][False], times[name][True]
        ratios = [a / b for a, b in zip(plain, shared)]
        rows[name] = {"plain_s": statistics.median(plain), "shared_s": statistics.median(shared),
                      "speedup": statistics.median(ratios), "speedups": ratios, "max_diff": diffs[name],
                      "same_ids": same_ids[name]}
    return {"quick": quick, "rounds": rounds, "rows": rows, "top_p_s": top_p,
            "top_p_same_tokens": bool(torch.equal(*kept.values())),
            "vocab": int(logits.shape[-1]), "prompt_tokens": [len(p) for p in w["train"]]}


def section_text(d: dict) -> str:
    rows = []
    for name, r in d["rows"].items():
        spread = f" (rounds x{min(r['speedups']):.2f}..x{max(r['speedups']):.2f})" if len(r["speedups"]) > 1 else ""
        rows.append([name, f"{r['plain_s']:.3f}", f"{r['shared_s']:.3f}", f"x{r['speedup']:.2f}{spread}",
                     "yes" if r["same_ids"] else "NO", f"{r['max_diff']:.1e}"])
    tp = d["top_p_s"]
    names = list(tp)
    return "\n".join([
        "## Shared prefill: the main job's parts with shared tokens run once (`python -m bench.bench_shared_prefill`, issue 50 ask 2)", "",
        f"{d.get('machine', '?')}, load {d.get('load_avg', '?')} (1/5/15 min, start -> end). The default preset's first 8 "
        f"training prompts ({min(d['prompt_tokens'])}-{max(d['prompt_tokens'])} tokens, the chat template's first ones shared), "
        "fp32; each part timed plain and shared in every round, interleaved; medians of "
        f"{d['rounds']} rounds, the ratio the median of the per-round ratios. Rollout sampling: 8 prompts x 2 samples, 16 "
        "new tokens, old log-probs recorded; teacher scoring: those 16 sequences, top-16 and bf16 hidden states, "
        "chunked-prefill steps of 512 padded tokens; learner micro-batch: forward + backward over 8 of them and the "
        "output projection at their response positions; evaluation sampling: 8 held-out prompts x 4 samples at top-p "
        "0.8. Max difference: log-probs (rollout), log-probs and entropies (teacher), gradients (learner).", "",
        markdown_table(["part", "plain s", "shared s", "shared vs plain", "same sampled ids", "max difference"], rows), "",
        f"Top-p 0.8 filter of one decode step's [{len(d['prompt_tokens']) * 4}, {d['vocab']}] logits: "
        f"{names[0]} {tp[names[0]] * 1e3:.1f} ms, {names[1]} {tp[names[1]] * 1e3:.1f} ms "
        f"(x{tp[names[0]] / tp[names[1]]:.1f}); the same tokens kept: {'yes' if d['top_p_same_tokens'] else 'NO'}.", ""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="tiny-random, 1 round; prints, writes nothing")
    p.add_argument("--out", type=Path, default=None, help="quick: write the results JSON here")
    args = p.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    return measure_and_report("shared_prefill", lambda: measure(rounds, args.quick), section_text, quick=args.quick,
                              out=args.out)


if __name__ == "__main__":
    raise SystemExit(main())
