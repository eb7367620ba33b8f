"""The run configuration: one validated, frozen object per run, from one YAML file, then
`EOPD_RUN_<SECTION>__<KEY>` environment variables, then `key=value` overrides with dotted paths
(`train.lr=1e-5 loss.variant=opd`).

Defaults are the paper's (appendix A, Table 5): lr 3e-6, cosine schedule, AdamW, B = 128 rollouts
per iteration, B_mini = 32 (4 optimizer steps per iteration), 1 sample per prompt, top-p 1.0,
max response length 4096, top-k 16, temperature 1.0, tau 0.8, alpha 1.0, clip 0.2.

Every process of a run (learner, rollout workers, and later `eopd run`) loads the same file, so
they agree on the namespace of the queue, the data and the run directory. Relative paths in the
file are resolved against the file's directory. Unknown keys anywhere are errors; errors name
the dotted path of each offending field.
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from ..learner.alarms import AlarmName
from ..objective import LossConfig
from .base import ConfigError, Section
from .stages import run_needs_teacher_generation
from .teachers import DEFAULT_TEACHER, NamedTeacher, RouteConfig, TeacherConfig, check_routes


class StudentConfig(Section):
    model: str = Field("smollm2-135m", description="Student model spec: a preset, tiny-random@SEED, an HF directory or a .gguf file.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights' dtype of the rollout workers.")
    device: str = Field("cpu", description="Rollout worker device (cpu, cuda, cuda:1, ...).")


class TasksConfig(Section):
    """Prompts from the arithmetic/word-problem generator (`eopd_trainer.problems.generator`), written by `eopd run`."""

    train: int = Field(512, ge=1, description="Training prompts.")
    heldout: int = Field(64, ge=1, description="Held-out prompts (never shared with the training split).")
    variants: int = Field(0, ge=0, description="Also this many held-out problems written differently (other wordings, "
                          "stories and number ranges; none in either split): `eopd run` evaluates them as a second "
                          "set into eval-variants.json.")
    seed: int = Field(0, ge=0, description="Generator seed.")


class DataConfig(Section):
    train_files: list[Path] = Field(default_factory=list, description="JSONL (or parquet, with pyarrow) files of training prompts.")
    eval_files: list[Path] = Field(default_factory=list, description="Held-out prompt files (same format).")
    field: str = Field("prompt", description="Name of the prompt field of each record.")
    suffix: str = Field("", description='Appended to every prompt, e.g. " Please reason step by step, and put your final answer within \\boxed{}."')
    chat_template: bool | str = Field(
        True, description="true: the student tokenizer's chat template (user turn, generation prompt); a string: a "
        "template with {query}; false: the raw prompt."
    )
    max_prompt_length: int = Field(1024, ge=1, description="Longer prompts are truncated from the left.")
    shuffle: bool = Field(True, description="Shuffle prompts every epoch (deterministically from `seed`).")
    generate: TasksConfig | None = Field(None, description="`eopd run` generates the tasks' train/held-out splits into "
                                         "<run_dir>/data and uses them as train_files/eval_files.")


class VllmRolloutConfig(Section):
    """vLLM's engine settings of a worker with `rollout.engine: vllm` (see docs/vllm.md)."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="vLLM's weights/compute dtype; auto: student.dtype. Old log-probs from transformers use student.dtype.")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs the student is sharded over (vLLM starts one worker process per GPU).")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="GPU: fraction of GPU memory vLLM takes (weights, activations, "
                                          "KV cache); leave room for the transformers copy of the student that computes old log-probs.")
    kv_cache_gib: float | None = Field(None, gt=0, description="KV cache size in GiB; overrides the utilisation on GPU. None: from the "
                                       "utilisation on GPU, 1 GiB on CPU (VLLM_CPU_KVCACHE_SPACE still overrides it there).")
    max_model_len: int | None = Field(None, ge=2, description="Longest prompt + response vLLM accepts (None: the model's context "
                                      "length); must hold data.max_prompt_length + rollout.max_response_length.")
    max_num_seqs: int | None = Field(None, ge=1, description="Sequences vLLM decodes together (None: vLLM's default).")
    enforce_eager: bool = Field(True, description="No CUDA graphs / torch.compile inside vLLM: fast start (CPU needs it); "
                                "false on GPU hosts for faster decoding after a slower start.")
    enable_prefix_caching: bool = Field(True, description="Reuse the KV of shared prompt prefixes (the n_samples of a prompt); "
                                        "the cache is reset at every weight reload.")


class RolloutConfig(Section):
    engine: Literal["auto", "transformers", "vllm"] = Field(
        "auto", description="Sampling engine of the workers: transformers `generate`, or vLLM (needs vllm installed; "
        "weights reloaded in place at each policy version). auto: vLLM where student.device is CUDA and vLLM is "
        "installed, else transformers (`rollout.samplers.resolve_engine`).")
    kv_cache: Literal["auto", "dynamic", "static"] = Field(
        "auto", description="The transformers sampler's KV cache: static (preallocated to prompt + max_response_length; "
        "transformers then compiles the decode step on CUDA) or dynamic (grown per token). auto: static on CUDA, "
        "dynamic on CPU.")
    old_logprobs: Literal["auto", "generate", "transformers", "vllm"] = Field(
        "auto", description="Where old log-probs come from: `generate` (engine transformers): recorded from generate's "
        "raw logits of each step while sampling (no second forward pass; a probe at start checks they agree with the "
        "forward pass, ~1e-5 in fp32); `transformers`: a transformers forward pass over the sampled sequence (exactly "
        "what the learner's ratio is computed against); `vllm` (engine vllm): vLLM's log-prob of each sampled token (no "
        "second forward pass; agrees to 1e-5..1e-4 in fp32, not in bf16; needs top_p=1). auto: generate with the "
        "transformers engine and an fp32 student where the probe agrees, else transformers.")
    vllm: VllmRolloutConfig = Field(default_factory=VllmRolloutConfig, description="vLLM settings (engine=vllm).")
    n_samples: int = Field(1, ge=1, description="Responses sampled per prompt (paper: 1).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (paper: 1.0); old log-probs use it too.")
    top_p: float = Field(1.0, gt=0, le=1.0, description="Nucleus sampling (paper: 1.0 for Qwen).")
    max_response_length: int = Field(4096, ge=1, description="Maximum response tokens (paper: 4096).")
    generation_batch_size: int = Field(8, ge=1, description="Sequences generated together by one worker.")
    logprob_chunk_size: int = Field(1024, ge=1, description="Old log-probs: response positions whose logits are computed "
                                    "together (one [chunk, vocab] float32 block alive at a time, never [batch, seq, vocab]).")
    weights_poll_s: float = Field(0.2, gt=0, description="How often a worker polls for a newer policy version while it waits.")
    release_idle_weights: bool = Field(
        True, description="Sync mode, transformers engine on the CPU: a worker with no task frees its copy of the policy until it "
        "loads the next version (it would load it in full anyway): the learner trains meanwhile, and the job's memory "
        "peaks then (main job: 0.5 GiB less). vLLM keeps its weights.")
    claim_idle_ms: int = Field(30_000, ge=1, description="Tasks pending this long on another (dead) worker are reclaimed (XAUTOCLAIM).")
    stop_grace_s: float = Field(10.0, ge=0, description="On SIGTERM/SIGINT, how long a worker waits for answers already "
                                "requested before it exits; unfinished tasks stay pending and are re-done by another worker.")
    max_task_deliveries: int = Field(5, ge=1, description="A task delivered more often than this goes to the dead-letter stream.")
    max_rollout_deliveries: int = Field(
        4, ge=1, description="A scored rollout the learner has held across more than this many of its restarts (read "
        "and not committed: a rollout that crashes the learner) goes to the dead-letter stream instead of being read "
        "first again (no crash loop).")

    @model_validator(mode="after")
    def _engine_settings(self) -> RolloutConfig:
        if self.old_logprobs == "vllm" and self.engine == "transformers":
            raise ValueError("rollout.old_logprobs=vllm needs rollout.engine=vllm or auto on a CUDA host with vLLM (only "
                             "vLLM returns its own log-probs)")
        if self.old_logprobs == "generate" and self.engine == "vllm":
            raise ValueError("rollout.old_logprobs=generate needs the transformers sampler (rollout.engine=transformers or "
                             "auto on CPU); with vLLM use old_logprobs=vllm or transformers")
        if self.old_logprobs == "vllm" and self.top_p < 1.0:
            raise ValueError(
                f"rollout.old_logprobs=vllm needs rollout.top_p=1.0 (got {self.top_p}): vLLM's log-probs are renormalised "
                "over the top-p nucleus, the learner's are over the whole vocabulary; use old_logprobs=transformers")
        return self


class QueueConfig(Section):
    backend: Literal["auto", "redis", "redis-server", "embedded"] = Field(
        "auto", description="The queue `eopd run` uses (the learner and workers ignore it and use redis_url): auto = the "
        "Redis at $REDIS_URL if it answers, else a redis-server it starts, else the embedded in-memory queue; redis = "
        "only $REDIS_URL (or redis_url); redis-server = only a redis-server it starts; embedded = only the in-memory queue "
        "in the eopd run process (not persistent).")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis URL (redis://, rediss:// for TLS; password in the URL or REDIS_PASSWORD).")
    namespace: str = Field("eopd", description="Prefix of every Redis key of the run: <ns>:tasks, <ns>:rollouts, <ns>:dead, <ns>:policy.")
    auth_key_file: str | None = Field(
        None, description="File holding the run's message key (>= 32 bytes, e.g. `openssl rand -hex 32`; a k8s/compose "
        "secret): every task, rollout and policy announcement carries an HMAC-SHA256 under it and the learner and workers "
        "dead-letter (reason unauthenticated) or ignore what does not; Redis never sees the key. `eopd run` generates one "
        "(0600, <run_dir>/queue.key). None: messages are not authenticated (a warning says so).")
    max_backlog: int = Field(1024, ge=1, description="Producers wait while the rollout stream holds this many entries (backpressure).")
    block_ms: int = Field(1000, ge=1, description="XREADGROUP blocking time.")
    dead_letter_maxlen: int = Field(10_000, ge=1, description="The dead-letter and dropped streams are trimmed (approximately) to "
                                    "this length (the counts in <ns>:counts stay exact).")
    max_rejected_in_a_row: int | None = Field(
        None, ge=1, description="The learner exits (status 5, listing the recent reasons) after this many rollouts in a row were "
        "dead-lettered or dropped as stale/future with none admitted: systematic poison, not bad luck. None: 4 x train.batch_size.")
    lease_ttl_s: float = Field(15.0, gt=0, description="The learner's lease on the namespace (<ns>:lease) expires this long after "
                               "its last renewal (renewed every third of it); a second learner refuses to start while it is live.")
    lease_wait_s: float = Field(20.0, ge=0, description="How long a starting learner waits for a previous holder's lease to expire "
                                "(e.g. a learner killed on another host) before it refuses to start (exit 2).")


class TrainConfig(Section):
    batch_size: int = Field(128, ge=1, description="B: rollouts per iteration (paper: 128).")
    mini_batch_size: int = Field(32, ge=1, description="B_mini: rollouts per optimizer step (paper: 32 -> 4 steps per iteration).")
    micro_batch_size: int = Field(8, ge=1, description="Rollouts per forward/backward per process (gradient accumulation makes up B_mini).")
    iterations: int | None = Field(None, ge=1, description="Training iterations; default: from `epochs`.")
    warmup_kd_iterations: int = Field(
        0, ge=0, description="KD warm-up (prune-then-distill): the first this many iterations train with loss variant "
        "kd on teacher-generated responses (the teacher's Generate), then loss.variant; counted in `iterations`. "
        "Shown as stage kd-warmup in the progress line, train_metrics.jsonl and the report.")
    epochs: float = Field(3.0, gt=0, description="Passes over the training prompts when `iterations` is not given (paper: 3 on MATH).")
    lr: float = Field(3e-6, gt=0, description="Peak learning rate (paper: 3e-6).")
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up optimizer steps of the cosine schedule.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Cosine floor as a fraction of lr.")
    grad_clip: float = Field(1.0, ge=0, description="Gradient-norm clipping (0 disables).")
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage.")
    precision: Literal["fp32", "bf16"] = Field("fp32", description="Training precision (bf16 keeps fp32 master weights).")
    loss_from_hidden: bool = Field(True, description="Use the fused hidden-state loss (no [N, V] logits); ZeRO-3, and students whose logits are transformed after the output projection (Gemma 2 soft-capping, Cohere, Granite), always use the logits.")
    share_prefill: bool = Field(True, description="With the fused hidden-state loss: the tokens a micro-batch's rows share (the chat template every prompt starts with, a prompt sampled twice) run through the student once, their keys and values (and gradients) shared by every row that attends to them (eopd_common.shared_prefill); the same loss and gradients to float rounding. false: one forward pass over the padded rows.")
    recompute_mlp: bool = Field(True, description="Gated MLPs (Llama, Qwen, Mistral) keep gate(x) and up(x) for backward and recompute silu(gate) and the product there (learner/swiglu.py): a third of a forward's activations fewer, the same values and gradients. ZeRO-3 keeps the modules' own forward.")
    matmul_precision: Literal["highest", "high", "medium"] = Field(
        "high", description="torch.set_float32_matmul_precision in the learner on CUDA: \"high\" = TF32 matmuls "
        "(10-bit mantissa inputs, fp32 accumulation; the loss and its gradients stay within about 1e-3 relative of "
        "fp32), \"highest\" = full fp32, \"medium\" = bf16 inputs. Not applied on the CPU (fp32 there).")
    deepspeed: dict[str, Any] = Field(default_factory=dict, description="Extra DeepSpeed config merged over the generated one.")
    dist_backend: str = Field("", description="torch.distributed backend; default gloo on CPU, nccl on GPU.")
    stop_on: list[AlarmName] = Field(
        default_factory=list, description="Alarms that stop the run (learner/alarms.py): negative_divergence, "
        "entropy_band, truncation. Every alarm is shown on the progress line and in the report; one listed here also "
        "stops the learner at the iteration it fires (exit 7, the reason in its log and train_metrics.jsonl). "
        "Empty (the default): warn only.")


class CheckpointConfig(Section):
    every: int = Field(1, ge=1, description="Checkpoint every this many iterations (rollouts are acknowledged at checkpoints).")
    keep: int = Field(2, ge=1, description="Checkpoints kept (older ones deleted after a newer one is committed).")
    export_hf: bool = Field(True, description="Also write a Hugging Face save_pretrained export of the student.")
    keep_weights: int = Field(3, ge=1, description="Published weight versions kept in weights/.")


class EvalConfig(Section):
    """`eopd eval` / the evaluation at the end of `eopd run` (paper: temperature 1.0, top-p 0.8)."""

    enabled: bool = Field(True, description="`eopd run` evaluates eval.models on data.eval_files at the end.")
    n_samples: int = Field(4, ge=1, description="Samples per held-out prompt (the k of Avg@k; Pass@k for k <= n).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (paper: 1.0).")
    top_p: float = Field(0.8, gt=0, le=1.0, description="Nucleus sampling (paper: 0.8).")
    max_new_tokens: int = Field(256, ge=1, description="Maximum response tokens.")
    max_prompts: int = Field(0, ge=0, description="Use at most this many held-out prompts (0: all).")
    batch_size: int = Field(8, ge=1, description="Sequences generated / scored together.")
    high_entropy: float = Field(0.8, ge=0, description="Teacher-entropy threshold of the high-entropy KL (paper tau).")
    headline: Literal["strict", "flexible"] = Field(
        "strict", description="The answer extraction behind the headline metrics (avg_at_k, pass_at_k, the report's "
        "Avg@n / Pass@k): strict = the last \\boxed{}, flexible = the response's last number (lm-evaluation-harness "
        "GSM8K flexible-extract). Both are always computed and stored.")
    variants: bool = Field(True, description="Also evaluate the variants set (data.generate.variants) into "
                           "eval-variants.json.")
    cache: bool = Field(True, description="Reuse an evaluation made before (e.g. the teacher's and the initial "
                        "student's in every run) when the model's files, the teacher, the data, these settings, "
                        "the seed and the evaluation code are the same (eval/cache.py, $EOPD_CACHE_DIR/evals); "
                        "false: always evaluate.")
    models: list[str] = Field(default_factory=lambda: ["teacher", "initial", "final"],
                              description="What `eopd run` evaluates: teacher (the ceiling, once per run), initial "
                              "(student before training), final.")


class LoggingConfig(Section):
    progress: bool = Field(True, description="Console progress bar (tqdm).")
    tensorboard: bool = Field(True, description="TensorBoard event files under <run_dir>/tb.")
    prometheus_port: int = Field(0, ge=0, le=65535, description="Serve Prometheus metrics on this port (0: off).")
    level: str = Field("INFO")


class ThreadsConfig(Section):
    """CPU threads of the processes `eopd run` starts (issue 31, ask 7; job/threads.py). OpenMP reads
    these once, at a process's start, so they reach a child only through its environment. A count
    is at most MAX_THREADS: a fixed bound, not this machine's cores (a config is often validated on
    another machine than the one it runs on), above the hardware threads of any one node today."""

    MAX_THREADS: ClassVar[int] = 1024
    learner: int = Field(0, ge=0, le=MAX_THREADS, description="torch threads of the learner (0: every core the process may use; at most 1024).")
    rollout: int = Field(0, ge=0, le=MAX_THREADS, description="torch threads of each rollout worker (0: every core; at most 1024).")
    teacher: int = Field(0, ge=0, le=MAX_THREADS, description="torch threads of each teacher `eopd run` starts (0: every core; at most 1024).")
    MAX_SPIN_COUNT: ClassVar[int] = 10**9
    omp_wait_policy: Literal["passive", "brief", "active", "inherit"] = Field(
        "passive", description="How the children's waiting OpenMP threads wait: passive (OMP_WAIT_POLICY=PASSIVE: a "
        "waiting thread sleeps at once, so a process sharing the CPU with other work is not slowed by threads spinning "
        "for preempted ones; the default, chosen by bench/bench_busy_job.py: the main job beside a CPU hog 1.37x its "
        "time alone against 4.81x with OpenMP's default; alone within the run-to-run spread on a 2-core Xeon, 1.04x on an "
        "EPYC), "
        "brief (OMP_WAIT_POLICY unset, GOMP_SPINCOUNT=spin_count: a waiting thread spins that many times, then "
        "sleeps; libgomp's setting, the OpenMP runtime of torch's Linux wheels), active (they spin), inherit (this "
        "process's environment: OpenMP's default, 300000 spins then sleep). An OMP_WAIT_POLICY or GOMP_SPINCOUNT "
        "already set in the environment wins over the setting.")
    spin_count: int = Field(10_000, ge=0, le=MAX_SPIN_COUNT, description="omp_wait_policy brief: the spins of a "
                            "waiting OpenMP thread before it sleeps (GOMP_SPINCOUNT; libgomp's default is 300000).")


class WeightBroadcastConfig(Section):
    """`weight_sync: broadcast` (queue/weights_broadcast.py): the learner and the rollout workers form a
    process group of their own and every version goes out in one broadcast (NCCL between GPUs, one node
    or several; gloo between CPUs)."""

    address: str = Field("", description="host:port of the learner's TCPStore, where the group meets (the learner "
                         "listens there, on that host's interface only, the workers connect). Empty: `eopd run` picks "
                         "a free port on 127.0.0.1; a deployment over several nodes names the learner's address. Only "
                         "holders of queue.auth_key_file may join (queue/broadcast_trust.py).")
    workers: int = Field(1, ge=1, description="Rollout workers in the group (the learner waits for all of them to join "
                         "at its first publish).")
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="auto: NCCL when the learner's weights are on "
                                                     "a GPU, else gloo.")
    join_timeout_s: float = Field(600.0, gt=0, description="How long the learner waits at its first publish for every "
                                  "worker to join (workers load their models first); past it, files.")
    timeout_s: float = Field(300.0, gt=0, description="One broadcast's limit; a failed or late broadcast ends the group "
                             "and the run goes on with files (weight_sync disk).")


class FaultConfig(Section):
    """A fault to inject (tests and the chaos tier): at `point`, when the context matches, do `action`."""

    point: str = Field(description="e.g. learner.after_step, learner.after_commit, rollout.after_publish")
    action: Literal["kill", "hang", "raise", "delay", "corrupt"] = "kill"
    seconds: float = Field(1.0, ge=0, description="delay: how long the step sleeps")
    iteration: int | None = None
    step: int | None = None
    count: int | None = Field(None, description="rollout points: the number of published rollouts (see faults.py)")


SHM_ROOT = Path("/dev/shm")


def shm_weights_dir(run_dir: Path) -> Path:
    """The run's weights directory in shared memory: /dev/shm/eopd-<uid>-<hash of the run directory's
    real path>/weights (one per user and run directory, the same for every process of the run)."""
    key = hashlib.sha256(os.path.realpath(run_dir).encode()).hexdigest()[:16]
    return SHM_ROOT / f"eopd-{os.getuid()}-{key}" / "weights"


class RunConfig(Section):
    run_dir: Path = Field(Path("runs/default"), description="Checkpoints, published weights, logs and TensorBoard events.")
    seed: int = 0
    mode: Literal["sync", "async"] = Field("sync", description="sync: Algorithm 1 (rollouts of iteration i from the weights after i-1); async: bounded staleness.")
    max_staleness: int = Field(1, ge=0, description="async: rollouts sampled more than this many versions ago are dropped and counted.")
    weight_sync: Literal["auto", "disk", "shm", "mapped", "broadcast"] = Field(
        "auto", description="How published weights reach the rollout workers: disk (versioned files in <run_dir>/weights: "
        "any shared file system, several nodes), shm (the same files in /dev/shm, shared memory: learner and workers on "
        "one node, one user), mapped (one buffer in /dev/shm that the learner rewrites in place and the workers copy "
        "out under a sequence lock: no file format, no hash; one node), broadcast (a process group of the learner and "
        "the workers, `weight_broadcast`: NCCL device to device, one node or several; files in <run_dir>/weights "
        "once a broadcast fails). auto: mapped where `eopd run` starts them on this machine and /dev/shm has room, "
        "else disk.")
    weight_broadcast: WeightBroadcastConfig = WeightBroadcastConfig()
    teacher: TeacherConfig = TeacherConfig()
    teachers: list[NamedTeacher] = Field(default_factory=list, description="More teachers by name (config/teachers.py); "
                                         "`teacher:` is the one named `teacher`.")
    route: RouteConfig = RouteConfig()
    student: StudentConfig = StudentConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    queue: QueueConfig = QueueConfig()
    loss: LossConfig = LossConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    eval: EvalConfig = EvalConfig()
    faults: list[FaultConfig] = Field(default_factory=list)
    threads: ThreadsConfig = ThreadsConfig()

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        if not self.data.train_files and self.data.generate is None:
            raise ValueError("data.train_files: at least one prompt file is required (or data.generate)")
        t = self.train
        if t.batch_size % t.mini_batch_size:
            raise ValueError(f"train.batch_size ({t.batch_size}) must be a multiple of train.mini_batch_size ({t.mini_batch_size})")
        if t.batch_size % self.rollout.n_samples:
            raise ValueError(f"train.batch_size ({t.batch_size}) must be a multiple of rollout.n_samples ({self.rollout.n_samples})")
        held = t.batch_size * self.checkpoint.every
        if self.queue.max_backlog < held:
            raise ValueError(
                f"queue.max_backlog ({self.queue.max_backlog}) must be at least train.batch_size x checkpoint.every "
                f"({held}): rollouts stay in the stream until the checkpoint that trained on them is committed, so "
                "a smaller bound stops the workers before the learner has a batch (deadlock)"
            )
        self._stages_consistent()
        check_routes(self.teacher, self.teachers, self.route,
                     teacher_generates=run_needs_teacher_generation(self.loss, self.train.warmup_kd_iterations))
        if abs(self.rollout.temperature - self.loss.temperature) > 1e-9:
            raise ValueError(
                f"rollout.temperature ({self.rollout.temperature}) must equal loss.temperature ({self.loss.temperature}): "
                "the old log-probs and the ratio must be taken at the same temperature"
            )
        return self._with_full_vocabulary()

    def _with_full_vocabulary(self) -> RunConfig:
        """A loss over the teacher's full vocabulary (loss.support: full) reads the teacher's hidden
        states: they are asked for in bfloat16 where `teacher.hidden_states` was left unset, and a
        config that cannot serve them is refused here, before any process starts."""
        if not self.loss.needs_teacher_logits:
            return self
        what = f"loss.support: full (loss.variant {self.loss.variant}) reads the teacher's full vocabulary"
        if self.teachers or self.route.mixture:
            raise ValueError(f"teachers / route.mixture: {what}, served for the run's one teacher (`teacher:`) only; with "
                             "several teachers choose a top-k support (loss.support=teacher_topk) or the paper's loss "
                             "(loss.variant=eopd)")
        if self.teacher.hidden_states != "none":
            return self
        if "hidden_states" in self.teacher.model_fields_set:
            raise ValueError(f"teacher.hidden_states: none, but {what} from the teacher's hidden states: set "
                             "bfloat16 (the default for this loss) or float32")
        return self.model_copy(update={"teacher": self.teacher.model_copy(update={"hidden_states": "bfloat16"})})

    def all_teachers(self) -> dict[str, TeacherConfig]:
        """Every teacher by name, `teacher` (the `teacher:` section) first."""
        return {DEFAULT_TEACHER: self.teacher, **{t.name: t for t in self.teachers}}

    def _stages_consistent(self) -> None:
        """The KD warm-up and the off-policy / graded variants against the rest of the config."""
        t, variant = self.train, self.loss.variant
        if t.iterations is not None and t.warmup_kd_iterations > t.iterations:
            raise ValueError(f"train.warmup_kd_iterations ({t.warmup_kd_iterations}) is more than train.iterations "
                             f"({t.iterations})")
        if self.loss.advantages_given and self.rollout.n_samples < 2:
            raise ValueError(f"rollout.n_samples ({self.rollout.n_samples}) must be >= 2 for loss.variant={variant}: its "
                             "advantages are normalised within each prompt's group of samples (one sample: always 0)")

    # Derived quantities -------------------------------------------------------------------
    @property
    def steps_per_iteration(self) -> int:
        return self.train.batch_size // self.train.mini_batch_size

    @property
    def prompts_per_iteration(self) -> int:
        return self.train.batch_size // self.rollout.n_samples

    def total_iterations(self, num_prompts: int) -> int:
        if self.train.iterations is not None:
            return self.train.iterations
        return max(1, math.ceil(self.train.epochs * num_prompts / self.prompts_per_iteration))

    @property
    def weights_dir(self) -> Path:
        """Where the learner publishes weight versions; workers load announced files only from here
        (`weight_sync`: shm and mapped, a directory of this run in /dev/shm; disk and auto, <run_dir>/weights:
        `eopd run` makes auto concrete before its processes read the config)."""
        if self.weight_sync in ("shm", "mapped"):
            return shm_weights_dir(self.run_dir)
        return self.run_dir / "weights"

    @property
    def effective_max_staleness(self) -> int:
        return 0 if self.mode == "sync" else self.max_staleness

