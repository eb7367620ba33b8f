"""`eopd_common.models.pad_token_id`: the pad token, else the EOS token."""

from __future__ import annotations

from types import SimpleNamespace

from eopd_common.models import load_tokenizer, pad_token_id


def test_pad_id_falls_back_to_eos():
    assert pad_token_id(SimpleNamespace(pad_token_id=5, eos_token_id=2)) == 5
    assert pad_token_id(SimpleNamespace(pad_token_id=0, eos_token_id=2)) == 0  # 0 is an id, not "unset"
    assert pad_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=2)) == 2


def test_pad_id_of_the_presets_tokenizer():
    tok = load_tokenizer("tiny-random")  # SmolLM2's: pads with <|im_end|>, its EOS
    assert pad_token_id(tok) == tok.convert_tokens_to_ids("<|im_end|>") == 2
    tok.pad_token = None
    assert tok.pad_token_id is None and pad_token_id(tok) == tok.eos_token_id == 2
