"""Secrets on disk: files only their owner can read, and the bearer tokens kept in them.

One copy for every process that writes one: `eopd run` (the teacher token of the teachers it
starts, the embedded Redis's password file) and `eopd-teacher serve --create-token`."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

TOKEN_BYTES = 32  # a bearer token is this many random bytes, hex-encoded


def new_token() -> str:
    """A fresh random bearer token (hex)."""
    return secrets.token_hex(TOKEN_BYTES)


def write_private(path: Path, text: str) -> Path:
    """`text` into `path`, created 0600 (replacing an older file): never readable by others."""
    path = Path(path)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    return path


def write_token_file(path: Path) -> Path:
    """A new bearer token in `path` (0600, replacing an older file)."""
    return write_private(path, new_token() + "\n")
