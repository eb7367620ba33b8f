"""Suite-wide fixtures. Models are materialised once into a cache shared by all tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# One cache for the whole run (the smollm2-135m preset is converted from GGUF once, ~20 s).
os.environ.setdefault("EOPD_CACHE_DIR", str(Path.home() / ".cache" / "eopd"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Teachers the tests start (servers, `eopd run`'s, in-process engines) serve their statistics on the eager
# path unless a test asks for the compiled one (tests.procs.COMPILED): torch.compile's warm-up adds 3-6 s
# to every teacher start on 2 cores, and the suite starts well over a hundred. The compiled path stays
# under test: its numbers against eager and float64 (tests/teacher/test_stats*.py, test_engine.py's
# "compiled" engines), the session's shared `tiny_teacher`, the server without a compiler
# (test_no_compiler.py), the README's serve commands and the SmolLM2 main-job test.
os.environ.setdefault("EOPD_TEACHER_COMPILE_STATISTICS", "false")



def pytest_collection_modifyitems(config, items):
    """Longest file first (`tests.ordering.file_rank`, from the seconds in tests/durations.json): with
    two xdist workers and `--dist loadfile` (scripts/test.sh) taking files in turn, a long file handed
    out last leaves one worker idle while the other finishes it. Tests keep their order within a file."""
    from tests.ordering import file_rank, measured_seconds

    def file_of(item):
        return item.nodeid.split("::")[0]

    slow_files = {file_of(item) for item in items if item.get_closest_marker("slow")}
    seconds = measured_seconds(Path(__file__).with_name("durations.json"))
    items.sort(key=lambda item: file_rank(file_of(item), slow_files, seconds))

def pytest_runtest_logreport(report):
    """With EOPD_TEST_DURATIONS=DIR, every test phase's seconds are appended to DIR/<pid>.tsv
    (`python -m scripts.test_durations DIR` sums them per file and per test): where CI's time goes,
    beyond the 40 slowest phases pytest prints."""
    out = os.environ.get("EOPD_TEST_DURATIONS")
    if out and getattr(report, "node", None) is None:  # xdist's controller gets each worker's report again (`node` set)
        Path(out).mkdir(parents=True, exist_ok=True)
        with open(Path(out) / f"{os.getpid()}.tsv", "a") as f:
            f.write(f"{report.duration:.3f}\t{report.when}\t{report.nodeid}\n")


@pytest.fixture(scope="session")
def tiny_teacher():
    """A real teacher server (tiny-random model) as a subprocess over TCP, shared by the session."""
    from tests.procs import COMPILED, running_teacher

    with running_teacher("tiny-random", "--max-batch-wait-ms", "20", env=COMPILED) as proc:
        yield proc


@pytest.fixture(scope="module")
def process_group():
    """A private one-process gloo group for the module (DeepSpeed caches its groups: one init).
    The env is set through a MonkeyPatch and restored: nothing leaks into the environment of
    subprocesses other tests start."""
    import deepspeed

    from eopd_trainer.learner.distributed import skip_shm_comm_build
    from tests.procs import free_port

    with pytest.MonkeyPatch.context() as mp:
        for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(free_port())}.items():
            mp.setenv(k, v)
        # as the learner does: DeepSpeed would JIT-compile its CPU shared-memory comm op here (38-49 s
        # of C++ on a fresh 2-core machine, for inference_all_reduce, which no test calls)
        skip_shm_comm_build(deepspeed)
        deepspeed.init_distributed(dist_backend="gloo")
        yield
