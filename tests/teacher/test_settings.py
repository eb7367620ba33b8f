"""One settings object: CLI flags > EOPD_TEACHER_* env vars > YAML > defaults, unknown keys refused."""

from __future__ import annotations

import argparse

import pytest

from eopd_teacher.settings_base import SettingsError, add_arguments, load_settings, settings_from_args
from eopd_teacher.settings import TeacherSettings


def test_precedence(tmp_path, monkeypatch):
    cfg = tmp_path / "t.yaml"
    cfg.write_text("model: tiny-random\ngrpc_port: 1111\nhttp_port: 2222\nmax_top_k: 32\n")
    monkeypatch.setenv("EOPD_TEACHER_GRPC_PORT", "3333")
    monkeypatch.setenv("EOPD_TEACHER_HTTP_PORT", "4444")
    p = argparse.ArgumentParser()
    add_arguments(p, TeacherSettings)
    args = p.parse_args(["--config", str(cfg), "--http-port", "5555", "--no-compile-statistics"])
    s = settings_from_args(TeacherSettings, args)
    assert (s.model, s.grpc_port, s.http_port, s.max_top_k, s.compile_statistics) == ("tiny-random", 3333, 5555, 32, False)
    with pytest.raises(Exception):
        s.grpc_port = 1  # frozen


def test_errors_name_the_field(tmp_path):
    cfg = tmp_path / "t.yaml"
    cfg.write_text("modle: x\n")
    with pytest.raises(SettingsError, match="modle"):
        load_settings(TeacherSettings, cfg)
    with pytest.raises(SettingsError, match="grpc_port"):
        load_settings(TeacherSettings, None, {"grpc_port": "70000"})
    with pytest.raises(SettingsError, match="default_top_k"):
        load_settings(TeacherSettings, None, {"default_top_k": "100", "max_top_k": "64"})
    with pytest.raises(SettingsError, match="not found"):
        load_settings(TeacherSettings, tmp_path / "missing.yaml")


def test_cli_rejects_bad_settings_with_exit_2(capsys):
    from eopd_teacher.cli.main import main

    assert main(["serve", "--engine", "tensorrt"]) == 2
    assert "engine" in capsys.readouterr().err


def test_engine_settings_are_the_engines_part(tmp_path):
    """The engine sees the model, dtype, device, statistics and vLLM settings and warms up at the
    default top-k; none of the network, security or admission settings."""
    from eopd_teacher.engines import create_engine
    from eopd_teacher.settings import EngineSettings

    s = TeacherSettings(model="tiny-random", dtype="bfloat16", device="cpu", cache_dir=tmp_path, threads=3, chunk_size=7,
                        compile_statistics=False, fp32_projection=True, share_prefill=False, default_top_k=5, max_top_k=9,
                        vllm_kv_cache_gib=0.5, vllm_max_model_len=128, grpc_port=0)
    e = s.engine_settings()
    assert e == EngineSettings(
        model="tiny-random", engine="transformers", dtype="bfloat16", device="cpu", cache_dir=tmp_path, threads=3,
        chunk_size=7, prefill_chunk_tokens=512, generate_step_ms=50.0, compile_statistics=False, fp32_projection=True,
        share_prefill=False, warmup_top_k=5,
        vllm_tensor_parallel_size=1,
        vllm_gpu_memory_utilization=0.85, vllm_kv_cache_gib=0.5, vllm_max_model_len=128,
        vllm_max_num_batched_tokens=None, vllm_enforce_eager=True,
    )
    assert e.resolved_device() == "cpu"
    for name in ("max_top_k", "grpc_port", "auth_token", "max_sequences_per_request", "max_tokens_per_request"):
        assert not hasattr(e, name), name
    with pytest.raises(Exception):
        e.model = "x"  # frozen
    # create_engine takes the service's settings (or the engine's part) and hands the engine its part.
    assert create_engine(s).settings == e == create_engine(e).settings


def test_device_aware_defaults_resolve_from_the_device():
    """dtype, chunked prefill and the client share follow the device (issue 30): today's values on a CPU,
    bf16 with whole batches (a client's share = a whole batch) on CUDA; explicit values always win."""
    from eopd_teacher.settings import device_defaults

    cpu = TeacherSettings(device="cpu")
    assert (cpu.dtype, cpu.prefill_chunk_tokens, cpu.max_batch_tokens_per_client) == ("float32", 512, 4096)
    gpu = TeacherSettings(device="cuda:0", max_batch_tokens=32768)  # a profile, not a device: no GPU needed here
    assert (gpu.dtype, gpu.prefill_chunk_tokens, gpu.max_batch_tokens_per_client) == ("bfloat16", 0, 32768)
    assert device_defaults(True, 100) == {"dtype": "bfloat16", "prefill_chunk_tokens": 0, "max_batch_tokens_per_client": 100}
    explicit = load_settings(TeacherSettings, None, {"device": "cuda", "dtype": "float32", "prefill_chunk_tokens": "256",
                                                      "max_batch_tokens_per_client": "auto"})
    assert (explicit.dtype, explicit.prefill_chunk_tokens, explicit.max_batch_tokens_per_client) == ("float32", 256, 16384)
    import torch

    auto = TeacherSettings()  # device auto: whatever this machine has
    assert auto.dtype == ("bfloat16" if torch.cuda.is_available() else "float32")
    assert auto.engine_settings().dtype == auto.dtype


def test_device_aware_settings_refuse_bad_values_by_name(monkeypatch):
    monkeypatch.setenv("EOPD_TEACHER_PREFILL_CHUNK_TOKENS", "-1")
    with pytest.raises(SettingsError, match="prefill_chunk_tokens"):
        load_settings(TeacherSettings)
    monkeypatch.setenv("EOPD_TEACHER_PREFILL_CHUNK_TOKENS", "auto")
    assert load_settings(TeacherSettings, None, {"device": "cpu"}).prefill_chunk_tokens == 512
    with pytest.raises(SettingsError, match="max_batch_tokens_per_client"):
        load_settings(TeacherSettings, None, {"max_batch_tokens_per_client": "0"})
    with pytest.raises(SettingsError, match="device 'tpu'"):
        load_settings(TeacherSettings, None, {"device": "tpu"})


def test_serving_needs_client_authentication_or_the_explicit_opt_out(tmp_path, monkeypatch):
    """No token, no client CA: `auth_refusal` names every way out; a token (file or value), mutual
    TLS, or insecure_no_auth (the flag or its environment variable) lets the server start."""
    for name in ("EOPD_TEACHER_AUTH_TOKEN", "EOPD_TEACHER_AUTH_TOKEN_FILE", "EOPD_TEACHER_INSECURE_NO_AUTH"):
        monkeypatch.delenv(name, raising=False)
    refusal = TeacherSettings().auth_refusal()
    assert refusal is not None and "--auth-token-file" in refusal and "--create-token" in refusal
    assert "--insecure-no-auth" in refusal and "EOPD_TEACHER_INSECURE_NO_AUTH=1" in refusal
    assert TeacherSettings(auth_token="t").auth_refusal() is None
    assert TeacherSettings(insecure_no_auth=True).client_auth() is None
    assert TeacherSettings(insecure_no_auth=True).auth_refusal() is None
    monkeypatch.setenv("EOPD_TEACHER_INSECURE_NO_AUTH", "1")
    assert TeacherSettings().auth_refusal() is None


def test_create_token_needs_a_file_and_keeps_an_existing_one(tmp_path):
    """create_token names the file it creates (an error naming the field without one); a missing
    file is not an error then (serve creates it), an existing one is read as the token."""
    with pytest.raises(Exception, match="create_token: needs auth_token_file"):
        TeacherSettings(create_token=True)
    missing = tmp_path / "teacher.token"
    s = TeacherSettings(auth_token_file=missing, create_token=True)
    assert s.client_auth() == "token" and s.auth_refusal() is None
    with pytest.raises(Exception, match="auth_token_file"):
        TeacherSettings(auth_token_file=missing)  # without create_token a missing file is an error
    missing.write_text("kept\n")
    assert TeacherSettings(auth_token_file=missing, create_token=True).bearer_token() == "kept"
