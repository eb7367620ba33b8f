"""`eopd_common.model_dirs`: the Hugging Face directory of a model spec (the tiny-random preset
saved once, bit-identical to the in-process model, named as the transformers engine names it) and
what is read from it (`read_model_config`, `safetensors_index`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import eopd_common.model_dirs as model_dirs
from eopd_common.model_dirs import materialise_model_dir, read_model_config, safetensors_index
from eopd_common.models import build_tiny_random, default_cache_dir, dir_revision, load_causal_lm, smollm2_dir


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def tiny_dir(cache):
    path, name, revision = materialise_model_dir("tiny-random@3", cache)
    return path, name, revision


def test_tiny_random_is_saved_once_and_named_as_the_transformers_engine_names_it(tiny_dir, cache, monkeypatch):
    path, name, revision = tiny_dir
    assert path.parent == cache and path.name.startswith("tiny-random-3-")  # + a hash of its config
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    lm = load_causal_lm("tiny-random@3", cache_dir=cache)  # what TransformersEngine.load reports
    assert (name, revision) == (lm.name, lm.revision) == ("tiny-random@3", "tiny-random:seed=3")

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the tiny-random directory was built again")

    monkeypatch.setattr(model_dirs, "build_tiny_random", no_rebuild)
    assert materialise_model_dir("tiny-random@3", cache) == tiny_dir
    assert not list(cache.glob(".tiny-random-*.tmp*"))  # no temporary directory left behind


def test_tiny_random_dir_holds_the_in_process_model(tiny_dir):
    path, _, _ = tiny_dir
    saved = load_file(path / "model.safetensors")
    built = build_tiny_random(read_model_config(path)["vocab_size"], seed=3).state_dict()
    assert saved.keys() == built.keys()
    assert all(torch.equal(saved[k], built[k]) for k in built)
    other, _, _ = materialise_model_dir("tiny-random@4", path.parent)  # another seed, another directory
    assert other != path and not torch.equal(load_file(other / "model.safetensors")["lm_head.weight"], saved["lm_head.weight"])


def test_a_model_directory_is_used_where_it_is(tiny_dir, cache):
    path, _, _ = tiny_dir
    assert materialise_model_dir(str(path), cache) == (path, str(path), dir_revision(path))
    lm = load_causal_lm(str(path), cache_dir=cache)
    assert (lm.name, lm.revision) == (str(path), dir_revision(path))


def test_read_model_config(tiny_dir):
    path, _, _ = tiny_dir
    config = read_model_config(path)
    assert config == json.loads((path / "config.json").read_text())
    assert config["hidden_size"] == 64 and config["tie_word_embeddings"] is False


def test_safetensors_index(tiny_dir, tmp_path):
    path, _, _ = tiny_dir
    index = safetensors_index(path)
    assert set(index) == set(load_file(path / "model.safetensors"))
    assert "lm_head.weight" in index and set(index.values()) == {path / "model.safetensors"}

    first, second = tmp_path / "model-00001-of-00002.safetensors", tmp_path / "model-00002-of-00002.safetensors"
    save_file({"a.weight": torch.zeros(2), "b.weight": torch.ones(1)}, first)
    save_file({"c.weight": torch.zeros(3)}, second)
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert safetensors_index(tmp_path) == {"a.weight": first, "b.weight": first, "c.weight": second}
    assert safetensors_index(tmp_path / "missing") == {}


@pytest.mark.slow
def test_smollm2_preset_is_its_materialised_directory():
    cache = default_cache_dir()
    path, name, revision = materialise_model_dir("smollm2-135m", cache)
    assert path == smollm2_dir(cache) and (path / "config.json").is_file()
    lm = load_causal_lm("smollm2-135m", cache_dir=cache)
    assert (name, revision) == (lm.name, lm.revision)


def test_importing_needs_no_extras():
    """eopd_common imports in a client-only install: torch, transformers and safetensors load only
    when a model directory is built or read."""
    code = ("import sys, eopd_common.model_dirs, eopd_common.client_security, eopd_common.vllm_args; "
            "print(sorted(m for m in ('torch', 'transformers', 'safetensors', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


def test_a_gguf_models_tokenizer_is_converted_once(tmp_path, monkeypatch):
    """`materialise_gguf`: the tokenizer converted first (`load_tokenizer` does, before the model) is
    kept when the model follows: transformers' GGUF tokenizer conversion (~5 s for SmolLM2) runs once
    per directory. The conversions are stand-ins here (the real ones take ~30 s): this checks the
    order of work, and that both markers and both outputs end in the target."""
    import transformers

    from eopd_common.models import materialise_gguf

    calls = []

    class Saved:
        def __init__(self, what):
            self.what = what

        def save_pretrained(self, out, **_):
            (out / f"{self.what}.json").write_text("{}")

    class Model(Saved):
        hf_quantizer, config = None, type("Config", (), {})()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: calls.append("tokenizer") or Saved("tokenizer"))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: calls.append("model") or Model("model"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    target = tmp_path / "out"
    materialise_gguf(gguf, target, tokenizer_only=True)
    materialise_gguf(gguf, target, tokenizer_only=True)  # done: nothing again
    materialise_gguf(gguf, target)
    materialise_gguf(gguf, target)
    assert calls == ["tokenizer", "model"]
    assert {p.name for p in target.iterdir()} == {"tokenizer.json", "model.json", ".tokenizer-done", ".model-done"}
    fresh = tmp_path / "fresh"
    materialise_gguf(gguf, fresh)  # the model first: its tokenizer comes with it
    assert calls == ["tokenizer", "model", "tokenizer", "model"]
    assert (fresh / "tokenizer.json").is_file() and (fresh / ".model-done").is_file()


def test_conversions_started_together_convert_once(tmp_path, monkeypatch):
    """`materialise_gguf` from several threads at once on an empty target (what two test workers or
    a run's processes do on a fresh cache): one converts under the target's lock, the others wait
    and find it done. Stand-in conversions, as above; each open of the lock file is its own flock."""
    import threading
    import time

    import transformers

    from eopd_common.models import materialise_gguf

    calls = []

    class Saved:
        def save_pretrained(self, out, **_):
            time.sleep(0.3)  # long enough for the other threads to arrive while it converts
            (out / "tokenizer.json").write_text("{}")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: calls.append("tokenizer") or Saved())
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    target = tmp_path / "out"
    threads = [threading.Thread(target=materialise_gguf, args=(gguf, target), kwargs={"tokenizer_only": True})
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["tokenizer"]
    assert {p.name for p in target.iterdir()} == {"tokenizer.json", ".tokenizer-done"}
