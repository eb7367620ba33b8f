"""`eopd_common.vllm_args`: the `vllm.LLM` arguments the teacher's engine and the student's sampler
share, the CPU default KV cache size, and the process set-up before vLLM starts. vLLM is not needed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from eopd_common.vllm_args import (
    CPU_DEFAULT_KV_CACHE_GIB,
    GiB,
    describe_kwargs,
    engine_kwargs,
    prepare_vllm_process,
)

COMMON = dict(dtype="bfloat16", tensor_parallel_size=2, gpu_memory_utilization=0.85, enforce_eager=False)


def test_common_kwargs_on_gpu_leave_the_kv_cache_to_vllm():
    assert GiB == 1 << 30 and CPU_DEFAULT_KV_CACHE_GIB == 1.0
    assert engine_kwargs(**COMMON, kv_cache_gib=None, max_model_len=None, on_cpu=False) == COMMON


def test_cpu_default_kv_cache_and_explicit_sizes():
    on_cpu = engine_kwargs(**COMMON, kv_cache_gib=None, max_model_len=None, on_cpu=True)
    assert on_cpu == {**COMMON, "kv_cache_memory_bytes": 1 << 30}
    for cpu in (True, False):  # an explicit size wins everywhere
        kw = engine_kwargs(**COMMON, kv_cache_gib=0.25, max_model_len=4096, on_cpu=cpu)
        assert kw == {**COMMON, "kv_cache_memory_bytes": (1 << 30) // 4, "max_model_len": 4096}
        assert isinstance(kw["kv_cache_memory_bytes"], int)


def test_describe_kwargs():
    kw = {"runner": "pooling", "pooler_config": object(), "dtype": "float32", "seed": 0}
    assert describe_kwargs(kw, skip=("pooler_config",)) == "runner=pooling, dtype=float32, seed=0"
    assert describe_kwargs({"a": 1}) == "a=1"


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    yield monkeypatch
    torch.set_num_threads(threads)


def test_process_setup_defaults(clean_env):
    prepare_vllm_process()
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # in-process engine core
    assert os.environ["OMP_NUM_THREADS"] == str(torch.get_num_threads())


def test_process_setup_keeps_what_the_environment_says(clean_env):
    clean_env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    clean_env.setenv("OMP_NUM_THREADS", "3")
    before = torch.get_num_threads()
    prepare_vllm_process(0)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1" and os.environ["OMP_NUM_THREADS"] == "3"
    assert torch.get_num_threads() == before


def test_process_setup_with_threads_sets_both(clean_env):
    clean_env.setenv("OMP_NUM_THREADS", "7")
    prepare_vllm_process(threads=1)
    assert os.environ["OMP_NUM_THREADS"] == "1" and torch.get_num_threads() == 1


def test_importing_needs_neither_vllm_nor_torch():
    code = "import sys, eopd_common.vllm_args; print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"
