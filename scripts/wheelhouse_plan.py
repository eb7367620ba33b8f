"""What scripts/wheelhouse.sh downloads: the wheels of a resolution, less what the host brings.

    python scripts/wheelhouse_plan.py REPORT.json --python 3.12 --platform manylinux_2_28_x86_64 \
        [--exclude torch ...] > requirements.txt

REPORT.json is pip's installation report (`pip install --dry-run --report`) of eopd and its extras,
resolved for the target interpreter and platform. The output is one `name==version` per line, eopd
itself excepted: every package of that resolution still needed once the `--exclude`d packages (e.g. torch, which many
clusters ship) are provided by the host, i.e. those reachable from eopd without passing through an
excluded one. A package only an excluded one needs (torch's sympy, networkx, nvidia-*, triton) is
dropped with it; one that something else also needs (filelock, jinja2) stays. With --missing, packages
with a wheel of that version in the --built wheelhouse already (built from sources, earlier
downloads) are not listed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

try:  # packaging itself: pip's vendored copy imports the stdlib's distutils, after which setuptools (and
    # with it torch's cpp_extension: DeepSpeed's JIT ops, torch.compile) cannot be imported in the process
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # an interpreter with pip only
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name


def target_environment(python: str, platform: str) -> dict[str, str]:
    """PEP 508 marker values of a CPython `python` (X.Y) on a wheel platform tag."""
    machine = next((m for m in ("x86_64", "aarch64", "arm64", "ppc64le", "s390x", "amd64") if platform.endswith(m)),
                   "x86_64")
    if platform.startswith("macosx"):
        system, sys_platform, os_name = "Darwin", "darwin", "posix"
    elif platform.startswith("win"):
        system, sys_platform, os_name = "Windows", "win32", "nt"
    else:
        system, sys_platform, os_name = "Linux", "linux", "posix"
    return {"python_version": python, "python_full_version": f"{python}.0", "implementation_name": "cpython",
            "implementation_version": f"{python}.0", "platform_python_implementation": "CPython",
            "platform_machine": machine, "platform_system": system, "sys_platform": sys_platform,
            "os_name": os_name, "platform_release": "", "platform_version": ""}


def _applies(req: Requirement, env: dict[str, str], extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": e}) for e in (extras or {""}))


def needed(report: dict, env: dict[str, str], exclude: set[str]) -> list[dict]:
    """The report's items reachable from the requested ones (eopd) without an excluded package."""
    items = {canonicalize_name(i["metadata"]["name"]): i for i in report["install"]}
    roots = [(name, set(i.get("requested_extras") or ())) for name, i in items.items() if i.get("requested")]
    seen: dict[str, set[str]] = {}
    stack = list(roots)
    while stack:
        name, extras = stack.pop()
        if name in exclude or name not in items:
            continue
        if name in seen and extras <= seen[name]:
            continue
        seen[name] = seen.get(name, set()) | extras
        for text in items[name]["metadata"].get("requires_dist") or ():
            req = Requirement(text)
            if _applies(req, env, seen[name]):
                stack.append((canonicalize_name(req.name), {canonicalize_name(e) for e in req.extras}))
    return [items[n] for n in items if n in seen]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wheelhouse_plan.py", description=__doc__.splitlines()[0])
    p.add_argument("report", type=Path)
    p.add_argument("--python", required=True)
    p.add_argument("--platform", required=True)
    p.add_argument("--exclude", action="append", default=[], help="a package the host provides (repeatable)")
    p.add_argument("--built", type=Path, help="the wheelhouse")
    p.add_argument("--missing", action="store_true", help="only the packages without a wheel of that version in --built")
    args = p.parse_args(argv)
    report = json.loads(args.report.read_text())
    exclude = {canonicalize_name(e) for e in args.exclude}
    built = {tuple(w.name.split("-")[:2]) for w in args.built.glob("*.whl")} if args.built else set()
    built = {(canonicalize_name(n), v) for n, v in built}
    for item in needed(report, target_environment(args.python, args.platform), exclude):
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        if item.get("requested") or (args.missing and (canonicalize_name(name), version) in built):
            continue
        print(f"{name}=={version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
