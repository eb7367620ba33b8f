"""`eopd run / eval / report` without starting processes: config validation (the GPU preset
included), the layer-subset student, the evaluation on tiny models, the report's figures."""

from __future__ import annotations

import contextlib
import html
import json
import re
import shutil
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from eopd_trainer.config import load_config

from tests.procs import ROOT

CONFIGS = ROOT / "configs"


@pytest.mark.parametrize("preset", ["tiny", "smollm2-cpu", "qwen3-paper"])
def test_presets_validate(preset, capsys):
    from eopd_trainer.cli import main

    assert main(["run", "--config", str(CONFIGS / f"{preset}.yaml"), "--validate-only"]) == 0
    assert "is valid" in capsys.readouterr().out


def test_the_far_student_preset_is_the_default_but_for_its_student():
    """configs/smollm2-far.yaml (issue 35) differs from the default preset only in its student (the
    path scripts/far_student.py --build writes, relative to the file), run_dir and queue namespace,
    and its loss: it keeps the paper's `eopd`, which its experiment ran (the default's `eopd_rkl` was
    chosen on the near student only); the archived choice it names drops the layers the file says."""
    default = load_config(CONFIGS / "smollm2-cpu.yaml", ["loss.variant=eopd"]).model_dump(mode="json")
    far = load_config(CONFIGS / "smollm2-far.yaml").model_dump(mode="json")
    assert far["student"].pop("model") == str(ROOT / "runs" / "far-student" / "student")
    assert default["student"].pop("model") == "smollm2-135m[drop=14]"
    assert (far.pop("run_dir"), default.pop("run_dir")) == (str(ROOT / "runs" / "smollm2-far"), str(ROOT / "runs" / "smollm2-cpu"))
    assert (far["queue"].pop("namespace"), default["queue"].pop("namespace")) == ("eopd:smollm2-far", "eopd:smollm2-cpu")
    assert far == default
    choice = json.loads((ROOT / "docs" / "results" / "far-student" / "choice.json").read_text())
    assert choice["chosen"] == "8,10,12,14,16,18,20" and "(8, 10, 12, 14, 16, 18, 20)" in (CONFIGS / "smollm2-far.yaml").read_text()


def test_qwen3_paper_has_the_paper_hyperparameters():
    cfg = load_config(CONFIGS / "qwen3-paper.yaml")
    assert (cfg.train.batch_size, cfg.train.mini_batch_size, cfg.train.lr) == (128, 32, 3e-6)
    assert (cfg.teacher.top_k, cfg.loss.tau, cfg.loss.alpha, cfg.rollout.max_response_length) == (16, 0.8, 1.0, 4096)
    assert (cfg.eval.temperature, cfg.eval.top_p) == (1.0, 0.8)
    assert "Qwen3-8B" in cfg.teacher.model and "Qwen3-1.7B-Base" in cfg.student.model
    assert cfg.teacher.dtype == "bfloat16"  # the preset names its teacher's dtype (issue 31)


def test_validate_only_rejects_bad_values(capsys):
    from eopd_trainer.cli import main

    assert main(["run", "--config", str(CONFIGS / "qwen3-paper.yaml"), "--validate-only", "train.lr=-1"]) == 2
    assert "train.lr" in capsys.readouterr().err
    assert main(["run", "--config", str(CONFIGS / "tiny.yaml"), "--validate-only", "teacher.model="]) == 2
    assert main(["run", "--config", str(CONFIGS / "tiny.yaml"), "--validate-only",
                 "student.model=tiny-random[layers=a:b]"]) == 2


def test_layer_subset_student(tmp_path):
    import torch
    from eopd_common.models import load_causal_lm, materialise_spec, parse_layer_subset

    assert parse_layer_subset("smollm2-135m") is None
    assert parse_layer_subset("smollm2-135m[layers=0:30:3]") == ("smollm2-135m", slice(0, 30, 3))
    assert parse_layer_subset("x[layers=0,2]") == ("x", [0, 2])
    path = materialise_spec("tiny-random@0[layers=1]", tmp_path / "s")
    sub = load_causal_lm(path).model
    full = load_causal_lm("tiny-random@0").model
    assert sub.config.num_hidden_layers == 1
    sd_sub, sd_full = sub.state_dict(), full.state_dict()
    assert torch.equal(sd_sub["model.layers.0.mlp.up_proj.weight"], sd_full["model.layers.1.mlp.up_proj.weight"])
    assert torch.equal(sd_sub["lm_head.weight"], sd_full["lm_head.weight"])
    assert materialise_spec("tiny-random@0[layers=1]", tmp_path / "s") == path  # reused, deterministic


def test_layer_subset_built_in_a_child_process_is_the_same_model(tmp_path):
    """`materialise_spec_apart` (eopd run's supervisor): the child builds the same files, a spec
    without a subset is returned as is (no child), and the child's error is raised here as itself."""
    from eopd_common.models import materialise_spec, materialise_spec_apart

    assert materialise_spec_apart("tiny-random@0", tmp_path / "unused") == "tiny-random@0"
    assert not (tmp_path / "unused").exists()
    apart = Path(materialise_spec_apart("tiny-random@0[drop=0]", tmp_path / "apart"))
    here = Path(materialise_spec("tiny-random@0[drop=0]", tmp_path / "here"))
    assert (apart / "model.safetensors").read_bytes() == (here / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="out of range"):
        materialise_spec_apart("tiny-random@0[drop=2]", tmp_path / "bad")


def test_pruned_student_drops_the_named_layers(tmp_path):
    import torch
    from eopd_common.models import DroppedLayers, load_causal_lm, materialise_spec, parse_layer_subset

    assert parse_layer_subset("smollm2-135m[drop=14]") == ("smollm2-135m", DroppedLayers((14,)))
    assert parse_layer_subset("x[drop=20, 4,4]") == ("x", DroppedLayers((4, 20)))
    assert DroppedLayers((1, 3)).keep(5) == [0, 2, 4]
    for bad in ("x[drop=a]", "x[drop=]"):
        with pytest.raises(ValueError, match="drop="):
            parse_layer_subset(bad)
    with pytest.raises(ValueError, match="out of range"):
        materialise_spec("tiny-random@0[drop=2]", tmp_path / "bad")
    path = materialise_spec("tiny-random@0[drop=0]", tmp_path / "s")
    sub, full = load_causal_lm(path).model, load_causal_lm("tiny-random@0").model
    assert sub.config.num_hidden_layers == 1
    assert torch.equal(sub.state_dict()["model.layers.0.self_attn.q_proj.weight"],
                       full.state_dict()["model.layers.1.self_attn.q_proj.weight"])


def test_evaluate_model_on_tiny_models():
    from eopd_common.models import load_causal_lm
    from eopd_trainer.config import EvalConfig
    from eopd_trainer.data import render_prompt
    from eopd_trainer.eval.evaluate import evaluate_model, ks_for

    assert ks_for(1) == [1] and ks_for(4) == [1, 2, 4] and ks_for(6) == [1, 2, 4, 6]
    student, teacher = load_causal_lm("tiny-random@1"), load_causal_lm("tiny-random@0")
    prompts = [render_prompt(student.tokenizer, q) for q in ("What is 2 + 2?", "What is 3 * 3?")]
    ecfg = EvalConfig(n_samples=2, max_new_tokens=6, batch_size=4)
    r = evaluate_model(student.model, student.tokenizer, teacher.model, prompts, ["4", "9"], ecfg)
    assert r["avg_at_k"] == 0.0 and set(r["pass_at_k"]) == {"1", "2"}
    assert r["tokens"] > 0 and sum(r["entropy_hist_student"]) == r["tokens"] == sum(r["entropy_hist_teacher"])
    assert 0 <= r["high_entropy_share_student"] <= 1 and r["forward_kl"] > 0 and r["reverse_kl"] > 0
    same = evaluate_model(teacher.model, teacher.tokenizer, teacher.model, prompts, ["4", "9"], ecfg)
    assert abs(same["forward_kl"]) < 1e-6 and abs(same["reverse_kl"]) < 1e-6


def _fake_run(run_dir, variant):
    run_dir.mkdir()
    (run_dir / "run.yaml").write_text(f"loss:\n  variant: {variant}\n")
    with (run_dir / "train_metrics.jsonl").open("w") as fh:
        for it in range(1, 4):
            fh.write(json.dumps({"step": it, "kind": "step", "iteration": it, "loss": 1.0}) + "\n")
            fh.write(json.dumps({"step": it, "kind": "iteration", "iteration": it, "iter/loss": 3.0 - it,
                                 "iter/pg_loss": 1.0, "iter/fkl_loss": 2.0 - it, "iter/gate_ratio": 0.5,
                                 "iter/fkl_gated_mean": 1.0 / it, "iter/student_entropy": 2.0,
                                 "iter/teacher_entropy": 1.5}) + "\n")
    bins = [0.0, 1.0, 2.0, 3.0]
    model = {"n_samples": 4, "prompts": 8, "avg_at_k": 0.25, "pass_at_k": {"1": 0.25, "2": 0.4, "4": 0.6},
             "entropy_bins": bins, "entropy_hist_student": [5, 3, 1], "entropy_hist_teacher": [6, 2, 1],
             "high_entropy_share_student": 0.4, "high_entropy_share_teacher": 0.3, "fkl_high_entropy": 1.2,
             "reverse_kl": 0.9}
    (run_dir / "eval.json").write_text(json.dumps({"models": {"initial": model, "final": model}}))


def test_report_embeds_every_figure(tmp_path):
    from eopd_trainer.cli import main
    from eopd_trainer.eval.report import CURVES

    _fake_run(tmp_path / "opd", "opd")
    _fake_run(tmp_path / "eopd", "eopd")
    out = tmp_path / "r.html"
    assert main(["report", str(tmp_path / "opd"), str(tmp_path / "eopd"), "--out", str(out)]) == 0
    text = out.read_text()
    imgs = re.findall(r"<img alt='([^']+)' src='data:image/png;base64,([A-Za-z0-9+/=]+)'>", text)
    titles = [t for t, _ in imgs]
    assert [html.unescape(t) for t in titles] == [t for t, _ in CURVES] + ["Entropy histograms", "Pass@k"]
    assert all(len(b) > 1000 for _, b in imgs)
    assert "opd / final" in text and "eopd / initial" in text and "<td>25.0</td>" in text


def test_queue_backend_is_validated():
    from eopd_trainer.config import ConfigError

    assert load_config(CONFIGS / "tiny.yaml").queue.backend == "auto"
    assert load_config(CONFIGS / "tiny.yaml", ["queue.backend=embedded"]).queue.backend == "embedded"
    with pytest.raises(ConfigError, match=r"queue\.backend"):
        load_config(CONFIGS / "tiny.yaml", ["queue.backend=memory"])


def test_choose_queue_fallback_chain(tmp_path, monkeypatch):
    """Every branch of `queue.backend`, with real servers: an embedded queue stands in for "the
    Redis at REDIS_URL" (it speaks RESP over TCP); redis-server is hidden by making `which` fail."""
    import redis
    from eopd_trainer.config import QueueConfig
    from eopd_trainer.job.embedded_queue import EmbeddedQueue
    from eopd_trainer.job.local_queue import choose_queue
    from eopd_trainer.job.supervisor import RunError, Supervisor

    from tests.procs import free_port

    dead_url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    monkeypatch.setattr("eopd_trainer.job.local_queue.shutil.which", lambda name: None)
    monkeypatch.setenv("REDIS_PASSWORD", "for-the-external-redis")

    def pick(backend):
        sup = Supervisor(tmp_path / "logs")
        return sup, choose_queue(sup, tmp_path, QueueConfig(backend=backend))

    with EmbeddedQueue() as external:
        monkeypatch.setenv("REDIS_URL", external.url)
        monkeypatch.setenv("REDIS_PASSWORD", external.password)
        sup, q = pick("auto")  # REDIS_URL answers (with REDIS_PASSWORD): used as it is
        assert (q.backend, q.url) == ("redis", external.url) and sup.embedded is None
        sup, q = pick("embedded")  # forced: not the reachable REDIS_URL
        assert q.backend == "embedded" and q.url != external.url and q.password != external.password
        sup.stop_all()
        monkeypatch.setenv("REDIS_PASSWORD", "for-the-external-redis")

    monkeypatch.setenv("REDIS_URL", dead_url)
    sup, q = pick("auto")  # unreachable REDIS_URL, no redis-server: the embedded queue
    assert q.backend == "embedded" and sup.embedded is not None
    assert f"REDIS_URL={dead_url} does not answer; redis-server is not installed; using the embedded queue" in q.message
    assert "not persistent" in q.message
    assert sup.drop_env == ("REDIS_PASSWORD",)  # the external Redis' password goes to no child
    assert sup.child_env["REDIS_PASSWORD"] == q.password != "for-the-external-redis"  # the queue's own
    client = redis.Redis.from_url(q.auth_url)
    assert client.ping() and client.set("k", "v") and client.get("k") == b"v"
    sup.check()
    sup.stop_all()  # stops the embedded queue (after the children)
    assert not sup.embedded.alive()
    with pytest.raises(redis.exceptions.ConnectionError):
        redis.Redis.from_url(q.url, socket_connect_timeout=1).ping()
    with pytest.raises(RunError, match="the embedded queue's server thread stopped"):
        sup.check()

    with pytest.raises(RunError, match=r"queue.backend=redis and the Redis at REDIS_URL .* does not answer"):
        pick("redis")
    with pytest.raises(RunError, match="queue.backend=redis-server and redis-server is not on PATH"):
        pick("redis-server")
    monkeypatch.setenv("REDIS_URL", dead_url.replace("redis://", "redis://user:s3cret@"))
    with pytest.raises(RunError) as err:
        pick("redis")
    assert "s3cret" not in str(err.value) and "user:***@127.0.0.1" in str(err.value)


HTTP2_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # an empty HTTP/2 SETTINGS frame: what a gRPC server sends


@contextlib.contextmanager
def _squatter(reply: bytes | None) -> Iterator[int]:
    """A foreign server on a port the OS picked: it answers every connection with `reply` (or says
    nothing and closes when None, like a plain TCP service), then closes it."""
    sock = socket.create_server(("127.0.0.1", 0))
    sock.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            with conn:
                with contextlib.suppress(OSError):
                    if reply is not None:
                        conn.sendall(reply)
                    conn.settimeout(0.5)
                    conn.recv(65536)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield sock.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        sock.close()


@pytest.mark.parametrize("reply", [HTTP2_SETTINGS, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
                                   b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"],
                         ids=["http2", "plain-200", "plain-404"])
def test_wait_http_ready_names_a_wrong_server_in_one_line(tmp_path, reply):
    """Another server on the teacher's HTTP port (a gRPC server's HTTP/2 frames, or an HTTP server
    that is not eopd-teacher): a RunError whose first line names the URL and the problem, never an
    http.client exception escaping as a traceback."""
    from eopd_trainer.job.supervisor import RunError, Supervisor, wait_http_ready

    sup = Supervisor(tmp_path / "logs")
    child = sup.start("teacher", ["sleep", "30"])
    try:
        with _squatter(reply) as port:
            url = f"http://127.0.0.1:{port}/readyz"
            t0 = time.monotonic()
            with pytest.raises(RunError) as err:
                wait_http_ready(child, url, timeout=1.5, expect_key="ready", what="eopd-teacher's HTTP side")
            assert time.monotonic() - t0 < 10
        first = str(err.value).splitlines()[0]
        assert first.startswith("teacher was not ready after 2 s: "), first
        assert f"{url} answers, but not as eopd-teacher's HTTP side" in first and "another server holds that port" in first
        if reply == HTTP2_SETTINGS:
            assert "(BadStatusLine)" in first, first
    finally:
        sup.stop_all()


def test_teacher_ports_file_of_another_process_is_refused(tmp_path):
    """A ports file the teacher started here did not write (another pid) is never used."""
    from eopd_trainer.job.supervisor import RunError, Supervisor
    from eopd_trainer.job.teacher_proc import TeacherChild

    sup = Supervisor(tmp_path / "logs")
    child = sup.start("teacher", ["sleep", "30"], kind=TeacherChild)
    try:
        child.ports_path = tmp_path / "teacher.ports.json"
        child.ports_path.write_text(json.dumps({"grpc_port": 1, "http_port": 2, "pid": 1}))
        with pytest.raises(RunError, match=r"written by pid 1, not by the teacher started here"):
            child.ports(timeout=2)
        child.ports_path.write_text(json.dumps({"grpc_port": 1234, "http_port": 1235, "pid": child.popen.pid}))
        assert child.ports(timeout=2) == (1234, 1235) and child.target == "127.0.0.1:1234"
        assert child.http_url == "http://127.0.0.1:1235"  # a file without http_scheme (older teachers): http
        child.grpc_port = child.http_port = 0
        child.ports_path.write_text(json.dumps({"grpc_port": 1234, "http_port": 1235, "pid": child.popen.pid,
                                                "http_scheme": "https"}))
        assert child.ports(timeout=2) == (1234, 1235) and child.http_url == "https://127.0.0.1:1235"
        assert child.probe_tls_context() is not None
    finally:
        sup.stop_all()


@pytest.mark.integration
def test_run_teacher_serves_the_configured_dtype(tmp_path):
    """`eopd run` starts its teacher with teacher.dtype: auto is float32 on this CPU (bfloat16 on CUDA,
    tests/teacher/test_settings.py), an explicit dtype is served as given."""
    from eopd_teacher.client import TeacherClient
    from eopd_trainer.job.supervisor import Supervisor
    from eopd_trainer.job.teacher_proc import start_teacher

    sup = Supervisor(tmp_path / "logs")
    try:
        for dtype, served in (("auto", "float32"), ("bfloat16", "bfloat16")):
            teacher = start_teacher(sup, "tiny-random", "--dtype", dtype, name=f"teacher-{dtype}", insecure_no_auth=True)
            teacher.wait_ready(120)
            with TeacherClient(teacher.target) as client:
                assert client.info(timeout=30).dtype == served
    finally:
        sup.stop_all()


def test_teacher_that_dies_before_reporting_its_ports_fails_to_start(tmp_path):
    from eopd_trainer.job.supervisor import RunError, Supervisor
    from eopd_trainer.job.teacher_proc import start_teacher

    sup = Supervisor(tmp_path / "logs")
    teacher = start_teacher(sup, "no-such-model-spec:::", command=(sys.executable, "-c", "import sys; sys.exit(3)"))
    with pytest.raises(RunError, match=r"^teacher failed to start \(exit code 3\)"):
        teacher.wait_ready(30)


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_redis_server_port_collision_is_retried(tmp_path, monkeypatch):
    """The port picked for the run's redis-server is taken before it binds: (a) by a plain listening
    socket (redis-server exits), (b) by another redis-server: ours exits too, and the foreign one is
    never even connected to (issue 33: the password went there first). The third port is free: the
    run's queue ends there, and the foreign Redis got nothing."""
    import redis
    from eopd_trainer.config import QueueConfig
    from eopd_trainer.job import local_queue
    from eopd_trainer.job.supervisor import Supervisor

    from tests.trainer.redis_helpers import running_redis

    monkeypatch.delenv("REDIS_URL", raising=False)
    with running_redis() as foreign, socket.create_server(("127.0.0.1", 0)) as plain:
        free = local_queue.free_port()
        ports = iter([plain.getsockname()[1], foreign.port, free])
        monkeypatch.setattr(local_queue, "free_port", lambda: next(ports))
        sup = Supervisor(tmp_path / "logs")
        watcher = foreign.client()
        seen = watcher.info("stats")["total_connections_received"]
        try:
            q = local_queue.choose_queue(sup, tmp_path, QueueConfig(backend="redis-server"))
            assert q.backend == "redis-server" and q.url == f"redis://127.0.0.1:{free}/0", q
            assert f"port {plain.getsockname()[1]} was taken" in q.message, q.message
            assert f"port {foreign.port} was taken" in q.message, q.message
            assert [c.name for c in sup.children] == ["redis"] and sup.children[0].alive()
            client = redis.Redis.from_url(q.auth_url)  # a redis-server started here has a random password
            assert client.info("server")["process_id"] == sup.children[0].popen.pid
            client.set("eopd:probe", "1")
            assert watcher.keys("*") == []
            assert watcher.info("stats")["total_connections_received"] == seen  # nobody else connected
            sup.check()
        finally:
            sup.stop_all()


def test_a_layer_subset_teacher_is_built_and_the_students_spec_is_its_initial_weights(tmp_path):
    """Self-distillation (issue 32): teacher.model = student.model serves the student's initial
    weights (student-init/); another layer-subset teacher is built into teacher-init/."""
    from eopd_trainer.job.prepare import prepare

    spec = "tiny-random@0[drop=0]"
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"run_dir={tmp_path / 'self'}", f"student.model={spec}",
                                                      f"teacher.model={spec}"])
    prepared, _ = prepare(cfg)
    assert prepared.teacher.model == prepared.student.model == str(tmp_path / "self" / "student-init")
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"run_dir={tmp_path / 'other'}", f"student.model={spec}",
                                                      "teacher.model=tiny-random@0[drop=1]"])
    prepared, _ = prepare(cfg)
    assert prepared.teacher.model == str(tmp_path / "other" / "teacher-init")
    assert prepared.student.model == str(tmp_path / "other" / "student-init")
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"run_dir={tmp_path / 'plain'}"])
    assert prepare(cfg)[0].teacher.model == "tiny-random@0"  # any other spec as it is
