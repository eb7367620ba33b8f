"""The output-head maths shared by teacher and learner (`eopd_common.output_head`), against a plain
float64 full-vocabulary reference: every transform (soft-capping, logit scaling, temperature,
padded-vocabulary masking, the token remap), chunking, the wire forms and their checks."""

from __future__ import annotations

import pytest
import torch

from eopd_common.hidden_wire import WIRE_DTYPE_BYTES, hidden_bytes_per_token
from eopd_common.output_head import (
    WIRE_DTYPES,
    HeadInfo,
    OutputHead,
    head_statistics,
    pack_hidden,
    teacher_logprob_chunks,
    unpack_hidden,
    vocab_permutation,
)


def _head(v=97, d=12, *, bias=True, softcap=0.0, factor=1.0, valid=0, seed=0) -> OutputHead:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, d, generator=g)
    b = torch.randn(v, generator=g) if bias else None
    info = HeadInfo(model="m@r", vocab_size=v, hidden_size=d, dtype="float32", has_bias=bias, logit_factor=factor,
                    final_logit_softcapping=softcap, valid_vocab_size=valid)
    return OutputHead.of(info, w, b)


def _reference_logp(head: OutputHead, h: torch.Tensor, inv_t: torch.Tensor, perm=None) -> torch.Tensor:
    """[N, V] float64 log-softmax, every transform written out."""
    z = h.double() @ head.weight.double().T
    if head.bias is not None:
        z = z + head.bias.double()
    cap = head.info.final_logit_softcapping
    if cap:
        z = cap * torch.tanh(z / cap)
    z = z * head.info.logit_factor * inv_t.double()[:, None]
    z[:, head.info.valid_vocab :] = -torch.inf
    if perm is not None:
        z = z[:, perm]
    return torch.log_softmax(z, -1)


@pytest.mark.parametrize("kw", [dict(), dict(softcap=3.0), dict(factor=0.25, bias=False), dict(valid=90),
                                dict(softcap=2.0, factor=1.7, valid=64)])
def test_statistics_equal_the_full_vocabulary_reference(kw):
    head = _head(**kw)
    g = torch.Generator().manual_seed(1)
    n = 23
    h = torch.randn(n, head.info.hidden_size, generator=g) * 2
    inv_t = torch.rand(n, generator=g) + 0.5
    targets = torch.randint(0, head.info.valid_vocab, (n,), generator=g)
    perm = vocab_permutation({3: 7, 10: 11, 11: 10}, head.info.vocab_size)
    ref = _reference_logp(head, h, inv_t, perm)
    st = head_statistics(head, h, targets, inv_t, top_k=5, chunk_size=4, perm=perm)
    p = ref.exp()
    ref_ent = -(p * torch.where(p > 0, ref, 0.0)).sum(-1)
    torch.testing.assert_close(st.token_logprobs.double(), ref.gather(-1, targets[:, None]).squeeze(-1), atol=1e-5, rtol=0)
    torch.testing.assert_close(st.entropies.double(), ref_ent, atol=1e-5, rtol=0)
    top = ref.topk(5, -1)
    torch.testing.assert_close(st.topk_logprobs.double(), top.values, atol=1e-5, rtol=0)
    # The ids name those values (which of two near-tied ids comes first may differ: saturated soft-capping).
    torch.testing.assert_close(ref.gather(-1, st.topk_ids), top.values, atol=1e-5, rtol=0)
    if kw.get("valid"):
        assert (st.topk_ids < kw["valid"]).all()  # masked rows never come up


def test_chunks_cover_every_position_once_and_never_exceed_the_chunk():
    head = _head()
    h = torch.randn(10, head.info.hidden_size)
    spans = []
    for start, stop, logp in teacher_logprob_chunks(head, h, torch.ones(10), chunk_size=3):
        assert logp.shape == (stop - start, head.info.vocab_size) and stop - start <= 3
        torch.testing.assert_close(logp.exp().sum(-1), torch.ones(stop - start))
        spans.append((start, stop))
    assert spans == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert list(teacher_logprob_chunks(head, h[:0], torch.ones(0))) == []
    with pytest.raises(ValueError, match=r"hidden \(10, 5\) must be \[N, 12\]"):
        list(teacher_logprob_chunks(head, torch.randn(10, 5), torch.ones(10)))
    with pytest.raises(ValueError, match="chunk_size"):
        list(teacher_logprob_chunks(head, h, torch.ones(10), chunk_size=0))


def test_the_token_remap_is_a_permutation_that_swaps_into_the_students_ids():
    perm = vocab_permutation({5: 9}, 12)  # the student's 5 is the teacher's 9: the teacher's 5 goes to the student's 9
    assert perm.tolist() == [0, 1, 2, 3, 4, 9, 6, 7, 8, 5, 10, 11]
    assert vocab_permutation({}, 12) is None
    with pytest.raises(ValueError, match="outside the vocabulary"):
        vocab_permutation({5: 12}, 12)


@pytest.mark.parametrize("dtype,width", [("bfloat16", 2), ("float32", 4)])
def test_hidden_states_round_trip_their_wire_form(dtype, width):
    h = torch.randn(7, 12, dtype=torch.float64)
    data = pack_hidden(h, dtype)
    assert len(data) == 7 * 12 * width
    back = unpack_hidden(data, 12, dtype, rows=7)
    assert back.dtype == getattr(torch, dtype) and back.shape == (7, 12)
    torch.testing.assert_close(back, h.to(back.dtype))
    with pytest.raises(ValueError, match="8 rows, expected 7|expected 7"):
        unpack_hidden(data + data[: 12 * width], 12, dtype, rows=7)
    with pytest.raises(ValueError, match="not rows of hidden_size 11"):
        unpack_hidden(data, 11, dtype)
    with pytest.raises(ValueError, match="hidden states dtype"):
        pack_hidden(h, "float16")


def test_the_payload_rebuilds_the_head_and_its_fingerprint_is_checked():
    for dtype in (torch.float32, torch.bfloat16):
        head = _head(bias=True)
        info = HeadInfo(**{**head.info.__dict__, "dtype": {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]})
        head = OutputHead.of(info, head.weight.to(dtype), head.bias.to(dtype))
        payload = b"".join(bytes(p) for p in head.payload_parts(chunk_bytes=100))
        assert len(payload) == info.num_bytes
        back = OutputHead.from_payload(info, payload, head.fingerprint)
        assert torch.equal(back.weight, head.weight) and torch.equal(back.bias, head.bias)
        with pytest.raises(ValueError, match="output head fingerprint"):
            OutputHead.from_payload(info, payload[:-1] + bytes([payload[-1] ^ 1]), head.fingerprint)
        with pytest.raises(ValueError, match="output head payload"):
            OutputHead.from_payload(info, payload[:-2], head.fingerprint)
    other = OutputHead.of(HeadInfo(**{**head.info.__dict__, "logit_factor": 2.0}), head.weight, head.bias)
    assert other.fingerprint != head.fingerprint  # the transforms are part of what is named


def test_a_wrong_head_description_is_named():
    with pytest.raises(ValueError, match="valid_vocab_size"):
        HeadInfo("m", 10, 4, "float32", False, valid_vocab_size=11).check()
    with pytest.raises(ValueError, match="logit_factor"):
        HeadInfo("m", 10, 4, "float32", False, logit_factor=0.0).check()
    with pytest.raises(ValueError, match="dtype"):
        HeadInfo("m", 10, 4, "int8", False).check()


def test_the_torch_free_byte_sizes_are_torchs():
    """hidden_wire's sizes (no torch: the queue's and the validation's byte bounds) are the element
    sizes of the torch dtypes the tensors travel in, and a packed row is that many bytes."""
    assert {n: torch.empty((), dtype=d).element_size() for n, d in WIRE_DTYPES.items()} == WIRE_DTYPE_BYTES
    for dtype in ("bfloat16", "float32"):
        assert len(pack_hidden(torch.randn(3, 12), dtype)) == 3 * hidden_bytes_per_token(12, dtype)
