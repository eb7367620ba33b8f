"""Alarms: a run that notices when it goes wrong (issue 48, ask 4). Pure functions of an
iteration's summary (the learner's `iter/...` record without the prefix).

| alarm                 | fires when                                                                       |
|-----------------------|----------------------------------------------------------------------------------|
| `negative_divergence` | a divergence term (`fkl_loss`, `topk_rkl_loss`, `divergence_loss`) < -1e-4:       |
|                       | a divergence is >= 0, so a negative one means a loss that is not one (the        |
|                       | collapse of eopd_topk_rkl before its tail bucket went below zero)               |
| `entropy_band`        | the student's mean entropy leaves [H_te / 2 - 0.5, 2 H_te + 1] nats, H_te the    |
|                       | teacher's mean entropy on the same tokens                                       |
| `truncation`          | nearly every response of the iteration ran to the length limit                 |
|                       | (`truncated_frac` >= 0.9)                                                       |

The band is wide on purpose: on-policy distillation moves the student's entropy toward the
teacher's, but a healthy student starts away from it (a smaller model is often sharper or
broader by a factor below 2); the collapse of issue 48 went from 1.5 to 7.3 nats against a
teacher at 1.2-2.7. The additive 0.5 / 1 nats keep a near-deterministic teacher (H_te ~ 0) from
flagging a student that is merely a little less sure. A missing key (a variant without teacher
scores, `vocab_metrics` off) disables the alarm that reads it.

The truncation share is high on purpose: healthy runs of the default preset (16 new tokens) reach
half or more in single iterations (56% at iteration 1 of `eopd_topk_rkl` and of TRL's GKD objective
on smollm2-cpu, bench_divergences; up to 81% in an archived far-student GKD run,
docs/results/runs-far/gkd1.0-s2), while the collapse ran every answer to the limit.

`eopd run` shows the alarms on its progress line and `eopd report` lists them; `train.stop_on`
(a list of alarm names, empty by default) makes the learner stop the run at the first iteration
one of them fires, with the alarm's message as the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

AlarmName = Literal["negative_divergence", "entropy_band", "truncation"]
ALARMS: tuple[str, ...] = get_args(AlarmName)
NEGATIVE_DIVERGENCE, ENTROPY_BAND, TRUNCATION = ALARMS

#: Divergence terms of the loss (each >= 0 for a true divergence; `pg_loss` may be negative).
DIVERGENCE_TERMS = ("fkl_loss", "topk_rkl_loss", "divergence_loss")
NEGATIVE_TOLERANCE = 1e-4
TRUNCATED_SHARE = 0.9


def entropy_band(teacher_entropy: float) -> tuple[float, float]:
    """The student's allowed mean entropy (nats) around the teacher's: `[H / 2 - 0.5, 2 H + 1]`."""
    return teacher_entropy / 2 - 0.5, 2 * teacher_entropy + 1


@dataclass(frozen=True)
class Alarm:
    name: str
    message: str


def check_alarms(summary: dict[str, float]) -> list[Alarm]:
    """The alarms an iteration's summary raises, in `ALARMS` order (empty when healthy)."""
    out = []
    negative = {k: summary[k] for k in DIVERGENCE_TERMS if k in summary and summary[k] < -NEGATIVE_TOLERANCE}
    if negative:
        out.append(Alarm(NEGATIVE_DIVERGENCE, "divergence below zero: " + ", ".join(
            f"{k} {v:.4g}" for k, v in negative.items()) + " (a divergence is >= 0: the loss is not one)"))
    if "student_entropy" in summary and "teacher_entropy" in summary:
        h_s, h_t = summary["student_entropy"], summary["teacher_entropy"]
        lo, hi = entropy_band(h_t)
        if not lo <= h_s <= hi:
            out.append(Alarm(ENTROPY_BAND, f"student entropy {h_s:.3f} nats outside [{lo:.3f}, {hi:.3f}] "
                                           f"around the teacher's {h_t:.3f}"))
    if summary.get("truncated_frac", 0.0) >= TRUNCATED_SHARE:
        out.append(Alarm(TRUNCATION, f"{summary['truncated_frac']:.0%} of the responses ran to the length limit "
                                     f"(rollout.max_response_length; alarm at >= {TRUNCATED_SHARE:.0%})"))
    return out


def stop_reason(alarms: list[Alarm], stop_on: list[str] | tuple[str, ...], iteration: int) -> str | None:
    """The reason to stop the run (`train.stop_on`), or None: the first alarm that fired and is listed."""
    for alarm in alarms:
        if alarm.name in stop_on:
            return f"train.stop_on: alarm {alarm.name} at iteration {iteration}: {alarm.message}"
    return None
