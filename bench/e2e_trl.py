"""One TRL training run for the head-to-head benchmark (`bench/bench_e2e.py`), TRL's code unmodified:
`trl.experimental.gkd.GKDTrainer` (in-process teacher) or
`trl.experimental.server_distillation.ServerDistillationTrainer` (a teacher server's `/v1/completions`).

    .venv-vllm/bin/python -m bench.e2e_trl SPEC.json

Runs in .venv-vllm, where TRL 1.16 is installed (its `VLLMClient`, which the server trainer uses,
starts only where the `vllm` package is importable). The spec (written by bench_e2e) gives the
system, the model directories, the prompts already rendered as the student sees them in `eopd run`
(the preset's chat template and suffix), and the matched settings. What this adds around TRL:

- the prompts reach each trainer as the exact text eopd renders: the server trainer takes plain
  string prompts as they are; GKD's chat-ML collator builds the prompt from `messages` with the
  tokenizer's chat template, so the tokenizer gets a template that writes the rendered prompt
  verbatim (`VERBATIM_TEMPLATE`; the assistant turn is empty: with `lmbda` 1 GKD replaces it with the
  student's own sample at every step);
- a callback saves the student (`save_pretrained`) every `save_every` optimizer steps and at the end,
  and writes `timeline.json`: per checkpoint the wall-clock time at which it was reached and the
  seconds spent saving before it (the benchmark takes saving off the training clock), the peak RSS
  of this process, and TRL's log history;
- GKD's time split (`time_split`): the seconds in its on-policy generation (the trainer's
  `generate_on_policy_outputs`, wrapped on the instance) and in the teacher's forward passes (a
  forward pre-hook and hook on the teacher model), measured around TRL's calls without changing them.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

# messages = [{"role": "user", "content": <the rendered prompt>}, {"role": "assistant", "content": ""}]
VERBATIM_TEMPLATE = ("{{ messages[0]['content'] }}{% for m in messages[1:] %}{{ m['content'] }}<|im_end|>\n{% endfor %}")
SYSTEMS = ("gkd", "server")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def timeline_callback(out: Path, save_every: int, max_steps: int, tokenizer):
    from transformers import TrainerCallback

    class Timeline(TrainerCallback):
        """Saves the student every `save_every` steps (and at the last) off the clock, and records when."""

        def __init__(self):
            self.saved_s = 0.0
            self.checkpoints: list[dict] = []

        def on_step_end(self, args, state, control, model=None, **kwargs):
            step = state.global_step
            if step % save_every and step != max_steps:
                return
            reached = time.time()
            path = out / "checkpoints" / f"step-{step}"
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
            self.checkpoints.append({"step": step, "time": reached, "saved_s_before": self.saved_s, "path": str(path)})
            self.saved_s += time.time() - reached

    return Timeline()


class Stopwatch:
    """Seconds spent inside wrapped calls, by name (`time_split` of timeline.json)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._started: dict[str, float] = {}

    def start(self, name: str) -> None:
        self._started[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - self._started.pop(name)
        self.calls[name] = self.calls.get(name, 0) + 1

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            self.start(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stop(name)
        return timed

    def time_module(self, name: str, module) -> None:
        """Times every forward of `module` (a pre-hook starts the clock, a hook stops it)."""
        module.register_forward_pre_hook(lambda *_: self.start(name))
        module.register_forward_hook(lambda *_: self.stop(name))

    def to_json(self) -> dict:
        return {name: {"s": round(s, 3), "calls": self.calls[name]} for name, s in self.seconds.items()}


def time_gkd(trainer, watch: Stopwatch) -> None:
    """GKD's generation and teacher forwards timed on this trainer instance (TRL's code unchanged)."""
    trainer.generate_on_policy_outputs = watch.wrap("generate", trainer.generate_on_policy_outputs)
    watch.time_module("teacher_forward", trainer.teacher_model)


def build_trainer(spec: dict, out: Path, callback):
    """The TRL trainer of `spec["system"]`, configured as the spec says."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(spec["seed"])
    tokenizer = AutoTokenizer.from_pretrained(spec["student"])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(spec["student"], dtype=torch.float32)
    common = dict(output_dir=str(out / "trl"), max_steps=spec["steps"], per_device_train_batch_size=spec["batch_size"],
                  gradient_accumulation_steps=1, learning_rate=spec["lr"], lr_scheduler_type="constant_with_warmup",
                  warmup_steps=spec["warmup_steps"], weight_decay=spec["weight_decay"], adam_beta1=spec["betas"][0],
                  adam_beta2=spec["betas"][1], adam_epsilon=spec["eps"], max_grad_norm=spec["grad_clip"],
                  seed=spec["seed"], data_seed=spec["seed"], logging_steps=1, save_strategy="no", report_to="none",
                  use_cpu=not torch.cuda.is_available(), bf16=False, gradient_checkpointing=False, beta=spec["beta"],
                  temperature=spec["temperature"])
    if spec["system"] == "gkd":
        from trl.experimental.gkd import GKDConfig, GKDTrainer

        tokenizer.chat_template = VERBATIM_TEMPLATE
        teacher = AutoModelForCausalLM.from_pretrained(spec["teacher"], dtype=torch.float32)
        data = Dataset.from_dict({"messages": [[{"role": "user", "content": p}, {"role": "assistant", "content": ""}]
                                               for p in spec["prompts"]]})
        args = GKDConfig(**common, lmbda=spec["lmbda"], max_new_tokens=spec["max_new_tokens"])
        return GKDTrainer(model=model, teacher_model=teacher, args=args, processing_class=tokenizer,
                          train_dataset=data, callbacks=[callback])
    from trl.experimental.server_distillation import ServerDistillationConfig, ServerDistillationTrainer

    args = ServerDistillationConfig(**common, teacher_model_server_url=spec["teacher_url"], loss_top_k=spec["loss_top_k"],
                                    max_completion_length=spec["max_new_tokens"], top_p=1.0, top_k=0)
    return ServerDistillationTrainer(model=model, args=args, processing_class=tokenizer,
                                     train_dataset=Dataset.from_dict({"prompt": spec["prompts"]}), callbacks=[callback])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    if spec["system"] not in SYSTEMS:
        raise SystemExit(f"system {spec['system']!r}: one of {SYSTEMS}")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    callback = timeline_callback(out, spec["save_every"], spec["steps"], AutoTokenizer.from_pretrained(spec["student"]))
    trainer = build_trainer(spec, out, callback)
    watch = Stopwatch()
    if spec["system"] == "gkd":
        time_gkd(trainer, watch)
    started = time.time()
    result = trainer.train()
    import trl

    (out / "timeline.json").write_text(json.dumps({
        "system": spec["system"], "trl_version": trl.__version__, "train_started": started,
        "checkpoints": callback.checkpoints, "saved_s": callback.saved_s, "peak_rss_mb": peak_rss_mb(),
        "global_step": result.global_step, "time_split": watch.to_json(),
        "log_history": trainer.state.log_history}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
