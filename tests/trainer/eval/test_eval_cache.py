"""The evaluation cache (eval/cache.py): every field of the key changes it, the fingerprints follow
file contents, entries round-trip and a corrupt one is a miss; `RunEvaluator` reuses an entry
without loading the model and `eval.cache=false` turns the cache off (tiny models)."""

from __future__ import annotations

import copy
import json

import pytest

from eopd_trainer.config import EvalConfig
from eopd_trainer.eval.cache import EvalCache, code_fingerprint, dir_sha256, eval_key, key_fields, model_fingerprint
from eopd_trainer.eval.evaluate import SAMPLING_SETTINGS
from tests.procs import ROOT

BASE = key_fields(model="dir=aa", teacher="dir=bb", data_files=["cc"],
                  prompts={"field": "prompt", "suffix": " box it", "chat_template": True, "max_prompt_length": 1024},
                  sampling=EvalConfig().model_dump(mode="json", include=SAMPLING_SETTINGS), seed=1234,
                  code={"version": 1, "sources": "dd", "torch": "2.13.0", "transformers": "5.0", "math-verify": "0.8"})


def _leaves(d: dict, prefix=()):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _leaves(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def _changed(v):
    if isinstance(v, bool):
        return not v
    if isinstance(v, (int, float)):
        return v + 1 if not isinstance(v, float) else v / 2
    if isinstance(v, list):
        return v + ["ee"]
    return None if v is None else f"{v}x"


@pytest.mark.parametrize("path", [p for p, _ in _leaves(BASE)], ids=lambda p: ".".join(p))
def test_every_field_changes_the_key(path):
    fields = copy.deepcopy(BASE)
    node = fields
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = _changed(node[path[-1]])
    assert fields != BASE
    assert eval_key(fields) != eval_key(BASE)
    assert eval_key(copy.deepcopy(BASE)) == eval_key(BASE)  # and nothing else does


def test_the_teacher_absent_is_a_key_of_its_own():
    assert eval_key({**BASE, "teacher": None}) != eval_key(BASE)


def test_the_key_covers_every_setting_behind_the_numbers():
    # a new EvalConfig field must either change the numbers (then it is in the key) or be listed here
    not_numbers = {"enabled", "variants", "models", "cache"}
    assert set(EvalConfig.model_fields) == SAMPLING_SETTINGS | not_numbers
    for name in SAMPLING_SETTINGS:
        assert name in BASE["sampling"]


def test_fingerprints_follow_file_contents(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    first = model_fingerprint(str(model))
    assert first == model_fingerprint(str(model)) == f"dir={dir_sha256(model)}"
    (model / "model.safetensors").write_bytes(b"\1" + b"\0" * 63)  # same size, other weights
    assert model_fingerprint(str(model)) != first
    assert model_fingerprint("tiny-random@0") != model_fingerprint("tiny-random@1")
    code = code_fingerprint()
    assert code["version"] >= 1 and len(code["sources"]) == 64 and code["torch"] != "absent"


def test_entries_round_trip_and_a_corrupt_one_is_a_miss(tmp_path):
    cache = EvalCache(tmp_path / "evals")
    key = eval_key(BASE)
    assert cache.get(key) is None
    cache.put(key, BASE, {"avg_at_k": 0.25})
    entry = cache.get(key)
    assert entry["result"] == {"avg_at_k": 0.25} and entry["fields"] == BASE and entry["key"] == key
    cache.path(key).write_text("{not json")
    assert cache.get(key) is None
    cache.path("other").write_text(json.dumps({**entry, "key": key}))  # an entry under another name
    assert cache.get("other") is None


def _run_dir(tmp_path, extra: str = "") -> None:
    (tmp_path / "run.yaml").write_text(
        "teacher:\n  model: tiny-random@0\nstudent:\n  model: tiny-random@1\n"
        f"data:\n  train_files: [{ROOT / 'tests/data/tiny_prompts.jsonl'}]\n"
        f"  eval_files: [{ROOT / 'tests/data/tiny_heldout.jsonl'}]\n  field: prompt\n"
        f"eval:\n  n_samples: 1\n  max_new_tokens: 4\n  max_prompts: 2\n{extra}")


def test_run_evaluator_reuses_the_cache_without_loading(tmp_path, monkeypatch):
    import eopd_common.models
    import eopd_trainer.eval.evaluate
    from eopd_trainer.eval.evaluate import EvalSet, RunEvaluator

    _run_dir(tmp_path)
    loads = []
    real = eopd_common.models.load_causal_lm
    monkeypatch.setattr(eopd_trainer.eval.evaluate, "load_causal_lm", lambda spec, **k: loads.append(spec) or real(spec, **k))
    cache = EvalCache(tmp_path / "evals")
    heldout = EvalSet(None, (ROOT / "tests/data/tiny_heldout.jsonl",))
    reversed_file = tmp_path / "reversed.jsonl"
    reversed_file.write_text("".join(reversed((ROOT / "tests/data/tiny_heldout.jsonl").read_text().splitlines(True))))
    other = EvalSet("reversed", (reversed_file,))
    first = RunEvaluator(tmp_path, cache=cache).evaluate("initial", [heldout, other])
    assert loads == ["tiny-random@0", "tiny-random@1"]  # the teacher (KL columns) and the model, once for both sets
    assert first[None]["cache"]["reused"] is False and first["reversed"]["cache"]["reused"] is False
    assert first[None]["cache"]["key"] != first["reversed"]["cache"]["key"]  # other data, other key
    assert (tmp_path / "eval.json").is_file() and (tmp_path / "eval-reversed.json").is_file()
    loads.clear()
    again = RunEvaluator(tmp_path, cache=cache).evaluate("initial", [heldout])[None]
    assert loads == []  # nothing loaded
    assert again["cache"]["reused"] and again["cache"]["key"] == first[None]["cache"]["key"]
    strip = lambda r: {k: v for k, v in r.items() if k != "cache"}  # noqa: E731
    assert strip(again) == strip(first[None])
    assert "reused from cache" in eopd_trainer.eval.evaluate.summary_line("initial", again)
    # another seed is another evaluation
    seeded = RunEvaluator(tmp_path, ["seed=7"], cache=cache).evaluate("initial", [heldout])[None]
    assert not seeded["cache"]["reused"] and loads == ["tiny-random@0", "tiny-random@1"]


def test_eval_cache_false_turns_it_off(tmp_path, monkeypatch):
    from eopd_trainer.eval.evaluate import EvalSet, RunEvaluator

    monkeypatch.setenv("EOPD_CACHE_DIR", str(tmp_path / "cache"))
    _run_dir(tmp_path, "  cache: false\n")
    heldout = EvalSet(None, (ROOT / "tests/data/tiny_heldout.jsonl",))
    evaluator = RunEvaluator(tmp_path)
    assert evaluator.cache is None
    r = evaluator.evaluate("teacher", [heldout])[None]
    assert "cache" not in r and not (tmp_path / "cache" / "evals").exists()
