"""Suite-wide fixtures. Models are materialised once into a cache shared by all tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# One cache for the whole run (the smollm2-135m preset is converted from GGUF once, ~20 s).
os.environ.setdefault("EOPD_CACHE_DIR", str(Path.home() / ".cache" / "eopd"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_teacher():
    """A real teacher server (tiny-random model) as a subprocess over TCP, shared by the session."""
    from tests.procs import running_teacher

    with running_teacher("tiny-random", "--max-batch-wait-ms", "20") as proc:
        yield proc
