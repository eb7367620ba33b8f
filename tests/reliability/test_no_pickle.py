"""No unsafe deserialization in the services (issue 8): an AST scan of services/**/*.py.

Fails on: importing pickle (or cPickle, dill, cloudpickle, shelve, marshal, joblib), any use of
`pickle.<name>`, `torch.load(...)` without the literal `weights_only=True`, `numpy.load(...,
allow_pickle=True)`, and DeepSpeed's `load_checkpoint(...)` (which unpickles with
weights_only=False) anywhere but the ONE documented exception: the learner resuming from its own
checkpoint directory (docs/reliability.md, "No unsafe deserialization across process boundaries").
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal", "joblib"}
# (file, dotted call) -> why it is allowed. Each entry must still exist (no stale exceptions).
ALLOWED = {
    ("services/trainer/eopd_trainer/learner/checkpoint.py", "engine.load_checkpoint"):
        "DeepSpeed checkpoint files written and read only by the learner on its own volume (docs/reliability.md)",
}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def _kw_is_true(call: ast.Call, name: str) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is True for k in call.keywords)


def violations(source: str, rel: str) -> tuple[list[str], set[tuple[str, str]]]:
    """(problems as 'file:line: what', allowed calls seen) of one file's source."""
    out, seen = [], set()
    tree = ast.parse(source, rel)
    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in UNSAFE_MODULES:
                    out.append(f"{where}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in UNSAFE_MODULES:
                out.append(f"{where}: from {node.module} import ...")
            if node.module == "torch" and any(a.name == "load" for a in node.names):
                out.append(f"{where}: from torch import load (call torch.load(..., weights_only=True))")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in UNSAFE_MODULES:
            out.append(f"{where}: {node.value.id}.{node.attr}")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name == "torch.load" and not _kw_is_true(node, "weights_only"):
                out.append(f"{where}: torch.load without weights_only=True")
            elif name in ("np.load", "numpy.load") and any(k.arg == "allow_pickle" for k in node.keywords) \
                    and not any(k.arg == "allow_pickle" and isinstance(k.value, ast.Constant) and k.value.value is False
                                for k in node.keywords):
                out.append(f"{where}: {name} with allow_pickle")
            elif name.endswith(".load_checkpoint") or name == "load_checkpoint":
                if (rel, name) in ALLOWED:
                    seen.add((rel, name))
                else:
                    out.append(f"{where}: {name} (DeepSpeed unpickles checkpoints; not a documented exception)")
    return out, seen


def test_services_never_unpickle():
    files = sorted((ROOT / "services").rglob("*.py"))
    scanned = [f for f in files if not f.name.endswith(("_pb2.py", "_pb2_grpc.py"))]
    assert len(scanned) >= 20, f"only {len(scanned)} files under services/: wrong root?"
    problems, seen = [], set()
    for f in scanned:
        rel = f.relative_to(ROOT).as_posix()
        p, s = violations(f.read_text(), rel)
        problems += p
        seen |= s
    assert not problems, "unsafe deserialization in services/:\n" + "\n".join(problems)
    assert seen == set(ALLOWED), f"stale exceptions (remove them from ALLOWED and docs): {sorted(set(ALLOWED) - seen)}"
    doc = (ROOT / "docs" / "reliability.md").read_text()
    assert "test_no_pickle.py" in doc and "load_checkpoint" in doc


def test_the_scan_catches_each_pattern():
    bad = {
        "import pickle": "import pickle",
        "from pickle import loads": "from pickle import",
        "import dill as d": "import dill",
        "x = pickle.loads(b)": "pickle.loads",
        "import torch\ntorch.load(f)": "torch.load without weights_only=True",
        "torch.load(f, weights_only=False)": "torch.load without",
        "torch.load(f, weights_only=flag)": "torch.load without",
        "from torch import load": "from torch import load",
        "np.load(f, allow_pickle=True)": "allow_pickle",
        "other.load_checkpoint(d)": "load_checkpoint",
    }
    for source, what in bad.items():
        problems, _ = violations(source, "x.py")
        assert len(problems) == 1 and what in problems[0], (source, problems)
    good = "import torch, numpy as np\ntorch.load(f, weights_only=True)\nnp.load(f)\nnp.load(f, allow_pickle=False)\nimport json"
    assert violations(good, "x.py") == ([], set())
    assert violations("engine.load_checkpoint(d)", "services/trainer/eopd_trainer/learner/checkpoint.py")[1] == set(ALLOWED)
