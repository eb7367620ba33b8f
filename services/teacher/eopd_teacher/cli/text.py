"""Text input of the CLI's `score` and `generate`: the tokenizer that encodes it (checked against
the served model's) and a prompt's encoding (plain, or the chat template's user turn)."""

from __future__ import annotations

from eopd_common.models import load_tokenizer, tokenizer_fingerprint


def text_tokenizer(tokenizer_spec: str | None, info, cache_dir, command: str = "score"):
    """The tokenizer that encodes text rows: `tokenizer_spec`, else the served model's looked up by
    its name on this machine; it must match the served tokenizer's fingerprint. Exits with a
    message naming `--tokenizer` when it cannot be found or does not match."""
    spec = tokenizer_spec or info.model_name
    try:
        tok = load_tokenizer(spec, cache_dir)
    except Exception as exc:  # noqa: BLE001 - a bad spec, missing files, an unreadable tokenizer
        if tokenizer_spec:
            raise SystemExit(f"eopd-teacher {command}: cannot load the tokenizer of --tokenizer {spec!r}: {exc}") from None
        raise SystemExit(
            f"eopd-teacher {command}: text input needs the served model's tokenizer, but the served model {spec!r} "
            f"cannot be loaded on this machine by that name ({exc}). Pass --tokenizer with a preset, Hugging Face "
            "model directory or .gguf file that has the served model's tokenizer."
        ) from None
    if info.tokenizer_fingerprint and tokenizer_fingerprint(tok) != info.tokenizer_fingerprint:
        which = f"--tokenizer {spec!r}" if tokenizer_spec else f"the model {spec!r} found on this machine"
        hint = "" if tokenizer_spec else " Pass --tokenizer with the served model's tokenizer."
        raise SystemExit(
            f"eopd-teacher {command}: the tokenizer of {which} differs from the served model's (fingerprint "
            f"{tokenizer_fingerprint(tok)[:12]}... vs {info.tokenizer_fingerprint[:12]}...), so its token ids "
            f"would mean other tokens to the teacher.{hint}"
        )
    return tok


def encode_prompt(tok, text: str, chat: bool) -> list[int]:
    """`text`'s token ids: wrapped in the tokenizer's chat template as a user turn (with the
    generation prompt) when `chat`, else encoded as is (no special tokens)."""
    if chat:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return list(tok(text, add_special_tokens=False)["input_ids"])
