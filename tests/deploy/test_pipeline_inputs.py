"""Offline checks of the deployment files (issue 7), the pipeline's inputs: no Docker engine and no cluster needed.

- every path the run config of a rollout worker or learner reads (after the EOPD_RUN_* variables and
  arguments the deployment gives) is under a mount of its container, gpu and cpu stacks alike, and
  the runbook names the host paths compose reads;
- only the learner (and the cpu prepare steps) can write the shared volume (DeepSpeed checkpoints).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.deploy_env import (
    Container,
    ROOT,
    RUN_ENV_PREFIX,
    TARGETS,
    _cli_overrides,
    _k8s_expand,
    _mount_of,
    check_mounted,
    compose_config,
    compose_container,
    dotenv_example,
    find,
    k8s_container,
    objects,
    pipeline_containers,
    pod_spec,
    run_config_paths,
)


def load_as_container(c: Container, values: dict[str, str], root: Path, monkeypatch) -> tuple[Any, Any]:
    """The config container `c` loads: its run config at /opt/eopd/configs (the repository's configs/,
    placed under `root` at that path so relative paths resolve as in the container), its EOPD_RUN_*
    variables, then its key=value arguments. Returns (config, a function mapping its paths back to the
    container's)."""
    import shutil

    from eopd_trainer.config import load_config

    root = root.resolve()
    cmd = _k8s_expand(c.cmd, values)
    config = cmd[cmd.index("--config") + 1]
    assert config.startswith("/opt/eopd/configs/"), f"{c.where}: --config {config}"
    if not (root / "opt/eopd/configs").exists():
        shutil.copytree(ROOT / "configs", root / "opt/eopd/configs")
    with monkeypatch.context() as m:
        for name in [n for n in os.environ if n.upper().startswith(RUN_ENV_PREFIX)]:
            m.delenv(name)
        for name, value in c.env.items():
            if name.startswith(RUN_ENV_PREFIX):
                m.setenv(name, value)
        cfg = load_config(f"{root}{config}", _cli_overrides(cmd))
    return cfg, lambda p: p[len(str(root)):] if p.startswith(str(root) + "/") else p


GPU_PIPELINE = ("compose rollout", "compose trainer", "gpu eopd-rollout", "gpu eopd-learner")


def test_pipeline_inputs_are_mounted(tmp_path, monkeypatch):
    """The gpu compose stack and the gpu overlay: everything the run config reads, after the
    EOPD_RUN_* variables and the arguments the deployment gives (the run directory, the data files'
    directories, the student and teacher model directories), is under a mount of the container that
    reads it, and the run config's teacher is the model the teacher serves. The run config as written
    (qwen3-paper.yaml: /data/math, /models/Qwen3-1.7B-Base) would not be; and the runbook names the
    host paths compose reads."""
    from dataclasses import replace

    objs = objects("gpu")
    values = dict(find(objs, "ConfigMap", "eopd-run")["data"])
    services = compose_config("gpu")["services"]
    assert values["RUN_CONFIG"] == dotenv_example()[0]["RUN_CONFIG"]  # the same run on both

    # The teachers: the model they serve is under their mounts.
    teacher_obj = find(objs, "Deployment", "eopd-teacher")
    teachers = {
        "compose": (compose_container("teacher", services["teacher"]), services["teacher"]["environment"]),
        "gpu": (k8s_container("gpu eopd-teacher", pod_spec(teacher_obj), pod_spec(teacher_obj)["containers"][0]),
                find(objs, "ConfigMap", "eopd-teacher-env")["data"]),
    }
    for container, env in teachers.values():
        check_mounted(container, [("EOPD_TEACHER_MODEL", env["EOPD_TEACHER_MODEL"])])

    containers = [c for c in pipeline_containers() if c.where in GPU_PIPELINE]
    assert sorted(c.where for c in containers) == sorted(GPU_PIPELINE)
    runbook = (ROOT / "docs" / "deploy.md").read_text().partition("## 1. ")[2].partition("\n## 2. ")[0]
    for c in containers:
        cfg, to_container = load_as_container(c, values, tmp_path, monkeypatch)
        paths = run_config_paths(cfg, to_container)
        assert {"student.model", "teacher.model"} <= {w for w, _ in paths}, (c.where, paths)
        check_mounted(c, paths)
        stack = c.where.split()[0]
        assert cfg.teacher.model == teachers[stack][1]["EOPD_TEACHER_MODEL"], c.where
        # Without the deployment's EOPD_RUN_* variables the config's own paths are not mounted.
        bare, to_container = load_as_container(replace(c, env={}), values, tmp_path, monkeypatch)
        with pytest.raises(AssertionError, match="under none of its mounts"):
            check_mounted(c, run_config_paths(bare, to_container))
        if stack == "compose":
            # Bind mounts (MODELS_DIR, DATA_DIR): the host paths, relative to the checkout, are in the runbook.
            svc = services[c.where.split()[1]]
            binds = {v["target"]: v["source"] for v in svc["volumes"] if v["type"] == "bind"}
            files = [str(f) for f in cfg.data.train_files + cfg.data.eval_files]
            for path in [to_container(f) for f in files] + [cfg.student.model, cfg.teacher.model]:
                mount = _mount_of(path, binds)
                assert mount, f"{c.where}: {path} is not on a host directory"
                host = os.path.relpath(binds[mount] + path[len(mount):], ROOT)
                assert re.search(rf"(?<![\w/.]){re.escape(host)}\b", runbook), \
                    f"docs/deploy.md, section 1, does not tell users to put {host} on the host ({c.where} reads {path})"


def test_only_the_learner_writes_the_shared_volume():
    """/shared holds the learner's DeepSpeed checkpoints, unpickled on resume (torch.load with
    weights_only=False: docs/reliability.md). The rollout workers only read published weights there
    (vLLM's per-version reload directories are temporary directories), so every container but the
    learner and the cpu prepare steps mounts it read-only."""
    writers = []
    for profile in ("gpu", "cpu"):
        for name, svc in compose_config(profile)["services"].items():
            c = compose_container(name, svc)
            if "/shared" in c.mounts and not c.mounts["/shared"]:
                writers.append(c.where)
    for target in TARGETS:
        for o in objects(target):
            if o["kind"] in ("Deployment", "StatefulSet", "Job"):
                spec = pod_spec(o)
                for kind, cs in (("", spec["containers"]), ("init ", spec.get("initContainers", []))):
                    for c in cs:
                        k = k8s_container(f"{target} {o['metadata']['name']} {kind}{c['name']}", spec, c)
                        if "/shared" in k.mounts and not k.mounts["/shared"]:
                            writers.append(k.where)
    assert sorted(set(writers)) == sorted({
        "compose trainer", "compose trainer-cpu", "compose prepare-cpu",
        *(f"{t} eopd-learner learner" for t in TARGETS),
        "cpu-dev eopd-rollout init prepare", "cpu-dev eopd-learner init prepare",
    }), sorted(writers)
    for c in pipeline_containers():  # every worker does mount it (published weights)
        assert c.mounts.get("/shared") is (not c.learner), c.where
