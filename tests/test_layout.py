"""The layout rules of services/ (the rooms by job drawn in docs/pipeline.md), checked on the source with `ast`:
nothing is imported, so this runs in a second and needs neither torch nor the services' extras.

The import graph has one node per module under services/ and one edge per import statement,
labelled by where the statement sits:
- "top": module level (class bodies and `try:` blocks included: they run at import);
- "local": inside a function (runs when the function is called);
- "typecheck": inside `if TYPE_CHECKING:` at module level (never runs).
Runtime rules use the "top" and "local" edges; `TYPE_CHECKING` blocks are skipped.

The rules: no runtime import cycle; services/ never imports bench/ or tests/; no file over 450
lines; the trainer's rollout/ and learner/ never import each other (they meet in queue/); the
trainer reaches the teacher only through its client, conversion and types; the learner's Redis
feed never imports torch and its DeepSpeed trainer never imports Redis; the loss variants' registry
and flags are read only in objective/ and the iteration plan (config/stages.py); Redis is imported only in
the trainer's queue/ and its two local-queue starters, and outside queue/ the run's namespace
(`queue.namespace.RunQueue`) is the queue's only port; function-local imports only for the heavy
or optional packages listed below. In the teacher (rooms drawn in
docs/teacher.md): its front ends grpc/ and http/ never import each other, the HTTP front end and
the service never import protobuf, no module imports another module's `_private` name, there
is no import cycle even through `TYPE_CHECKING` imports, and docs/teacher.md's module table names
every module.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ROOT / "services"
PACKAGES = {
    "eopd_trainer": SERVICES / "trainer" / "eopd_trainer",
    "eopd_teacher": SERVICES / "teacher" / "eopd_teacher",
    "eopd_common": SERVICES / "common" / "eopd_common",
    "eopd": SERVICES / "common" / "eopd",
}
MAX_LINES = 450


@dataclass(frozen=True)
class Edge:
    src: str  # importing module
    dst: str  # imported module (`from pkg import mod` names pkg.mod when that is a module)
    kind: str  # "top", "local" or "typecheck"
    line: int
    function: str | None  # the enclosing function of a "local" import

    def __str__(self) -> str:
        where = f" in {self.function}()" if self.function else ""
        return f"{self.src}:{self.line}{where} imports {self.dst} ({self.kind})"


def _module_name(package: str, directory: Path, path: Path) -> str:
    parts = [package, *path.relative_to(directory).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    """Every module under services/, by dotted name."""
    out = {}
    for package, directory in PACKAGES.items():
        for path in sorted(directory.rglob("*.py")):
            out[_module_name(package, directory, path)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        source = f"{base}.{node.module}" if node.module else base
    else:
        source = node.module or ""
    known = modules()
    return [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]


def _walk(tree: ast.Module):
    """(import node, kind, enclosing function) for every import statement of a module."""
    def visit(node: ast.AST, kind: str, function: str | None):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, kind, function
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from visit(child, "local", function or getattr(child, "name", "<lambda>"))
            elif isinstance(child, ast.If) and kind == "top" and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), "typecheck", function)
                for stmt in child.orelse:  # the else branch runs
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), kind, function)
            else:
                yield from visit(child, kind, function)

    yield from visit(tree, "top", None)


@cache
def edges() -> tuple[Edge, ...]:
    out: dict[Edge, None] = {}  # one edge per statement and target, in order
    for module, path in modules().items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node, kind, function in _walk(tree):
            for dst in _targets(module, is_package, node):
                out[Edge(module, dst, kind, node.lineno, function)] = None
    return tuple(out)


def _under(name: str, prefix: str) -> bool:
    """`name` is the module or package `prefix` or inside it."""
    return name == prefix or name.startswith(prefix + ".")


def _report(problems: list) -> str:
    return "\n".join(str(p) for p in problems)


def _sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


# -- the rules --------------------------------------------------------------------------------------

def test_no_import_cycle():
    """The runtime import graph of services/ (module-level and function-local imports) is acyclic."""
    known = modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for e in edges():
        if e.kind != "typecheck" and e.dst in known and e.dst != e.src:
            graph[e.src].add(e.dst)
            graph[e.dst]  # noqa: B018 - every node is a key
    cycles = _sccs(graph)
    detail = [e for e in edges() if any(e.src in c and e.dst in c for c in cycles) and e.kind != "typecheck"]
    assert not cycles, f"import cycles {cycles}:\n{_report(detail)}"


def test_services_never_import_bench_or_tests():
    """The installed packages never import the checkout's bench/ or tests/."""
    bad = [e for e in edges() if _under(e.dst, "bench") or _under(e.dst, "tests")]
    assert not bad, _report(bad)


def test_no_file_over_450_lines():
    """No file under services/ is over 450 lines (generated `*_pb2*.py` excepted)."""
    too_long = []
    for path in sorted(p for p in SERVICES.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        if path.suffix == ".py" and "_pb2" in path.name:
            continue
        try:
            n = len(path.read_text().splitlines())
        except UnicodeDecodeError:
            continue
        if n > MAX_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert not too_long, "\n".join(too_long)


def _room(module: str) -> str | None:
    for room in ("rollout", "learner"):
        if _under(module, f"eopd_trainer.{room}"):
            return room
    return None


def test_rollout_and_learner_never_import_each_other():
    """eopd_trainer.rollout(.*) and eopd_trainer.learner(.*) meet only in queue/ and the shared root
    modules; neither imports the other, not even for type checking."""
    bad = [e for e in edges() if _room(e.src) and _room(e.dst) and _room(e.src) != _room(e.dst)]
    assert not bad, _report(bad)


def test_rollout_never_imports_eval():
    """The rollout worker grades with problems/ (below both), never with eval/ (`eopd eval`, above it)."""
    bad = [e for e in edges() if _under(e.src, "eopd_trainer.rollout") and _under(e.dst, "eopd_trainer.eval")]
    assert not bad, _report(bad)


TEACHER_API = ("eopd_teacher.client", "eopd_teacher.convert", "eopd_teacher.types")


def test_trainer_imports_the_teacher_only_through_its_client():
    """The trainer uses the teacher through eopd_teacher.client (plus convert and types)."""
    bad = [e for e in edges() if _under(e.src, "eopd_trainer") and _under(e.dst, "eopd_teacher")
           and not any(_under(e.dst, api) for api in TEACHER_API)]
    assert not bad, _report(bad)


def _teacher_room(module: str) -> str | None:
    for room in ("grpc", "http"):
        if _under(module, f"eopd_teacher.{room}"):
            return room
    return None


def test_teacher_front_ends_never_import_each_other():
    """eopd_teacher.grpc(.*) and eopd_teacher.http(.*) meet only in serving/ (the service) and the
    core; neither imports the other, not even for type checking."""
    assert "eopd_teacher.grpc.servicer" in modules() and "eopd_teacher.http.openai_compat" in modules()
    bad = [e for e in edges() if _teacher_room(e.src) and _teacher_room(e.dst) and _teacher_room(e.src) != _teacher_room(e.dst)]
    assert not bad, _report(bad)


def test_teacher_http_and_service_never_touch_protobuf():
    """A request followed from the HTTP route to the engine meets no protobuf message: http/ and
    serving/ import neither the generated `eopd.v1` code nor `eopd_teacher.convert` (gRPC shapes);
    serving/ (what both front ends call) imports neither front end."""
    bad = [e for e in edges() if (_under(e.src, "eopd_teacher.http") or _under(e.src, "eopd_teacher.serving"))
           and (_under(e.dst, "eopd.v1") or _under(e.dst, "eopd_teacher.convert")
                or (_under(e.src, "eopd_teacher.serving") and _teacher_room(e.dst)))]
    assert not bad, _report(bad)


def _private_imports(package: str) -> list[str]:
    """`from X import _name` statements in `package` where `_name` is not X's own dunder."""
    out = []
    for module, path in modules().items():
        if not _under(module, package):
            continue
        for node, _, _ in _walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.endswith("__"):
                        out.append(f"{module}:{node.lineno} imports {alias.name} from {'.' * node.level}{node.module or ''}")
    return out


def test_no_module_imports_a_private_name():
    """No module under services/ imports another module's `_name`: what a collaborator needs is
    public, or handed in (a teacher stream session gets its scoring function, the client's lanes a
    transport, the trainer's callers a RunQueue)."""
    bad = [line for package in PACKAGES for line in _private_imports(package)]
    assert not bad, "\n".join(bad)


def test_no_import_cycle_even_for_type_checking():
    """The whole import graph of services/, `TYPE_CHECKING` imports included, is acyclic: no split-off
    piece imports its owner back for an annotation (the objective's variants and terms annotate with
    `objective.params.LossParams`, not the config that imports their registry)."""
    known = modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for e in edges():
        if e.dst in known and e.dst != e.src:
            graph[e.src].add(e.dst)
            graph[e.dst]  # noqa: B018 - every node is a key
    cycles = _sccs(graph)
    detail = [e for e in edges() if any(e.src in c and e.dst in c for c in cycles)]
    assert not cycles, f"import cycles {cycles}:\n{_report(detail)}"


def test_teacher_module_table_names_every_module():
    """docs/teacher.md's module table matches the tree: every module under eopd_teacher/ is named
    there (as `room/file.py`, or `file.py` in its room's row)."""
    doc = (ROOT / "docs" / "teacher.md").read_text()
    section = doc[doc.index("## Modules"):doc.index("## How scoring works")]
    directory = PACKAGES["eopd_teacher"]
    missing = [str(path.relative_to(directory)) for path in sorted(directory.rglob("*.py"))
               if path.name not in ("__init__.py", "__main__.py")
               and f"`{path.relative_to(directory)}`" not in section and f"`{path.name}`" not in section]
    assert not missing, f"modules missing from docs/teacher.md's module table: {missing}"


def _direct_imports(module: str, forbidden: tuple[str, ...]) -> list[Edge]:
    """`module`'s own runtime imports of `forbidden` (direct: the shared root modules it may use,
    such as `config`, are not followed)."""
    if "eopd_trainer.learner.feed" not in modules():
        pytest.skip("eopd_trainer/learner/feed.py does not exist yet: issue 16 step 4L splits the learner into "
                    "feed (Redis) and trainer (DeepSpeed)")
    assert module in modules(), f"{module} is missing"
    return [e for e in edges() if e.src == module and e.kind != "typecheck"
            and any(_under(e.dst, f) for f in forbidden)]


def test_learner_feed_is_torch_free():
    """learner/feed.py (rank 0, Redis) never imports torch, DeepSpeed, the objective, the trainer
    side of the learner or the weight files."""
    bad = _direct_imports("eopd_trainer.learner.feed", (
        "torch", "deepspeed", "eopd_trainer.objective", "eopd_trainer.learner.trainer",
        "eopd_trainer.learner.distributed", "eopd_trainer.queue.weights"))
    assert not bad, _report(bad)


def test_the_run_supervisor_and_the_cli_import_without_torch():
    """`eopd run`'s supervisor (job/run.py), `eopd report`, `eopd prepare` and the CLI's config loading
    never import torch (1.5 s and ~300 MB a process; the supervisor imports it only to evaluate,
    job/run.py `_evaluate`), checked in a fresh interpreter as those processes start."""
    code = ("import sys, eopd_trainer.cli, eopd_trainer.job.run, eopd_trainer.job.prepare, eopd_trainer.eval.report\n"
            "from eopd_trainer.config import load_config\n"
            "for preset in ('configs/tiny.yaml', 'configs/smollm2-cpu.yaml', 'configs/qwen3-paper.yaml', 'configs/smollm2-far.yaml'):\n"
            "    cfg = load_config(preset, [])\n"
            "    cfg.loss.needs_teacher_scores, cfg.loss.teacher_share\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'transformers'))))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-2000:]


def test_the_teacher_client_and_its_cli_import_without_torch():
    """A client-only install (`pip install eopd`: numpy, grpcio, protobuf, pydantic, pyyaml) scores
    over gRPC: the clients, `eopd-teacher info/score` and the request validation import no torch,
    transformers or the server's extras, checked in a fresh interpreter."""
    code = ("import sys, eopd_teacher.client, eopd_teacher.cli.main, eopd_teacher.convert\n"
            "print(sorted(m for m in sys.modules if m in ('torch', 'transformers', 'safetensors', 'fastapi', 'uvicorn')"
            " or m.startswith(('torch.', 'transformers.'))))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-2000:]


def test_learner_trainer_is_redis_free():
    """learner/trainer.py (DeepSpeed) never imports Redis or the queue's Redis modules."""
    bad = _direct_imports("eopd_trainer.learner.trainer", (
        "redis", "eopd_trainer.queue.streams", "eopd_trainer.queue.lease", "eopd_trainer.queue.announce"))
    assert not bad, _report(bad)


# The loss variants' registry and flags: read inside objective/ and by the iteration plan only.
VARIANT_REGISTRY = {"get_variant", "VARIANTS", "Variant", "register_variant", "PositionContext"}
VARIANT_FLAGS = {"pg", "advantages_from", "topk_rkl", "shape_advantage", "fkl_positions", "fkl_coef", "ce_coef",
                 "weighted_terms", "needs_student_entropy_grad"}
VARIANT_READERS = ("eopd_trainer.objective", "eopd_trainer.config.stages")


def test_variant_flags_are_read_only_by_the_objective_and_the_iteration_plan():
    """Outside objective/ and the iteration plan (config/stages.py), no module imports the variant
    registry (get_variant, VARIANTS, Variant, ...) or reads a variant's flags (`.pg`,
    `.advantages_from`, ...): the rollout worker, the trainer and the config ask `LossConfig`'s
    properties (`needs_teacher_scores`, `reads_old_logprobs`, `advantages_given`, `num_candidates`,
    `teacher_share`) or the plan (`IterationPlan`)."""
    bad = []
    for module, path in modules().items():
        if not _under(module, "eopd_trainer") or any(_under(module, r) for r in VARIANT_READERS):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                sources = _targets(module, is_package, node)
                for alias, source in zip(node.names, sources):
                    if _under(source, "eopd_trainer.objective.variants") or (
                            _under(source, "eopd_trainer.objective") and alias.name in VARIANT_REGISTRY):
                        bad.append(f"{module}:{node.lineno} imports {alias.name} from {source}")
            elif isinstance(node, ast.Import):
                bad += [f"{module}:{node.lineno} imports {a.name}" for a in node.names
                        if _under(a.name, "eopd_trainer.objective.variants")]
            elif isinstance(node, ast.Attribute) and node.attr in VARIANT_FLAGS:
                bad.append(f"{module}:{node.lineno} reads .{node.attr}")
    assert not bad, "\n".join(bad)


# The queue's port (issue 29 part 3): Redis is spoken in queue/ and by the two local-queue starters of
# `eopd run` (which start or probe a server: no namespace yet); everyone else gets a RunQueue.
REDIS_SPEAKERS = ("eopd_trainer.queue", "eopd_trainer.job.local_queue", "eopd_trainer.job.embedded_queue")
# What hands out or takes a raw Redis client: only queue/ itself uses these (namespace.RunQueue is the port).
RAW_QUEUE_NAMES = {
    "eopd_trainer.queue.streams": {"connect", "Keys", "wait_for_room", "read_counts", "read_dropped",
                                   "read_dead_letters"},
    "eopd_trainer.queue.lease": {"Lease"},
}


def test_redis_is_imported_only_in_the_queue():
    """`redis` and `fakeredis` are imported (at any level, type checking included) only in
    eopd_trainer/queue/ and the two local-queue starters job/local_queue.py, job/embedded_queue.py."""
    bad = [e for e in edges() if (_under(e.dst, "redis") or _under(e.dst, "fakeredis"))
           and not any(_under(e.src, m) for m in REDIS_SPEAKERS)]
    assert not bad, _report(bad)


def _imported_names() -> list[tuple[str, int, str, str]]:
    """(module, line, imported module, name) of every `from X import name` under services/."""
    out = []
    for module, path in modules().items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, _kind, _function in _walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _targets(module, path.name == "__init__.py", ast.ImportFrom(module=node.module, names=[
                    ast.alias(name="__module__")], level=node.level))[0]
                out.extend((module, node.lineno, source, a.name) for a in node.names)
    return out


def test_outside_the_queue_the_namespace_is_the_port():
    """Outside eopd_trainer/queue/ nothing builds a Redis client, a key name or a lease, nor reads
    the announcement or the counts directly: callers get a `queue.namespace.RunQueue`."""
    bad = [f"{src}:{line} imports {name} from {source}" for src, line, source, name in _imported_names()
           if not _under(src, "eopd_trainer.queue") and name in RAW_QUEUE_NAMES.get(source, ())]
    bad += [str(e) for e in edges() if _under(e.dst, "eopd_trainer.queue.announce")
            and not _under(e.src, "eopd_trainer.queue")]
    assert not bad, "\n".join(bad)


# Function-local imports allowed anywhere: optional extras and heavy packages.
LAZY_ANYWHERE = (
    "vllm",  # optional extra
    "deepspeed",  # heavy; probes CUDA ops at import
    "matplotlib",  # figures only
    "math_verify",  # imports sympy: seconds
    "pyarrow",  # parquet only
    "torch.utils.tensorboard",  # TensorBoard
    "torch._dynamo",  # only on a compile failure
    "fakeredis",  # `eopd run` works without it when a Redis answers
    "rich",  # the standalone toy's table, with a plain-text fallback
)
# Allowed only in modules that must import without the extras (a client-only install).
LAZY_IN = {
    "eopd_common": ("torch", "transformers", "safetensors", "gguf"),
    "eopd_teacher.settings": ("torch",),
    "eopd_teacher.engines": ("eopd_teacher.engines.transformers_engine", "eopd_teacher.engines.vllm_engine"),
    # `eopd-teacher info/score` must work on a client-only install; `serve` needs the teacher extra
    # (fastapi, uvicorn, prometheus-client), which the server module imports at its top.
    "eopd_teacher.cli.main": ("eopd_teacher.server",),
    # The client (convert.py is shared by both ends) imports without torch: only fetching the
    # output head (`head_from_pb`, `TeacherClient.output_head`) builds its tensors.
    "eopd_teacher.convert": ("eopd_common.output_head",),
    # `eopd run`'s supervisor, `eopd report` and `eopd --help` load a run's config and never compute a
    # loss: the variants' registry and the data path's seeds import without torch (1.5 s and ~300 MB
    # each), and the supervisor imports the evaluation (models: torch, transformers) when it evaluates.
    "eopd_trainer.objective.variants": ("torch", "eopd_trainer.objective.loss_terms"),
    "eopd_trainer.objective.rng": ("torch",),
    "eopd_trainer.job.run": ("eopd_trainer.eval.evaluate",),
}


def _lazy_allowed(e: Edge) -> bool:
    if any(_under(e.dst, p) for p in LAZY_ANYWHERE):
        return True
    for where, packages in LAZY_IN.items():
        module_ok = e.src == where or (where == "eopd_common" and _under(e.src, where))
        if module_ok and any(_under(e.dst, p) for p in packages):
            return True
    return False


def test_function_local_imports_only_for_lazy_packages():
    """In-package and light imports are at the top; function-local imports only for the heavy or
    optional packages of the allow-list (vLLM, DeepSpeed, matplotlib, ...)."""
    bad = [e for e in edges() if e.kind == "local" and not _lazy_allowed(e)]
    assert not bad, f"{len(bad)} function-local imports to move to the top:\n{_report(bad)}"


def test_the_graph_sees_the_packages():
    """The walk finds the services' modules and their imports (guards the rules above against
    passing on an empty graph)."""
    names = modules()
    assert {"eopd_common.models", "eopd_teacher.client", "eopd_trainer.objective"} <= set(names)
    kinds = {e.kind for e in edges()}
    assert kinds == {"top", "local", "typecheck"}, kinds
