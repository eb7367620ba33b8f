"""How the smollm2-cpu preset's student and prompt were chosen (docs/run.md): held-out accuracy of
the teacher and of pruned copies of it, on the preset's task family and prompt, sampled as `eopd
eval` samples (temperature 1.0, top-p 0.8), graded on the last number (flexible).

    .venv/bin/python scripts/probe_students.py [--drops "14;20;4,16"] [--config configs/smollm2-cpu.yaml]
        [--prompts 40] [--samples 2] [key=value ...]

Each `--drops` entry is a comma-separated list of decoder layers removed (`smollm2-135m[drop=...]`);
"" is the teacher itself. Overrides apply to the preset, e.g. `data.chat_template=true` for the
model's own chat template without the worked example. It samples problems from the preset's
TRAINING split, never the held-out one: choosing with it does not tune on held-out problems.
"""

from __future__ import annotations

import argparse
import time

import torch

from eopd_common.models import load_causal_lm
from eopd_trainer.config import load_config
from eopd_trainer.data import render_prompt
from eopd_trainer.problems.grading import is_correct
from eopd_trainer.problems.generator import make_splits
from eopd_trainer.rollout.samplers.transformers_sampler import generate


def pruned(model, dropped: list[int]):
    import copy

    m = copy.deepcopy(model)
    keep = [i for i in range(len(m.model.layers)) if i not in dropped]
    m.model.layers = torch.nn.ModuleList([m.model.layers[i] for i in keep])
    for j, layer in enumerate(m.model.layers):
        layer.self_attn.layer_idx = j
    m.config.num_hidden_layers = len(keep)
    return m


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/smollm2-cpu.yaml")
    p.add_argument("--drops", default=";14", help="';'-separated layer lists; '' = the teacher")
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    cfg = load_config(args.config, args.overrides)
    gen = cfg.data.generate
    train, _ = make_splits(gen.train, gen.heldout, gen.seed)[:2]
    problems = train[: args.prompts]  # the training split: the choice never looks at held-out problems
    teacher = load_causal_lm(cfg.teacher.model)
    tok = teacher.tokenizer
    prompts = [render_prompt(tok, r[cfg.data.field], suffix=cfg.data.suffix, chat_template=cfg.data.chat_template,
                             max_length=cfg.data.max_prompt_length) for r in problems]
    flat = [pr for pr in prompts for _ in range(args.samples)]
    answers = [r["answer"] for r in problems for _ in range(args.samples)]
    print(f"{len(problems)} training problems x {args.samples} samples, prompt {len(prompts[0])} tokens")
    for spec in args.drops.split(";"):
        dropped = [int(x) for x in spec.split(",") if x.strip()]
        model = pruned(teacher.model, dropped) if dropped else teacher.model
        t0 = time.monotonic()
        samples = []
        for start in range(0, len(flat), 32):
            samples += generate(model, tok, flat[start : start + 32], temperature=cfg.eval.temperature,
                                top_p=cfg.eval.top_p, max_new_tokens=cfg.eval.max_new_tokens, seed=start)
        texts = [tok.decode(s.response_ids, skip_special_tokens=True) for s in samples]
        acc = sum(is_correct(t, a, "flexible") for t, a in zip(texts, answers, strict=True)) / len(texts)
        name = f"drop {spec}" if dropped else "teacher"
        print(f"{name:>16}: flexible accuracy {acc:.3f}  ({time.monotonic() - t0:.0f} s)  e.g. {texts[0]!r} "
              f"{texts[2]!r}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
