"""Prometheus metrics of a rollout worker."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server


class WorkerMetrics:
    """Prometheus metrics of a rollout worker (served with --prometheus-port)."""

    def __init__(self, port: int = 0):
        self.published = Counter("eopd_rollout_published_total", "Scored rollouts published")
        self.tokens = Counter("eopd_rollout_response_tokens_total", "Response tokens sampled and scored")
        self.reclaimed = Counter("eopd_rollout_tasks_reclaimed_total", "Tasks taken over from idle workers")
        self.dead = Counter("eopd_rollout_dead_letters_total", "Tasks sent to the dead-letter stream")
        self.version = Gauge("eopd_rollout_policy_version", "Policy version the worker samples with")
        self.sample_seconds = Histogram("eopd_rollout_sample_seconds", "Sampling + old log-probs per task batch")
        self.backpressure_waits = Counter("eopd_rollout_backpressure_waits_total", "Publishes delayed by a full stream")
        self.stream_restarts = Counter("eopd_rollout_teacher_stream_restarts_total",
                                       "Teacher streams abandoned after teacher.timeout_s without an answer")
        self.unscored = Counter("eopd_rollout_unscored_total", "Rollouts the teacher did not score (their task is "
                                "dead-lettered), by status code, or bad_answer for an answer that does not match the request",
                                ["reason"])
        self.reload_failures = Counter("eopd_rollout_weight_reload_failures_total",
                                       "Announced weights that could not be loaded (missing, sha256 mismatch, "
                                       "rewritten while read); retried")
        self.reload_seconds = Histogram("eopd_rollout_weight_reload_seconds",
                                        "Loading an announced policy version into the sampler (in place)")
        if port:
            start_http_server(port)

    def time_summary(self) -> str:
        """The worker's sampling and weight-load seconds so far, for its last log line (bench_e2e's
        time split reads it: `sampling S s in N rounds, weight loads S s in N`)."""
        (sample_s, rounds), (reload_s, loads) = _total(self.sample_seconds), _total(self.reload_seconds)
        return f"sampling {sample_s:.2f} s in {rounds} rounds, weight loads {reload_s:.2f} s in {loads}"


def _total(histogram: Histogram) -> tuple[float, int]:
    """(sum of the observations, their count) of an unlabelled histogram."""
    values = {s.name.rsplit("_", 1)[-1]: s.value for family in histogram.collect() for s in family.samples}
    return values["sum"], int(values["count"])
