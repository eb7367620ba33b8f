"""Offline checks of the deployment files (issue 7), their agreement: no Docker engine and no cluster needed.

- compose, the manifests, .env.example and the settings objects agree on ports, environment
  variable names (every EOPD_* variable is a real setting of the service it is given to), run-config
  override keys, run-config files and image names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.deploy.deploy_env import (
    NAMES,
    ROOT,
    RUN_ENV_PREFIX,
    TARGETS,
    _is_config_path,
    _load,
    check_run_env,
    check_teacher_values,
    compose_config,
    dotenv_example,
    find,
    objects,
    pipeline_containers,
    pod_spec,
    prepared_run_dirs,
    teacher_fields,
)


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


def test_teacher_credential_components_reach_the_rollout_workers():
    """The workers get the token file (the base's, issue 49) and, with the TLS components, the CA from
    the same Secrets the teacher uses, through EOPD_RUN_* variables naming real config keys."""
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
    # Without the components the workers get the token (the teacher requires it: the base's) and no TLS.
    gpu = objects("gpu")
    plain = pod_spec(find(gpu, "Deployment", "eopd-rollout"))["containers"][0]
    assert not any(e["name"].startswith(RUN_ENV_PREFIX + "TEACHER__TLS") for e in plain["env"])
    assert {e["name"]: e.get("value") for e in plain["env"]}["EOPD_RUN_TEACHER__AUTH_TOKEN_FILE"] == "/etc/eopd/auth/token"
    assert find(gpu, "ConfigMap", "eopd-teacher-env")["data"]["EOPD_TEACHER_AUTH_TOKEN_FILE"] == "/etc/eopd/auth/token"


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
    # The probe listener: off by default in the settings (tests, `eopd run`), on in every deployment.
    assert fields["http_probe_port"].default is None
    probes = int(values["EOPD_TEACHER_HTTP_PROBE_PORT"])
    assert probes not in (grpc, http)
    for dockerfile in ("deploy/docker/teacher.Dockerfile", "deploy/docker/teacher-cpu.Dockerfile"):
        text = (ROOT / dockerfile).read_text()
        assert f"EXPOSE {grpc} {http} {probes}" in text
        assert f"EOPD_TEACHER_GRPC_PORT={grpc}" in text and f"EOPD_TEACHER_HTTP_PORT={http}" in text
        assert f"EOPD_TEACHER_HTTP_PROBE_PORT={probes}" in text
    # compose: published targets and the rollout worker's teacher address
    for profile, teacher, rollout in (("gpu", "teacher", "rollout"), ("cpu", "teacher-cpu", "rollout-cpu")):
        services = compose_config(profile)["services"]
        assert {p["target"] for p in services[teacher]["ports"]} == {grpc, http}
        assert int(services[teacher]["environment"]["EOPD_TEACHER_HTTP_PROBE_PORT"]) == probes
        assert f"teacher.target=teacher:{grpc}" in services[rollout]["command"]
        if teacher == "teacher-cpu":
            assert "teacher" in services[teacher]["networks"]["default"]["aliases"]
    # manifests: container ports, probes, Services, the rollout worker's dns:/// target
    for target in TARGETS:
        objs = objects(target)
        c = pod_spec(find(objs, "Deployment", "eopd-teacher"))["containers"][0]
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": grpc, "http": http, "probes": probes}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            port = c[probe]["grpc"]["port"] if "grpc" in c[probe] else c[probe]["httpGet"]["port"]
            assert port in (grpc, "probes"), (target, probe)  # HTTP probes on the probe listener (issue 33)
            if "httpGet" in c[probe]:  # only with teacher-tls, whose HTTP side then serves HTTPS (issue 17)
                assert target == "+components" and c[probe]["httpGet"]["scheme"] == "HTTPS", (target, probe)
        cm = find(objs, "ConfigMap", "eopd-teacher-env")["data"]
        assert int(cm["EOPD_TEACHER_GRPC_PORT"]) == grpc and int(cm["EOPD_TEACHER_HTTP_PORT"]) == http
        assert int(cm["EOPD_TEACHER_HTTP_PROBE_PORT"]) == probes
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
