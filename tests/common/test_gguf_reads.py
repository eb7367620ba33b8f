"""`gguf_reads.reads_once`: transformers' GGUF conversion parses the file once and builds gguf-py's
tensor-name map once, and what it converts is unchanged (the packaged SmolLM2 file, real gguf-py
and transformers)."""

from __future__ import annotations

import gguf
import pytest
import torch

from eopd_common.gguf_reads import reads_once
from eopd_common.models import smollm2_gguf_path


def test_one_reader_per_file_and_one_name_map_per_architecture_inside_the_block():
    path = smollm2_gguf_path()
    plain = gguf.GGUFReader(path)
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == "llama")
    with reads_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first  # the same file by another spelling: read once
        assert list(first.fields) == list(plain.fields) and len(first.tensors) == len(plain.tensors)
        assert first.fields["general.architecture"].contents() == plain.fields["general.architecture"].contents()
        assert [t.name for t in first.tensors] == [t.name for t in plain.tensors]
        names = gguf.get_tensor_name_map(arch, 30)
        assert gguf.get_tensor_name_map(arch, 30) is names and gguf.get_tensor_name_map(arch, 2) is not names
        fresh = name_map(arch, 30)
        for hf in ("model.layers.7.self_attn.q_proj", "model.layers.29.mlp.down_proj", "model.norm", "lm_head"):
            assert names.get_name(hf) == fresh.get_name(hf)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_class, name_map)  # put back
    assert gguf.GGUFReader(path) is not first


@pytest.mark.slow
def test_the_converted_model_is_what_transformers_loads_from_the_file():
    """The packaged SmolLM2 as `materialise_gguf` converted it (inside `reads_once`; the directory the
    preset uses) has transformers' own config and weights of the GGUF file, loaded without it."""
    from transformers import AutoModelForCausalLM

    from eopd_common.models import smollm2_dir

    path = smollm2_gguf_path()
    converted = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype="float32")
    plain = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype="float32")
    ours, theirs = converted.state_dict(), plain.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    assert converted.config.num_hidden_layers == plain.config.num_hidden_layers == 30
    assert converted.config.vocab_size == plain.config.vocab_size
