"""The learner's per-iteration records (rank 0): one metrics record per optimizer step and an
iteration summary, the iteration's log line and the progress bar."""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm

from .alarms import Alarm, check_alarms
from .metrics import MetricsSink

log = logging.getLogger("eopd.learner")


def _summary(steps: list[dict[str, float]]) -> dict[str, float]:
    return {k: sum(s[k] for s in steps if k in s) / len(steps) for k in steps[0]}


class IterationLog:
    def __init__(self, metrics: MetricsSink, total_iterations: int, start_iteration: int, *, progress: bool):
        self.metrics = metrics
        self.total_iterations = total_iterations
        self.progress = None
        if progress:
            self.progress = tqdm(total=total_iterations, initial=start_iteration, desc="eopd train", unit="it",
                                 dynamic_ncols=True, file=sys.stderr)

    @staticmethod
    def records(iteration: int, steps: list[dict[str, float]], stats: dict[str, float], t_collect: float,
                t_total: float, optimizer_steps: int, stage: str = "") -> list[tuple[int, dict[str, float], dict]]:
        """(step, values, extra) of every metrics record of an iteration: its steps, then the summary
        (`optimizer_steps`: the run's count after the iteration). `stage` (the iteration's loss
        variant, or "kd-warmup") goes into every record's extra fields; the summary's extra fields
        carry `alarms` ({name: message}, `alarms.check_alarms`) when any fired."""
        base = optimizer_steps - len(steps)
        per_step = {k: stats[k] for k in ("queue_backlog", "staleness_mean", "staleness_max")}
        tag = {"stage": stage} if stage else {}
        out = [(base + i, {**m, **per_step}, {"iteration": iteration, "kind": "step", **tag})
               for i, m in enumerate(steps, 1)]
        summary = _summary(steps)
        summary.update(stats, collect_s=t_collect, iteration_s=t_total,
                       idle_frac=stats.get("queue_wait_s", 0.0) / t_total if t_total > 0 else 0.0)
        alarms = {a.name: a.message for a in check_alarms(summary)}
        out.append((optimizer_steps, {f"iter/{k}": v for k, v in summary.items()},
                    {"iteration": iteration, "kind": "iteration", **tag, **({"alarms": alarms} if alarms else {})}))
        return out

    def log(self, iteration: int, steps: list[dict[str, float]], stats: dict[str, float], t_collect: float,
            t_total: float, optimizer_steps: int, stage: str = "") -> list[Alarm]:
        """Writes the iteration's records and log line; returns the alarms it raised (each also logged
        as a warning)."""
        alarms: dict[str, str] = {}
        for step, values, extra in self.records(iteration, steps, stats, t_collect, t_total, optimizer_steps, stage):
            self.metrics.log(step, values, **extra)
            alarms.update(extra.get("alarms", {}))
        for name, message in alarms.items():
            log.warning("iter %d: alarm %s: %s", iteration, name, message)
        summary = _summary(steps)
        msg = (f"iter {iteration}/{self.total_iterations} [{stage or '-'}] loss {summary['loss']:.4f} "
               f"pg {summary['pg_loss']:.4f} "
               f"fkl {summary['fkl_loss']:.4f} gate {summary.get('gate_ratio', 0):.3f} "
               f"stale {stats['staleness_mean']:.2f} backlog {int(stats['queue_backlog'])}")
        log.info(msg)
        if self.progress is not None:
            self.progress.set_postfix(stage=stage or "-", loss=f"{summary['loss']:.4f}", gate=f"{summary.get('gate_ratio', 0):.2f}",
                                      stale=f"{stats['staleness_mean']:.1f}", backlog=int(stats["queue_backlog"]),
                                      **({"alarm": ",".join(alarms)} if alarms else {}))
            self.progress.update(1)
        return [Alarm(name, message) for name, message in alarms.items()]

    def stopped(self, iteration: int, optimizer_steps: int, reason: str) -> None:
        """The record of a run stopped by `train.stop_on` (kind "stop", its `reason`), for `eopd run`."""
        self.metrics.log(optimizer_steps, {}, iteration=iteration, kind="stop", reason=reason)
        log.error("stopping the run: %s", reason)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        self.metrics.close()
