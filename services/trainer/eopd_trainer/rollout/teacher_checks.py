"""Checks of the teacher before the worker takes any task (`check_teacher`, both in order): the
tokenizer (`check_tokenizer`, with `teacher.token_remap` explaining moved special tokens) and the
teacher's limits against this run's requests (`check_teacher_limits`)."""

from __future__ import annotations

import logging
from itertools import combinations
from typing import TYPE_CHECKING

from eopd_common.models import describe_tokenizer_difference, load_tokenizer, tokenizer_fingerprint

from ..config.stages import run_needs_teacher_generation

if TYPE_CHECKING:
    from ..config import RunConfig, TeacherConfig


log = logging.getLogger("eopd.rollout")


class TokenizerMismatch(RuntimeError):
    pass


_SPECIAL_ROLES = ("bos", "eos", "unk", "pad")


class _TokenizerView:
    """What `tokenizer_fingerprint` reads of a tokenizer, with other special tokens."""

    def __init__(self, vocab: dict[str, int], roles: dict[str, str | None], all_special: list[str]):
        self._vocab = vocab
        for role, token in roles.items():
            setattr(self, f"{role}_token", token)
        self.all_special_tokens = all_special

    def get_vocab(self) -> dict[str, int]:
        return self._vocab


def remapped_tokenizer_match(tokenizer, token_remap: dict[int, int], teacher_fingerprint: str) -> str | None:
    """Whether the teacher's tokenizer is the student's with special tokens moved by `token_remap`.

    The teacher only publishes a fingerprint of its vocabulary *and* special tokens (ModelInfo), so
    the candidates are computed here: the student's vocabulary with each subset of its bos/eos/unk/pad
    tokens whose id is a remap source replaced by the token at the target id (the list of all
    special tokens with the new tokens added, with or without the replaced ones). A match proves the
    vocabularies are identical (the vocabulary is inside the hashed payload) and names the special
    tokens that differ, e.g. "eos '<|endoftext|>' -> '<|im_end|>'"; None if no candidate matches."""
    vocab = tokenizer.get_vocab()
    token_of = {i: t for t, i in vocab.items()}
    roles = {r: getattr(tokenizer, f"{r}_token", None) for r in _SPECIAL_ROLES}
    movable = [r for r in _SPECIAL_ROLES
               if roles[r] is not None and token_remap.get(vocab.get(roles[r], -1)) in token_of]
    base = set(tokenizer.all_special_tokens)
    seen: set[tuple] = set()
    for n in range(1, len(movable) + 1):
        for moved in combinations(movable, n):
            cand = {r: token_of[token_remap[vocab[t]]] if r in moved else t for r, t in roles.items()}
            added = base | {cand[r] for r in moved}
            unused = {roles[r] for r in moved} - {t for t in cand.values() if t is not None}
            for special in (added, added - unused):
                key = (tuple(cand.items()), tuple(sorted(special)))
                if key in seen:
                    continue
                seen.add(key)
                if tokenizer_fingerprint(_TokenizerView(vocab, cand, sorted(special))) == teacher_fingerprint:
                    return ", ".join(f"{r} {roles[r]!r} -> {cand[r]!r}" for r in moved)
    return None


def check_tokenizer(info, tokenizer, student_spec: str, token_remap: dict[int, int] | None = None) -> str | None:
    """Refuses a teacher whose tokenizer differs from the student's, saying what differs.

    With `teacher.token_remap`, a teacher whose tokenizer is the student's vocabulary with special
    tokens moved along the remap (a base student ending on <|endoftext|>, an instruct teacher on
    <|im_end|>) is accepted: returns what differs (None when the fingerprints are equal)."""
    fp = tokenizer_fingerprint(tokenizer)
    if fp == info.tokenizer_fingerprint:
        return None
    if token_remap:
        moved = remapped_tokenizer_match(tokenizer, token_remap, info.tokenizer_fingerprint)
        if moved is not None:
            return moved
    details = []
    try:  # the teacher's model spec is often loadable here too: then name the differences exactly
        details.append(describe_tokenizer_difference(load_tokenizer(info.model_name), tokenizer))
    except Exception:  # noqa: BLE001 - best effort: the spec may only exist on the teacher's host
        if info.vocab_size != len(tokenizer):
            details.append(f"vocabulary sizes differ (teacher model {info.vocab_size} vs student tokenizer {len(tokenizer)})")
    if token_remap:
        details.append(f"not explained by teacher.token_remap {dict(token_remap)} either")
    raise TokenizerMismatch(
        f"tokenizer mismatch: teacher {info.model_name!r} has tokenizer fingerprint {info.tokenizer_fingerprint[:16]}..., "
        f"student {student_spec!r} has {fp[:16]}...: {'; '.join(details) or 'the vocabularies or special tokens differ'}. "
        "Token ids would mean different strings to the teacher; use a student with the teacher's tokenizer "
        "(or set teacher.check_tokenizer=false only if you know the ids agree)."
    )


def check_teacher(info, cfg: RunConfig, tokenizer, worker_id: str, teacher: TeacherConfig | None = None,
                  key: str = "teacher") -> str:
    """The checks of a teacher (ModelInfo `info`; `teacher`: its section, `cfg.teacher` unless
    given, named `key` in messages) before any task: the tokenizer (when check_tokenizer), then the
    limits; returns its model name@revision."""
    t = teacher or cfg.teacher
    if t.check_tokenizer:
        moved = check_tokenizer(info, tokenizer, cfg.student.model, t.token_remap)
        if moved:
            log.info("%s tokenizer: the student's vocabulary, special tokens moved by %s.token_remap (%s)", key, key,
                     moved)
    check_teacher_limits(info, cfg, tokenizer, t, key)  # after the tokenizer check: its message is the more specific
    log.info("%s %s ready (%s, top-k max %d); worker %s", key, info.model_name, info.engine, info.max_top_k, worker_id)
    return f"{info.model_name}@{info.model_revision}"


class TeacherIncompatible(RuntimeError):
    """The teacher cannot serve this run's requests (context, top-k, request size, vocabulary)."""


def check_teacher_limits(info, cfg: RunConfig, tokenizer, teacher: TeacherConfig | None = None,
                         key: str = "teacher") -> None:
    """Refuses, before any task is taken, a teacher whose limits (GetModelInfo) every or some
    request of this run would exceed, naming the config keys (`key`: the teacher's section); all
    problems in one message."""
    t = teacher or cfg.teacher
    problems = []
    longest = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    if longest > info.max_context_length:
        problems.append(f"data.max_prompt_length ({cfg.data.max_prompt_length}) + rollout.max_response_length "
                        f"({cfg.rollout.max_response_length}) = {longest} exceeds the teacher's max_context_length "
                        f"({info.max_context_length})")
    if cfg.loss.num_candidates > getattr(info, "max_candidates", 0):
        problems.append(f"loss.candidate_k ({cfg.loss.num_candidates}, per-position candidates of loss.variant "
                        f"{cfg.loss.variant}) exceeds the teacher's max_candidates ({getattr(info, 'max_candidates', 0)})")
    if t.top_k > info.max_top_k:
        problems.append(f"{key}.top_k ({t.top_k}) exceeds the teacher's max_top_k ({info.max_top_k})")
    if info.max_sequences_per_request and t.sequences_per_request > info.max_sequences_per_request:
        problems.append(f"{key}.sequences_per_request ({t.sequences_per_request}) exceeds the teacher's "
                        f"max_sequences_per_request ({info.max_sequences_per_request})")
    if len(tokenizer) > info.vocab_size:
        problems.append(f"student.model {cfg.student.model!r}: its tokenizer has {len(tokenizer)} ids, more than the "
                        f"teacher's vocabulary ({info.vocab_size}): ids the teacher cannot score")
    outside = sorted(i for i in t.token_remap.values() if i >= info.vocab_size)
    if outside:
        problems.append(f"{key}.token_remap: target ids {outside} outside the teacher's vocabulary [0, {info.vocab_size})")
    problems += generation_problems(info, cfg)
    if problems:
        raise TeacherIncompatible(f"the {key} {info.model_name!r} at {t.target} cannot serve this run: "
                                  + "; ".join(problems))


def generation_problems(info, cfg: RunConfig) -> list[str]:
    """What stops the teacher from generating this run's off-policy responses (KD warm-up, kd, gkd:
    config/stages.py), naming the config keys; [] when the run asks for none or it can."""
    warmup = cfg.train.warmup_kd_iterations
    if not run_needs_teacher_generation(cfg.loss, warmup):
        return []
    why = f"train.warmup_kd_iterations={warmup}" if warmup else f"loss.variant={cfg.loss.variant}"
    max_new, max_samples = getattr(info, "max_new_tokens", 0), getattr(info, "max_generate_samples", 0)
    if not max_new:
        return [f"{why} needs the teacher to generate responses (Generate), and this teacher does not serve Generate "
                "(ModelInfo.max_new_tokens 0)"]
    problems = []
    if cfg.rollout.max_response_length > max_new:
        problems.append(f"rollout.max_response_length ({cfg.rollout.max_response_length}) exceeds the teacher's "
                        f"Generate max_new_tokens ({max_new}) ({why})")
    if max_samples and cfg.rollout.n_samples > max_samples:
        problems.append(f"rollout.n_samples ({cfg.rollout.n_samples}) exceeds the teacher's max_generate_samples "
                        f"({max_samples}) ({why})")
    return problems
