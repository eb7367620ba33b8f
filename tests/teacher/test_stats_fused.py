"""The statistics pass's parts against plain references: the eager reduction in blocks of rows
equals it whole; bf16 logits give the float32 statistics of those logits (tolerance 1e-4 nats, the
reference in float64) on the eager and compiled paths at several shapes; the two-stage top-k names
exactly torch.topk's values; `device_statistics` + `host_copy.to_host` on the CPU are the
`token_statistics` answer, with nothing to wait for."""

from __future__ import annotations

import pytest
import torch

from eopd_teacher import stats
from eopd_teacher.host_copy import to_host
from eopd_teacher.stats import blocked_topk_indices, compiled_chunk_stats, device_statistics, eager_chunk_stats, token_statistics

TOL = 1e-4  # nats: float32 accumulation vs the float64 reference over up to 4096 logits


def _logits(rows: int, vocab: int, seed: int, dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    raw = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    inv_t = 1.0 / torch.empty(rows).uniform_(0.5, 2.0, generator=g)
    return raw, inv_t, torch.randint(0, vocab, (rows,), generator=g)


def _reference(raw: torch.Tensor, inv_t: torch.Tensor, targets: torch.Tensor):
    logp = torch.log_softmax(raw.double() * inv_t.double()[:, None], -1)
    return (torch.logsumexp(raw.double() * inv_t.double()[:, None], -1), logp.gather(1, targets[:, None]).squeeze(1),
            -(logp.exp() * logp).sum(-1))


# The compiled path at two shapes of one dynamic-shape graph (one bf16 compilation: about 15 s).
@pytest.mark.parametrize("path,rows,vocab", [("eager", 1, 7), ("eager", 13, 1000), ("eager", 64, 4096), ("eager", 5, 4097),
                                             ("compiled", 13, 1000), ("compiled", 64, 4097)])
def test_bf16_logits_give_their_fp32_statistics(path, rows, vocab):
    raw, inv_t, targets = _logits(rows, vocab, seed=rows + vocab)
    fn = eager_chunk_stats() if path == "eager" else compiled_chunk_stats()
    lse, lp, ent = fn(raw, inv_t, targets)
    assert lse.dtype == lp.dtype == ent.dtype == torch.float32
    for got, want in zip((lse, lp, ent), _reference(raw, inv_t, targets), strict=True):
        torch.testing.assert_close(got.double(), want, atol=TOL, rtol=0)


def test_eager_blocks_of_rows_equal_the_whole_chunk(monkeypatch):
    raw, inv_t, targets = _logits(37, 300, seed=1)
    whole = stats._chunk_stats(raw, inv_t, targets)
    for elements in (1, 300, 301, 2999):  # 1 row, 1 row, 1 row, 9 rows per block
        monkeypatch.setattr(stats, "EAGER_BLOCK_ELEMENTS", elements)
        for a, b in zip(eager_chunk_stats()(raw, inv_t, targets), whole, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("rows,vocab,k", [(9, 64 * 64, 16), (4, 64 * 8, 2), (3, 64 * 10 + 1, 4), (2, 128, 8)])
def test_blocked_topk_names_the_topk_values(rows, vocab, k):
    raw, _, _ = _logits(rows, vocab, seed=vocab)  # bf16: ties occur
    raw[0, :5] = float("-inf")  # masked entries
    ids = blocked_topk_indices(raw, k)
    ref = torch.topk(raw, k, dim=-1, sorted=True)
    assert torch.equal(raw.gather(-1, ids), ref.values)  # the same values, in order
    ties = raw.gather(-1, ids) == raw.gather(-1, ref.indices)
    assert bool(ties.all()) and ids.shape == (rows, k)


def test_device_statistics_to_host_on_cpu_is_the_answer():
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(21, 16, generator=g), torch.randn(640, 16, generator=g)
    targets, inv_t = torch.randint(0, 640, (21,), generator=g), torch.ones(21)
    cand = torch.randint(-1, 640, (21, 3), generator=g)
    dev = device_statistics(h, w, targets, inv_t, 5, chunk_size=8, candidates=cand)
    pending = to_host(dev)
    assert pending.ready
    host = pending.wait()
    assert host.token_logprobs is dev.token_logprobs and pending.copy_wait_s == 0.0  # nothing copied on the CPU
    ref = token_statistics(h, w, targets, inv_t, 5, chunk_size=8, candidates=cand)
    for f in ("token_logprobs", "entropies", "topk_ids", "topk_logprobs", "candidate_logprobs"):
        torch.testing.assert_close(getattr(host, f), getattr(ref, f), equal_nan=True)
    assert host.topk_ids.dtype == torch.int32  # what the wire carries
