"""Timing-only re-runs of the head-to-head (`bench_e2e --phase retime`), pure but for reading the archive.

A head-to-head ratio compares seconds measured on one machine, and each session of this project gets
a new one: a seed's systems are rarely all timed on the same machine. A *re-timing* trains a system
and seed again on the machine at hand, beside the systems timed there, and keeps only its
trained.json (the checkpoints' training seconds and the machine), never evaluated: its accuracies
are those of the archived run of that system and seed. That holds because a re-run trains the same
student (fixed seeds, fp32, deterministic kernels on CPU): every re-run archived so far reproduced
its first run's held-out and variants Avg@8 at every checkpoint exactly (bench/results/e2e-avg8/
README.md, "Seed 0 again", "Seeds 1 and 2 again"). The report then pairs a system's time with the
reference's on any machine both were timed on.

Layout: `<archive>/timing/<system>-s<seed>@<boot>/trained.json`, `<boot>` the first 8 hex digits
of the machine's kernel boot id (`e2e_report.machine_of` tells machines apart the same way)."""

from __future__ import annotations

import json
from pathlib import Path

TIMING_DIR = "timing"


def timing_name(name: str, machine: dict) -> str:
    """The re-timing's directory name: the run's name (`<system>-s<seed>`) and the machine's boot id
    (8 hex digits), e.g. `trl-gkd-s0@ce0d4cf8`. A machine without a boot id cannot be told apart
    from another of its CPU name: refused."""
    boot = machine.get("boot_id") or ""
    if len(boot) < 8:
        raise ValueError(f"re-timing {name}: the machine has no kernel boot id to tell it apart ({machine})")
    return f"{name}@{boot[:8]}"


def load_timings(archive: Path | None) -> list[dict]:
    """Every re-timing kept in `archive` (their trained.json, sorted by directory name)."""
    if archive is None or not (archive / TIMING_DIR).is_dir():
        return []
    return [json.loads(p.read_text()) for p in sorted((archive / TIMING_DIR).glob("*/trained.json"))]


def retimed(run: dict, timing: dict) -> dict:
    """`run` (one system and seed, its checkpoints with accuracies) as `timing` timed it: the same
    accuracies, `timing`'s training seconds per checkpoint and its machine. The two must be the same
    system and seed, and every checkpoint of `run` one of `timing`'s (label and step), else
    ValueError: a re-timing of another schedule says nothing of this run's curve."""
    if (timing["system"], timing["seed"]) != (run["system"], run["seed"]):
        raise ValueError(f"re-timing of {timing['system']} seed {timing['seed']} paired with {run['system']} seed {run['seed']}")
    theirs = {c["label"]: c for c in timing["checkpoints"]}
    missing = [c["label"] for c in run["checkpoints"] if theirs.get(c["label"], {}).get("step") != c["step"]]
    if missing:
        raise ValueError(f"re-timing of {run['system']} seed {run['seed']}: checkpoints {missing} are not the run's "
                         f"(label and step); it has {[(c['label'], c['step']) for c in timing['checkpoints']]}")
    return {**run, "machine": timing.get("machine", {}), "retimed": True,
            "checkpoints": [{**c, "train_s": theirs[c["label"]]["train_s"]} for c in run["checkpoints"]]}


def retimed_runs(runs: list[dict], timings: list[dict]) -> list[dict]:
    """Every re-timing whose system and seed has a run in `runs`, as that run retimed (`retimed`);
    re-timings without one are left out (nothing to take accuracies from)."""
    by_key = {(r["system"], r["seed"]): r for r in runs}
    return [retimed(by_key[(t["system"], t["seed"])], t) for t in timings if (t["system"], t["seed"]) in by_key]
