"""Fixtures of the vLLM tier's teacher tests (test_vllm_engine.py, test_vllm_generate.py). Nothing
here imports vLLM: the engine imports it when it loads."""

from __future__ import annotations

import pytest

from eopd_teacher.engines.vllm_engine import VllmEngine
from eopd_teacher.settings import TeacherSettings


class _Engines:
    """At most one live vLLM engine per process: asking for another model shuts the current one."""

    def __init__(self):
        self.current: VllmEngine | None = None

    def get(self, model: str) -> VllmEngine:
        if self.current is not None and self.current.settings.model == model:
            return self.current
        self.close()
        eng = VllmEngine(TeacherSettings(model=model, engine="vllm", chunk_size=7, compile_statistics=False).engine_settings())
        eng.load()
        self.current = eng
        return eng

    def close(self) -> None:
        if self.current is not None:
            self.current.shutdown()
            self.current = None


@pytest.fixture(scope="session")
def engines():
    e = _Engines()
    yield e
    e.close()


# The environment of the vLLM tier's teacher subprocesses: the engine core in-process (starts in
# seconds), quieter logs.
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}


@pytest.fixture(scope="session")
def vllm_server():
    """One `eopd-teacher serve --engine vllm` subprocess of tiny-random over TCP, shared by the tests
    that score and generate through it (what they check is the server's answers, not its start)."""
    from tests.procs import running_teacher

    with running_teacher("tiny-random", "--engine", "vllm", "--vllm-kv-cache-gib", "0.5", env=VLLM_ENV, timeout=300) as proc:
        yield proc
