"""The default server (compile_statistics on) on a machine without a C++ compiler: torch.compile
cannot build its kernels, the engine falls back to the eager statistics path with one warning,
says so (/readyz, /metrics, log) and serves the reference numbers."""

from __future__ import annotations

import http.client
import json
import shutil

import numpy as np
import pytest

from eopd_common.models import load_causal_lm
from eopd_teacher.client import TeacherClient
from tests.procs import COMPILED, running_teacher

from ..reference import assert_topk_match, reference_scores

pytestmark = pytest.mark.integration


def _get(port: int, path: str) -> tuple[int, dict, str]:
    """One GET without following redirects."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read().decode()
    finally:
        conn.close()


def test_server_without_cxx_compiler_serves_eager_statistics(tmp_path):
    # torch._inductor looks for a compiler in torch._inductor.config.cpp.cxx = (None, $CXX or "g++"):
    # None (a conda download) only with TORCH_INDUCTOR_INSTALL_GXX, then `$CXX --version`. A CXX that
    # does not exist, an empty PATH (the server is started by absolute interpreter path) and a fresh
    # inductor cache (no kernel built earlier can be reused) leave it no compiler at all.
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    env = {
        "CXX": str(tmp_path / "no-such-g++"),
        "CC": str(tmp_path / "no-such-gcc"),
        "PATH": str(empty_bin),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache"),
        "TORCH_INDUCTOR_INSTALL_GXX": "",
        **COMPILED,
    }
    for tool in ("g++", "gcc", "cc", "c++", "clang", "clang++"):
        assert shutil.which(tool, path=env["PATH"]) is None
    ref = load_causal_lm("tiny-random").model
    with running_teacher("tiny-random", env=env) as proc:  # compile_statistics on, as by default
        status, _, body = _get(proc.http_port, "/readyz")
        assert status == 200 and json.loads(body)["statistics"] == "eager"
        rng = np.random.default_rng(5)
        seqs = [(f"s{i}", rng.integers(0, 49152, int(n)).tolist(), 2) for i, n in enumerate(rng.integers(4, 40, 5))]
        with TeacherClient(proc.target) as c:
            results = c.score(seqs, top_k=8)
        for (_, ids, score_from), r in zip(seqs, results, strict=True):
            lp, ent, ti, tv = reference_scores(ref, ids, score_from, 8, 1.0)
            np.testing.assert_allclose(r.token_logprobs, lp, atol=1e-4, rtol=0)
            np.testing.assert_allclose(r.entropies, ent, atol=1e-4, rtol=0)
            assert_topk_match(r.topk_ids, r.topk_logprobs, ti, tv)
        status, headers, metrics = _get(proc.http_port, "/metrics")
        assert status == 200 and headers["content-type"].startswith("text/plain")
        assert "eopd_teacher_statistics_compiled 0.0" in metrics
        log = proc.log()
    assert log.count("torch.compile of the statistics failed") == 1, log[-3000:]
    assert "InvalidCxxCompiler" in log and "eager statistics" in log


def test_metrics_answered_without_redirect(tiny_teacher):
    status, headers, body = _get(tiny_teacher.http_port, "/metrics")
    assert status == 200, (status, headers.get("location"))
    assert headers["content-type"].startswith("text/plain") and "eopd_teacher_ready 1.0" in body
    # The default server compiles its statistics (this machine has a compiler).
    assert "eopd_teacher_statistics_compiled 1.0" in body
