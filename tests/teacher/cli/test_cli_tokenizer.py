"""`eopd-teacher score` with text input: which tokenizer encodes it. The served model is found by
the name the server reports (a .gguf file by its file name, a directory by the path it was given)
or given with --tokenizer; it must carry the served tokenizer's fingerprint."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from eopd_common.models import load_tokenizer, resolve_spec, smollm2_gguf_path, tokenizer_fingerprint
from eopd_teacher.cli.main import _encode
from eopd_teacher.types import ModelInfo

TEXT = [{"id": "t", "prompt": "What is 2 + 3?", "response": " It is 5."}]


@pytest.fixture(scope="module")
def smollm2_tok():
    return load_tokenizer("tiny-random")  # the presets share SmolLM2's tokenizer


def _info(model_name: str, fingerprint: str) -> ModelInfo:
    return ModelInfo(model_name=model_name, model_revision="r", vocab_size=49152, max_context_length=2048, dtype="float32",
                     engine="transformers", default_top_k=16, max_top_k=64, tokenizer_fingerprint=fingerprint)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_tok) -> Path:
    """`<tmp>/models/tiny`: a model directory as resolve_spec accepts it (config.json + tokenizer)."""
    root = tmp_path_factory.mktemp("served")
    path = root / "models" / "tiny"
    smollm2_tok.save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return path


def test_served_relative_dir_found_from_the_same_directory(model_dir, smollm2_tok, monkeypatch):
    monkeypatch.chdir(model_dir.parents[1])
    info = _info(resolve_spec("models/tiny").name, tokenizer_fingerprint(smollm2_tok))
    seqs, tok = _encode(TEXT, None, info, None)
    assert tokenizer_fingerprint(tok) == info.tokenizer_fingerprint
    assert seqs[0][2] == len(smollm2_tok("What is 2 + 3?", add_special_tokens=False)["input_ids"])


def test_served_relative_dir_elsewhere_needs_tokenizer(model_dir, smollm2_tok, tmp_path, monkeypatch):
    monkeypatch.chdir(model_dir.parents[1])
    info = _info(resolve_spec("models/tiny").name, tokenizer_fingerprint(smollm2_tok))
    monkeypatch.chdir(tmp_path)  # the client runs somewhere the server's relative path means nothing
    with pytest.raises(SystemExit) as e:
        _encode(TEXT, None, info, None)
    msg = str(e.value)
    assert "'models/tiny'" in msg and "Pass --tokenizer" in msg
    seqs, _ = _encode(TEXT, str(model_dir), info, None)  # --tokenizer with the absolute path works
    assert len(seqs) == 1
    seqs, _ = _encode(TEXT, "smollm2-135m", info, None)  # so does a preset with the same tokenizer
    assert len(seqs) == 1


def test_served_gguf_file(smollm2_tok, tmp_path, monkeypatch):
    gguf = smollm2_gguf_path()
    info = _info(resolve_spec(str(gguf)).name, tokenizer_fingerprint(smollm2_tok))
    assert info.model_name == gguf.name  # the server names a .gguf file by its file name only
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        _encode(TEXT, None, info, None)
    assert repr(gguf.name) in str(e.value) and "Pass --tokenizer" in str(e.value)
    seqs, _ = _encode(TEXT, "smollm2-135m", info, None)  # --tokenizer with the same tokenizer
    assert len(seqs) == 1
    monkeypatch.chdir(gguf.parent)  # beside the file, its name is enough (and its tokenizer matches)
    seqs, tok = _encode(TEXT, None, info, None)
    assert tokenizer_fingerprint(tok) == info.tokenizer_fingerprint and len(seqs) == 1


def test_tokenizer_with_another_fingerprint_is_refused(smollm2_tok):
    info = _info("tiny-random", "0" * 64)
    with pytest.raises(SystemExit) as e:
        _encode(TEXT, None, info, None)
    assert "differs from the served model's" in str(e.value) and "Pass --tokenizer" in str(e.value)
    with pytest.raises(SystemExit) as e:
        _encode(TEXT, "tiny-random", info, None)
    assert "--tokenizer 'tiny-random'" in str(e.value) and "differs" in str(e.value)


def test_bad_tokenizer_option_and_token_id_rows(smollm2_tok, tmp_path):
    info = _info("tiny-random", tokenizer_fingerprint(smollm2_tok))
    with pytest.raises(SystemExit) as e:
        _encode(TEXT, str(tmp_path / "missing"), info, None)
    assert "cannot load the tokenizer of --tokenizer" in str(e.value)
    # Token-id rows need no tokenizer at all, whatever the served model is called.
    rows = [{"id": "ids", "token_ids": [5, 6, 7], "score_from": 1}]
    assert _encode(rows, None, replace(info, model_name="nowhere.gguf"), None) == ([("ids", [5, 6, 7], 1)], None)
