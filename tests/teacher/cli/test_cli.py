"""The CLI commands as written in the README, against the real server."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from eopd_teacher.client import TeacherClient
from tests.procs import COMPILED, ROOT, TeacherProc, restart_port, running_teacher, spawn, wait_teacher_ready

pytestmark = pytest.mark.integration


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eopd_teacher.cli", *args], capture_output=True, text=True, timeout=300)


def test_info(tiny_teacher):
    out = _run("info", "--target", tiny_teacher.target)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["model_name"] == "tiny-random" and info["vocab_size"] == 49152


def test_score_text_and_token_ids(tiny_teacher, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(
        json.dumps({"id": "t", "prompt": "What is 2 + 3?", "response": " It is 5.", "chat": True}) + "\n"
        + json.dumps({"id": "ids", "token_ids": [5, 6, 7, 8], "score_from": 2}) + "\n"
    )
    dst = tmp_path / "out.jsonl"
    out = _run("score", "--target", tiny_teacher.target, "--input", str(src), "--output", str(dst), "--top-k", "4")
    assert out.returncode == 0, out.stderr
    recs = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["id"] for r in recs] == ["t", "ids"]
    text = recs[0]
    n = len(text["token_ids"])
    assert n >= 3 and len(text["entropies"]) == n and len(text["topk_ids"]) == n and len(text["topk_ids"][0]) == 4
    assert "".join(text["tokens"]).strip() == "It is 5."
    assert recs[1]["token_ids"] == [7, 8] and len(recs[1]["token_logprobs"]) == 2


def test_score_reports_bad_input_line(tiny_teacher, tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps({"id": "x", "text": "no response field"}) + "\n")
    out = _run("score", "--target", tiny_teacher.target, "--input", str(src))
    assert out.returncode != 0 and "line 1" in (out.stderr + out.stdout)


def test_score_text_with_unusable_tokenizer_says_so(tiny_teacher, tmp_path):
    src = tmp_path / "text.jsonl"
    src.write_text(json.dumps({"id": "t", "prompt": "Hi", "response": " there"}) + "\n")
    out = _run("score", "--target", tiny_teacher.target, "--input", str(src), "--tokenizer", str(tmp_path / "no-such-model"))
    assert out.returncode != 0
    assert "cannot load the tokenizer of --tokenizer" in out.stderr and "Traceback" not in out.stderr, out.stderr


def _console_script() -> str:
    """The installed `eopd-teacher` executable of this environment."""
    beside = Path(sys.executable).parent / "eopd-teacher"
    found = str(beside) if beside.is_file() else shutil.which("eopd-teacher")
    assert found, "eopd-teacher console script not installed"
    return found


@pytest.mark.slow
def test_readme_commands_on_smollm2():
    """The issue's commands as written, through the installed console script: serve SmolLM2,
    then `info` and `score` on the example file."""
    exe = _console_script()
    gp, hp = restart_port(), restart_port()
    base = spawn([exe, "serve", "--model", "smollm2-135m", "--host", "127.0.0.1", "--grpc-port", str(gp), "--http-port", str(hp),
                  "--insecure-no-auth"],
                 name="teacher-smollm2", env=COMPILED)
    proc = TeacherProc("teacher", base.popen, base.log_path, grpc_port=gp, http_port=hp)
    try:
        wait_teacher_ready(proc, timeout=300)
        target = f"127.0.0.1:{gp}"

        def run(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)

        out = run("info", "--target", target)
        assert out.returncode == 0, out.stderr
        info = json.loads(out.stdout)
        assert info["model_name"] == "smollm2-135m" and info["vocab_size"] == 49152
        assert info["engine"] == "transformers" and len(info["tokenizer_fingerprint"]) == 64

        example = "examples/score_example.jsonl"
        rows = [json.loads(line) for line in (ROOT / example).read_text().splitlines() if line.strip()]
        out = run("score", "--target", target, "--input", example)
        assert out.returncode == 0, out.stderr
        recs = [json.loads(line) for line in out.stdout.splitlines()]
    finally:
        proc.stop()
    assert [r["id"] for r in recs] == [r["id"] for r in rows]
    for row, rec in zip(rows, recs, strict=True):
        lp = np.asarray(rec["token_logprobs"])
        ent = np.asarray(rec["entropies"])
        ti = np.asarray(rec["topk_ids"])
        tv = np.asarray(rec["topk_logprobs"])
        n = len(rec["token_ids"])
        assert n >= 1 and lp.shape == ent.shape == (n,) and ti.shape == tv.shape == (n, 16), rec["id"]
        assert np.isfinite(lp).all() and np.isfinite(ent).all() and np.isfinite(tv).all()
        assert (lp <= 0).all() and (tv <= 0).all() and (ent >= 0).all()
        assert ((ti >= 0) & (ti < 49152)).all()
        assert (np.diff(tv, axis=1) <= 0).all(), "top-k not sorted by descending probability"
        assert (lp <= tv[:, 0] + 1e-5).all()  # no token is likelier than the top-1
        assert rec["mean_logprob"] == pytest.approx(lp.mean(), abs=1e-6)
        if "token_ids" in row:
            assert rec["token_ids"] == row["token_ids"][row["score_from"]:]
        else:
            assert "".join(rec["tokens"]).strip() == row["response"].strip()


def test_serve_on_port_zero_reports_its_ports(tmp_path):
    """`serve` on port 0 for both servers with --ports-file: once bound, the file holds both ports
    and the pid (written atomically: no temp file left beside it), the teacher answers on them
    (GetModelInfo over gRPC, /healthz and /readyz over HTTP) and its log names the same ports."""
    exe = _console_script()
    ports_file = tmp_path / "teacher.ports.json"
    base = spawn([exe, "serve", "--model", "tiny-random", "--host", "127.0.0.1", "--grpc-port", "0", "--http-port", "0",
                  "--ports-file", str(ports_file), "--insecure-no-auth"], name="teacher-port0")
    try:
        deadline = time.monotonic() + 120
        while not ports_file.exists():
            assert base.alive(), f"teacher exited with {base.popen.returncode}:\n{base.log()[-4000:]}"
            assert time.monotonic() < deadline, f"no ports file after 120 s:\n{base.log()[-4000:]}"
            time.sleep(0.1)
        ports = json.loads(ports_file.read_text())
        assert set(ports) == {"grpc_port", "http_port", "pid", "http_scheme"} and ports["pid"] == base.popen.pid, ports
        assert ports["http_scheme"] == "http"  # "https" with TLS on (tests/reliability/test_security.py)
        gp, hp = ports["grpc_port"], ports["http_port"]
        assert gp > 0 and hp > 0 and gp != hp, ports
        assert [p.name for p in tmp_path.iterdir()] == [ports_file.name]
        proc = TeacherProc("teacher", base.popen, base.log_path, grpc_port=gp, http_port=hp)
        wait_teacher_ready(proc, timeout=120)  # /readyz 200 on the reported HTTP port
        with urllib.request.urlopen(f"{proc.http}/healthz", timeout=10) as r:
            assert r.status == 200 and json.loads(r.read()) == {"status": "alive"}
        with TeacherClient(proc.target, timeout=30) as client:
            info = client.info()
        assert info.model_name == "tiny-random" and info.vocab_size == 49152
        assert f"listening grpc=127.0.0.1:{gp} " in base.log() and f" http=127.0.0.1:{hp} " in base.log(), base.log()
    finally:
        code = base.stop()
    assert code == 0, base.log()[-4000:]


def test_score_rpc_error_names_the_input_line_without_traceback(tiny_teacher, tmp_path):
    """A request the server refuses: exit 1 and `line N (id ...): CODE: details`, N the line of the
    failing sequence in the file (blank lines counted, not its index within a request chunk)."""
    src = tmp_path / "in.jsonl"
    rows = [
        {"id": "a", "token_ids": [1, 2, 3], "score_from": 1},
        {"id": "b", "token_ids": [1, 2, 3], "score_from": 1},
        {"id": "c", "token_ids": [4, 5, 6], "score_from": 1},
        {"id": "d", "token_ids": [7, 49152, 8], "score_from": 1},  # out of the vocabulary
    ]
    src.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + "\n".join(json.dumps(r) for r in rows[2:]) + "\n")
    out = _run("score", "--target", tiny_teacher.target, "--input", str(src), "--batch-size", "2")
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    assert "line 5 (id 'd'): INVALID_ARGUMENT: " in out.stderr and "sequences[1].token_ids[1]" in out.stderr, out.stderr


def test_info_unreachable_is_a_message_not_a_traceback():
    from tests.procs import free_port

    out = _run("info", "--target", f"127.0.0.1:{free_port()}", "--timeout", "1")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("eopd-teacher info: ") and "not ready after 1.0s" in out.stderr, out.stderr


def test_serve_help_renders_factory_defaults():
    out = _run("serve", "--help")
    assert out.returncode == 0 and "PydanticUndefined" not in out.stdout
    from eopd_common.models import default_cache_dir

    # argparse wraps the help at spaces and after hyphens ("/tmp/cold-cache" -> "cold-" + newline + "cache"):
    # compared with all whitespace taken out
    help_of_cache_dir = "".join(out.stdout.split("  --cache-dir CACHE_DIR", 1)[1].split("  --threads", 1)[0].split())
    assert "".join(f"(default: {default_cache_dir()})".split()) in help_of_cache_dir, help_of_cache_dir


def _readme_python_blocks(section: str) -> list[str]:
    """The ```python blocks of one `## section` of the README, in order."""
    text = (ROOT / "README.md").read_text()
    start = text.index(f"## {section}\n")
    end = text.find("\n## ", start + 1)
    body = text[start:end if end != -1 else None]
    blocks = body.split("```python\n")[1:]
    return [b.split("\n```", 1)[0] for b in blocks]


def test_readme_python_examples_run(tmp_path, monkeypatch, capsys):
    """The README's Python examples as written (only the address changed), against a real server
    started as the README starts it (`--auth-token-file ~/.eopd-teacher.token --create-token`, HOME
    a temporary directory): the sync score and the async stream with on_error="yield" and two streams."""
    blocks = _readme_python_blocks("Use the teacher")
    assert len(blocks) == 2, "README's 'Use the teacher' section should hold the sync and the streaming example"
    env: dict = {}
    with running_teacher("tiny-random", "--auth-token-file", str(tmp_path / ".eopd-teacher.token"), "--create-token") as t:
        monkeypatch.setenv("HOME", str(tmp_path))  # for the examples' Path.home(), not the teacher's caches
        for block in blocks:
            assert "127.0.0.1:50051" in block
            exec(compile(block.replace("127.0.0.1:50051", t.target), "README.md", "exec"), env)  # noqa: S102
    s = env["s"]
    n = len(env["token_ids"]) - env["prompt_len"]
    assert s.token_logprobs.shape == (n,) and s.entropies.shape == (n,) and s.topk_ids.shape == (n, 16)
    assert env["info"].vocab_size == 49152
    lines = capsys.readouterr().out.splitlines()
    assert sorted(line.split()[0] for line in lines) == sorted(f"req-{i}" for i in range(8))
    # Every request answered with scores (no RequestFailed: the example's requests are valid).
    assert all(float(line.split()[1]) > 0 for line in lines), lines
