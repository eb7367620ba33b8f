"""The learner's DeepSpeed side (every rank, never Redis): `PolicyTrainer` sets up the process group,
the student, the DeepSpeed engine and the checkpoint manager, trains an iteration's rollouts
(mini-batches of micro-batches, gradient accumulation, data parallel over ranks), writes the
policy's weight files and the Hugging Face export. Also the loss terms and step metrics it reduces,
whether the loss takes the fused hidden-state path (`fused_loss_path`), and quiet library logging."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
import transformers
from eopd_common.logits import logit_transforms
from eopd_common.models import load_causal_lm, pad_token_id
from eopd_common.shared_prefill import response_hidden
from huggingface_hub.utils import disable_progress_bars

from ..batching import (
    PackedBatch,
    aggregation_units,
    gradient_accumulation_steps,
    pack_rollouts,
    rollout_advantages,
    shard,
    shuffle_for_iteration,
    split,
)
from ..config import RunConfig
from ..faults import Faults
from ..objective import METRIC_KEYS, LossConfig, compute_loss, compute_loss_from_hidden, step_generator
from ..objective.mixture import mixture_loss, per_teacher_keys
from ..queue.messages import PolicyVersion, Rollout
from ..queue.weights import export_state_dict
from .checkpoint import CheckpointManager
from .state import LearnerState
from .distributed import (
    all_reduce_step_metrics,
    barrier,
    build_ds_config,
    full_parameters,
    init_process_group,
    lr_scheduler_factory,
)
from .swiglu import recompute_gated_mlps
from .teacher_head import FullVocabTeacher
from .weights_out import WeightsOut

log = logging.getLogger("eopd.learner")

LOSS_TERMS = ("loss", "pg_loss", "fkl_loss", "entropy_loss", "topk_rkl_loss", "divergence_loss")
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


def gradient_norm(parameters) -> float:
    """The L2 norm of the parameters' gradients taken together (those without one left out): what
    `torch.nn.utils.clip_grad_norm_` measures before it clips, without clipping."""
    norms = [p.grad.detach().float().norm() for p in parameters if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


def skip_lone_allreduce(world: int, zero_stage: int) -> bool:
    """Whether the engine's gradient all-reduce is switched off: one process without ZeRO has
    nothing to reduce, yet DeepSpeed 0.19 (`buffered_allreduce_fallback`) would still copy every
    gradient into one flat bucket (the size of the model in float32: 0.5 GB for SmolLM2-135M, at
    the learner's memory peak), all-reduce it over a group of one and copy it back, every step.
    ZeRO stages 1-2 reduce through their optimizer and are left alone."""
    return world == 1 and zero_stage == 0


def _quiet_libraries() -> None:
    """No per-file progress bars from transformers / huggingface_hub in the learner's log."""
    transformers.utils.logging.disable_progress_bar()
    disable_progress_bars()


class PolicyTrainer:
    def __init__(self, cfg: RunConfig, faults: Faults):
        self.cfg = cfg
        self.faults = faults
        self.weights_out = WeightsOut(cfg)  # files, the mapped buffer or the broadcast group (rank 0)

    # Set-up ----------------------------------------------------------------------------------
    def init_process_group(self) -> tuple[int, int]:
        """(rank, world size); the first thing the learner does."""
        _quiet_libraries()
        self.rank, self.world = init_process_group(self.cfg.train.dist_backend)
        return self.rank, self.world

    def setup(self, run_dir: Path, total_iterations: int) -> None:
        """The student, the DeepSpeed engine (optimizer, LR schedule) and the checkpoint manager."""
        import deepspeed

        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        self.run_dir = run_dir
        self.gas = gradient_accumulation_steps(cfg.train.mini_batch_size, cfg.train.micro_batch_size, self.world)
        on_cpu = not torch.cuda.is_available()
        self.device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
        if not on_cpu:  # TF32 (or bf16) float32 matmuls with fp32 accumulation: train.matmul_precision
            torch.set_float32_matmul_precision(cfg.train.matmul_precision)
        loaded = load_causal_lm(cfg.student.model, dtype="float32", device=str(self.device))
        self.tokenizer = loaded.tokenizer
        self.pad_id = pad_token_id(self.tokenizer)
        model = loaded.model
        model.train()
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.step_keys = STEP_METRIC_KEYS + per_teacher_keys(list(cfg.route.mixture))  # route.mixture's per teacher
        if cfg.train.recompute_mlp and cfg.train.zero_stage < 3:  # ZeRO-3: only a projection's forward gathers it
            log.info("%d gated MLPs recompute silu(gate) * up in backward (train.recompute_mlp)", recompute_gated_mlps(model))
        self.fused_loss, why = fused_loss_path(cfg.train, model)
        if why:
            log.warning("%s", why)
        # loss.support full: the teacher's logits from the hidden states its rollouts carry (issue 48).
        self.full_vocab_teacher = FullVocabTeacher(cfg) if FullVocabTeacher.needed(cfg) else None
        if self.full_vocab_teacher is not None:
            head = self.full_vocab_teacher.load()
            log.info("teacher output head %s (%s, [%d, %d] %s) for loss.support full", head.fingerprint[:16],
                     head.info.model, head.info.vocab_size, head.info.hidden_size, head.info.dtype)
        total_steps = total_iterations * cfg.steps_per_iteration
        ds_config = build_ds_config(cfg, self.world, total_steps)
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_config,
            lr_scheduler=lr_scheduler_factory(cfg, total_steps))
        if skip_lone_allreduce(self.world, cfg.train.zero_stage):
            self.engine.enable_backward_allreduce = False
        self.ckpt = CheckpointManager(run_dir / "checkpoints", keep=cfg.checkpoint.keep,
                                      export_hf=cfg.checkpoint.export_hf, rank=self.rank, barrier=barrier,
                                      faults=self.faults)

    def restore_checkpoint(self) -> LearnerState | None:
        """The committed checkpoint into the engine; its trainer state (None on a fresh run)."""
        return self.ckpt.load(self.engine)

    def save_checkpoint(self, iteration: int, state: LearnerState) -> None:
        self.ckpt.save(self.engine, iteration, state, export_fn=self.export_hf)

    @property
    def global_steps(self) -> int:
        return int(self.engine.global_steps)

    # Training ----------------------------------------------------------------------------------
    def micro_loss(self, packed: PackedBatch, denominator: float, generator: torch.Generator | None = None,
                   loss_cfg: LossConfig | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of one micro-batch under `loss_cfg` (default loss config; the KD warm-up passes
        its kd copy). Teacher inputs are None when the micro-batch has none (grpo), advantages
        given when packed with them (grpo)."""
        dev = self.device
        ids, am = packed.input_ids.to(dev), packed.attention_mask.to(dev)
        pos = packed.positions.to(dev)
        loss_cfg = loss_cfg or self.cfg.loss
        inputs = packed.loss_inputs
        if not loss_cfg.reads_old_logprobs:
            # Without a policy-gradient term (kd, gkd) there is no behaviour-policy ratio to measure:
            # teacher-generated rollouts carry zeros as old log-probs, so none are passed.
            inputs = inputs.replace(old_logprobs=None)
        inputs = inputs.to(dev)
        module = self.engine.module
        if self.fused_loss:
            if self.cfg.train.share_prefill and packed.prompt_ids:  # the rows' shared tokens run once
                hidden = response_hidden(module, packed.prompt_ids, packed.response_ids, self.pad_id, dev)
            else:
                hidden = module.get_decoder()(input_ids=ids, attention_mask=am).last_hidden_state
                hidden = hidden.reshape(-1, hidden.shape[-1])[pos]
            head = module.get_output_embeddings()

            def loss_of(x):
                return compute_loss_from_hidden(hidden, head.weight, x, bias=head.bias, config=loss_cfg,
                                                denominator=denominator, generator=generator)
        else:
            logits = self.engine(input_ids=ids, attention_mask=am).logits
            flat = logits.reshape(-1, logits.shape[-1])[pos]

            def loss_of(x):
                return compute_loss(flat, x, loss_cfg, denominator=denominator, generator=generator)
        if not packed.mixture:
            return loss_of(inputs)
        parts = [(name, {k: v.to(dev) for k, v in fields.items()}) for name, fields in packed.mixture]
        return mixture_loss(loss_of, inputs, parts, self.cfg.route.mixture)  # route.mixture: the weighted sum

    def train_iteration(self, iteration: int, rollouts: list[Rollout], opt_step: int,
                        loss_cfg: LossConfig | None = None) -> list[dict[str, float]]:
        """One optimizer step per mini-batch of the shuffled rollouts; `opt_step` is the run's
        0-based index of the first one; `loss_cfg` the iteration's loss (config/stages.py: kd during
        the warm-up; default loss config). Returns each step's metrics (one per optimizer step taken).

        A variant whose advantages are given (grpo) gets each rollout's group-normalised reward
        (`rollout_advantages`), computed over the whole iteration before the mini-batch split so a
        task's samples are normalised together (sync mode: an iteration holds every sample of its
        tasks; async mode: a task's samples can straddle iterations, each part normalised within
        its iteration)."""
        cfg = self.cfg
        loss_cfg = loss_cfg or cfg.loss
        advantages = None
        if loss_cfg.advantages_given:
            advantages = rollout_advantages(rollouts, loss_cfg.grpo_eps)
        ordered = shuffle_for_iteration(rollouts, cfg.seed, iteration)
        steps = []
        for step, mini in enumerate(split(ordered, cfg.train.mini_batch_size), 1):
            local = shard(mini, self.rank, self.world)
            units = aggregation_units(loss_cfg, mini)
            # engine.backward divides by gas and the all-reduce averages over ranks: this makes the
            # sum over every micro-batch of every rank the loss over the whole mini-batch.
            denominator = units / (self.gas * self.world)
            rows = []
            loss_sum = {k: 0.0 for k in LOSS_TERMS}
            lr_used = float(self.scheduler.get_last_lr()[0])  # in the param groups until this step is taken
            micros = split(local, cfg.train.micro_batch_size)
            own_norm = None
            for micro_index, micro in enumerate(micros):
                packed = pack_rollouts(micro, self.pad_id, advantages=advantages)
                if self.full_vocab_teacher is not None and loss_cfg.needs_teacher_logits:
                    packed = dataclasses.replace(packed, loss_inputs=self.full_vocab_teacher.attach(
                        packed.loss_inputs, micro, self.device))
                # random_fkl's draw: different at every step, rank and micro-batch, the same again
                # when a resumed run redoes this step.
                gen = step_generator(loss_cfg.random_seed, iteration, opt_step, self.rank, micro_index)
                loss, m = self.micro_loss(packed, denominator, gen, loss_cfg)
                self.engine.backward(loss)
                if micro_index == len(micros) - 1 and cfg.train.zero_stage == 0:
                    # the step's gradients, all-reduced, before the clip (DeepSpeed keeps no norm at stage 0)
                    own_norm = gradient_norm(self.engine.module.parameters())
                self.engine.step()
                rows.append(({k: v for k, v in m.items() if k not in LOSS_TERMS}, packed.num_tokens))
                for k in LOSS_TERMS:
                    loss_sum[k] += m.get(k, 0.0) / self.gas  # this rank's share x world, see denominator
            opt_step += 1
            # Over every rank's micro-batches (one all-reduce), not rank 0's share only.
            metrics = {**all_reduce_step_metrics(rows, loss_sum, self.step_keys, LOSS_TERMS), "lr": lr_used}
            grad_norm = self.engine.get_global_grad_norm()
            grad_norm = own_norm if grad_norm is None else grad_norm
            if grad_norm is not None:
                metrics["grad_norm"] = float(grad_norm)  # before train.grad_clip
            steps.append(metrics)
            self.faults.hit("learner.after_step", iteration=iteration, step=step)
        return steps

    # Weights out -------------------------------------------------------------------------------
    def save_weights(self, version: int, iteration: int) -> PolicyVersion | None:
        """Publishes the policy (collective: ZeRO-3 gathers; rank 0 publishes through `weight_sync` and
        gets the PolicyVersion to announce, the other ranks None)."""
        with full_parameters(self.engine, self.cfg.train.zero_stage):
            if self.rank == 0:
                return self.weights_out.publish(self.engine.module, version, iteration)
        return None

    def prune_weights(self, protect: int) -> None:
        self.weights_out.prune(protect)

    def export_hf(self, path: Path) -> None:
        """The Hugging Face export of a checkpoint (collective; rank 0 writes)."""
        with full_parameters(self.engine, self.cfg.train.zero_stage):
            if self.rank == 0:
                self.engine.module.save_pretrained(str(path), state_dict=export_state_dict(self.engine.module),
                                                   safe_serialization=True)
                self.tokenizer.save_pretrained(str(path))
