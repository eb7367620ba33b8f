"""Random-initialised Qwen3-shaped model directories with a Qwen3-like tokenizer, built in code (no
download): for the paper preset's end-to-end test on a CPU (tiny shapes) and the trainer's GPU
benchmark (real shapes).

The tokenizer is byte-level (every byte one token, no merges), its vocabulary padded with filler
tokens up to the model's vocabulary size, and Qwen3's special tokens at Qwen3's ids:
<|endoftext|> 151643, <|im_start|> 151644, <|im_end|> 151645, with a ChatML chat template. A base
student ends on <|endoftext|>, an instruct teacher on <|im_end|> (`role`), as Qwen3-1.7B-Base and
Qwen3-8B do: the paper preset's `teacher.token_remap {151643: 151645}` is what explains the
difference to the workers' tokenizer check.

    python -m bench.random_qwen3 OUT_DIR --role teacher --hidden-size 4096 --layers 36 ...
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ENDOFTEXT, IM_START, IM_END = 151643, 151644, 151645
SPECIAL = {"<|endoftext|>": ENDOFTEXT, "<|im_start|>": IM_START, "<|im_end|>": IM_END}
QWEN3_VOCAB = 151936  # the models' (padded) vocabulary
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@dataclass(frozen=True)
class Qwen3Shape:
    """The architecture of a Qwen3 model (defaults: tiny, for CPU tests)."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 32
    vocab_size: int = QWEN3_VOCAB
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096


# The paper's models (config.json of Qwen3-8B and Qwen3-1.7B-Base).
QWEN3_8B = Qwen3Shape(4096, 12288, 36, 32, 8, 128, QWEN3_VOCAB, False, 40960)
QWEN3_1_7B = Qwen3Shape(2048, 6144, 28, 16, 8, 128, QWEN3_VOCAB, True, 32768)


def byte_level_tokenizer(vocab_size: int, eos: str):
    """A fast tokenizer: 256 byte tokens, fillers up to `vocab_size` (special ids inside it), the
    three special tokens at Qwen3's ids, `eos` its end-of-sequence (and padding) token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size <= max(SPECIAL.values()):
        raise ValueError(f"vocab_size {vocab_size} must exceed Qwen3's special ids ({max(SPECIAL.values())})")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_tokens = sorted(alphabet)
    vocab: dict[str, int] = {t: i for i, t in enumerate(byte_tokens)}
    ids = iter(i for i in range(len(vocab), vocab_size) if i not in SPECIAL.values())
    # Fillers: distinct strings of byte-level characters (never produced by encoding: there are no merges).
    for n, i in enumerate(ids):
        vocab[f"{byte_tokens[n // 65536 % 256]}{byte_tokens[n // 256 % 256]}{byte_tokens[n % 256]}"] = i
    vocab.update(SPECIAL)  # at Qwen3's ids; registered as special (never split) below
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in SPECIAL])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=eos, chat_template=CHATML)
    for text, i in SPECIAL.items():
        if fast.convert_tokens_to_ids(text) != i:
            raise AssertionError(f"{text} got id {fast.convert_tokens_to_ids(text)}, not Qwen3's {i}")
    return fast


def write_random_qwen3(out: Path, shape: Qwen3Shape = Qwen3Shape(), *, role: str = "student", seed: int = 0,
                       dtype: str = "float32", device: str = "cpu") -> Path:
    """A Hugging Face directory at `out`: a random Qwen3 of `shape` (weights in `dtype`) and the
    byte-level Qwen3-like tokenizer; role 'student' (base: eos <|endoftext|>) or 'teacher'
    (instruct: eos <|im_end|>)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    if role not in ("student", "teacher"):
        raise ValueError(f"role must be student or teacher, got {role!r}")
    eos = "<|im_end|>" if role == "teacher" else "<|endoftext|>"
    config = Qwen3Config(**asdict(shape), bos_token_id=ENDOFTEXT, eos_token_id=SPECIAL[eos], pad_token_id=SPECIAL[eos],
                         rms_norm_eps=1e-6, rope_theta=1000000.0)
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
    byte_level_tokenizer(shape.vocab_size, eos).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--role", choices=("student", "teacher"), default="student")
    p.add_argument("--preset", choices=("tiny", "qwen3-8b", "qwen3-1.7b"), default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    shape: dict[str, Any] = {"tiny": Qwen3Shape(), "qwen3-8b": QWEN3_8B, "qwen3-1.7b": QWEN3_1_7B}
    write_random_qwen3(a.out, shape[a.preset], role=a.role, seed=a.seed, dtype=a.dtype, device=a.device)
    print(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
