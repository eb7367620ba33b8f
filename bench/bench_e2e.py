"""Head to head with TRL (issue 34): the same distillation on the same machine, accuracy against
training time. eopd (`eopd run` with EOPD, with OPD, and with its GKD at lambda 1: the dense
divergence, to tell the loss from the system), TRL's `GKDTrainer` on-policy with its teacher
in the same process, and TRL's `ServerDistillationTrainer` against eopd-teacher's and stock vLLM's
`/v1/completions`, TRL's code unmodified (`bench/e2e_trl.py`, in .venv-vllm where TRL 1.16 is).

    .venv/bin/python -m bench.bench_e2e [--seeds 0 1 2] [--systems eopd opd trl-gkd ...] [--phase all]
    .venv/bin/python -m bench.bench_e2e --layout trl --systems eopd-gkd eopd-trl-gkd --seeds 0  # eopd at TRL's layout
    .venv/bin/python -m bench.bench_e2e --quick [--out FILE]   # tiny preset, minutes: checks the wiring
    eopd bench e2e [--quick]                                  # the same through bench/run_all.py

The task is the default preset's (`configs/smollm2-cpu.yaml`): SmolLM2-135M-Instruct teaching
`smollm2-135m[drop=14]`, the same generated training problems, prompt (chat template, suffix) and
16-token answers, graded by `eopd eval` on the same held-out and variants sets. Matched where a
setting has a counterpart: optimizer (AdamW, lr, betas, eps, no weight decay, gradient clipping 1.0,
2 warm-up steps then constant), sampling temperature 1, responses per optimizer step (the preset's
mini-batch, 8) and optimizer steps (the preset's iterations x its steps per iteration, 64), fp32 on
the CPU, checkpoints at the same share of training; and, checked against TRL 1.16's code (the docs
section lists where): the stop token in the loss, the prompt masked by position, training samples at
top-p 1, the same grading. Not matched (listed in the docs section): at the preset's layout eopd
samples 2 responses per prompt (TRL 1 response for each of twice as many prompts) and trains its
second mini-batch on samples of the previous policy (`--layout trl`: eopd's runs at TRL's layout,
kept as SYSTEM@trl beside them, issue 47), the loss (EOPD / OPD's sampled-token PPO surrogate; TRL GKD's
full-vocabulary reverse KL, beta 1; TRL server's top-1 reverse KL with a tail bucket, beta 1, the only
reverse-KL support its server path has), TRL GKD's loss scale and the warm-up's first step, and each
system's process layout (TRL: one process, or one plus the teacher server).

Phases, each resumable (a run whose files are in --out or --archive is not done again):
`train` (timed, one run at a time: needs an otherwise idle machine), `eval` (`eopd eval` of every
checkpoint on the held-out set, the last also on the variants set; the time does not matter, the
checkpoints are deleted afterwards unless --keep-checkpoints), `report` (docs/benchmarks.md section
`e2e_trl` and docs/figures/e2e_trl.png). `--phase all` does the three, but writes the section only
when it holds every system the published one holds: `--phase all --systems NEW` adds a system's runs
without replacing the section. `retime` (timed, like
`train`) trains archived runs again on this machine for their seconds alone, so that systems timed
on a later machine still pair with them (bench/e2e_timing.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from bench import e2e_report as rep
from bench import e2e_timing
from bench.e2e_systems import DEFAULT_SYSTEMS, EOPD_SYSTEMS, HEAD_TO_HEAD_LAYOUTS, LAYOUTS, SYSTEMS, base_system, system_key, train, trl_python
from bench.report import ROOT, machine_description, provenance, results_dir, timing_machine, write_results, write_section

SECTION = "e2e_trl"
FIGURE = ROOT / "docs" / "figures" / "e2e_trl.png"
ARCHIVE = ROOT / "bench" / "results" / "e2e"
QUICK_EVAL = ("eval.n_samples=2", "eval.max_prompts=4", "eval.batch_size=8")


def render_text(tokenizer, text: str, data) -> str:
    """The prompt text the student sees in `eopd run` (`data.render_prompt` without tokenizing)."""
    query = text + data.suffix
    if data.chat_template is True:
        return tokenizer.apply_chat_template([{"role": "user", "content": query}], add_generation_prompt=True, tokenize=False)
    if isinstance(data.chat_template, str):
        return data.chat_template.replace("{query}", query)
    return query


def prepare_settings(preset: Path, out: Path, *, iterations: int | None, save_every: int | None, quick: bool,
                     layout: str = "preset", eval_samples: int | None = None) -> dict:
    """Prepares the shared run directory (data, student) with `eopd prepare` and derives every
    system's matched settings from the preset's config at eopd's `layout` (e2e_systems.LAYOUTS; TRL's
    settings are the same at every layout: 64 steps of 8 responses). `save_every` (iterations):
    default a quarter of the run; `eval_samples`: responses per held-out problem when grading (Avg@k;
    default the preset's)."""
    from eopd_common.model_dirs import materialise_model_dir
    from eopd_common.models import default_cache_dir, load_tokenizer
    from eopd_trainer.config import load_config
    from eopd_trainer.data import read_records, render_prompt
    from eopd_trainer.job.prepare import prepare_and_write

    shared = out / "shared"
    _, cfg = prepare_and_write(load_config(preset, [f"run_dir={shared}", *LAYOUTS[layout]]))
    cache = Path(default_cache_dir())
    student = str(materialise_model_dir(cfg.student.model, cache)[0])
    teacher = str(materialise_model_dir(cfg.teacher.model, cache)[0])
    tok = load_tokenizer(student)
    t = cfg.train
    given_iterations, given_save_every = iterations, save_every  # eopd's systems: else each its own (e2e_systems.eopd_layout)
    iterations = iterations or t.iterations
    save_every = save_every or max(1, iterations // 4)
    steps_per_iteration = t.batch_size // t.mini_batch_size
    records = [r for f in cfg.data.train_files for r in read_records(f)]
    steps = iterations * steps_per_iteration
    prompts = [render_text(tok, r[cfg.data.field], cfg.data) for r in records]
    for text, r in list(zip(prompts, records))[:16]:  # the text TRL tokenizes is the prompt eopd trains on
        want = render_prompt(tok, r[cfg.data.field], suffix=cfg.data.suffix, chat_template=cfg.data.chat_template,
                             max_length=cfg.data.max_prompt_length)
        if tok(text, add_special_tokens=False)["input_ids"] != want:
            raise RuntimeError(f"the rendered prompt text does not tokenize to eopd's prompt ids: {text[:80]!r}")
    variants = shared / "data" / "heldout_variants.jsonl"
    return {"preset": preset.stem, "preset_path": str(preset), "layout": layout, "eopd_overrides": list(LAYOUTS[layout]), "shared": str(shared), "student": student, "teacher": teacher,
            "teacher_dtype": "float32" if cfg.teacher.dtype == "auto" else cfg.teacher.dtype,
            "iterations": iterations, "save_every": save_every, "iterations_given": given_iterations,
            "save_every_given": given_save_every, "steps": steps, "steps_per_iteration": steps_per_iteration,
            "save_every_steps": save_every * steps_per_iteration, "batch_size": t.mini_batch_size,
            "samples_per_prompt": cfg.rollout.n_samples, "prompts_per_iteration": t.batch_size // cfg.rollout.n_samples,
            "lr": t.lr, "warmup_steps": t.warmup_steps, "min_lr_ratio": t.min_lr_ratio, "weight_decay": t.weight_decay,
            "betas": list(t.betas), "eps": t.eps, "grad_clip": t.grad_clip, "max_new_tokens": cfg.rollout.max_response_length,
            "temperature": cfg.rollout.temperature, "prompts": prompts, "n_train_prompts": len(prompts),
            "eval_overrides": [*(QUICK_EVAL if quick else ()), *([f"eval.n_samples={eval_samples}"] if eval_samples else [])],
            "eval_n": eval_samples or (2 if quick else cfg.eval.n_samples),
            "variants_file": str(variants) if variants.is_file() else ""}


def _find(name: str, out: Path, archive: Path | None) -> Path | None:
    for base in (out, archive):
        if base is not None and (base / name).is_file():
            return base / name
    return None


def check_graded_at(evaluated: Path, k: int) -> None:
    """An evaluation found in --runs or --archive was graded at `k` samples per problem, or a clear
    error: runs graded at another Avg@k never enter one table (give them an archive of their own)."""
    models = json.loads(evaluated.read_text())["models"]
    other = sorted({m["n_samples"] for m in models.values() if m.get("n_samples") != k})
    if other:
        raise SystemExit(f"bench_e2e: {evaluated} was graded at {other} samples per problem, this run grades at {k} "
                         "(--eval-samples): use another --archive and --runs for it")


def _eval_dir(run_dir: Path, settings: dict) -> Path:
    d = run_dir / "eval"
    d.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(settings["shared"]) / "run.yaml", d / "run.yaml")
    return d


def evaluate(run_dir: Path, trained: dict, settings: dict) -> None:
    """`eopd eval` of every checkpoint on the held-out set; the last also on the variants set."""
    from eopd_trainer.eval.evaluate import evaluate_run

    d = _eval_dir(run_dir, settings)
    labels = [c["label"] for c in trained["checkpoints"]]
    done = json.loads((d / "eval.json").read_text())["models"] if (d / "eval.json").is_file() else {}
    todo = [c for c in trained["checkpoints"] if c["label"] not in done]
    if todo:
        evaluate_run(d, [c["path"] for c in todo], settings["eval_overrides"], names=[c["label"] for c in todo])
    if settings["variants_file"] and labels and not (d / "eval-variants.json").is_file():
        last = trained["checkpoints"][-1]
        evaluate_run(d, [last["path"]], settings["eval_overrides"], names=[last["label"]],
                     data_files=[Path(settings["variants_file"])], set_name="variants")


def evaluate_initial(settings: dict, out: Path, archive: Path | None) -> Path:
    """The starting student (and the teacher, the ceiling) on the held-out set, once."""
    from eopd_trainer.eval.evaluate import evaluate_run

    found = _find("initial/eval.json", archive, None) or _find("initial/eval/eval.json", out, None)
    if found is not None:
        check_graded_at(found, settings["eval_n"])
        return found
    d = _eval_dir(out / "initial", settings)
    if not (d / "eval.json").is_file():
        evaluate_run(d, [settings["student"], settings["teacher"]], settings["eval_overrides"], names=["initial", "teacher"])
    return d / "eval.json"


def archive_run(run_dir: Path, archive: Path | None) -> None:
    if archive is None:
        return
    dest = archive / run_dir.name
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("trained.json", "eval/eval.json", "eval/eval-variants.json"):
        if (run_dir / name).is_file():
            shutil.copy(run_dir / name, dest / Path(name).name)


def retime_all(args, settings: dict) -> None:
    """`--phase retime`: every (seed, system) trained again on this machine, timed like `train`, and
    kept as a re-timing (`<archive>/timing/<name>@<boot>/trained.json`, e2e_timing) unless this
    machine has one already; never evaluated, its checkpoints deleted. The report pairs it with the
    runs timed on this machine; its accuracies are the archived run's."""
    if args.archive is None:
        raise SystemExit("bench_e2e: --phase retime keeps its runs in --archive (timing/); give one")
    for seed in args.seeds:
        for system in args.systems:
            name = f"{system_key(system, settings['layout'])}-s{seed}"
            machine = timing_machine()  # before the run, on the quiet machine
            dest = args.archive / e2e_timing.TIMING_DIR / e2e_timing.timing_name(name, machine)
            if (dest / "trained.json").is_file():
                print(f"[e2e] {dest.name}: timed on this machine already", flush=True)
                continue
            print(f"[e2e] re-timing {name} on this machine", flush=True)
            run_dir = args.runs / dest.name
            shutil.rmtree(run_dir, ignore_errors=True)
            trained = train(system, seed, run_dir, settings).to_json()
            trained["settings"] = {k: v for k, v in settings.items() if k != "prompts"}
            trained["machine"] = machine
            dest.mkdir(parents=True, exist_ok=True)
            (dest / "trained.json").write_text(json.dumps(trained, indent=1))
            shutil.rmtree(run_dir, ignore_errors=True)
            print(f"[e2e] {dest.name}: {[(c['label'], round(c['train_s'])) for c in trained['checkpoints']]}", flush=True)


def run_all(args, settings: dict) -> list[dict]:
    """Train, then evaluate, every (seed, system) not done yet; the runs as e2e_report reads them."""
    out, archive = args.runs, args.archive
    runs = []
    for seed in args.seeds:
        for system in args.systems:
            name = f"{system_key(system, settings['layout'])}-s{seed}"
            run_dir = out / name
            found = _find(f"{name}/trained.json", out, archive)
            if found is None and args.phase in ("all", "train"):
                print(f"[e2e] training {name}", flush=True)
                machine = timing_machine()  # before the run, on the quiet machine: its seconds are this machine's
                trained = train(system, seed, run_dir, settings).to_json()
                trained["settings"] = {k: v for k, v in settings.items() if k != "prompts"}
                trained["machine"] = machine
                run_dir.mkdir(parents=True, exist_ok=True)
                (run_dir / "trained.json").write_text(json.dumps(trained, indent=1))
                archive_run(run_dir, archive)
                print(f"[e2e] {name}: {[(c['label'], round(c['train_s'])) for c in trained['checkpoints']]}", flush=True)
                found = run_dir / "trained.json"
            if found is None:
                continue
            trained = json.loads(found.read_text())
            evaluated = _find(f"{name}/eval.json", out, archive) or _find(f"{name}/eval/eval.json", out, archive)
            if evaluated is not None:
                check_graded_at(evaluated, settings["eval_n"])
            if args.phase in ("all", "eval") and (evaluated is None or not _complete(evaluated, trained)):
                if not all(Path(c["path"]).is_dir() for c in trained["checkpoints"]):
                    print(f"[e2e] {name}: its checkpoints are gone; not evaluated", flush=True)
                    continue
                print(f"[e2e] evaluating {name}", flush=True)
                evaluate(run_dir, trained, settings)
                archive_run(run_dir, archive)
                if not args.keep_checkpoints:
                    _prune(run_dir)
                evaluated = run_dir / "eval" / "eval.json"
            if evaluated is not None:
                runs.append(_with_accuracy(trained, evaluated))
    return runs


def system_entry(text: str) -> str:
    """argparse type of a `--systems` entry: a system (SYSTEMS) or an eopd system at a head-to-head
    layout, `SYSTEM@LAYOUT` (e.g. `eopd-gkd@trl-async`); anything else a clear error."""
    system, layout = base_system(text)
    if system not in SYSTEMS:
        raise argparse.ArgumentTypeError(f"unknown system {system!r}; systems: {', '.join(SYSTEMS)}")
    if "@" in text and (system not in EOPD_SYSTEMS or layout not in HEAD_TO_HEAD_LAYOUTS or layout == "preset"):
        raise argparse.ArgumentTypeError(f"{text!r}: SYSTEM@LAYOUT takes one of eopd's systems and a layout other than "
                                         f"the preset's, one of {', '.join(HEAD_TO_HEAD_LAYOUTS[1:])}")
    return text


def _complete(evaluated: Path, trained: dict) -> bool:
    models = json.loads(evaluated.read_text())["models"]
    return all(c["label"] in models for c in trained["checkpoints"])


def _prune(run_dir: Path) -> None:
    for big in ("checkpoints", "weights", "student-init"):
        shutil.rmtree(run_dir / big, ignore_errors=True)


def _with_accuracy(trained: dict, evaluated: Path) -> dict:
    models = json.loads(evaluated.read_text())["models"]
    run = dict(trained)
    run["checkpoints"] = [{**c, "heldout": {k: models[c["label"]][k] for k in ("avg_at_k", "pass_at_k")}}
                          for c in trained["checkpoints"] if c["label"] in models]
    variants = evaluated.with_name("eval-variants.json")
    last = trained["checkpoints"][-1]["label"] if trained["checkpoints"] else None
    if variants.is_file() and last in json.loads(variants.read_text())["models"]:
        v = json.loads(variants.read_text())["models"][last]
        run["final_variants"] = {"avg_at_k": v["avg_at_k"], "pass_at_k": v["pass_at_k"]}
    return run


def _mode_of(key: str) -> str:
    """The mode a run of `key` trained in, from its system's and layout's overrides: for runs archived
    before a run recorded its mode (`eopd_layout`)."""
    system, layout = base_system(key)
    return "async" if "mode=async" in (*EOPD_SYSTEMS[system], *LAYOUTS[layout]) else "sync"


def layout_text(runs: list[dict], st: dict) -> str:
    """What the head-to-head says of eopd's data layout, per layout its systems were trained at (each
    run's own record: `--layout` and a preset's `per_loss` change it; TRL: 1 response to each of 8
    prompts per step)."""
    groups: dict[tuple, list[str]] = {}
    for r in sorted(runs, key=lambda r: r["system"]):
        if base_system(r["system"])[0] not in EOPD_SYSTEMS:
            continue
        rs = r.get("layout") or r.get("settings") or st
        key = (rs["samples_per_prompt"], rs["prompts_per_iteration"], rs["steps_per_iteration"], rs["batch_size"],
               rs.get("mode") or _mode_of(r["system"]))
        if rep.label(r["system"]) not in groups.setdefault(key, []):
            groups[key].append(rep.label(r["system"]))
    out = []
    for (n, p, spi, bs, mode), systems in groups.items():
        who = "; ".join(systems)
        lag = (" In async mode: the worker samples the next step's responses while the learner trains on these, so "
               "each step trains on samples of the policy one version behind (TRL samples with the current one)."
               if mode == "async" else "")
        if n == 1 and spi == 1:
            fresh = "a fresh sample for every step" + ("" if mode == "async" else ", as TRL")
            out.append(f"Data layout, matched for {who}: 1 response for each of {p} prompts per optimizer step, one step "
                       f"per iteration, {fresh}.{lag}")
        else:
            out.append(f"Data layout, not matched for {who}: {n} responses for each of {p} prompts per iteration (TRL: 1 "
                       f"response for each of {bs} prompts per step, so TRL sees {n}x as many distinct prompts), "
                       f"{'the second' if spi == 2 else f'the last {spi - 1}'} of its {spi} mini-batches per iteration "
                       f"trained on samples of an older policy (TRL samples afresh for every step).{lag}")
    return " ".join(out)


def section_text(data: dict) -> str:
    s, k = data["summary"], data["eval_n"]
    st = data["settings"]
    ref, ref_s, ref_loss = rep.reference_names(s.get("reference", "eopd"))
    lines = [
        "## Head to head with TRL: accuracy against training time (`python -m bench.bench_e2e`, issue 34)", "",
        f"Report written on {data['machine']}. Every run was timed alone on its machine, one run at a time, nothing "
        f"else running: {rep.machines_line(data['runs'])}. The ratios to {ref} are paired within a seed and a machine "
        f"(the CPU's name and, where recorded, the kernel's boot id: two machines called AMD EPYC ran 1.4-1.9x apart); a "
        f"run timed on another machine than its seed's {ref} run gives accuracy but no ratio{rep.retimings_text(data.get('retimings', []))}. "
        f"Task: the `{st['preset']}` preset "
        f"(SmolLM2-135M-Instruct teacher, `smollm2-135m[drop=14]` student, generated arithmetic and word problems, "
        f"{st['max_new_tokens']}-token answers); every student graded by `eopd eval` on the same held-out set "
        f"(Avg@{k}, Pass@{k}, temperature 1, top-p 0.8) and, at the end, on the variants set. Training seconds run from "
        "the launch of a system's first process (teacher start and model loading included) to each checkpoint, "
        "checkpoint writes excluded.", "",
        "Matched: AdamW, lr {lr:g}, betas {b}, eps {eps:g}, no weight decay, gradient clip {gc:g}, {w} warm-up steps then "
        "constant; {bs} responses per optimizer step, {steps} optimizer steps; sampling temperature {temp:g}; fp32. "
        "Also matched, checked against TRL 1.16's code (`trl/trainer/gkd_trainer.py`, `trl/trainer/utils.py`): the "
        "student's stop token (`<|im_end|>`, also SmolLM2's pad token) is in the loss in every system (TRL masks a "
        "generated completion by position after its first EOS, not by token id); the prompt, with the `<|im_end|>` "
        "tokens of its chat template, is attended to and never scored (TRL masks it by position); training samples "
        "are drawn at temperature 1, top-p 1, no top-k, up to {mx} tokens, stopping at `<|im_end|>`, in every system; "
        "grading is the same command for every system (top-p 0.8 there, for all); loss temperature 1, dropout off, "
        "no gradient accumulation, no prompt truncated. {layout} "
        "Not matched: TRL GKD's loss scale: GKDTrainer divides the batch's summed per-token KL by `num_items_in_batch`, which "
        "transformers counts from the dataset's labels before the completions are generated (the empty assistant "
        "turn's 2 tokens per example: 16 for 8 examples), a constant where eopd (and TRL's server trainer) take the "
        "token mean of the mini-batch, so its gradients are a few times larger (AdamW is indifferent to a constant "
        "factor; the clip at 1 and each step's weight are not), immaterial here: eopd's gradient norm before the clip "
        "was 4.7-18.6 in the first 12 steps of TRL's objective (seed 0, the preset), so every step is clipped to norm 1 "
        "in both systems and the loss's scale cancels; `eopd-trl-gkd-sum`, TRL's objective at TRL's scale "
        "(`loss.aggregation=token-sum loss.sum_divisor=16`), ended seed 0 with the same held-out Avg@8 as "
        "`eopd-trl-gkd` at every checkpoint; the warm-up's first step: transformers' "
        "`constant_with_warmup` gives TRL's first optimizer step lr 0 (steps: 0, lr/2, lr), eopd's lr/2, lr; the loss (eopd EOPD / OPD: the "
        "sampled-token PPO surrogate, EOPD adding forward KL over the teacher's top-16 where its entropy >= 0.8; eopd "
        "GKD: forward KL over the teacher's top-16 at every position of the student's own samples; TRL "
        "GKD: lambda 1 (fully on-policy), beta 1 = the full-vocabulary reverse KL per token; TRL server: beta 1 with "
        "`loss_top_k` 1, the sampled token's reverse KL with a tail bucket, the only reverse-KL support its server "
        "path allows); the process layout (eopd: teacher service, rollout worker, Redis and learner processes; TRL "
        "GKD: one process; TRL server: the trainer plus the teacher server).".format(
            lr=st["lr"], b=tuple(st["betas"]), eps=st["eps"], gc=st["grad_clip"], w=st["warmup_steps"], bs=st["batch_size"],
            steps=st["steps"], temp=st["temperature"], mx=st["max_new_tokens"], layout=layout_text(data["runs"], st)), "",
        f"Initial student: held-out Avg@{k} {s['initial']:.3f}. Target: {ref_s} final held-out Avg@{k}, mean over "
        f"its seeds: " + ("-" if s["target"] is None else f"{s['target']:.3f}") + ". Three readings of the time to it, each "
        f"a ratio to {ref}'s time paired by seed: the first crossing (interpolated between checkpoints); the time from which "
        "a system stays at or above it through its last checkpoint (a chance crossing that falls back does not count); "
        f"and the first crossing of {ref_loss}'s final accuracy in the same seed (" + ", ".join(
            f"seed {k}: {v:.3f}" for k, v in sorted(s.get("seed_targets", {}).items())) + f"), which every seed of {ref} "
        "reaches, where a seed that ends below the mean never reaches the mean target.", "",
        rep.summary_table(s, k), "",
        f"![accuracy against training time](figures/{FIGURE.name})", "",
        "<details><summary>Every checkpoint</summary>", "", rep.curve_table(data["runs"], s["initial"]), "", "</details>", ""]
    if data.get("reading"):
        lines += [data["reading"], ""]
    return "\n".join(lines)


def archive_reading(archive: Path | None) -> str | None:
    """The reading of the runs kept in `archive` (its reading.md, stripped), None without one: a
    report of one archive never publishes another archive's reading."""
    path = archive / "reading.md" if archive is not None else None
    return path.read_text().strip() if path is not None and path.is_file() else None


def dropped_systems(published: dict | None, runs: list[dict]) -> list[str]:
    """The systems of the published results (`published`: the JSON the section was rendered from) that
    `runs` lacks, sorted: a report of fewer systems (`--phase all --systems ONE` to add one system)
    must not replace the section of every system."""
    have = {r["system"] for r in runs}
    return sorted({r["system"] for r in (published or {}).get("runs", [])} - have)


def report(runs: list[dict], settings: dict, initial_eval: Path, *, write: bool, json_out: Path | None,
           archive: Path | None = ARCHIVE, reference: str = "eopd", keep_fuller: bool = False) -> dict:
    """The summary of `runs`; with `write`, the published section, its JSON and figure, unless
    `keep_fuller` (`--phase all`) and the published JSON holds systems `runs` lacks (`dropped_systems`);
    `--phase report` always writes."""
    initial = json.loads(initial_eval.read_text())["models"]["initial"]["avg_at_k"]
    retimings = e2e_timing.retimed_runs(runs, e2e_timing.load_timings(archive))
    summary = rep.summarise(runs, initial, reference=reference, retimings=retimings)
    data = {"summary": summary, "runs": runs, "retimings": retimings,
            "settings": {k: v for k, v in settings.items() if k != "prompts"},
            "eval_n": settings["eval_n"], "machine": machine_description(provenance()),
            "trl_python": str(trl_python())}
    reading = archive_reading(archive) if write else None
    if reading:
        data["reading"] = reading
    print(rep.summary_table(summary, data["eval_n"]))
    if json_out is not None:
        json_out.write_text(json.dumps(data, indent=1))
    published = results_dir() / f"{SECTION}.json"
    dropped = (dropped_systems(json.loads(published.read_text()) if published.is_file() else None, runs)
               if write and keep_fuller else [])
    if write and dropped:
        print(f"[e2e] not writing the published section ({published}, docs/benchmarks.md, the figure): it has "
              f"{', '.join(dropped)}, which this report lacks (render it with --phase report and every system)", flush=True)
    elif write and runs:
        FIGURE.parent.mkdir(parents=True, exist_ok=True)
        rep.figure(runs, initial, summary["target"], FIGURE, data["eval_n"], reference=reference)
        path = write_results(SECTION, data)
        write_section(SECTION, section_text(json.loads(path.read_text())))
    return data


def warm_up(systems: list[str]) -> None:
    """Each system once on the tiny preset, untimed (`--quick --phase train`): one-time costs a user pays
    once per machine (DeepSpeed's JIT-built CPU op, vLLM's compiled kernels, the page cache) stay off
    the timed runs."""
    import subprocess

    print("[e2e] warm-up: every system once on the tiny preset, untimed", flush=True)
    subprocess.run([sys.executable, "-m", "bench.bench_e2e", "--quick", "--phase", "train", "--systems", *systems],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny preset, 2 iterations, seed 0: the wiring; writes no docs")
    p.add_argument("--systems", nargs="+", default=list(DEFAULT_SYSTEMS), type=system_entry, metavar="SYSTEM[@LAYOUT]",
                   help=f"systems: {', '.join(SYSTEMS)}; with --phase report also SYSTEM@LAYOUT, an eopd system's "
                        "runs at another layout (trained with --layout LAYOUT), to report runs of several layouts")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--preset", default="smollm2-cpu")
    p.add_argument("--iterations", type=int, default=None, help="default: the preset's")
    p.add_argument("--save-every", type=int, default=None,
                   help="checkpoint every this many eopd iterations (TRL: the same share); default a quarter of the run")
    p.add_argument("--eval-samples", type=int, default=None,
                   help="responses per held-out problem when grading (Avg@k; default the preset's eval.n_samples)")
    p.add_argument("--layout", choices=HEAD_TO_HEAD_LAYOUTS, default="preset",
                   help="eopd's data layout (issue 47, e2e_systems.LAYOUTS): the preset's, TRL's (`trl`: 8 prompts x 1 "
                        "response per step), `trl-async` (the same in async mode), ...; its runs are kept as "
                        "SYSTEM@LAYOUT beside the preset's, TRL's runs are shared")
    p.add_argument("--phase", choices=("all", "train", "eval", "report", "retime"), default="all",
                   help="retime: train again on this machine for the ratios only, kept in <archive>/timing/")
    p.add_argument("--runs", type=Path, default=ROOT / "runs" / "e2e", help="the runs' directories (checkpoints: GBs)")
    p.add_argument("--archive", type=Path, default=ARCHIVE, help="small files of each finished run (resumable across machines)")
    p.add_argument("--keep-checkpoints", action="store_true")
    p.add_argument("--reference", choices=SYSTEMS, default="eopd",
                   help="the system whose final accuracy is the target and whose seconds the ratios divide by")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed tiny run of each system before the timed ones")
    p.add_argument("--out", type=Path, default=None, help="write the results JSON here too (with --quick: only here)")
    args = p.parse_args(argv)
    keyed = [x for x in args.systems if "@" in x]
    if keyed and args.phase != "report":
        p.error(f"--systems {' '.join(keyed)}: SYSTEM@LAYOUT only reports runs (--phase report); train and evaluate "
                "them with --layout LAYOUT")
    if args.quick:
        args.preset, args.iterations, args.save_every, args.seeds = "tiny", 2, 1, args.seeds[:1]
        args.runs, args.archive = Path(tempfile.mkdtemp(prefix="eopd-e2e-")), None
    settings = prepare_settings(ROOT / "configs" / f"{args.preset}.yaml", args.runs, iterations=args.iterations,
                                save_every=args.save_every, quick=args.quick, layout=args.layout,
                                eval_samples=args.eval_samples)
    print(f"[e2e] {len(args.systems)} systems x seeds {args.seeds}; {settings['steps']} optimizer steps of "
          f"{settings['batch_size']} responses; TRL runs with {trl_python()}", flush=True)
    if args.phase in ("all", "train", "retime") and not args.quick and not args.no_warmup:
        warm_up(args.systems)
    if args.phase == "retime":
        retime_all(args, settings)
        return 0
    runs = run_all(args, settings)
    initial = evaluate_initial(settings, args.runs, args.archive) if args.phase != "train" else None
    if initial is not None:
        if args.archive is not None and not (args.archive / "initial" / "eval.json").is_file():
            (args.archive / "initial").mkdir(parents=True, exist_ok=True)
            shutil.copy(initial, args.archive / "initial" / "eval.json")
        report(runs, settings, initial, write=not args.quick and args.phase in ("all", "report"), json_out=args.out,
               archive=args.archive, reference=args.reference, keep_fuller=args.phase == "all")
    if args.quick:
        shutil.rmtree(args.runs, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
