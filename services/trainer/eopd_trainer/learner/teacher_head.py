"""The teacher's exact full-vocabulary distribution on the learner: its output head fetched once
(`fetch_teacher_head`, TeacherService.GetOutputHead over the run's teacher connection) and the
hidden states the rollouts carry (`teacher.hidden_states`) turned into logits on demand
(`teacher_logit_rows`: `eopd_common.output_head.TeacherLogitRows`, a chunk of rows at a time).

Every rollout names the head its hidden states belong to; one naming another head (a teacher
restarted with other weights, another teacher) is refused with the rollout named, never projected
with the wrong weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from eopd_common.output_head import OutputHead, TeacherLogitRows, unpack_hidden, vocab_permutation
from eopd_teacher.client import TeacherClient

from ..config import TeacherConfig
from ..queue.messages import Rollout


def fetch_teacher_head(teacher: TeacherConfig, *, client_kwargs: dict | None = None) -> OutputHead:
    """The output head of the teacher at `teacher.target` (size and fingerprint checked by the
    client). `client_kwargs`: the TeacherClient's security and retry options (auth, TLS)."""
    with TeacherClient(teacher.target, **(client_kwargs or {})) as client:
        info = client.wait_ready(teacher.ready_timeout_s)
        if not info.output_head_fingerprint:
            raise ValueError(f"teacher.hidden_states: the teacher at {teacher.target} (engine {info.engine!r}) serves no "
                             "output head; use a transformers teacher or hidden_states none")
        head = client.output_head(timeout=teacher.timeout_s)
    if head.fingerprint != info.output_head_fingerprint:
        raise ValueError(f"teacher at {teacher.target}: GetOutputHead sent head {head.fingerprint}, ModelInfo names "
                         f"{info.output_head_fingerprint} (the teacher changed between the two calls)")
    return head


def rollouts_hidden(rollouts: Sequence[Rollout], head: OutputHead) -> list[torch.Tensor]:
    """Each rollout's `[n, d]` teacher hidden states (in their wire dtype); ValueError naming the
    rollout when one carries none or names another head."""
    out = []
    for r in rollouts:
        if r.teacher_hidden is None:
            raise ValueError(f"rollout {r.rollout_id} carries no teacher hidden states (teacher.hidden_states is none "
                             "on its worker?)")
        if r.teacher_head_fingerprint != head.fingerprint:
            raise ValueError(f"rollout {r.rollout_id}: its hidden states belong to output head {r.teacher_head_fingerprint}, "
                             f"the learner holds {head.fingerprint} (teacher {head.info.model})")
        out.append(unpack_hidden(r.teacher_hidden, r.teacher_hidden_size, r.teacher_hidden_dtype, rows=r.num_response_tokens))
    return out


def head_on(head: OutputHead, device: str | torch.device) -> OutputHead:
    """`head` with its tensors in float32 on `device` (the head itself where they are already):
    `head_logits` projects in float32, and a bf16 head converted there would be converted again
    for every chunk of rows, forward and backward (an 8B teacher's head is 2.5 GB in float32)."""
    w, b = head.weight, head.bias
    if w.device == torch.device(device) and w.dtype == torch.float32 and (b is None or b.dtype == torch.float32):
        return head
    return OutputHead(head.info, w.to(device, torch.float32), None if b is None else b.to(device, torch.float32),
                      head.fingerprint)


def teacher_logit_rows(rollouts: Sequence[Rollout], head: OutputHead, teacher: TeacherConfig, *,
                       device: str | torch.device = "cpu", lead: tuple[int, ...] | None = None) -> TeacherLogitRows:
    """The teacher's logits of the rollouts' response tokens, on demand (`TeacherLogitRows`), in the
    order the loss flattens them: the rollouts' tokens one after another (flat form), or, with
    `lead = (B, T)`, rollout b's token t at row b * T + t (rows past a response are zeros, masked
    by the loss). Applies the teacher's temperature and its token remap (student ids)."""
    parts = rollouts_hidden(rollouts, head)
    d = head.info.hidden_size
    if lead is None:
        hidden = torch.cat(parts) if parts else torch.empty(0, d)
    else:
        b, t = lead
        if b != len(parts) or any(p.shape[0] > t for p in parts):
            raise ValueError(f"lead {lead}: {len(parts)} rollouts of up to {max((p.shape[0] for p in parts), default=0)} tokens")
        hidden = torch.zeros(b, t, d, dtype=parts[0].dtype if parts else torch.float32)
        for i, p in enumerate(parts):
            hidden[i, : p.shape[0]] = p
        hidden = hidden.view(b * t, d)
    n = hidden.shape[0]
    on = head_on(head, device)
    perm = vocab_permutation(teacher.token_remap, head.info.vocab_size)
    return TeacherLogitRows(on, hidden.to(device), torch.full((n,), 1.0 / teacher.temperature, device=device), perm)


class FullVocabTeacher:
    """The learner's side of `loss.support: full`: the teacher's output head, fetched once
    (`load`), and per micro-batch the teacher's logits of its response tokens on demand
    (`attach`: `LossInputs.teacher_logits`, flat rows in `pack_rollouts`' order)."""

    def __init__(self, cfg):
        t = cfg.teacher
        if t.hidden_states == "none":
            raise ValueError("loss.support: full needs the teacher's hidden states: set teacher.hidden_states to "
                             "bfloat16 or float32")
        if len(cfg.all_teachers()) > 1 or cfg.route.mixture:
            raise ValueError("loss.support: full is served for the run's one teacher (`teacher:`), not with "
                             "`teachers:` or route.mixture")
        self.teacher = t
        self.head: OutputHead | None = None

    @staticmethod
    def needed(cfg) -> bool:
        """Whether the run's loss (or its KD warm-up's, which never is) reads full-vocabulary logits."""
        return cfg.loss.needs_teacher_logits

    def load(self) -> OutputHead:
        """Fetches the head (every rank: each projects its own micro-batches)."""
        t = self.teacher
        self.head = fetch_teacher_head(t, client_kwargs=dict(timeout=t.timeout_s, retry_timeout=t.retry_timeout_s,
                                                             security=t.client_security()))
        return self.head

    def attach(self, loss_inputs, rollouts: Sequence[Rollout], device):
        """`loss_inputs` with `teacher_logits` built from `rollouts`' hidden states. The head is moved
        to `device` in float32 on the first call and kept there (not copied per micro-batch)."""
        assert self.head is not None, "FullVocabTeacher.load() first"
        self.head = head_on(self.head, device)
        return loss_inputs.replace(teacher_logits=teacher_logit_rows(rollouts, self.head, self.teacher, device=device))
