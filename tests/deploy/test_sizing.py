"""Offline checks of the deployment files (issue 7), the sizing:

- the sizing in docs/deploy.md uses the numbers of docs/benchmarks.md and its arithmetic follows.
"""

from __future__ import annotations

import re

from tests.deploy.deploy_env import ROOT, find, objects, pod_spec


# The sizing in docs/deploy.md follows docs/benchmarks.md ---------------------------------------------

def _md_table(text: str) -> tuple[list[str], list[list[str]]]:
    """The first Markdown table in `text`: (header, rows)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append([c.strip() for c in line.strip().strip("|").split("|")])
    return table[0], table[2:]


def test_sizing_follows_the_benchmarks():
    """Every input of the sizing is the value of the benchmark row it names, and the arithmetic
    follows from the inputs (re-running a benchmark section makes this fail until deploy.md is redone)."""
    import math

    sizing = (ROOT / "docs" / "deploy.md").read_text().partition("## 4. Sizing")[2]
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    assert sizing and "being re-run" not in sizing
    header, rows = _md_table(sizing.partition("**Inputs")[2])
    assert header == ["input", "value", "section", "row", "column"]
    inputs = {}
    for name_cell, value, section, row, column in rows:
        name = re.match(r"`(\w+)`", name_cell)[1]
        inputs[name] = value
        if section == "(a choice)":
            continue
        text = bench.partition(f"<!-- BEGIN {section} -->")[2].partition(f"<!-- END {section} -->")[0]
        assert text, f"docs/benchmarks.md has no section {section}"
        if row == "-":  # a number in the section's text
            assert re.search(rf"(?<![\d.]){re.escape(value)}(?![\d.])", text), f"{name}: {value} is not in {section}"
            continue
        h, rs = _md_table(text)
        keys = row.split(", ")
        found = [r for r in rs if r[:len(keys)] == keys]
        assert len(found) == 1, f"{name}: no single row {row!r} in docs/benchmarks.md {section}"
        got = found[0][h.index(column)]
        assert got == value, (f"docs/deploy.md sizing: {name} = {value}, but docs/benchmarks.md {section}, row {row!r}, "
                              f"column {column!r} is {got}: copy it and redo the arithmetic")

    def num(name: str) -> float:
        v = inputs[name]
        return float(v.rstrip("%")) / 100 if v.endswith("%") else float(v)

    t16, t32, loss, trained, scored, busy, x, u = (num(n) for n in
                                                   ("T_bf16", "T_fp32", "L_loss", "P_trained", "P_scored", "P_busy", "X", "u"))
    learner = find(objects("gpu"), "Job", "eopd-learner")
    gpus = learner["spec"]["completions"] * pod_spec(learner)["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    r_loss = 8192 / loss
    b16, b32 = r_loss / (t16 * u), r_loss / (t32 * u)
    capacity = scored / busy
    replicas = trained / (capacity * u)
    expected = [
        f"8192 / {inputs['L_loss']} = {r_loss:,.0f}",
        f"{r_loss:.0f} / ({inputs['T_bf16']} * {inputs['u']}) = {r_loss:.0f} / {t16 * u:.1f} = {b16:.2f}",
        f"{r_loss:.0f} / ({inputs['T_fp32']} * {inputs['u']}) = {r_loss:.0f} / {t32 * u:.1f} = {b32:.2f}",
        f"{inputs['P_scored']} / {busy:.2f} = {capacity:.1f}",
        f"{inputs['P_trained']} / ({capacity:.1f} * {inputs['u']}) = {inputs['P_trained']} / {capacity * u:.1f} = {replicas:.2f}",
        f"{b32:.2f} / {replicas:.2f} = {b32 / replicas:.0f}x",
        f"{r_loss:.0f} / {inputs['P_trained']} = {r_loss / trained:.0f}x",
        f"{inputs['X']} / {inputs['u']} = {x / u:.2f}",
        f"ceil({x / u:.2f} * {gpus}) = {math.ceil(x / u * gpus)}",
        f"**{math.ceil(replicas)} replica",
    ]
    flat = " ".join(sizing.split())
    for fragment in expected:
        assert fragment in flat, f"docs/deploy.md sizing: expected {fragment!r} from the inputs; redo the arithmetic"
