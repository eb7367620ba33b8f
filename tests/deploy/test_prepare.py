"""Offline checks of the deployment files (issue 7), the prepare step: no Docker engine and no cluster needed.

- the prepare step of the cpu-dev overlay and of the compose cpu profile (`eopd prepare` in an init
  container / a one-shot service): its rendered command run for real (container paths mapped to a
  temporary directory), and the config the rollout worker and the learner then load.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.deploy_env import (
    Container,
    PREPARE,
    ROOT,
    _arg,
    _cli_overrides,
    _k8s_expand,
    check_mounted,
    clean_env,
    compose_config,
    find,
    objects,
    pipeline_containers,
    pod_spec,
    prepare_steps,
    run_config_paths,
)


def _env_refs(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_cpu_dev_overlay_prepares_the_run_directory_before_the_pipeline_starts():
    """The rollout worker and the learner of cpu-dev cannot load `smollm2-135m[drop=14]` or find
    `data.generate`'s files by themselves: an init container runs `eopd prepare` into the shared
    volume first, and the main container loads the run.yaml it writes; compose does the same."""
    objs = objects("cpu-dev")
    for kind, name in (("Deployment", "eopd-rollout"), ("Job", "eopd-learner")):
        spec = pod_spec(find(objs, kind, name))
        inits = {c["name"]: c for c in spec["initContainers"]}
        assert [c["name"] for c in spec["initContainers"]] == ["models", "prepare"], name  # models first
        prep, main = inits["prepare"], spec["containers"][0]
        assert prep["command"] == PREPARE and prep["image"] == main["image"]
        assert prep["args"][:2] == ["--config", "/opt/eopd/configs/$(RUN_CONFIG)"]
        run_dir = _arg(prep["args"], "run_dir")
        main_args = main.get("command", []) + main["args"]
        assert main_args[main_args.index("--config") + 1] == f"{run_dir}/run.yaml", name
        assert _arg(main_args, "run_dir") == run_dir
        env, main_env = _env_refs(prep), _env_refs(main)
        for var in ("RUN_CONFIG", "RUN_NAME", "PYTHONPATH"):
            assert env[var] == main_env[var], (name, var)
        mounts = {m["mountPath"]: m for m in prep["volumeMounts"]}
        assert mounts["/shared"]["name"] == "shared" and not mounts["/shared"].get("readOnly")
        assert mounts["/opt/eopd/configs"]["name"] == "configs" and mounts["/models"]["name"] == "models"
        assert prep["securityContext"]["allowPrivilegeEscalation"] is False
    # The overlay's run config is one that needs it.
    run_config = find(objs, "ConfigMap", "eopd-run")["data"]["RUN_CONFIG"]
    text = find(objs, "ConfigMap", "eopd-run-configs")["data"][run_config]
    assert "[drop=" in text and "generate:" in text
    # compose: prepare-cpu completes before the rollout worker and the learner, which load its run.yaml.
    services = compose_config("cpu")["services"]
    run_dir = _arg(services["prepare-cpu"]["command"], "run_dir")
    for name in ("rollout-cpu", "trainer-cpu"):
        svc = services[name]
        assert svc["depends_on"]["prepare-cpu"]["condition"] == "service_completed_successfully"
        assert svc["command"][svc["command"].index("--config") + 1] == f"{run_dir}/run.yaml"
    assert services["prepare-cpu"]["depends_on"]["models-cpu"]["condition"] == "service_completed_successfully"
    # the gpu overlay names no layer subset or generated data: it has no prepare step
    assert not [w for w, _, _ in prepare_steps() if not w.startswith(("cpu-dev", "compose"))]


def _container_path(path: str, root: Path) -> str:
    """A path inside the containers -> the same file here (configs from the checkout, volumes in `root`)."""
    for prefix, local in (("/opt/eopd/configs", ROOT / "configs"), ("/shared", root / "shared")):
        if path == prefix or path.startswith(prefix + "/"):
            return str(local) + path[len(prefix):]
        if "=" in path and path.partition("=")[2].startswith(prefix):
            key, _, value = path.partition("=")
            return f"{key}={_container_path(value, root)}"
    return path


def _start_prepare(step_args: list[str], root: Path) -> subprocess.Popen:
    args = [_container_path(a, root) for a in step_args]
    env = {k: v for k, v in clean_env().items() if k != "PYTHONPATH"}  # the packaged model is installed here
    return subprocess.Popen([sys.executable, "-m", "eopd_trainer.cli", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, where: str) -> str:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"{where}: eopd prepare failed ({proc.returncode}):\n{err[-3000:]}"
    return out.strip().splitlines()[-1]  # the path of run.yaml (libraries may print before it)


def _local_to_container(path: str, root: Path) -> str:
    """The inverse of `_container_path`: a file here -> the path the containers see."""
    for prefix, local in (("/opt/eopd/configs", ROOT / "configs"), ("/shared", root / "shared")):
        if path == str(local) or path.startswith(str(local) + "/"):
            return prefix + path[len(str(local)):]
    return path


def _pipeline_configs(root: Path, values: dict[str, str]) -> list[tuple[Container, Any]]:
    """The config each rollout worker / learner of cpu-dev and compose cpu loads, as it would load it."""
    from eopd_trainer.config import load_config

    out = []
    for c in pipeline_containers():
        if not c.where.startswith(("cpu-dev", "compose rollout-cpu", "compose trainer-cpu")):
            continue
        cmd = [_container_path(a, root) for a in _k8s_expand(c.cmd, values)]
        out.append((c, load_config(cmd[cmd.index("--config") + 1], _cli_overrides(cmd))))
    return out


@pytest.mark.parametrize("run_config", ["tiny.yaml", "smollm2-cpu.yaml"])
def test_the_prepare_steps_work_for_real(run_config, tmp_path):
    """The rendered prepare commands, run as the pods and compose would run them (container paths
    mapped to tmp_path); the configs the rollout workers and learners then load name a student
    directory and data files that exist. smollm2-cpu (the overlay's preset): the rollout pod's and
    the learner pod's init containers and compose's prepare-cpu at the same time on one shared
    volume, as pods starting together do. tiny: a re-run on a trained run directory keeps it."""
    import json

    objs = objects("cpu-dev")
    values = dict(find(objs, "ConfigMap", "eopd-run")["data"])
    values["RUN_CONFIG"] = run_config  # tiny.yaml: what an overlay that keeps the base's RUN_CONFIG runs
    steps = [(w, s) for w, s, _ in prepare_steps() if w.startswith("cpu-dev")]
    assert len(steps) == 2
    run_dir = tmp_path / "shared" / "runs" / values["RUN_NAME"]
    if run_config == "smollm2-cpu.yaml":
        compose_step = next(s for w, s, _ in prepare_steps() if w == "compose prepare-cpu")
        assert _arg(compose_step["command"], "run_dir") == f"/shared/runs/{values['RUN_NAME']}"
        procs = [(w, _start_prepare(_k8s_expand(s["command"][1:] + s["args"], values), tmp_path)) for w, s in steps]
        procs.append(("compose prepare-cpu", _start_prepare(compose_step["command"][1:], tmp_path)))
        outputs = {_finish(p, w) for w, p in procs}
        assert outputs == {str(run_dir / "run.yaml")}
        layers = json.loads((run_dir / "student-init" / "config.json").read_text())["num_hidden_layers"]
        preset = yaml.safe_load((ROOT / "configs" / "smollm2-cpu.yaml").read_text())
        dropped = preset["student"]["model"].partition("[drop=")[2].rstrip("]").split(",")
        assert layers == 30 - len(dropped)  # smollm2-135m[drop=...]: SmolLM2 has 30 decoder layers
        generated = preset["data"]["generate"]
        assert len((run_dir / "data" / "train.jsonl").read_text().splitlines()) == generated["train"]
        assert len((run_dir / "data" / "heldout.jsonl").read_text().splitlines()) == generated["heldout"]
    else:
        where, step = steps[0]
        assert _finish(_start_prepare(_k8s_expand(step["command"][1:] + step["args"], values), tmp_path), where) == \
            str(run_dir / "run.yaml")
        # A restarted pod on a trained run: prepared again, nothing of the run is deleted.
        (run_dir / "checkpoints").mkdir()
        (run_dir / "checkpoints" / "COMMITTED").write_text("iter-000004\n")
        where, step = steps[1]
        _finish(_start_prepare(_k8s_expand(step["command"][1:] + step["args"], values), tmp_path), where)
        assert (run_dir / "checkpoints" / "COMMITTED").read_text() == "iter-000004\n"
    configs = _pipeline_configs(tmp_path, values)
    assert len(configs) == 4  # cpu-dev rollout and learner, compose rollout-cpu and trainer-cpu
    for container, cfg in configs:
        where = container.where
        if run_config == "smollm2-cpu.yaml":
            # What the container reads is under its mounts (as the gpu stacks: test_pipeline_inputs_are_mounted).
            # tiny.yaml is left out: its prompt files (../tests/data) are in no image or volume; the base's
            # RUN_CONFIG=tiny.yaml is a placeholder every overlay replaces (docs/deploy.md).
            check_mounted(container, run_config_paths(cfg, lambda p: _local_to_container(p, tmp_path)))
        if where.startswith("compose") and run_config != "smollm2-cpu.yaml":
            continue  # compose's cpu profile is smollm2-cpu only
        assert Path(cfg.run_dir) == run_dir, where
        student = Path(cfg.student.model)
        if run_config == "smollm2-cpu.yaml":
            assert student == run_dir / "student-init" and (student / "model.safetensors").is_file(), where
        else:
            assert cfg.student.model == "tiny-random@1"  # nothing to materialise: the spec as it is
        for f in cfg.data.train_files + cfg.data.eval_files:
            assert Path(f).is_file(), (where, f)
        assert cfg.data.generate is None or Path(cfg.data.train_files[0]).parent == run_dir / "data"
