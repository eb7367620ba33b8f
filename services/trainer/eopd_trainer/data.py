"""Prompts: reading JSONL / parquet files, rendering with the student's chat template, and the
deterministic order in which the learner hands them out as tasks."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np


class DataError(ValueError):
    pass


def read_records(path: Path) -> list[dict]:
    """Records of a .jsonl/.json-lines file or a .parquet file (parquet needs pyarrow)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"prompt file not found: {path}")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:  # pragma: no cover - depends on the environment
            raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow), or convert it to JSONL") from None
        return pq.read_table(path).to_pylist()
    out = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON: {exc}") from None
            if not isinstance(rec, dict):
                raise DataError(f"{path}:{lineno}: each line must be a JSON object")
            rec["_source"] = f"{path}:{lineno}"
            out.append(rec)
    return out


def load_prompts(paths: Sequence[Path], field: str) -> list[str]:
    """The prompt texts of every file, concatenated in order (the task's prompt_index indexes this)."""
    prompts: list[str] = []
    for path in paths:
        for i, rec in enumerate(read_records(path)):
            where = rec.get("_source", f"{path}[{i}]")
            if field not in rec:
                keys = sorted(k for k in rec if k != "_source")
                raise DataError(f"{where}: no field {field!r} (data.field); the record has {keys}")
            value = rec[field]
            if isinstance(value, list) and value and isinstance(value[0], dict):  # chat messages
                value = next((m.get("content", "") for m in value if m.get("role") == "user"), "")
            if not isinstance(value, str) or not value.strip():
                raise DataError(f"{where}: field {field!r} must be a non-empty string")
            prompts.append(value)
    if not prompts:
        raise DataError(f"no prompts in {[str(p) for p in paths]}")
    return prompts


def render_prompt(tokenizer, text: str, *, suffix: str = "", chat_template: bool | str = True,
                  max_length: int | None = None) -> list[int]:
    """Token ids of a prompt as the student sees it (paper appendix A: the chat template applied,
    ending with the assistant's generation prompt). Over-long prompts keep their last tokens."""
    query = text + suffix
    if chat_template is True:
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError("data.chat_template is true but the student tokenizer has no chat template; "
                            "give a template string with {query} or set it to false")
        out = tokenizer.apply_chat_template([{"role": "user", "content": query}], add_generation_prompt=True,
                                            tokenize=True)
        ids = list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
    elif isinstance(chat_template, str):
        ids = tokenizer(chat_template.replace("{query}", query), add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(query, add_special_tokens=False)["input_ids"]
    ids = [int(i) for i in ids]
    if max_length is not None and len(ids) > max_length:
        ids = ids[-max_length:]
    if not ids:
        raise DataError(f"prompt {text[:40]!r} renders to no tokens")
    return ids


def prompt_index(task_seq: int, num_prompts: int, *, seed: int, shuffle: bool = True) -> int:
    """The prompt of task number `task_seq`: epoch e = task_seq // num_prompts walks a permutation
    of the prompts drawn from (seed, e), so every prompt is used once per epoch."""
    epoch, pos = divmod(task_seq, num_prompts)
    if not shuffle:
        return pos
    perm = np.random.default_rng([seed, epoch]).permutation(num_prompts)
    return int(perm[pos])
