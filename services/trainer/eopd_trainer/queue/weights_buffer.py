"""Weight sync through one mapped buffer (`weight_sync: mapped`, issue 31 ask 3): the learner and the
rollout workers of one node map the same file in the run's owner-only /dev/shm directory
(`<shm weights dir>/policy.buf`); the learner copies the policy's tensors into it in place and the
workers copy them out. No file format, no sha256 pass, no file per version: one memcpy each side
(a GPU learner's copy is its device-to-host copy, a GPU worker's its host-to-device copy).

Layout: a HEADER_BYTES header, the layout (JSON: every tensor `export_state_dict` keeps, in
state-dict order, with its dtype and shape), then the tensors, each at an offset aligned to ALIGN
bytes. The header holds a magic, a sequence number, the version and iteration written, and the
layout's hash and length. A worker reads the tensors in the learner's dtypes and loads them into
its model like a weights file (dtypes converted; names and shapes checked).

Consistency: the learner makes the sequence number odd, writes the tensors, then writes the
version, the checksum of what it wrote and an even sequence number (seq + 2 per publish, never
reused while the file exists: a restarted learner continues from the number it finds). A worker
checks the sequence number, copies the tensors out into memory of its own, and uses the copy only
if the number is still the announced one and the copy's checksum is the learner's (`checksum`:
the number alone is not enough, stores to a mapping may become visible out of order); otherwise the
buffer was being (or has been) rewritten and the load is `WeightsUnavailable` (transient: re-read
the announcement, retry), with the worker's model untouched (`read_buffer`). The transformers
sampler loads without that copy of the whole policy (`load_buffer_into`, issue 50 ask 5): the same
checks, with the tensors copied straight into its model, so a torn copy has already written the model
(`WeightsTorn`: the worker then samples nothing until a whole version loads). So a worker never
samples from half-written weights, and the announcement (`PolicyVersion`, format `mapped`,
`sha256` = "seq:<n>") names exactly one content of the buffer.

Trust: the buffer is the run's user's (0600 in an 0700 directory); the checksum catches a torn copy,
not a writer, and any process of that user can write both (docs/reliability.md, "The mapped weights
buffer"). What a worker refuses whoever wrote it: tensors holding a NaN or an infinity
(`non_finite`; WeightsUnavailable, the model keeps its weights).
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import struct
import warnings
from pathlib import Path

import torch

from .messages import PolicyVersion, now_ns
from .weights import WeightsUnavailable, check_tensors, export_state_dict_names

FORMAT = "mapped"
BUFFER_NAME = "policy.buf"
MAGIC = b"EOPDWB01"
HEADER = struct.Struct("<8sqqq16sqq")  # magic, seq, version, iteration, layout hash, layout bytes, checksum
HEADER_BYTES = 64
ALIGN = 64
_SEQ_AT = 8  # byte offset of seq in the header
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
                               torch.int16, torch.int8, torch.uint8, torch.bool)}


def buffer_path(weights_dir: Path) -> Path:
    return Path(weights_dir) / BUFFER_NAME


Entry = tuple[str, torch.dtype, tuple[int, ...], int, int]  # name, dtype, shape, offset, nbytes


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout_of(model: torch.nn.Module) -> tuple[list[Entry], int, bytes]:
    """(entries, total bytes, the layout's JSON) of the tensors `export_state_dict` keeps (tied
    aliases dropped), in the learner's dtypes; the JSON sits after the header, the data after it."""
    state = model.state_dict()
    names = export_state_dict_names(model)
    described = json.dumps([(n, str(state[n].dtype), list(state[n].shape)) for n in names]).encode()
    entries = parse_layout(described, "being written")  # the offsets a reader computes, by the same code
    return entries, buffer_end(entries, len(described)), described


def buffer_end(entries: list[Entry], described_bytes: int) -> int:
    """The buffer's size: the end of its last tensor (aligned), or of its layout when it has none."""
    return _align(entries[-1][3] + entries[-1][4]) if entries else data_start(described_bytes)


def parse_layout(described: bytes, where: str) -> list[Entry]:
    entries, offset = [], data_start(len(described))
    try:
        for name, dtype, shape in json.loads(described):
            d = _DTYPES[dtype]
            nbytes = math.prod(shape) * torch.empty((), dtype=d).element_size()
            entries.append((name, d, tuple(shape), offset, nbytes))
            offset += _align(nbytes)
    except (ValueError, KeyError, TypeError) as exc:
        raise WeightsUnavailable(f"weights buffer {where}: unreadable layout ({exc})") from None
    return entries


def _view(mm: mmap.mmap, entry: Entry) -> torch.Tensor:
    _, dtype, shape, offset, nbytes = entry
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # a read-only mapping: torch warns that the buffer is not writable
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).view(shape)


def _seq(mm: mmap.mmap) -> int:
    return struct.unpack_from("<q", mm, _SEQ_AT)[0]


def _data(mm: mmap.mmap, start: int) -> torch.Tensor:
    """The data region (every tensor, with the zero padding between them) as bytes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mm, dtype=torch.uint8, count=len(mm) - start, offset=start)


def checksum(data: torch.Tensor) -> int:
    """The sum of the region's 8-byte words (wrapping; the region's length is a multiple of ALIGN):
    what the learner wrote, checked against what a worker copied out. A copy torn between two
    versions sums differently unless the parts exchanged sum alike, so it is refused whatever
    order the CPUs made the bytes visible in (the sequence number alone relies on it: stores to the
    mapping may be seen out of order, e.g. memcpy's non-temporal stores on x86, any store on ARM)."""
    return int(data.view(torch.int64).sum())


class BufferWriter:
    """The learner's side (rank 0): creates or reuses the buffer (owner-only), publishes into it."""

    def __init__(self, weights_dir: Path, model: torch.nn.Module):
        self.path = buffer_path(weights_dir)
        self.entries, self.size, self.described = layout_of(model)
        self.layout = hashlib.sha256(self.described).digest()[:16]
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size != self.size:
                os.ftruncate(fd, self.size)
            self.mm = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        magic, seq, _, _, layout, _, _ = HEADER.unpack_from(self.mm, 0)
        # a restarted learner continues the sequence (even: the last publish completed; odd: it died writing)
        self.seq = seq + (seq % 2) if magic == MAGIC and layout == self.layout and seq > 0 else 0
        self.mm[HEADER_BYTES:HEADER_BYTES + len(self.described)] = self.described
        self.data_start = data_start(len(self.described))
        HEADER.pack_into(self.mm, 0, MAGIC, self.seq, -1, -1, self.layout, len(self.described), 0)

    def publish(self, model: torch.nn.Module, version: int, iteration: int) -> PolicyVersion:
        state = model.state_dict()
        self.seq += 1
        struct.pack_into("<q", self.mm, _SEQ_AT, self.seq)  # odd: being written
        with torch.no_grad():
            for entry in self.entries:
                _view(self.mm, entry).copy_(state[entry[0]].detach())
        if any(t.is_cuda for t in state.values()):
            torch.cuda.synchronize()  # the device-to-host copies have landed before the buffer says complete
        total = checksum(_data(self.mm, self.data_start))
        self.seq += 1
        HEADER.pack_into(self.mm, 0, MAGIC, self.seq, version, iteration, self.layout, len(self.described), total)
        return PolicyVersion(version=version, uri=str(self.path), sha256=f"seq:{self.seq}", num_bytes=self.size,
                             iteration=iteration, created_unix_ns=now_ns(), format=FORMAT)

    def close(self) -> None:
        self.mm.close()


def _open(pv: PolicyVersion) -> mmap.mmap:
    try:
        fd = os.open(pv.uri, os.O_RDONLY)
    except FileNotFoundError:
        raise WeightsUnavailable(f"weights buffer {pv.uri} (version {pv.version}): not found") from None
    except OSError as exc:
        raise WeightsUnavailable(f"weights buffer {pv.uri} (version {pv.version}): cannot open: {exc.strerror or exc}") from None
    try:
        size = os.fstat(fd).st_size
        if size != pv.num_bytes or size < HEADER_BYTES:
            raise WeightsUnavailable(f"weights buffer {pv.uri} (version {pv.version}): {size} bytes, the announcement "
                                     f"says {pv.num_bytes}")
        return mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def announced_seq(pv: PolicyVersion) -> int:
    if not pv.sha256.startswith("seq:") or not pv.sha256[4:].isdigit():
        raise WeightsUnavailable(f"weights buffer {pv.uri} (version {pv.version}): announcement {pv.sha256!r} names no "
                                 "sequence number")
    return int(pv.sha256[4:])


def buffer_holds(pv: PolicyVersion) -> bool:
    """Whether the buffer holds, complete, what `pv` announces (a learner that died between writing
    the buffer and announcing it left newer bytes there: the announcement must be made again)."""
    try:
        want = announced_seq(pv)
        mm = _open(pv)
    except WeightsUnavailable:
        return False
    try:
        magic, seq, version, _, _, _, _ = HEADER.unpack_from(mm, 0)
        return magic == MAGIC and seq == want and version == pv.version
    finally:
        mm.close()


def _checked_layout(mm: mmap.mmap, pv: PolicyVersion, want: int) -> tuple[list[Entry], int, int]:
    """(entries, data start, the learner's checksum) of a buffer that holds the announced sequence
    number and a layout matching its header; WeightsUnavailable otherwise."""
    magic, seq, version, _, layout, n, total = HEADER.unpack_from(mm, 0)
    if magic != MAGIC or not 0 < n <= len(mm) - HEADER_BYTES:
        raise WeightsUnavailable(f"weights buffer {pv.uri}: not an eopd weights buffer")
    if seq != want or version != pv.version:
        raise WeightsUnavailable(f"weights buffer {pv.uri}: holds sequence {seq} (version {version}), the "
                                 f"announcement names {want} (version {pv.version}): rewritten since, or being written")
    described = bytes(mm[HEADER_BYTES:HEADER_BYTES + n])
    if hashlib.sha256(described).digest()[:16] != layout:
        raise WeightsUnavailable(f"weights buffer {pv.uri}: its layout does not match its header")
    entries = parse_layout(described, pv.uri)
    if entries and buffer_end(entries, n) != len(mm):
        raise WeightsUnavailable(f"weights buffer {pv.uri}: its layout does not span its {len(mm)} bytes")
    return entries, data_start(n), total


def _non_finite_refused(bad: list[str], pv: PolicyVersion) -> WeightsUnavailable:
    """A diverged learner's weights, or a process of the run's user writing the buffer
    (docs/reliability.md): refused before the model is touched."""
    return WeightsUnavailable(f"weights buffer {pv.uri} (version {pv.version}): non-finite values (NaN or inf) in "
                              f"{len(bad)} tensors ({', '.join(bad[:3])}): refused, the model keeps its weights")


def read_buffer(pv: PolicyVersion) -> dict[str, torch.Tensor]:
    """The announced tensors (the learner's dtypes), copied out of the buffer into this process's
    memory in one copy and checked (module docstring): the sequence number before and after, and
    the copy's checksum against the one the learner wrote; WeightsUnavailable when the buffer does
    not hold the announced version now, or held it only in part while it was copied."""
    want = announced_seq(pv)
    mm = _open(pv)
    try:
        entries, start, total = _checked_layout(mm, pv, want)
        data = _data(mm, start).clone()
        if _seq(mm) != want or checksum(data) != total:
            raise WeightsUnavailable(f"weights buffer {pv.uri} (version {pv.version}): rewritten while it was read")
    finally:
        mm.close()
    tensors = tensor_views(data, entries, start)
    bad = non_finite(tensors)
    if bad:
        raise _non_finite_refused(bad, pv)
    return tensors


class WeightsTorn(WeightsUnavailable):
    """`load_buffer_into` copied a version that was being rewritten: the model holds parts of two
    versions. Transient like its parent (re-read the announcement, retry), but the model must not
    be sampled from until a whole version loads."""


def _word_sum(t: torch.Tensor) -> int:
    """The sum of `t`'s bytes as 8-byte words, zero-padded to a whole word (`checksum` of its span
    in the buffer, whose padding is zeros)."""
    b = t.detach().contiguous().view(-1).view(torch.uint8)
    if b.numel() % 8 or b.storage_offset() % 8:  # a view that does not start on a word: summed from a copy
        b = torch.cat([b, b.new_zeros((8 - b.numel() % 8) % 8)])
    return int(b.view(torch.int64).sum())


def _copy_finite(mm: mmap.mmap, entries: list[Entry], start: int, state: dict[str, torch.Tensor]) -> tuple[list[str], int]:
    """(names of the non-finite tensors, 0) with nothing copied; else ([], the word sum of the bytes
    copied into `state`'s tensors). Every view into the mapping is gone when it returns (the
    mapping cannot close while one lives)."""
    views = tensor_views(_data(mm, start), entries, start)
    src = None
    try:
        bad = non_finite(views)
        if bad:
            return bad, 0
        copied = 0
        with torch.no_grad():
            for name, src in views.items():
                dst = state[name]
                if dst.dtype == src.dtype and dst.is_contiguous():
                    dst.copy_(src)
                    copied += _word_sum(dst)
                else:  # converted: the bytes read are the staged tensor's
                    staged = src.clone()
                    copied += _word_sum(staged)
                    dst.copy_(staged)
        return [], copied
    finally:
        views = src = None  # noqa: F841 (a traceback keeps this frame's locals)


def load_buffer_into(model: torch.nn.Module, pv: PolicyVersion) -> None:
    """The announced tensors copied straight from the buffer into `model`'s own tensors (dtypes
    converted), without `read_buffer`'s copy of the whole policy: that copy, as large as the
    model's weights (0.5 GiB for SmolLM2-135M), set the main job's peak memory (issue 50 ask 5).

    What needs no copy is checked first and leaves the model untouched: the sequence number and the
    layout (WeightsUnavailable), the names and shapes (ValueError), non-finite values (read in
    place; WeightsUnavailable). Then each tensor is copied into the model (one tensor staged when
    its dtype is converted) and the copy checked as `read_buffer` checks its own: the sequence
    number after it, and the checksum of the bytes copied against the learner's. A copy torn by a
    rewrite raises WeightsTorn: the model holds parts of two versions (the caller must not sample
    from it until a whole version loads; rollout/versions.py)."""
    want = announced_seq(pv)
    mm = _open(pv)
    try:
        entries, start, total = _checked_layout(mm, pv, want)
        check_tensors(model, {name: torch.empty(shape, dtype=dtype, device="meta")
                              for name, dtype, shape, _, _ in entries}, pv.uri)
        bad, copied = _copy_finite(mm, entries, start, model.state_dict())
        torn = not bad and (_seq(mm) != want or (copied + 2**63) % 2**64 - 2**63 != total)
    finally:
        mm.close()
    if bad:
        raise _non_finite_refused(bad, pv)
    if torn:
        raise WeightsTorn(f"weights buffer {pv.uri} (version {pv.version}): rewritten while it was copied into the "
                          "model; the model holds no whole version until the next load")


def non_finite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The names of the floating-point tensors holding a NaN or an infinity. One sum per tensor
    (about a memory pass, no mask): IEEE arithmetic carries a NaN or an infinity of any element
    into the sum. fp16 is summed in fp32 (its own range, 65504, a finite tensor's sum may leave);
    an fp32 or bf16 sum leaves its range (3.4e38) only for weights no model has."""
    out = []
    for name, t in tensors.items():
        if t.is_floating_point() and t.numel():
            total = t.sum(dtype=torch.float32) if t.dtype == torch.float16 else t.sum()
            if not bool(torch.isfinite(total)):
                out.append(name)
    return out


def data_start(described_bytes: int) -> int:
    """Where the data region starts: after the header and the layout's JSON, aligned."""
    return _align(HEADER_BYTES + described_bytes)


def tensor_views(data: torch.Tensor, entries: list[Entry], start: int) -> dict[str, torch.Tensor]:
    """Every tensor of the layout as a view into `data`, the flat bytes of the data region (which
    begins at byte `start` of the buffer), on data's device."""
    out = {}
    for name, dtype, shape, offset, nbytes in entries:
        piece = data[offset - start:offset - start + nbytes]
        out[name] = piece.view(dtype).view(shape) if nbytes else torch.empty(shape, dtype=dtype, device=data.device)
    return out
