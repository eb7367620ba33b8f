"""One read of a GGUF file per conversion (`models.materialise_gguf`).

transformers (5.x) converting a GGUF model parses the file's header and metadata once for its
config and once more for its weights (`GGUFReader`, ~3.4 s each for the packaged SmolLM2 on a
2-core machine, most of it the vocabulary's strings), and maps tensor names by recursing over every
submodule of the model, building gguf-py's `TensorNameMap` for the architecture anew at each of
them (~6.5 s). `reads_once()` makes both happen once inside its block: `gguf.GGUFReader` returns
the reader already opened for a path (read-only: transformers only reads its fields and tensors),
and `gguf.get_tensor_name_map` returns the map already built for an (architecture, layers) pair
(read-only: transformers only calls `get_name`). transformers imports both from the `gguf` module
inside the functions that use them, so the module's attributes are what it calls; they are put back
on leaving the block. The converted files are the same bytes (tests/common/test_gguf_reads.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def reads_once() -> Iterator[None]:
    try:
        import gguf
    except ImportError:  # transformers raises its own error for a GGUF file without gguf-py
        yield
        return
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple, object] = {}
    maps: dict[tuple, object] = {}

    def reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    def tensor_name_map(arch, n_blocks):
        if (arch, n_blocks) not in maps:
            maps[(arch, n_blocks)] = name_map(arch, n_blocks)
        return maps[(arch, n_blocks)]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, tensor_name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map
        readers.clear()
