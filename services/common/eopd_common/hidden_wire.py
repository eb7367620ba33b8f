"""The wire form of a teacher's hidden states and output head, in bytes: dtype names and sizes.

Torch-free, so that what only bounds or checks sizes (the queue's rollout messages, the teacher's
request validation, `eopd run`'s supervisor loading a run's config) does not import torch;
`output_head.py` packs and unpacks the tensors themselves."""

from __future__ import annotations

# Wire name -> bytes per value, of the dtypes a head or hidden states travel in.
WIRE_DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
# The dtypes a teacher sends hidden states in (bfloat16 by default, float32 on request).
HIDDEN_DTYPES = ("bfloat16", "float32")


def bytes_per_value(dtype: str) -> int:
    """Bytes of one value of the wire dtype `dtype` ("float32", "bfloat16", "float16")."""
    return WIRE_DTYPE_BYTES[dtype]


def hidden_bytes_per_token(hidden_size: int, dtype: str) -> int:
    """Bytes of one position's packed hidden state."""
    return hidden_size * bytes_per_value(dtype)
