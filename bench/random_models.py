"""Random-initialised model directories of real architectures and shapes with a byte-level tokenizer,
built in code (no download): for the paper preset's end-to-end test on a CPU (tiny shapes) and the
GPU benchmarks (real shapes, built on the GPU).

The tokenizer is byte-level (every byte one token, no merges), its vocabulary padded with filler
tokens up to the model's vocabulary size, and the family's special tokens at the family's ids:
Qwen (2 and 3) <|endoftext|> 151643, <|im_start|> 151644, <|im_end|> 151645 with a ChatML chat
template; Llama 3 <|begin_of_text|> 128000, <|end_of_text|> 128001, <|eot_id|> 128009. A base
model ('student' role) ends on <|endoftext|> / <|end_of_text|>, an instruct one ('teacher') on
<|im_end|> / <|eot_id|>, as Qwen3-1.7B-Base and Qwen3-8B do: the paper preset's
`teacher.token_remap {151643: 151645}` is what explains the difference to the workers' tokenizer check.

    python -m bench.random_models OUT_DIR --shape qwen3-8b --role teacher --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ENDOFTEXT, IM_START, IM_END = 151643, 151644, 151645
QWEN_SPECIAL = {"<|endoftext|>": ENDOFTEXT, "<|im_start|>": IM_START, "<|im_end|>": IM_END}
LLAMA3_SPECIAL = {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001, "<|eot_id|>": 128009}
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3_CHAT = ("<|begin_of_text|>{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
               "{{ message['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
               "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


@dataclass(frozen=True)
class Shape:
    """A decoder's architecture (`family`: qwen3, qwen2 or llama) and sizes (defaults: tiny, for CPU tests)."""

    family: str = "qwen3"
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 32
    vocab_size: int = 151936
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096

    @property
    def special(self) -> dict[str, int]:
        return LLAMA3_SPECIAL if self.family == "llama" else QWEN_SPECIAL

    def eos(self, role: str) -> str:
        if self.family == "llama":
            return "<|eot_id|>" if role == "teacher" else "<|end_of_text|>"
        return "<|im_end|>" if role == "teacher" else "<|endoftext|>"

    def params(self) -> float:
        """Parameters, approximately (embeddings, attention, MLP; norms left out)."""
        h, q = self.hidden_size, self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        layer = h * q * 2 + h * kv * 2 + 3 * h * self.intermediate_size
        return self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * layer


TINY = Shape()
# The real models' shapes (their config.json): the paper's pair and the teacher benchmark's two.
SHAPES = {
    "tiny": TINY,
    "qwen3-8b": Shape("qwen3", 4096, 12288, 36, 32, 8, 128, 151936, False, 40960),
    "qwen3-1.7b": Shape("qwen3", 2048, 6144, 28, 16, 8, 128, 151936, True, 32768),
    "qwen2-1.5b": Shape("qwen2", 1536, 8960, 28, 12, 2, 128, 151936, True, 32768),
    "llama3-8b": Shape("llama", 4096, 14336, 32, 32, 8, 128, 128256, False, 8192),
}


def byte_level_tokenizer(vocab_size: int, special: dict[str, int], eos: str, chat_template: str):
    """A fast tokenizer: 256 byte tokens, fillers up to `vocab_size`, `special` at its ids, `eos` its
    end-of-sequence (and padding) token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size <= max(special.values()):
        raise ValueError(f"vocab_size {vocab_size} must exceed the special ids ({max(special.values())})")
    byte_tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {t: i for i, t in enumerate(byte_tokens)}
    ids = (i for i in range(len(vocab), vocab_size) if i not in special.values())
    # Fillers: distinct strings of byte-level characters (never produced by encoding: there are no merges).
    for n, i in enumerate(ids):
        vocab[f"{byte_tokens[n // 65536 % 256]}{byte_tokens[n // 256 % 256]}{byte_tokens[n % 256]}"] = i
    vocab.update(special)  # at the family's ids; registered as special (never split) below
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in special])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=eos, chat_template=chat_template)
    for text, i in special.items():
        if fast.convert_tokens_to_ids(text) != i:
            raise AssertionError(f"{text} got id {fast.convert_tokens_to_ids(text)}, not {i}")
    return fast


def model_config(shape: Shape, role: str):
    """The transformers config of `shape` for `role` (its eos: see the module docstring)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    special = shape.special
    eos = special[shape.eos(role)]
    sizes = {k: v for k, v in asdict(shape).items() if k != "family"}
    if shape.family == "llama":
        return LlamaConfig(**sizes, bos_token_id=special["<|begin_of_text|>"], eos_token_id=eos, pad_token_id=eos,
                           rms_norm_eps=1e-5, rope_theta=500000.0)
    cls = {"qwen3": Qwen3Config, "qwen2": Qwen2Config}[shape.family]
    return cls(**sizes, bos_token_id=ENDOFTEXT, eos_token_id=eos, pad_token_id=eos, rms_norm_eps=1e-6,
               rope_theta=1000000.0)


def write_random_model(out: Path, shape: Shape = TINY, *, role: str = "student", seed: int = 0, dtype: str = "float32",
                       device: str = "cpu") -> Path:
    """A Hugging Face directory at `out`: a random model of `shape` (weights in `dtype`, initialised on
    `device`) and its byte-level tokenizer; role 'student' (base) or 'teacher' (instruct)."""
    import torch
    from transformers import AutoModelForCausalLM

    if role not in ("student", "teacher"):
        raise ValueError(f"role must be student or teacher, got {role!r}")
    config = model_config(shape, role)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
        with torch.no_grad():  # larger logits than the default init, so distributions are not flat
            model.get_output_embeddings().weight.normal_(0.0, 0.5 if shape.hidden_size <= 256 else 0.02)
    finally:
        torch.random.set_rng_state(state)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    chat = LLAMA3_CHAT if shape.family == "llama" else CHATML
    byte_level_tokenizer(shape.vocab_size, shape.special, shape.eos(role), chat).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--vocab-size", type=int, default=None, help="override the shape's vocabulary size")
    p.add_argument("--role", choices=("student", "teacher"), default="student")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    shape = SHAPES[a.shape] if a.vocab_size is None else replace(SHAPES[a.shape], vocab_size=a.vocab_size)
    write_random_model(a.out, shape, role=a.role, seed=a.seed, dtype=a.dtype, device=a.device)
    print(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
