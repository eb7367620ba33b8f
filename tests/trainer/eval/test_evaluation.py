"""`eopd eval`'s evaluation: both gradings per sample, the headline choice, stored samples, the
teacher evaluated as itself in one pass, determinism (tiny models or a scripted sampler)."""

from __future__ import annotations

import json

import pytest

from eopd_trainer.config import EvalConfig
from eopd_trainer.rollout.samplers.base import Sample

# prompt 0 (gold 12): boxed and right, then right without a box; prompt 1 (gold 3): no number,
# then only the question's numbers echoed back (its last number, 2, is wrong).
RESPONSES = ["7 + 5 = \\boxed{12}", "7 + 5 = 12", "I do not know", "What is 1 + 2?"]


class _Tok:
    pad_token_id, eos_token_id = 0, 0

    def decode(self, ids, skip_special_tokens=True):
        return RESPONSES[ids[0]] if ids and ids[0] < len(RESPONSES) else f"prompt {ids}"


def _scripted_generate(model, tokenizer, prompts, *, temperature, top_p, max_new_tokens, seed, keep_logits=()):
    assert not keep_logits  # no teacher: no statistics, nothing recorded
    return [Sample(list(p), [seed + i], False) for i, p in enumerate(prompts)]  # response i decodes RESPONSES[i]


@pytest.mark.parametrize("headline", ["strict", "flexible"])
def test_both_gradings_and_the_headline(monkeypatch, headline):
    import eopd_trainer.eval.evaluate
    from eopd_trainer.eval.evaluate import evaluate_model, summary_line

    monkeypatch.setattr(eopd_trainer.eval.evaluate, "generate", _scripted_generate)
    ecfg = EvalConfig(n_samples=2, batch_size=8, headline=headline)
    r = evaluate_model(None, _Tok(), None, [[101], [102]], ["12", "3"], ecfg, seed=0,
                       prompt_texts=["What is 7 + 5?", "What is 1 + 2?"])
    assert r["strict"] == {"avg_at_k": 0.25, "pass_at_k": {"1": 0.25, "2": 0.5}, "boxed_frac": 0.25}
    assert r["flexible"] == {"avg_at_k": 0.5, "pass_at_k": {"1": 0.5, "2": 0.5}}
    assert r["headline"] == headline
    assert (r["avg_at_k"], r["pass_at_k"]) == (r[headline]["avg_at_k"], r[headline]["pass_at_k"])
    assert r["number_frac"] == 0.75 and r["boxed_frac"] == 0.25
    # per prompt, in order, the headline's correct responses out of n: a reader can split the set
    assert r["correct_per_prompt"] == {"strict": [1, 0], "flexible": [2, 0]}[headline]
    assert r["samples"] == [
        {"prompt": "What is 7 + 5?", "answer": "12", "response": RESPONSES[0], "correct": True,
         "correct_strict": True, "correct_flexible": True},
        {"prompt": "What is 1 + 2?", "answer": "3", "response": RESPONSES[2], "correct": False,
         "correct_strict": False, "correct_flexible": False},
    ]
    assert [e["response"] for e in r["examples"]] == [RESPONSES[0], RESPONSES[2]]
    assert "tokens" not in r  # no teacher: no entropy / KL statistics
    other = "flexible" if headline == "strict" else "strict"
    assert summary_line("m", r) == (f"m: avg@2 {r['avg_at_k']:.3f} pass@2 0.500 ({headline}; {other} avg@2 "
                                    f"{r[other]['avg_at_k']:.3f})")


def test_samples_are_the_first_eight_prompts(monkeypatch):
    import eopd_trainer.eval.evaluate
    from eopd_trainer.eval.evaluate import evaluate_model

    monkeypatch.setattr(eopd_trainer.eval.evaluate, "generate", _scripted_generate)
    r = evaluate_model(None, _Tok(), None, [[100 + i] for i in range(10)], ["1"] * 10,
                       EvalConfig(n_samples=1, batch_size=4), seed=0)
    assert len(r["samples"]) == 8 and len(r["examples"]) == 3
    assert r["samples"][5]["prompt"] == "prompt [105]"  # no prompt_texts: the decoded prompt


def test_summary_line_reads_old_results():
    from eopd_trainer.eval.evaluate import summary_line

    old = {"n_samples": 4, "avg_at_k": 0.25, "pass_at_k": {"1": 0.25, "4": 0.5}}
    assert summary_line("final", old) == "final: avg@4 0.250 pass@4 0.500 (strict)"


def test_the_teacher_evaluated_as_itself_runs_once_and_is_deterministic(monkeypatch):
    import eopd_trainer.eval.kl
    from eopd_common.models import load_causal_lm
    from eopd_trainer.data import render_prompt
    from eopd_trainer.eval.evaluate import evaluate_model

    teacher = load_causal_lm("tiny-random@0")
    prompts = [render_prompt(teacher.tokenizer, q) for q in ("What is 2 + 2?", "What is 3 * 3?")]
    ecfg = EvalConfig(n_samples=2, max_new_tokens=6, batch_size=4)

    def two_models(*a, **k):
        raise AssertionError("the teacher as its own teacher must take the one-model path")

    monkeypatch.setattr(eopd_trainer.eval.kl, "position_log_probs", two_models)
    # fp32: its log-distributions are the logits recorded while sampling, no pass over its samples at all
    monkeypatch.setattr(eopd_trainer.eval.kl, "_response_log_probs", two_models)
    r = evaluate_model(teacher.model, teacher.tokenizer, teacher.model, prompts, ["4", "9"], ecfg)
    assert r["forward_kl"] == 0.0 and r["reverse_kl"] == 0.0 and r["tokens"] > 0
    assert r["entropy_hist_student"] == r["entropy_hist_teacher"]
    assert r["entropy_mean_student"] == r["entropy_mean_teacher"]
    again = evaluate_model(teacher.model, teacher.tokenizer, teacher.model, prompts, ["4", "9"], ecfg)
    assert json.dumps(again, sort_keys=True) == json.dumps(r, sort_keys=True)  # seeded: repeatable


def test_evaluate_run_loads_the_teacher_once(tmp_path, monkeypatch):
    import eopd_common.models
    import eopd_trainer.eval.evaluate
    from eopd_trainer.eval.evaluate import evaluate_run

    from tests.procs import ROOT

    (tmp_path / "run.yaml").write_text(
        "teacher:\n  model: tiny-random@0\nstudent:\n  model: tiny-random@1\n"
        f"data:\n  train_files: [{ROOT / 'tests/data/tiny_prompts.jsonl'}]\n"
        f"  eval_files: [{ROOT / 'tests/data/tiny_heldout.jsonl'}]\n  field: prompt\n"
        "eval:\n  n_samples: 1\n  max_new_tokens: 4\n  max_prompts: 2\n  cache: false\n")  # every model evaluated
    loads = []
    real = eopd_common.models.load_causal_lm
    monkeypatch.setattr(eopd_trainer.eval.evaluate, "load_causal_lm", lambda spec, **k: loads.append(spec) or real(spec, **k))
    result = evaluate_run(tmp_path, ["teacher", "initial", "tiny-random@0"], names=["teacher", "initial", "t2"])
    assert loads == ["tiny-random@0", "tiny-random@1"]  # the teacher (also named by its spec) once
    models = result["models"]
    assert list(models) == ["teacher", "initial", "t2"]
    assert models["teacher"]["reverse_kl"] == 0.0 and models["t2"]["forward_kl"] == 0.0
    assert models["initial"]["reverse_kl"] > 0
    assert models["teacher"]["samples"][0]["prompt"] == "What is 10 + 38?"
    assert json.loads((tmp_path / "eval.json").read_text())["models"].keys() == models.keys()


def test_statistics_from_the_recorded_logits_are_those_of_a_second_pass(monkeypatch):
    """fp32: the model's log-distributions on its own samples come from the logits `generate`
    recorded (only the teacher runs over the samples); every statistic equals the one computed
    from a second forward pass of the model over the same samples (the path bf16 models take),
    to float rounding, and the sampled responses are the same."""
    import eopd_trainer.eval.evaluate
    import eopd_trainer.eval.kl
    from eopd_common.models import load_causal_lm
    from eopd_trainer.data import render_prompt
    from eopd_trainer.eval.evaluate import evaluate_model

    student, teacher = load_causal_lm("tiny-random@1"), load_causal_lm("tiny-random@0")
    questions = ("What is 2 + 2?", "What is 3 * 3?", "What is 10 - 7?")
    prompts = [render_prompt(student.tokenizer, q) for q in questions]
    ecfg = EvalConfig(n_samples=3, max_new_tokens=6, batch_size=4)  # firsts fall in every batch, at varying rows
    passes = []
    real = eopd_trainer.eval.kl._response_log_probs
    monkeypatch.setattr(eopd_trainer.eval.kl, "_response_log_probs",
                        lambda model, *a: passes.append(model) or real(model, *a))
    got = evaluate_model(student.model, student.tokenizer, teacher.model, prompts, ["4", "9", "3"], ecfg)
    assert passes and all(m is teacher.model for m in passes)  # the student is never run again
    passes.clear()
    monkeypatch.setattr(eopd_trainer.eval.evaluate, "records_logits", lambda model: False)
    want = evaluate_model(student.model, student.tokenizer, teacher.model, prompts, ["4", "9", "3"], ecfg)
    assert student.model in passes and teacher.model in passes
    assert got["samples"] == want["samples"] and got["correct_per_prompt"] == want["correct_per_prompt"]
    assert got["tokens"] == want["tokens"] > 0
    assert got["entropy_hist_student"] == want["entropy_hist_student"]
    assert got["entropy_hist_teacher"] == want["entropy_hist_teacher"]
    for key in ("entropy_mean_student", "entropy_mean_teacher", "forward_kl", "reverse_kl", "fkl_high_entropy",
                "high_entropy_share_student", "high_entropy_share_teacher"):
        assert got[key] == pytest.approx(want[key], abs=1e-5), key


def test_generate_records_the_logits_of_the_kept_samples(monkeypatch):
    """`generate(keep_logits=...)`: the kept samples carry their response positions' raw logits
    [len(response), V], which a full forward pass over the sequence reproduces (fp32, ~1e-5); the
    others carry none; `recorded_log_probs` refuses samples without them."""
    import torch
    from eopd_common.models import load_causal_lm
    from eopd_trainer.data import render_prompt
    from eopd_trainer.eval.kl import _response_log_probs, recorded_log_probs
    from eopd_trainer.rollout.samplers.transformers_sampler import generate

    lm = load_causal_lm("tiny-random@1")
    prompts = [render_prompt(lm.tokenizer, q) for q in ("What is 2 + 2?", "What is 13 * 3?")]
    batch = [prompts[0], prompts[0], prompts[1], prompts[1]]
    samples = generate(lm.model, lm.tokenizer, batch, temperature=1.0, top_p=0.8, max_new_tokens=7, seed=3,
                       keep_logits=[0, 3])
    assert samples[1].logits is None and samples[2].logits is None
    vocab = lm.model.get_output_embeddings().weight.shape[0]
    for s in (samples[0], samples[3]):
        assert s.logits.shape == (len(s.response_ids), vocab) and s.logits.dtype == torch.float32
    kept = [samples[0], samples[3]]
    (ls, lt), = recorded_log_probs(None, kept, lm.tokenizer.pad_token_id, 8)
    assert lt is ls and ls.dtype == torch.float64
    again = _response_log_probs(lm.model, kept, lm.tokenizer.pad_token_id, 1.0)
    assert (ls - again).abs().max() < 1e-4
    plain = generate(lm.model, lm.tokenizer, batch, temperature=1.0, top_p=0.8, max_new_tokens=7, seed=3)
    assert [s.response_ids for s in plain] == [s.response_ids for s in samples]  # recording changes no sample
    with pytest.raises(ValueError, match="every sample must carry the logits"):
        next(recorded_log_probs(None, samples[:2], lm.tokenizer.pad_token_id, 8))
