"""A teacher's output head and the exact full-vocabulary distribution it makes of hidden states:
the maths both services share (the teacher serves the head, the learner applies it).

The teacher can send, per scored position, its final hidden state `h [d]` (the input of its output
projection, after the final norm) instead of only its top-k; with its output head (`OutputHead`:
`lm_head.weight [V, d]`, the bias `[V]` when there is one, and the transforms after the projection)
anyone computes the teacher's logits at that position exactly as the teacher does:

    z      = h @ W.T + b                                   # [V], float32
    z      = cap * tanh(z / cap)                           # final_logit_softcapping, when > 0
    logits = z * logit_factor / temperature                # Cohere/Granite scaling, the request's T
    logits[v] = -inf for v >= valid_vocab                  # padded rows of the projection
    logits = logits[:, perm]                               # the run's token remap (student ids)

`teacher_logprob_chunks` yields the log-softmax of these logits over positions in chunks of
`chunk_size` rows, so a caller never holds `[N, V]` (one `[chunk, V]` block at a time);
`head_statistics` reduces them to what the teacher's Score sends (token log-prob, exact entropy,
top-k), the parity check of the hidden-state path. `pack_hidden` / `unpack_hidden` are the wire
form of hidden states (little-endian, row-major, bfloat16 or float32); `head_fingerprint` names a
head (sha256 of the model id, the transforms and the payload bytes).

Pure functions of tensors and bytes: no I/O, no protobuf.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import Tensor

from .hidden_wire import HIDDEN_DTYPES, WIRE_DTYPE_BYTES, bytes_per_value

# Wire names of the hidden-state and head dtypes -> torch dtypes (the names are hidden_wire's, each
# the torch attribute of that name).
WIRE_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in WIRE_DTYPE_BYTES}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype ("float32", "bfloat16", "float16")."""
    for name, d in WIRE_DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"dtype {dtype} has no wire name (one of {sorted(WIRE_DTYPES)})")


@dataclass(frozen=True)
class HeadInfo:
    """What an output head is, without its weights (OutputHeadInfo on the wire)."""

    model: str  # model_name@model_revision
    vocab_size: int  # V, rows of the projection
    hidden_size: int  # d
    dtype: str  # the payload's dtype (WIRE_DTYPES)
    has_bias: bool
    logit_factor: float = 1.0  # logits = logit_factor * (softcapped) projection
    final_logit_softcapping: float = 0.0  # 0: off
    valid_vocab_size: int = 0  # ids >= it are masked (-inf); 0: all V ids are valid

    @property
    def valid_vocab(self) -> int:
        return self.valid_vocab_size or self.vocab_size

    @property
    def num_bytes(self) -> int:
        """Bytes of the payload: the weight `[V, d]` and the bias `[V]` when there is one."""
        return (self.vocab_size * self.hidden_size + (self.vocab_size if self.has_bias else 0)) * bytes_per_value(self.dtype)

    def check(self) -> None:
        """ValueError naming the field that is wrong."""
        if self.dtype not in WIRE_DTYPES:
            raise ValueError(f"output head dtype: {self.dtype!r} is not one of {sorted(WIRE_DTYPES)}")
        if self.vocab_size < 1 or self.hidden_size < 1:
            raise ValueError(f"output head vocab_size {self.vocab_size} and hidden_size {self.hidden_size} must be >= 1")
        if not 0 <= self.valid_vocab_size <= self.vocab_size:
            raise ValueError(f"output head valid_vocab_size: {self.valid_vocab_size} must be in [0, {self.vocab_size}]")
        if not (np.isfinite(self.logit_factor) and self.logit_factor > 0):
            raise ValueError(f"output head logit_factor: {self.logit_factor} must be a positive finite number")
        if not (np.isfinite(self.final_logit_softcapping) and self.final_logit_softcapping >= 0):
            raise ValueError(f"output head final_logit_softcapping: {self.final_logit_softcapping} must be >= 0 (0: off)")


def head_fingerprint(info: HeadInfo, payload_parts: Iterable[bytes | memoryview]) -> str:
    """sha256 (hex) of the head's description (model id and transforms, canonical JSON) and its
    payload bytes, in order."""
    h = hashlib.sha256(json.dumps(asdict(info), sort_keys=True, separators=(",", ":")).encode())
    for part in payload_parts:
        h.update(part)
    return h.hexdigest()


@dataclass(frozen=True)
class OutputHead:
    """A head with its tensors: `weight [V, d]` and `bias [V]` (or None) in `info.dtype`."""

    info: HeadInfo
    weight: Tensor
    bias: Tensor | None
    fingerprint: str

    @classmethod
    def of(cls, info: HeadInfo, weight: Tensor, bias: Tensor | None) -> OutputHead:
        """The head of a loaded model (its fingerprint computed over the payload)."""
        info.check()
        head = cls(info, weight.detach(), None if bias is None else bias.detach(), "")
        return cls(info, head.weight, head.bias, head_fingerprint(info, head.payload_parts()))

    def payload_parts(self, chunk_bytes: int = 1 << 24) -> Iterator[memoryview]:
        """The payload (weight, then bias) as consecutive little-endian slices of at most
        `chunk_bytes`. A CPU head's slices are views of it; a device head is copied to the host one
        slice at a time, so serving it never holds a host copy of the whole head (an 8B teacher's is
        1.2 GB in bf16) and a second call copies no more than the first."""
        for t in (self.weight, self.bias):
            if t is None:
                continue
            flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
            for start in range(0, flat.numel(), chunk_bytes):
                yield memoryview(flat[start : start + chunk_bytes].to("cpu").numpy())

    @classmethod
    def from_payload(cls, info: HeadInfo, payload: bytes | bytearray, fingerprint: str) -> OutputHead:
        """The head from its received payload; ValueError when its size or fingerprint is wrong."""
        info.check()
        if len(payload) != info.num_bytes:
            raise ValueError(f"output head payload: {len(payload)} bytes, expected {info.num_bytes} "
                             f"([{info.vocab_size}, {info.hidden_size}] {info.dtype}{' + bias' if info.has_bias else ''})")
        got = head_fingerprint(info, [payload])
        if got != fingerprint:
            raise ValueError(f"output head fingerprint: the payload hashes to {got}, the teacher named {fingerprint}")
        dtype = WIRE_DTYPES[info.dtype]
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype)
        v, d = info.vocab_size, info.hidden_size
        weight = flat[: v * d].view(v, d)
        bias = flat[v * d :].clone() if info.has_bias else None
        return cls(info, weight, bias, fingerprint)


# Hidden states on the wire --------------------------------------------------------------------

def pack_hidden(hidden: Tensor, dtype: str) -> bytes:
    """`hidden [n, d]` (any float dtype, any device) as little-endian row-major bytes in `dtype`
    ("bfloat16" or "float32")."""
    if dtype not in HIDDEN_DTYPES:
        raise ValueError(f"hidden states dtype: {dtype!r} is not one of {list(HIDDEN_DTYPES)}")
    t = hidden.detach().to(device="cpu", dtype=WIRE_DTYPES[dtype]).contiguous()
    return t.view(torch.uint8).numpy().tobytes()


def unpack_hidden(data: bytes, hidden_size: int, dtype: str, rows: int | None = None) -> Tensor:
    """`[n, hidden_size]` tensor (in `dtype`) from `pack_hidden`'s bytes; ValueError naming what
    is wrong when the size does not fit (`rows`: the n expected, when known)."""
    if dtype not in HIDDEN_DTYPES:
        raise ValueError(f"hidden states dtype: {dtype!r} is not one of {list(HIDDEN_DTYPES)}")
    width = hidden_size * bytes_per_value(dtype)
    if hidden_size < 1 or len(data) % width:
        raise ValueError(f"hidden states: {len(data)} bytes are not rows of hidden_size {hidden_size} {dtype}")
    n = len(data) // width
    if rows is not None and n != rows:
        raise ValueError(f"hidden states: {n} rows, expected {rows}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(WIRE_DTYPES[dtype]).view(n, hidden_size)


# The distribution ------------------------------------------------------------------------------

def vocab_permutation(token_remap: Mapping[int, int], vocab_size: int) -> Tensor | None:
    """The column order that puts a teacher's distribution in the student's ids: student id s takes
    teacher id `perm[s]`. `token_remap` maps student ids to teacher ids (teacher.token_remap); a
    target that is not itself a source gives its id back to the source (a swap), so `perm` is a
    permutation and the distribution keeps its mass. None for an empty remap."""
    if not token_remap:
        return None
    perm = torch.arange(vocab_size)
    for src, dst in token_remap.items():
        if not (0 <= src < vocab_size and 0 <= dst < vocab_size):
            raise ValueError(f"token_remap: {src} -> {dst} outside the vocabulary [0, {vocab_size})")
        perm[src] = dst
        if dst not in token_remap:
            perm[dst] = src
    if torch.unique(perm).numel() != vocab_size:
        raise ValueError(f"token_remap {dict(token_remap)} is not invertible over the vocabulary")
    return perm


def head_logits(head: OutputHead, hidden: Tensor, inv_temperature: Tensor, perm: Tensor | None = None) -> Tensor:
    """The teacher's logits at a block of positions (see the module docstring).

    Args:
        head: the output head (its tensors on `hidden`'s device).
        hidden: `[c, d]` final hidden states, any float dtype.
        inv_temperature: `[c]` 1 / temperature per position.
        perm: `[V]` column order (`vocab_permutation`), or None.

    Returns:
        `[c, V]` float32.
    """
    info = head.info
    w = head.weight.float()
    z = torch.nn.functional.linear(hidden.float(), w, None if head.bias is None else head.bias.float())
    cap = info.final_logit_softcapping
    if cap > 0:
        z = (z / cap).tanh_().mul_(cap)
    z.mul_((inv_temperature.to(z) * info.logit_factor).unsqueeze(-1))
    if info.valid_vocab < info.vocab_size:
        z[:, info.valid_vocab :] = -torch.inf
    return z if perm is None else z[:, perm.to(z.device)]


def teacher_logprob_chunks(head: OutputHead, hidden: Tensor, inv_temperature: Tensor, chunk_size: int = 256,
                           perm: Tensor | None = None) -> Iterator[tuple[int, int, Tensor]]:
    """The teacher's full-vocabulary log-probabilities, `chunk_size` positions at a time.

    Args:
        hidden: `[N, d]`; inv_temperature: `[N]`; perm: as `head_logits`.

    Yields:
        `(start, stop, logp)` with `logp [stop - start, V]` float32 = log_softmax of
        `head_logits(hidden[start:stop])`; nothing for N = 0.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size: {chunk_size} must be >= 1")
    n = hidden.shape[0]
    if tuple(inv_temperature.shape) != (n,):
        raise ValueError(f"inv_temperature {tuple(inv_temperature.shape)} must be [{n}]")
    if hidden.dim() != 2 or hidden.shape[1] != head.info.hidden_size:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be [N, {head.info.hidden_size}] (the head's hidden_size)")
    for start in range(0, n, chunk_size):
        stop = min(start + chunk_size, n)
        z = head_logits(head, hidden[start:stop], inv_temperature[start:stop], perm)
        yield start, stop, z.log_softmax(-1)


@dataclass(frozen=True)
class HeadStatistics:
    """What Score sends, computed from hidden states: `token_logprobs [N]`, `entropies [N]`,
    `topk_ids [N, k]` int64, `topk_logprobs [N, k]`, float32."""

    token_logprobs: Tensor
    entropies: Tensor
    topk_ids: Tensor
    topk_logprobs: Tensor


def head_statistics(head: OutputHead, hidden: Tensor, targets: Tensor, inv_temperature: Tensor, top_k: int,
                    chunk_size: int = 256, perm: Tensor | None = None) -> HeadStatistics:
    """The token log-prob, exact entropy and top-k at N positions (`targets [N]` ids) from
    `teacher_logprob_chunks`: one `[chunk_size, V]` block alive at a time."""
    n = hidden.shape[0]
    lp, ent = torch.empty(n), torch.empty(n)
    ids, tlp = torch.empty(n, top_k, dtype=torch.int64), torch.empty(n, top_k)
    for start, stop, logp in teacher_logprob_chunks(head, hidden, inv_temperature, chunk_size, perm):
        tgt = targets[start:stop].to(device=logp.device, dtype=torch.int64)
        lp[start:stop] = logp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1).cpu()
        p = logp.exp()
        ent[start:stop] = -(p * logp.clamp(min=torch.finfo(torch.float32).min)).sum(-1).cpu()
        top = logp.topk(top_k, dim=-1)
        ids[start:stop], tlp[start:stop] = top.indices.cpu(), top.values.cpu()
    return HeadStatistics(lp, ent, ids, tlp)


@dataclass(frozen=True)
class TeacherLogitRows:
    """The teacher's full-vocabulary logits built on demand from its hidden states, for a loss that
    reads them a chunk of rows at a time (the learner's `teacher_logits` for support "full"): never
    `[N, V]` at once.

    Attributes:
        head: the teacher's output head (its tensors on the device the rows are wanted on).
        hidden: `[N, d]` the teacher's final hidden states, row i for flat token i.
        inv_temperature: `[N]` 1 / teacher temperature.
        perm: `[V]` column order into the student's ids (`vocab_permutation`), or None.

    Called as `rows(indices)` with `indices [c]` long (flat token indices) or as `rows(start, end)`
    (the rows start..end); returns `[c, V]` float32 (`head_logits`).
    """

    head: OutputHead
    hidden: Tensor
    inv_temperature: Tensor
    perm: Tensor | None = None

    def __call__(self, rows: Tensor | int, end: int | None = None) -> Tensor:
        sel = slice(int(rows), int(end)) if end is not None else rows.to(self.hidden.device)
        return head_logits(self.head, self.hidden[sel], self.inv_temperature[sel], self.perm)

    @property
    def num_rows(self) -> int:
        return int(self.hidden.shape[0])
