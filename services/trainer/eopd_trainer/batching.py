"""Packing rollouts into tensors, and splitting an iteration into mini- and micro-batches (pure).

A batch of b sequences (prompt_b + response_b, right-padded to length L) is fed to the student;
the hidden state at position t-1 predicts token t, so response token i of sequence b (at position
P_b + i) is predicted at flat position `b * L + P_b + i - 1`. `positions` lists those flat
positions, in order, for every response token: N = sum of response lengths.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .objective import LossInputs, group_advantages
from .queue.messages import Rollout

# The largest top-k a micro-batch is packed (padded) to: teacher.top_k's upper bound. The learner
# admits only rollouts of exactly teacher.top_k (`RolloutLimits`, while decoding); this is the packing's
# own guard, so no rollout can make it pad every rollout of a micro-batch to a huge k.
MAX_TOP_K = 1024


@dataclass(frozen=True)
class PackedSequences:
    input_ids: torch.Tensor  # [b, L] long
    attention_mask: torch.Tensor  # [b, L] long
    positions: torch.Tensor  # [N] long, flat index into [b * L]
    sampled_ids: torch.Tensor  # [N] long
    seq_index: torch.Tensor  # [N] long

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


@dataclass(frozen=True)
class PackedBatch:
    """A micro-batch of rollouts: the student's inputs and the loss's per-token inputs."""

    input_ids: torch.Tensor  # [b, L] long
    attention_mask: torch.Tensor  # [b, L] long
    positions: torch.Tensor  # [N] long, flat index into [b * L] of the position predicting each response token
    # The loss's inputs at those N tokens (`objective.LossInputs`, flat, no mask: every token valid):
    # sampled_ids, seq_index, old_logprobs (zeros, unread, for teacher-generated responses); the
    # teacher's scores, None when no rollout of the micro-batch has any (grpo: graded, not scored);
    # candidate_ids / candidate_logprobs, None when no rollout has candidates; advantages [N] float32,
    # each response token's rollout's (grpo: group-normalised reward, `rollout_advantages`), None
    # when not given.
    loss_inputs: LossInputs
    # route.mixture: each other teacher's name and its scores as `LossInputs` fields (the four
    # teacher_* tensors, packed like the main teacher's), for `loss_inputs.replace(**fields)`.
    mixture: tuple[tuple[str, dict], ...] = ()
    # Each row's prompt and response ids (what `eopd_common.shared_prefill.response_hidden` takes to run
    # the rows' shared tokens once); empty when packed without them.
    prompt_ids: tuple[list[int], ...] = ()
    response_ids: tuple[list[int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


def pack_sequences(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int) -> PackedSequences:
    """Right-padded prompt + response token ids and the positions predicting each response token."""
    if len(prompts) != len(responses) or not prompts:
        raise ValueError("pack_sequences needs as many prompts as responses, at least one")
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    b, L = len(prompts), max(lengths)
    ids = np.full((b, L), pad_id, dtype=np.int64)
    mask = np.zeros((b, L), dtype=np.int64)
    positions, sampled, seq_index = [], [], []
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        if len(p) < 1:
            raise ValueError(f"sequence {i}: empty prompt (the first response token needs a context)")
        seq = np.concatenate([np.asarray(p, dtype=np.int64), np.asarray(r, dtype=np.int64)])
        ids[i, : len(seq)] = seq
        mask[i, : len(seq)] = 1
        start = i * L + len(p) - 1
        positions.append(np.arange(start, start + len(r), dtype=np.int64))
        sampled.append(np.asarray(r, dtype=np.int64))
        seq_index.append(np.full(len(r), i, dtype=np.int64))
    return PackedSequences(
        input_ids=torch.from_numpy(ids),
        attention_mask=torch.from_numpy(mask),
        positions=torch.from_numpy(np.concatenate(positions)),
        sampled_ids=torch.from_numpy(np.concatenate(sampled)),
        seq_index=torch.from_numpy(np.concatenate(seq_index)),
    )


def _pad_topk(arr: np.ndarray, k: int, fill) -> np.ndarray:
    if arr.shape[1] == k:
        return arr
    out = np.full((arr.shape[0], k), fill, dtype=arr.dtype)
    out[:, : arr.shape[1]] = arr
    return out


def pack_rollouts(rollouts: Sequence[Rollout], pad_id: int, *, max_top_k: int = MAX_TOP_K,
                  advantages: Mapping[str, float] | None = None) -> PackedBatch:
    """Everything the loss needs for a micro-batch of rollouts. Differing top-k sizes are padded
    with id 0 at log-prob -inf (zero teacher mass, ignored by the forward KL), up to `max_top_k`:
    a rollout with a larger top-k is a ValueError naming it, before anything is allocated.

    Without teacher scores in any rollout (grpo) the teacher fields are None; a micro-batch mixing
    scored and unscored rollouts is a ValueError. `advantages` (rollout id -> its advantage, e.g.
    `rollout_advantages`) gives `loss_inputs.advantages [N]`, each rollout's value at every one of
    its response tokens; a rollout missing from it is a ValueError naming it."""
    over = [r.rollout_id for r in rollouts if r.top_k > max_top_k]
    if over:
        raise ValueError(f"rollouts {over[:5]}: top_k above the packing's maximum {max_top_k}")
    seqs = pack_sequences([r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts], pad_id)

    def cat(name: str, dtype) -> torch.Tensor:
        return torch.from_numpy(np.concatenate([np.asarray(getattr(r, name)) for r in rollouts]).astype(dtype))

    loss_inputs = LossInputs(
        sampled_ids=seqs.sampled_ids,
        seq_index=seqs.seq_index,
        old_logprobs=cat("old_logprobs", np.float32),
        **_pack_teacher(rollouts, cat),
        **_pack_candidates(rollouts),
        advantages=None if advantages is None else _broadcast_advantages(rollouts, advantages),
    )
    return PackedBatch(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask, positions=seqs.positions,
                       loss_inputs=loss_inputs, mixture=_pack_mixture(rollouts),
                       prompt_ids=tuple(list(map(int, r.prompt_ids)) for r in rollouts),
                       response_ids=tuple(list(map(int, r.response_ids)) for r in rollouts))


def _pack_mixture(rollouts: Sequence[Rollout]) -> tuple[tuple[str, dict], ...]:
    """The mixture parts' scores, packed per teacher like the main one's; a micro-batch whose
    rollouts name different mixture teachers is a ValueError."""
    names = [tuple(part.teacher for part in r.mixture) for r in rollouts]
    if len(set(names)) > 1:
        raise ValueError(f"rollouts of one micro-batch carry different mixture teachers: {sorted(set(names))}")
    out = []
    for j, name in enumerate(names[0]):
        parts = [r.mixture[j] for r in rollouts]
        k = max(part.top_k for part in parts)
        out.append((name, {
            "teacher_logprobs": torch.from_numpy(np.concatenate([part.logprobs for part in parts]).astype(np.float32)),
            "teacher_entropies": torch.from_numpy(np.concatenate([part.entropies for part in parts]).astype(np.float32)),
            "teacher_topk_ids": torch.from_numpy(np.concatenate([_pad_topk(part.topk_ids, k, 0) for part in parts]).astype(np.int64)),
            "teacher_topk_logprobs": torch.from_numpy(
                np.concatenate([_pad_topk(part.topk_logprobs, k, -np.inf) for part in parts]).astype(np.float32)),
        }))
    return tuple(out)


def _pack_teacher(rollouts: Sequence[Rollout], cat) -> dict:
    """The teacher's scores `[N]` / `[N, k]` (top-k padded to the widest), or {} when none has any."""
    scored = [r.has_teacher_scores for r in rollouts]
    if not any(scored):
        return {}
    if not all(scored):
        missing = [r.rollout_id for r in rollouts if not r.has_teacher_scores]
        raise ValueError(f"rollouts {missing[:5]}: no teacher scores, in a micro-batch with scored rollouts")
    k = max(r.top_k for r in rollouts)
    topk_ids = np.concatenate([_pad_topk(r.teacher_topk_ids, k, 0) for r in rollouts]).astype(np.int64)
    topk_lp = np.concatenate([_pad_topk(r.teacher_topk_logprobs, k, -np.inf) for r in rollouts]).astype(np.float32)
    return {"teacher_logprobs": cat("teacher_logprobs", np.float32), "teacher_entropies": cat("teacher_entropies", np.float32),
            "teacher_topk_ids": torch.from_numpy(topk_ids), "teacher_topk_logprobs": torch.from_numpy(topk_lp)}


def _broadcast_advantages(rollouts: Sequence[Rollout], advantages: Mapping[str, float]) -> torch.Tensor:
    """[N] float32: rollout b's advantage repeated over its n_b response tokens, in packing order."""
    missing = [r.rollout_id for r in rollouts if r.rollout_id not in advantages]
    if missing:
        raise ValueError(f"rollouts {missing[:5]}: no advantage given")
    return torch.from_numpy(np.concatenate([np.full(r.num_response_tokens, advantages[r.rollout_id], np.float32)
                                            for r in rollouts]))


def rollout_advantages(rollouts: Sequence[Rollout], eps: float) -> dict[str, float]:
    """Each rollout's group-normalised advantage (GRPO): the rewards grouped by task_id (the samples
    of one prompt), `objective.group_advantages(rewards [B], group_ids [B], eps) -> [B]`. Call it on
    a whole iteration (every sample of a task together) before splitting into mini-batches. A
    rollout without a reward is a ValueError naming it."""
    missing = [r.rollout_id for r in rollouts if r.reward is None]
    if missing:
        raise ValueError(f"rollouts {missing[:5]}: no reward (grpo's advantages need the task grader's reward)")
    tasks = {t: i for i, t in enumerate(dict.fromkeys(r.task_id for r in rollouts))}
    rewards = torch.tensor([float(r.reward) for r in rollouts], dtype=torch.float64)
    groups = torch.tensor([tasks[r.task_id] for r in rollouts], dtype=torch.long)
    adv = group_advantages(rewards, groups, eps)
    return {r.rollout_id: float(a) for r, a in zip(rollouts, adv.tolist(), strict=True)}


def _pack_candidates(rollouts: Sequence[Rollout]) -> dict:
    """`candidate_ids [N, m]` / `candidate_logprobs [N, m]` of the rollouts' per-position candidates,
    padded to the widest m with -1 / NaN (filler: ignored by the loss); {} when none has any."""
    m = max(r.num_candidates for r in rollouts)
    if m == 0:
        return {}
    ids = [_pad_topk(r.candidate_ids, m, -1) if r.num_candidates else np.full((r.num_response_tokens, m), -1, np.int32)
           for r in rollouts]
    lps = [_pad_topk(r.candidate_logprobs, m, np.nan) if r.num_candidates
           else np.full((r.num_response_tokens, m), np.nan, np.float32) for r in rollouts]
    return {"candidate_ids": torch.from_numpy(np.concatenate(ids).astype(np.int64)),
            "candidate_logprobs": torch.from_numpy(np.concatenate(lps).astype(np.float32))}


def shuffle_for_iteration(rollouts: Sequence[Rollout], seed: int, iteration: int) -> list[Rollout]:
    """A deterministic order of an iteration's rollouts (sorted by id, then permuted by seed and
    iteration): a restarted learner replays the same mini-batches."""
    ordered = sorted(rollouts, key=lambda r: r.rollout_id)
    perm = np.random.default_rng([seed, iteration]).permutation(len(ordered))
    return [ordered[i] for i in perm]


def split(items: Sequence, size: int) -> list[list]:
    """Consecutive chunks of `size` (the last one may be shorter)."""
    if size < 1:
        raise ValueError("size must be >= 1")
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def shard(items: Sequence, rank: int, world: int) -> list:
    """This rank's share of a mini-batch (strided, so shares differ by at most one item)."""
    return list(items[rank::world])


def gradient_accumulation_steps(mini_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    if mini_batch_size % (micro_batch_size * world_size):
        raise ValueError(
            f"train.mini_batch_size ({mini_batch_size}) must be a multiple of train.micro_batch_size "
            f"({micro_batch_size}) x the number of processes ({world_size})"
        )
    return mini_batch_size // (micro_batch_size * world_size)


def aggregation_units(loss_cfg, mini_batch: Sequence[Rollout]) -> float:
    """The normaliser of a whole mini-batch's loss under `loss_cfg.aggregation`: its response tokens
    ("token-mean"), its sequences ("seq-mean-token-mean") or the constant `loss_cfg.sum_divisor`
    ("token-sum"). Divided by the micro-batches and ranks, it is `compute_loss`'s `denominator`."""
    if loss_cfg.aggregation == "seq-mean-token-mean":
        return float(len(mini_batch))
    if loss_cfg.aggregation == "token-sum":
        return float(loss_cfg.sum_divisor)
    return float(sum(r.num_response_tokens for r in mini_batch))
