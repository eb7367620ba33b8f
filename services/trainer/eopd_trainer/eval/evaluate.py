"""`eopd eval`: accuracy and distance to the teacher on the held-out prompts.

    eopd eval --run-dir RUN_DIR [--model final|initial|teacher|SPEC ...] [key=value ...]

For each model, on every held-out prompt (records with `prompt` and `answer`, e.g. from
`eopd_trainer.problems.generator`), `eval.n_samples` responses at temperature 1.0 and top-p 0.8 (the paper's
evaluation), each graded twice by `grading.grade` (math-verify against the gold answer):
**strict** (the last `\\boxed{}`) and **flexible** (the response's last number, as
lm-evaluation-harness's GSM8K flexible-extract).

- `strict` / `flexible`: `avg_at_k` (mean accuracy over all samples) and `pass_at_k[k]` (the
  unbiased estimator, k = 1, 2, 4, ..., n, averaged over prompts) of each grading; `strict` also
  has `boxed_frac`, and `number_frac` is the share of responses with any number;
- `avg_at_k` / `pass_at_k` at the top level: those of the headline grading (`headline`, from
  `eval.headline`, "strict" by default), what the report and older consumers read;
- `samples`: for the first 8 prompts, the prompt text, the gold answer, the model's first
  response and its gradings (the report's side-by-side table); `examples`: the first 3 (kept for
  older consumers);
- on the first sample of each prompt (the model's own response), at every response position, the
  exact next-token entropies of the model and of the teacher (`kl.paired_log_probs`, full
  vocabulary): their histograms (paper fig. 3), the share of tokens with entropy >= 1.0, the
  forward KL(teacher || model) averaged over positions where the teacher's entropy >= tau
  (`eval.high_entropy`), and the reverse/forward KL over all positions. An fp32 model's
  log-distributions come from the logits recorded while it sampled (`kl.recorded_log_probs`; a bf16
  one is run again over its samples), the teacher's from its forward pass over them; when the model
  evaluated is the teacher itself, its recorded logits serve as both (KL 0, the same entropies).

Sampling is seeded (`seed + 1234`, per batch), so an evaluation is repeatable. Results are merged
into `<run_dir>/eval.json` under the model's name.

An evaluation whose model files, teacher, data, eval settings, seed and code are those of one made
before is reused from the eval cache (`eval.cache`, on by default; `cache.py`, under
`$EOPD_CACHE_DIR/evals`) instead of being made again: its record says `cache: {key, reused: true}`
and its summary line "reused from cache KEY". `RunEvaluator` loads the teacher once and each model
once for all the sets it is evaluated on.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from eopd_common.models import load_causal_lm, pad_token_id

from ..config import ConfigError, EvalConfig
from ..data import read_records, render_prompt
from ..rollout.samplers.transformers_sampler import generate
from ..problems.grading import avg_at_k, extract_last_number, grade, pass_at_k
from .cache import EvalCache, code_fingerprint, eval_key, file_sha256, key_fields, model_fingerprint
from .kl import paired_log_probs, recorded_log_probs
from .runs import EvalSet, eval_path, resolve_model, run_config, summary_line

#: The eval settings an evaluation's numbers depend on (the `sampling` field of its cache key).
SAMPLING_SETTINGS = {"n_samples", "temperature", "top_p", "max_new_tokens", "max_prompts", "batch_size",
                     "high_entropy", "headline"}
HIST_BINS = np.linspace(0.0, 10.0, 51)  # nats


def ks_for(n: int) -> list[int]:
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


N_SAMPLES_SHOWN = 8  # prompts whose first response is stored under `samples`


def _accuracy(correct: list[bool], n: int) -> dict:
    """Avg@n and Pass@k (k = 1, 2, 4, ..., n) of per-sample outcomes, n samples per prompt in a row."""
    per_prompt = [correct[i : i + n] for i in range(0, len(correct), n)]
    return {"avg_at_k": float(np.mean([avg_at_k(c) for c in per_prompt])),
            "pass_at_k": {str(k): float(np.mean([pass_at_k(n, sum(c), k) for c in per_prompt])) for k in ks_for(n)}}


@torch.no_grad()
def evaluate_model(model, tokenizer, teacher, prompts: list[list[int]], answers: list[str], ecfg: EvalConfig, *,
                   seed: int = 1234, prompt_texts: list[str] | None = None) -> dict:
    """The evaluation of one model (see the module docstring). `teacher` may be None (no entropy
    or KL statistics) or `model` itself (no second pass). `prompt_texts` label `samples` (default: the
    decoded prompts)."""
    n = ecfg.n_samples
    flat = [p for p in prompts for _ in range(n)]
    recorded = teacher is not None and records_logits(model)
    samples, pairs = [], []
    for start in range(0, len(flat), ecfg.batch_size):
        batch = flat[start : start + ecfg.batch_size]
        keep = [i for i in range(len(batch)) if (start + i) % n == 0] if recorded else ()
        got = generate(model, tokenizer, batch, temperature=ecfg.temperature, top_p=ecfg.top_p,
                       max_new_tokens=ecfg.max_new_tokens, seed=seed + start, keep_logits=keep)
        if recorded:
            firsts = [got[i] for i in keep]
            pairs.extend(_entropies_and_kls(recorded_log_probs(None if teacher is model else teacher, firsts,
                                                               pad_token_id(tokenizer), max(1, ecfg.batch_size // 2))))
            got = [replace(sample, logits=None) for sample in got]  # [positions, V] each: not kept
        samples.extend(got)
    texts = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
    grades = [grade(t, answers[i // n]) for i, t in enumerate(texts)]
    strict = _accuracy([g["strict"] for g in grades], n)
    flexible = _accuracy([g["flexible"] for g in grades], n)
    boxed_frac = float(np.mean(["\\boxed" in t for t in texts]))
    head = ecfg.headline
    shown = []
    for i in range(min(N_SAMPLES_SHOWN, len(prompts))):
        g = grades[i * n]
        text = prompt_texts[i] if prompt_texts else tokenizer.decode(prompts[i], skip_special_tokens=True)
        shown.append({"prompt": text, "answer": answers[i], "response": texts[i * n], "correct": g[head],
                      "correct_strict": g["strict"], "correct_flexible": g["flexible"]})
    out: dict = {
        "n_samples": n, "prompts": len(prompts),
        "headline": head,
        **(strict if head == "strict" else flexible),
        "strict": {**strict, "boxed_frac": boxed_frac},
        "flexible": flexible,
        "number_frac": float(np.mean([extract_last_number(t) is not None for t in texts])),
        "response_length_mean": float(np.mean([len(s.response_ids) for s in samples])),
        "truncated_frac": float(np.mean([s.truncated for s in samples])),
        "boxed_frac": boxed_frac,
        "samples": shown,
        "examples": [{k: s[k] for k in ("response", "answer", "correct")} for s in shown[:3]],
        # per prompt, in the data's order: how many of its n responses are correct (headline grading);
        # lets a reader split the set (e.g. problems a run trained on or not, scripts/layout_ablation.py)
        "correct_per_prompt": [int(sum(g[head] for g in grades[i : i + n])) for i in range(0, len(grades), n)],
    }
    if teacher is None:
        return out
    if not recorded:
        pairs = _entropies_and_kls(paired_log_probs(model, teacher, samples[::n], pad_token_id(tokenizer),
                                                    max(1, ecfg.batch_size // 2)))
    hs, ht, fkl, rkl = (torch.cat([p[i] for p in pairs]).numpy() for i in range(4))
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


def records_logits(model) -> bool:
    """Whether the model's log-distributions on its own samples (the entropy and KL statistics) come
    from the logits recorded while sampling (fp32: decode steps agree with a forward pass to ~1e-5),
    used batch by batch, rather than from a second forward pass over the samples (bf16, fp16)."""
    return next(model.parameters()).dtype == torch.float32


def _entropies_and_kls(pairs) -> list[tuple[torch.Tensor, ...]]:
    """Per `(ls, lt)` pair of log-distributions [positions, V]: the model's and the teacher's
    entropies, the forward KL(teacher || model) and the reverse KL, each [positions]."""
    out = []
    for ls, lt in pairs:
        ps, pt = ls.exp(), lt.exp()
        out.append((-(ps * ls).sum(-1), -(pt * lt).sum(-1), (pt * (lt - ls)).sum(-1), (ps * (ls - lt)).sum(-1)))
    return out


class RunEvaluator:
    """Evaluates models of one run on one or more sets. The teacher is loaded at most once, and only
    when an evaluation is computed; a model is loaded once for all its sets, and not at all when every
    one of them is in the eval cache (`eval.cache`, `cache.py`), whose result is then reused, marked
    `cache: {key, reused: true}`."""

    def __init__(self, run_dir: Path, overrides: list[str] = (), *, cache: EvalCache | None = None):
        self.run_dir = Path(run_dir)
        self.cfg = run_config(self.run_dir, overrides)
        self.cache = cache if cache is not None else (EvalCache() if self.cfg.eval.cache else None)
        self._teacher = None
        self._fingerprints: dict[str, str] = {}
        self._records: dict[EvalSet, list[dict]] = {}

    def records(self, s: EvalSet) -> list[dict]:
        if s not in self._records:
            records = [r for f in s.files for r in read_records(f)]
            if self.cfg.eval.max_prompts:
                records = records[: self.cfg.eval.max_prompts]
            if not records or "answer" not in records[0]:
                raise ConfigError("eval needs held-out records with an `answer` field (data.eval_files)")
            self._records[s] = records
        return self._records[s]

    def teacher(self):
        if self._teacher is None and self.cfg.teacher.model:
            self._teacher = load_causal_lm(self.cfg.teacher.model)
        return self._teacher

    def fingerprint(self, spec: str) -> str:
        if spec not in self._fingerprints:
            self._fingerprints[spec] = model_fingerprint(spec)
        return self._fingerprints[spec]

    def key(self, spec: str, s: EvalSet) -> tuple[str, dict]:
        cfg = self.cfg
        data = cfg.data
        fields = key_fields(
            model=self.fingerprint(spec), teacher=self.fingerprint(cfg.teacher.model) if cfg.teacher.model else None,
            data_files=[file_sha256(Path(f)) for f in s.files],
            prompts={"field": data.field, "suffix": data.suffix, "chat_template": data.chat_template,
                     "max_prompt_length": data.max_prompt_length},
            sampling=cfg.eval.model_dump(mode="json", include=SAMPLING_SETTINGS), seed=cfg.seed + 1234,
            code=code_fingerprint())
        return eval_key(fields), fields

    def evaluate(self, name: str, sets: list[EvalSet], label: str | None = None) -> dict[str | None, dict]:
        """`name` (final, initial, teacher or a spec) on each set, merged into each set's eval file
        under `label` (default `name`); returns each set's result."""
        cfg, label = self.cfg, label or name
        spec = resolve_model(name, self.run_dir, cfg)
        results, todo = {}, []
        for s in sets:
            self.records(s)  # a set without answers fails before any model is loaded
            key, fields = self.key(spec, s) if self.cache else (None, None)
            entry = self.cache.get(key) if self.cache else None
            if entry is None:
                todo.append((s, key, fields))
                continue
            r = {**entry["result"], "model": spec, "cache": {"key": key, "reused": True, "created": entry["created"]}}
            self._write(s, label, r)
            results[s.name] = r
        if todo:
            teacher = self.teacher()
            is_teacher = teacher is not None and (name == "teacher" or spec == cfg.teacher.model)
            loaded = teacher if is_teacher else load_causal_lm(spec)  # the teacher is loaded (and run) once
            for s, key, fields in todo:
                records = self.records(s)
                prompts = [render_prompt(loaded.tokenizer, r[cfg.data.field], suffix=cfg.data.suffix,
                                         chat_template=cfg.data.chat_template, max_length=cfg.data.max_prompt_length)
                           for r in records]
                t0 = time.monotonic()
                r = evaluate_model(loaded.model, loaded.tokenizer, teacher.model if teacher else None, prompts,
                                   [str(r["answer"]) for r in records], cfg.eval, seed=cfg.seed + 1234,
                                   prompt_texts=[str(r[cfg.data.field]) for r in records])
                r.update(model=spec, eval_s=time.monotonic() - t0)
                if self.cache:
                    self.cache.put(key, fields, r)
                    r["cache"] = {"key": key, "reused": False}
                self._write(s, label, r)
                results[s.name] = r
        return {s.name: results[s.name] for s in sets}

    def _write(self, s: EvalSet, label: str, r: dict) -> None:
        path = eval_path(self.run_dir, s.name)
        result = json.loads(path.read_text()) if path.is_file() else {"models": {}}
        result["data"] = [str(f) for f in s.files]
        result["eval"] = self.cfg.eval.model_dump(mode="json")
        result["models"][label] = r
        path.write_text(json.dumps(result, indent=1))
        where = f" [{s.name}]" if s.name else ""
        took = "" if r.get("cache", {}).get("reused") else f" ({r['eval_s']:.0f} s)"  # reused: its line says so
        print(f"eopd eval{where}: {summary_line(label, r)}{took}", file=sys.stderr)


def evaluate_run(run_dir: Path, models: list[str], overrides: list[str] = (), *, names: list[str] | None = None,
                 data_files: list[Path] | None = None, set_name: str | None = None) -> dict:
    """Evaluates `models` on the run's held-out files (or on `data_files`, results then in
    `eval-<set_name>.json`: e.g. an independent held-out set written differently)."""
    if (data_files is None) != (set_name is None):
        raise ConfigError("give both a data file and a set name (--data FILE --set NAME), or neither")
    if set_name is not None and (not set_name or not all(c.isalnum() or c in "-_" for c in set_name)):
        raise ConfigError(f"set name {set_name!r}: use letters, digits, '-' and '_'")
    evaluator = RunEvaluator(run_dir, overrides)
    s = EvalSet(set_name, tuple(Path(f) for f in (data_files or evaluator.cfg.data.eval_files)))
    for i, name in enumerate(models):
        evaluator.evaluate(name, [s], label=names[i] if names else name)
    return json.loads(eval_path(run_dir, set_name).read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="eopd eval", description="Avg@k / Pass@k, entropies and KL to the teacher on "
                                "the held-out prompts of a run; results merged into <run_dir>/eval.json.")
    p.add_argument("--run-dir", type=Path, required=True, help="a run directory (its run.yaml gives data and teacher)")
    p.add_argument("--model", action="append", default=None,
                   help="final (default), initial, teacher, a local model directory or a spec; repeatable")
    p.add_argument("--name", action="append", default=None, help="label of each --model in eval.json")
    p.add_argument("--data", type=Path, action="append", default=None,
                   help="evaluate on these JSONL files (records with the run's prompt field and `answer`) instead of "
                   "the run's held-out split; needs --set")
    p.add_argument("--set", dest="set_name", default=None,
                   help="name of that set: results go to <run_dir>/eval-<set>.json (the report shows them)")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the run config (e.g. eval.n_samples=8)")
    args = p.parse_args(argv)
    models = args.model or ["final"]
    if args.name and len(args.name) != len(models):
        print("eopd eval: give one --name per --model", file=sys.stderr)
        return 2
    try:
        evaluate_run(args.run_dir, models, args.overrides, names=args.name, data_files=args.data,
                     set_name=args.set_name)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"eopd eval: {exc}", file=sys.stderr)
        return 2
    return 0
