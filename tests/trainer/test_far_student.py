"""scripts/far_student.py (issue 35): the far student's rule on hand-made probes, and the whole
build (prune, heal with KD through `eopd run`, probe on the training split, choose, copy) on the
tiny preset with real processes, and the rebuild of the chosen student alone (`--build`) to the
same weights."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file

from tests.procs import ROOT

spec = importlib.util.spec_from_file_location("far_student", ROOT / "scripts" / "far_student.py")
far_student = importlib.util.module_from_spec(spec)
spec.loader.exec_module(far_student)


def _cand(layers: int, number_frac: float, rkl: float) -> dict:
    return {"layers_removed": layers, "healed": {"number_frac": number_frac, "reverse_kl": rkl}}


def test_the_rule_most_layers_removed_among_the_far_students_that_keep_the_format():
    ref = {"reverse_kl": 0.3}
    cands = {"a": _cand(3, 0.95, 0.5), "b": _cand(5, 0.92, 0.7), "c": _cand(7, 0.6, 2.0), "d": _cand(4, 0.99, 0.9)}
    assert far_student.choose(cands, ref) == "b"  # c lost the format; b, d are >= 2x as far; b removes more layers
    assert far_student.choose({"a": cands["a"], "d": cands["d"]}, {"reverse_kl": 1.0}) == "d"  # none 2x as far: the farthest
    with pytest.raises(SystemExit, match="writes a number in 90%"):
        far_student.choose({"c": cands["c"]}, ref)


@pytest.mark.integration
def test_far_student_on_the_tiny_preset(tmp_path):
    out = tmp_path / "far"
    assert far_student.main(["--config", str(ROOT / "configs" / "tiny.yaml"), "--candidates", "1;0", "--heal-iterations", "1",
                             "--probe", "4", "--samples", "2", "--format-min", "0", "--out", str(out)]) == 0
    choice = json.loads((out / "choice.json").read_text())
    assert set(choice["candidates"]) == {"1", "0"} and choice["chosen"] in {"1", "0"}
    assert choice["default_student"]["model"] == "tiny-random@1" and choice["probe_problems"] == 4
    for c in choice["candidates"].values():
        assert c["layers_removed"] == 1
        for stage in ("pruned", "healed"):
            assert 0 <= c[stage]["avg_at_k"] <= 1 and c[stage]["reverse_kl"] > 0
    assert (out / "student" / "config.json").is_file()
    assert json.loads((out / "student" / "config.json").read_text())["num_hidden_layers"] == 1
    # --build (scripts/experiment.sh, each session: runs/ is not kept) heals the chosen candidate
    # alone, to the same weights
    rebuilt = tmp_path / "rebuilt"
    assert far_student.main(["--config", str(ROOT / "configs" / "tiny.yaml"), "--build", choice["chosen"],
                             "--heal-iterations", "1", "--out", str(rebuilt)]) == 0
    ours, theirs = (load_file(next((d / "student").glob("*.safetensors"))) for d in (out, rebuilt))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert not (rebuilt / "choice.json").exists()
