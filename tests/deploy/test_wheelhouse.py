"""scripts/wheelhouse.sh and the offline install of docs/deploy.md: a wheelhouse built for this
machine's interpreter (torch left out, as a cluster that ships its own; kept in $EOPD_CACHE_DIR/wheelhouse
between runs, so a warm run downloads nothing), installed into a fresh venv
with the network refused, beside a host-provided torch and transformers (from this checkout's .venv,
on the venv's path the way `--system-site-packages` puts a system's), which pip must keep; then eopd
imports and its two CLIs answer; and a client-only install (`eopd`, no extras) from the same
wheelhouse into a second venv, whose clients and `eopd-teacher info` need no torch. The plan's pure part (what the host's packages take with them) is
tested on a small report."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from eopd_common.models import default_cache_dir
from tests.procs import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
from wheelhouse_plan import needed, target_environment  # noqa: E402

HOST_PROVIDED = ("torch", "transformers")  # what a CUDA host brings (docs/deploy.md)
PROBE = "import socket; socket.create_connection(('pypi.org', 443), timeout=5)"


def _item(name: str, requires: list[str], *, extras: list[str] | None = None, requested: bool = False) -> dict:
    return {"metadata": {"name": name, "version": "1.0", "requires_dist": requires}, "requested": requested,
            **({"requested_extras": extras} if extras else {}),
            "download_info": {"url": f"https://files.example/{name}-1.0-py3-none-any.whl"}}


def test_the_plan_drops_what_only_an_excluded_package_needs():
    report = {"install": [
        _item("eopd", ["numpy", "torch; extra == 'trainer'", "transformers; extra == 'trainer'",
                       "colorama; sys_platform == 'win32'"], extras=["trainer"], requested=True),
        _item("torch", ["sympy", "filelock", "nvidia-cudnn-cu12; platform_machine == 'x86_64'"]),
        _item("transformers", ["filelock", "tokenizers"]),
        *(_item(n, []) for n in ("numpy", "sympy", "filelock", "nvidia-cudnn-cu12", "tokenizers", "colorama")),
    ]}
    env = target_environment("3.12", "manylinux_2_28_x86_64")
    names = lambda exclude: sorted(i["metadata"]["name"] for i in needed(report, env, exclude))  # noqa: E731
    everything = ["eopd", "filelock", "numpy", "nvidia-cudnn-cu12", "sympy", "tokenizers", "torch", "transformers"]
    assert names(set()) == everything  # colorama: windows only
    assert names({"torch"}) == ["eopd", "filelock", "numpy", "tokenizers", "transformers"]  # filelock: transformers'
    assert names({"torch", "transformers"}) == ["eopd", "numpy"]
    assert "colorama" in [i["metadata"]["name"] for i in needed(report, target_environment("3.12", "win_amd64"), set())]


def test_bad_arguments_name_the_option(tmp_path):
    for args, option in ((["--out", str(tmp_path)], "--python"), (["--python", "3", "--out", "x"], "--python"),
                         (["--python", "3.11"], "--out"), (["--python", "3.11", "--out", "x", "--extras", "gpu"], "--extras")):
        r = subprocess.run(["bash", "scripts/wheelhouse.sh", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and f"wheelhouse: {option}" in r.stderr, (args, r.stderr)


def _closure(names: tuple[str, ...]) -> set[str]:
    """The installed distributions `names` need, with theirs (markers evaluated here, no extras)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen, stack = set(), list(names)
    while stack:
        name = canonicalize_name(stack.pop())
        if name in seen:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional dependency not installed here
        seen.add(name)
        for text in dist.requires or ():
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                stack.append(req.name)
    return seen


def _host_site(where: Path) -> Path:
    """A site directory holding only the host-provided packages and what they need: links into this
    checkout's environment, the way a CUDA image's system site-packages holds its torch."""
    site = Path(sysconfig.get_paths()["purelib"])
    where.mkdir()
    for name in _closure(HOST_PROVIDED):
        dist = importlib.metadata.distribution(name)
        for top in {f.parts[0] for f in dist.files or () if f.parts[0] != ".."}:
            if (site / top).exists() and not (where / top).exists():
                (where / top).symlink_to(site / top)
    return where


def _offline(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    """`cmd` in a network namespace of its own (no interface but a down loopback: nothing is reachable)."""
    return subprocess.run(["unshare", "--net", "--", *cmd], env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.skipif(shutil.which("unshare") is None or subprocess.run(["unshare", "--net", "true"]).returncode != 0,
                    reason="needs `unshare --net` (root) to refuse the network")
@pytest.mark.timeout(1800)  # several real processes; minutes on a loaded 2-core machine
def test_offline_install_beside_a_host_torch(tmp_path):
    py = f"{sys.version_info[0]}.{sys.version_info[1]}"
    # kept between runs, as a user would: a warm run downloads nothing (eopd's wheel is always rebuilt)
    house = default_cache_dir() / "wheelhouse" / f"cp{py.replace('.', '')}-test"
    t0 = time.monotonic()
    built = subprocess.run(["bash", "scripts/wheelhouse.sh", "--python", py, "--out", str(house)], cwd=ROOT,
                           capture_output=True, text=True, timeout=900)
    build_s = time.monotonic() - t0
    assert built.returncode == 0, built.stderr[-4000:]
    wheels = {p.name.split("-")[0].lower() for p in house.glob("*.whl")}
    assert {"eopd", "deepspeed", "grpcio", "transformers"} <= wheels and "torch" not in wheels
    assert not any(w.startswith(("nvidia", "triton")) for w in wheels)

    base = Path(sys.base_prefix) / "bin" / f"python{py}"
    venv = tmp_path / "venv"
    subprocess.run([str(base), "-m", "venv", str(venv)], check=True, timeout=120)
    vsite = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                capture_output=True, text=True, check=True).stdout.strip())
    host = _host_site(tmp_path / "host-site-packages")
    (vsite / "host.pth").write_text(f"{host}\n")  # what --system-site-packages does with the system's

    # no index, no find-links or constraints from this machine's pip config (it lists a local torch)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(PIP_CONFIG_FILE=os.devnull, PATH=f"{venv / 'bin'}:{env['PATH']}")
    refused = _offline([str(venv / "bin" / "python"), "-c", PROBE], env)
    assert refused.returncode != 0 and ("OSError" in refused.stderr or "gaierror" in refused.stderr), refused.stderr
    t1 = time.monotonic()
    install = _offline([str(venv / "bin" / "pip"), "install", "--no-index", "--find-links", str(house),
                        "eopd[teacher,trainer]"], env)
    install_s = time.monotonic() - t1
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    assert not (vsite / "torch").exists() and not (vsite / "transformers").exists()  # kept the host's

    check = ("import json, deepspeed, eopd_teacher, eopd_trainer, torch, transformers; "
             "print(json.dumps({m.__name__: m.__file__ for m in (eopd_teacher, eopd_trainer, torch, transformers)}))")
    ran = _offline([str(venv / "bin" / "python"), "-c", check], env)
    assert ran.returncode == 0, ran.stderr[-3000:]
    files = json.loads(ran.stdout.strip().splitlines()[-1])
    assert files["eopd_trainer"].startswith(str(vsite)) and files["eopd_teacher"].startswith(str(vsite))
    assert files["torch"].startswith(str(host)) and files["transformers"].startswith(str(host))
    for cli, says in (("eopd-teacher", "serve"), ("eopd", "run")):
        helped = _offline([str(venv / "bin" / cli), "--help"], env)
        assert helped.returncode == 0 and says in helped.stdout, helped.stderr[-2000:]

    # A client-only install (no extras: no torch, transformers or server extras) from the same
    # wheelhouse: the clients and `eopd-teacher info/score` import and run without them.
    client = tmp_path / "client-venv"
    subprocess.run([str(base), "-m", "venv", str(client)], check=True, timeout=120)
    bare = _offline([str(client / "bin" / "pip"), "install", "--no-index", "--find-links", str(house), "eopd"], env)
    assert bare.returncode == 0, bare.stdout[-3000:] + bare.stderr[-3000:]
    probe = ("import importlib.util, sys; from eopd_teacher.client import AsyncTeacherClient, TeacherClient; "
             "import eopd_teacher.cli.main; "
             "print(sorted(m for m in ('torch', 'transformers', 'fastapi') if importlib.util.find_spec(m) or m in sys.modules))")
    ran = _offline([str(client / "bin" / "python"), "-c", probe], env)
    assert ran.returncode == 0 and ran.stdout.strip().splitlines()[-1] == "[]", ran.stdout[-2000:] + ran.stderr[-3000:]
    helped = _offline([str(client / "bin" / "eopd-teacher"), "info", "--help"], env)
    assert helped.returncode == 0 and "--target" in helped.stdout, helped.stdout[-2000:] + helped.stderr[-2000:]
    print(f"wheelhouse: {len(wheels)} wheels built in {build_s:.0f} s; offline install {install_s:.0f} s; "
          f"total {time.monotonic() - t0:.0f} s")
