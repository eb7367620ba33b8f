"""The training side of the learner: the loss terms and step metrics it reduces, whether the loss
takes the fused hidden-state path (`fused_loss_path`), and quiet library logging."""

from __future__ import annotations

from eopd_common.logits import logit_transforms

from ..objective import METRIC_KEYS

LOSS_TERMS = ("loss", "pg_loss", "fkl_loss", "entropy_loss")
# Token-weighted per-step metrics (the loss's own keys, plus those it adds with vocab metrics).
STEP_METRIC_KEYS = tuple(k for k in (*METRIC_KEYS, "student_entropy", "topk_overlap") if k not in LOSS_TERMS)


def fused_loss_path(train_cfg, model) -> tuple[bool, str]:
    """Whether the learner takes the fused hidden-state loss (`compute_loss_from_hidden`, no
    [N, V] logits), and why not when `train.loss_from_hidden` asks for it but it cannot: ZeRO-3
    (the output projection's weight is partitioned), or a student whose logits are not
    `lm_head(hidden)` (Gemma 2 soft-capping, Cohere's logit_scale, Granite's logits_scaling): the
    fused path would compute its log-probs without the transform, so the ratio against the
    worker's old log-probs (which apply it) would be wrong. Those take `model(...).logits`."""
    if not train_cfg.loss_from_hidden:
        return False, ""
    if train_cfg.zero_stage >= 3:
        return False, ""  # documented with the setting: ZeRO-3 always uses the logits
    transforms = logit_transforms(model.config)
    if transforms:
        return False, (f"train.loss_from_hidden: {type(model).__name__} transforms its logits after the output "
                       f"projection ({', '.join(transforms)}); the loss uses the model's logits instead of the fused path")
    return True, ""


def _quiet_libraries() -> None:
    """No per-file progress bars from transformers / huggingface_hub in the learner's log."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:  # pragma: no cover
        pass
