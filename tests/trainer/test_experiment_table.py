"""experiment_table: mean and range over seeds per variant and model, last-quarter training means."""

from __future__ import annotations

import json

from eopd_trainer.experiment_table import last_quarter, main


def fake_run(path, variant, seed, final_avg, gates):
    path.mkdir()
    (path / "run.yaml").write_text(f"loss: {{variant: {variant}}}\nseed: {seed}\n")
    models = {name: {"avg_at_k": avg, "pass_at_k": {"1": avg, "4": min(1.0, 2 * avg)}, "n_samples": 4,
                     "strict": {"avg_at_k": 0.0}, "flexible": {"avg_at_k": avg}, "high_entropy_share_student": 0.1,
                     "high_entropy_share_teacher": 0.2, "fkl_high_entropy": 0.5}
              for name, avg in (("teacher", 0.6), ("initial", 0.1), ("final", final_avg))}
    (path / "eval.json").write_text(json.dumps({"models": models}))
    (path / "eval-variants.json").write_text(json.dumps({"models": {"final": models["final"]}}))
    (path / "train_metrics.jsonl").write_text("".join(
        json.dumps({"kind": "iteration", "iteration": i + 1, "iter/gate_ratio": g, "iter/clip_frac": 0.05,
                    "iter/approx_kl": 0.01}) + "\n" for i, g in enumerate(gates)))
    (path / "run_summary.json").write_text(json.dumps({"total_s": 700.0 + seed}))
    return path


def test_tables_aggregate_over_seeds(tmp_path, capsys):
    a = fake_run(tmp_path / "a", "eopd", 0, 0.4, [0.5, 0.5, 0.5, 0.2])
    b = fake_run(tmp_path / "b", "eopd", 1, 0.3, [0.5, 0.5, 0.5, 0.4])
    c = fake_run(tmp_path / "c", "opd", 0, 0.2, [0.1] * 8)
    assert last_quarter(a, "gate_ratio") == 0.2 and last_quarter(c, "gate_ratio") == 0.1
    assert main([str(a), str(b), str(c), "--json", str(tmp_path / "f.json")]) == 0
    out = capsys.readouterr().out
    assert "| eopd / final | 2 | 0.350 (0.300–0.400) | 0.350 (0.300–0.400) | 0.700 (0.600–0.800) |" in out
    assert "| opd / final | 1 | 0.200 | 0.200 | 0.400 |" in out
    assert "### variants set" in out and "| eopd | 2 | 0.300 (0.200–0.400) | 0.050 (0.050–0.050)" in out
    assert len(json.loads((tmp_path / "f.json").read_text())) == 3
    assert main([str(tmp_path / "missing")]) == 2
