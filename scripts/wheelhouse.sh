#!/usr/bin/env bash
# A wheelhouse for installing eopd where there is no network (docs/deploy.md, "Offline install"):
#
#   scripts/wheelhouse.sh --python X.Y --out DIR [--platform TAG ...] [--extras teacher,trainer]
#                         [--with-torch] [--exclude PKG ...]
#
# DIR gets eopd's own wheel (built from this checkout, its gRPC stubs generated first) and a wheel of
# every dependency of `eopd[EXTRAS]` for CPython X.Y on the platform TAG (default: this machine's;
# repeatable, e.g. manylinux_2_28_x86_64), then `pip install --no-index --find-links DIR
# 'eopd[teacher,trainer]'` needs nothing else. Dependencies published only as sources (DeepSpeed) are
# built into wheels here; DeepSpeed with DS_BUILD_OPS=0 (its ops compile at first use), a pure-Python
# wheel any platform takes. A source-only dependency that builds a platform wheel is refused for
# another platform. torch (and what only torch needs: CUDA libraries, triton, networkx) is left out
# unless --with-torch: many clusters ship their own; --exclude leaves out other packages the target
# provides (e.g. transformers, numpy). DIR/wheelhouse-requirements.txt pins every dependency DIR holds.
# A DIR kept from an earlier run is reused: only what it lacks is downloaded. The build machine needs
# PyPI, the target nothing. PYTHON picks the interpreter that runs pip (default .venv/bin/python, else
# python3; pip >= 23 for --dry-run --report).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() { sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2; }
die() { echo "wheelhouse: $*" >&2; exit 2; }

py_ver="" out="" extras="teacher,trainer" with_torch=0
platforms=() excludes=()
while [ $# -gt 0 ]; do
  case "$1" in
    --python) py_ver="${2:-}"; shift 2 ;;
    --platform) platforms+=("${2:-}"); shift 2 ;;
    --out) out="${2:-}"; shift 2 ;;
    --extras) extras="${2:-}"; shift 2 ;;
    --with-torch) with_torch=1; shift ;;
    --exclude) excludes+=("${2:-}"); shift 2 ;;
    -h|--help) usage ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ "$py_ver" =~ ^3\.[0-9]+$ ]] || die "--python: give the target interpreter as X.Y (e.g. 3.12), got '${py_ver}'"
[ -n "$out" ] || die "--out: give the wheelhouse directory"
[[ "$extras" =~ ^[a-z,]*$ ]] || die "--extras: a comma-separated list of teacher, trainer, dev; got '$extras'"
for e in ${extras//,/ }; do
  case "$e" in teacher|trainer|dev) ;; *) die "--extras: unknown extra '$e' (teacher, trainer, dev)" ;; esac
done
for p in "${platforms[@]}"; do [[ "$p" =~ ^[a-z0-9_]+$ ]] || die "--platform: not a wheel platform tag: '$p'"; done

PY="${PYTHON:-}"
[ -n "$PY" ] || { [ -x "$ROOT/.venv/bin/python" ] && PY="$ROOT/.venv/bin/python"; } || PY=python3
here_ver="$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
here_platforms="$("$PY" -c 'from pip._vendor.packaging.tags import platform_tags; print(" ".join(platform_tags()))')"
if [ ${#platforms[@]} -eq 0 ]; then
  read -r -a platforms <<< "$here_platforms"
fi
local_target=0  # source-only dependencies may build platform wheels when the target is this machine
if [ "$py_ver" = "$here_ver" ] && [[ " $here_platforms " == *" ${platforms[0]} "* ]]; then local_target=1; fi
# pip takes a wheel only for a --platform naming its exact tag: manylinux_2_28_x86_64 also means the
# older glibc tags a manylinux_2_28 system runs (manylinux_2_27 ... manylinux_2_5, manylinux2014, 1)
accepted=()
for p in "${platforms[@]}"; do
  accepted+=("$p")
  if [[ "$p" =~ ^manylinux_2_([0-9]+)_(.+)$ ]]; then
    for ((g = BASH_REMATCH[1] - 1; g >= 5; g--)); do accepted+=("manylinux_2_${g}_${BASH_REMATCH[2]}"); done
    accepted+=("manylinux2014_${BASH_REMATCH[2]}" "manylinux2010_${BASH_REMATCH[2]}" "manylinux1_${BASH_REMATCH[2]}")
  fi
done
[ "$with_torch" = 1 ] || excludes+=(torch)

mkdir -p "$out"
out="$(cd "$out" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
t0=$SECONDS
step() { echo "wheelhouse: [$((SECONDS - t0)) s] $*" >&2; }

# 1. eopd's wheel, from a copy of this checkout's files (git's tracked and untracked ones, and the
#    generated stubs, which git ignores), so the build leaves nothing in the checkout
PYTHON="$PY" bash "$ROOT/scripts/gen_proto.sh" >/dev/null
mkdir "$work/src"
(cd "$ROOT" && { git ls-files -z --cached --others --exclude-standard -- pyproject.toml README.md LICENSE services
                 printf '%s\0' services/common/eopd/v1/*_pb2*.py*; } | tar --null --ignore-failed-read -T - -cf -) \
  | tar -xf - -C "$work/src"
rm -f "$out"/eopd-*.whl
isolation=()  # the build backend of this interpreter when it has the one pyproject.toml asks for
"$PY" -c 'import setuptools, wheel, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' 2>/dev/null \
  && isolation=(--no-build-isolation)
"$PY" -m pip wheel -q --no-deps "${isolation[@]}" -w "$out" "$work/src"
eopd_whl="$(ls "$out"/eopd-*.whl)"
step "built $(basename "$eopd_whl")"
req="$eopd_whl[$extras]"

# 2. the resolution for the target, wheels only (eopd's and those built before in DIR included).
#    Dependencies that PyPI has only as sources (DeepSpeed) fail it the first time: they are found by
#    a resolution for this machine, built into wheels here, and the target's resolution is redone.
target=(--only-binary=:all: --python-version "$py_ver" --implementation cp)
for p in "${accepted[@]}"; do target+=(--platform "$p"); done
resolve_target() {
  "$PY" -m pip install -q --dry-run --ignore-installed "${target[@]}" --find-links "$out" --report "$work/target.json" \
    "$@" "$req" 2> "$work/target.err"
}
if ! resolve_target; then
  step "no wheel-only resolution yet: looking for source-only dependencies"
  "$PY" -m pip install -q --dry-run --ignore-installed --prefer-binary --find-links "$out" --report "$work/here.json" "$req"
  "$PY" - "$work/here.json" > "$work/sdists.txt" <<'PYEOF'
import json, sys
for i in json.load(open(sys.argv[1]))["install"]:
    url = i.get("download_info", {}).get("url", "")
    if not url.endswith(".whl"):
        print(f"{i['metadata']['name']}=={i['metadata']['version']}")
PYEOF
  while read -r sdist; do
    [ -n "$sdist" ] || continue
    step "building $sdist from its sources"
    before="$(ls "$out")"
    DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps -w "$out" "$sdist"
    for whl in $(comm -13 <(echo "$before") <(ls "$out")); do
      if [[ "$whl" != *-none-any.whl ]] && [ "$local_target" = 0 ]; then
        rm -f "$out/$whl"
        die "$sdist has no wheel on PyPI and builds a platform wheel ($whl): build the wheelhouse on a ${platforms[0]} machine with Python $py_ver"
      fi
    done
  done < "$work/sdists.txt"
  resolve_target || { grep -v "is neither a file nor a directory" "$work/target.err" >&2
                      die "no wheel-only resolution for CPython $py_ver on ${platforms[0]} (pip's error above)"; }
fi
step "resolved for the target"

# 3. its wheels, less what the host provides (files already in DIR are kept, not downloaded again)
plan=(--python "$py_ver" --platform "${platforms[0]}" --built "$out")
for e in "${excludes[@]}"; do plan+=(--exclude "$e"); done
"$PY" "$ROOT/scripts/wheelhouse_plan.py" "$work/target.json" "${plan[@]}" --missing > "$work/download.txt"
if [ -s "$work/download.txt" ]; then
  "$PY" -m pip download -q --no-deps "${target[@]}" --find-links "$out" -d "$out" -r "$work/download.txt"
fi
step "downloaded $(wc -l < "$work/download.txt") wheels"
"$PY" "$ROOT/scripts/wheelhouse_plan.py" "$work/target.json" "${plan[@]}" > "$out/wheelhouse-requirements.txt"
n="$(ls "$out"/*.whl | wc -l)"
echo "wheelhouse: $out: $n wheels, $(du -sh "$out" | cut -f1), for CPython $py_ver on ${platforms[0]}" \
     "(eopd[$extras]; host-provided: ${excludes[*]:-none}) in $((SECONDS - t0)) s" >&2
