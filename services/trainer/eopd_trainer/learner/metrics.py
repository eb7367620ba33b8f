"""Metrics of the learner and the rollout workers: TensorBoard, Prometheus, a JSONL log, progress.

`MetricsSink.log(step, values)` writes one record to `<run_dir>/<name>_metrics.jsonl` (the data
of `eopd report`), TensorBoard scalars under `<run_dir>/tb/<name>` and Prometheus gauges named
`eopd_<name>_<key>` (served on `logging.prometheus_port` when set).

A resumed learner continues them without duplicated steps: `trim_records` drops the JSONL records
of iterations after the committed one (a crash left them; they are trained again), and the
TensorBoard writer is opened with `purge_step` (the first step it will write), which hides the
events a crashed attempt wrote from that step on.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from pathlib import Path

from eopd_common.atomic_files import write_atomic
from prometheus_client import Gauge, start_http_server

from .state import LearnerState

log = logging.getLogger(__name__)


def _prom_name(prefix: str, key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", f"eopd_{prefix}_{key}")


class MetricsSink:
    def __init__(self, run_dir: Path, name: str, *, tensorboard: bool = True, prometheus_port: int = 0,
                 enabled: bool = True, purge_step: int | None = None):
        self.name = name
        self.enabled = enabled
        self._gauges: dict[str, object] = {}
        self._tb = None
        self._fh = None
        if not enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self._fh = open(run_dir / f"{name}_metrics.jsonl", "a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # purge_step: a resumed run hides what an interrupted attempt logged from this step on
                self._tb = SummaryWriter(log_dir=str(run_dir / "tb" / name), purge_step=purge_step)
            except ImportError:  # pragma: no cover - tensorboard is a trainer dependency
                log.warning("tensorboard is not installed: no TensorBoard events")
        if prometheus_port:
            start_http_server(prometheus_port)
            log.info("Prometheus metrics on :%d/metrics", prometheus_port)

    def _gauge(self, key: str):
        g = self._gauges.get(key)
        if g is None:
            g = self._gauges[key] = Gauge(_prom_name(self.name, key), f"{self.name} {key}")
        return g

    def log(self, step: int, values: dict[str, float], **extra) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in values.items() if v is not None and isinstance(v, (int, float))}
        record = {"step": step, "time": time.time(), **extra, **clean}
        for k, v in clean.items():  # gauges first: whoever sees the record in the file can scrape all of it
            if math.isfinite(v):
                if self._tb is not None:
                    self._tb.add_scalar(k, v, step)
                self._gauge(k).set(v)
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
        if self._fh is not None:
            self._fh.close()


def trim_records(path: Path, iteration: int) -> bool:
    """Removes the records of iterations after `iteration` (the committed one) from a JSONL metrics
    file, atomically; returns whether the file holds the `"kind": "iteration"` record of `iteration`
    itself (a learner killed between its commit and its log line has not written it). A partial
    last line (killed mid-write) goes too."""
    path = Path(path)
    if not path.is_file():
        return iteration == 0
    keep, has = [], iteration == 0
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if int(rec.get("iteration", 0)) > iteration:
            continue
        has = has or (rec.get("kind") == "iteration" and int(rec.get("iteration", 0)) == iteration)
        keep.append(line + "\n")
    write_atomic(path, "".join(keep))
    return has


def resumed_sink(run_dir: Path, name: str, state: LearnerState, *, enabled: bool = True, **kwargs) -> MetricsSink:
    """The learner's sink, continuing what an earlier attempt logged: the records of iterations after
    the committed one (`state.iteration`) are removed, TensorBoard purges from the first step
    this attempt will write, and the committed iteration's records are written from the checkpoint
    (`state.metrics`) if the crash came between the commit and its log line."""
    path = Path(run_dir) / f"{name}_metrics.jsonl"
    earlier = enabled and path.exists()
    has_committed = trim_records(path, state.iteration) if earlier else True
    sink = MetricsSink(run_dir, name, enabled=enabled, purge_step=state.optimizer_steps + 1 if earlier else None,
                       **kwargs)
    if not has_committed:
        for rec in state.metrics:
            sink.log(rec["step"], rec["values"], iteration=rec["iteration"], kind=rec["kind"])
    return sink


def token_weighted_mean(rows: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """Averages metric dicts weighted by their token counts (keys missing in a row are skipped)."""
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for metrics, n in rows:
        for k, v in metrics.items():
            if v is None or not math.isfinite(float(v)):
                continue
            sums[k] = sums.get(k, 0.0) + float(v) * n
            weights[k] = weights.get(k, 0.0) + n
    return {k: sums[k] / weights[k] for k in sums if weights[k] > 0}
