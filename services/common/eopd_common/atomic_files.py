"""Files replaced atomically and durably: a reader sees the old file or the new one, never half of
either, and after a crash the new one is on disk or the old one still is.

One copy for every process that writes such a file: `eopd run` (the prepared config, the run
record, the requested config), the learner (the commit pointer, trainer state, RNG states, the
trimmed metrics), the evaluation cache and the teacher's port file. Torch-free."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Makes a rename inside directory `path` durable (best effort: some filesystems refuse)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Replaces `path` by `text` (UTF-8): written to a temporary file beside it, fsynced, renamed
    over it, the directory fsynced. The file gets the mode a plain `open(path, "w")` would (0666 less
    the umask: other users' pods read the prepared config too). The temporary file is removed when
    anything fails; `path` is then untouched."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
