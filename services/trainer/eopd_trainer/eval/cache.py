"""The evaluation cache: an evaluation already made is reused when nothing it depends on changed.

The main job evaluates the teacher and the initial student in every run, and those numbers do not
change from run to run. An evaluation is a function of its key's fields (`key_fields`):

- `model`: the evaluated model's files (`model_fingerprint`: the sha256 of every file of a model
  directory or GGUF file; a `tiny-random@SEED` preset by its seed and tokenizer files, its code
  being under `code`);
- `teacher`: the same of the teacher behind the entropy and KL columns (None without one);
- `data`: the sha256 of each evaluated file, and how prompts are rendered (field, suffix, chat
  template, maximum prompt length);
- `sampling`: the eval settings (n_samples, temperature, top_p, max_new_tokens, max_prompts,
  batch_size, high_entropy, headline);
- `seed`: the evaluation's sampling seed;
- `code`: `EVAL_CODE_VERSION` (bumped by hand when grading changes meaning), the sha256 of the
  source files on the evaluation's path (sampling, grading, KL, prompt rendering, model loading),
  and the torch, transformers and math-verify versions.

The cache is a directory of `<key>.json` files (`EvalCache`, default `$EOPD_CACHE_DIR/evals`),
each holding the fields and the result; written atomically, a corrupt entry reads as a miss.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import time
from pathlib import Path

from eopd_common import models as common_models
from eopd_common.atomic_files import write_atomic
from eopd_common.models import default_cache_dir, resolve_spec, smollm2_dir, smollm2_gguf_path

#: Bump when grading or the meaning of an evaluation's numbers changes without its code changing
#: (e.g. a dependency's behaviour); a change of the code on the path changes the key by itself.
EVAL_CODE_VERSION = 1

_PACKAGE = Path(__file__).resolve().parents[1]  # eopd_trainer
#: The source files an evaluation's numbers depend on (`code` field of the key).
CODE_FILES = (
    _PACKAGE / "eval" / "evaluate.py",
    _PACKAGE / "eval" / "kl.py",
    _PACKAGE / "problems" / "grading.py",
    _PACKAGE / "rollout" / "samplers" / "transformers_sampler.py",
    _PACKAGE / "rollout" / "samplers" / "nucleus.py",  # top-p: which tokens are sampled
    _PACKAGE / "rollout" / "samplers" / "step_logits.py",  # the model's distributions of the statistics
    _PACKAGE / "data.py",
)
_LIBRARIES = ("torch", "transformers", "math-verify")
_CHUNK = 1 << 20


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def dir_sha256(path: Path) -> str:
    """sha256 over every regular file under `path`: relative names and contents."""
    h = hashlib.sha256()
    for p in sorted(q for q in Path(path).rglob("*") if q.is_file()):
        h.update(f"{p.relative_to(path)}\0{file_sha256(p)}\n".encode())
    return h.hexdigest()


def model_fingerprint(spec: str) -> str:
    """What identifies a model spec's weights and tokenizer (see the module docstring)."""
    resolved = resolve_spec(spec)
    if resolved.kind == "preset" and resolved.name.startswith("tiny-random"):
        code = file_sha256(Path(common_models.__file__))  # the preset's definition
        return f"tiny-random@{resolved.seed}:code={code}:tokenizer={dir_sha256(smollm2_dir(tokenizer_only=True))}"
    if resolved.kind == "preset":
        return f"{resolved.name}:gguf={file_sha256(smollm2_gguf_path())}"
    assert resolved.path is not None
    if resolved.kind == "gguf":
        return f"gguf={file_sha256(resolved.path)}"
    return f"dir={dir_sha256(resolved.path)}"


def code_fingerprint() -> dict:
    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "absent"

    h = hashlib.sha256()
    for p in CODE_FILES:
        h.update(f"{p.name}\0{file_sha256(p)}\n".encode())
    return {"version": EVAL_CODE_VERSION, "sources": h.hexdigest(), **{lib: version(lib) for lib in _LIBRARIES}}


def key_fields(*, model: str, teacher: str | None, data_files: list[str], prompts: dict, sampling: dict, seed: int,
               code: dict) -> dict:
    """The fields of an evaluation's key (pure: fingerprints in, a dict out)."""
    return {"model": model, "teacher": teacher, "data": {"files": list(data_files), "prompts": dict(prompts)},
            "sampling": dict(sampling), "seed": int(seed), "code": dict(code)}


def eval_key(fields: dict) -> str:
    """The key of an evaluation: sha256 of its fields (canonical JSON), 24 hex digits."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:24]


class EvalCache:
    """`<root>/<key>.json`: `{"key", "fields", "created", "result"}`."""

    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else default_cache_dir() / "evals"

    def path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def get(self, key: str) -> dict | None:
        """The entry of `key`, or None (missing, unreadable or not this key's)."""
        try:
            entry = json.loads(self.path(key).read_text())
        except (OSError, ValueError):
            return None
        return entry if isinstance(entry, dict) and entry.get("key") == key and "result" in entry else None

    def put(self, key: str, fields: dict, result: dict) -> dict:
        entry = {"key": key, "fields": fields, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "result": result}
        self.root.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path(key), json.dumps(entry))
        return entry
