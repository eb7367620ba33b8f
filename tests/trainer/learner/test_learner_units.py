"""Pure parts of the learner's admission: rollout metadata checks, the rejection streak, and the
random_fkl generator keys."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from eopd_trainer.learner.ledger import RejectStreak
from eopd_trainer.queue.rollout_checks import check_rollout_metadata
from eopd_trainer.queue.messages import (PoisonMessage, Rollout, RolloutLimits, decode_rollout,
                                         encode_rollout)


def rollout(rid: str = "t3-s1", n: int = 4, k: int = 8, **changes) -> Rollout:
    rng = np.random.default_rng(0)
    task, sample = rid.split("-")
    base = Rollout(
        rollout_id=rid, task_id=task, prompt_index=0, sample_index=int(sample[1:]),
        prompt_ids=rng.integers(0, 100, 3).astype(np.int32), response_ids=rng.integers(0, 100, n).astype(np.int32),
        old_logprobs=-rng.random(n).astype(np.float32), teacher_logprobs=-rng.random(n).astype(np.float32),
        teacher_entropies=rng.random(n).astype(np.float32), teacher_topk_ids=rng.integers(0, 100, (n, k)).astype(np.int32),
        teacher_topk_logprobs=-rng.random((n, k)).astype(np.float32), policy_version=0, sampling_temperature=0.7)
    return dataclasses.replace(base, **changes)


def check(r: Rollout, **kw) -> None:
    args = {"temperature": 0.7, **kw}
    # Through the wire format and the run's bounds, as the learner sees it (the temperature is a
    # float32 field; top_k and the response length are RolloutLimits' to check).
    limits = RolloutLimits(max_prompt_length=16, max_response_length=4, top_k=8)
    check_rollout_metadata(decode_rollout(encode_rollout(r), vocab_size=100, limits=limits), **args)


def test_metadata_accepted():
    check(rollout())
    check(rollout(n=2))
    check(rollout(), n_samples=2, published_tasks=4)  # t3-s1: a published task, a sample it asked for


@pytest.mark.parametrize(("r", "kw", "reason"), [
    (rollout(sampling_temperature=1.0), {}, "rollout t3-s1: sampling_temperature 1 differs from loss.temperature 0.7"),
    (rollout(k=4), {}, "inconsistent ScoredRollout t3-s1: top_k 4 differs from teacher.top_k 8"),
    (rollout(k=16), {}, "inconsistent ScoredRollout t3-s1: top_k 16 differs from teacher.top_k 8"),
    (rollout(), {"published_tasks": 3}, "rollout t3-s1: task t3 was never published (the learner published 3 tasks)"),
    (rollout(), {"n_samples": 1}, "rollout t3-s1: sample_index 1 is not below rollout.n_samples 1"),
    (rollout(n=5), {}, "oversized ScoredRollout t3-s1: response_ids has 5 tokens, more than rollout.max_response_length 4"),
    (rollout(sample_index=0), {}, "rollout t3-s1: rollout_id does not match task_id 't3' and sample_index 0 (expected 't3-s0')"),
    (rollout(task_id="t4"), {}, "rollout t3-s1: rollout_id does not match task_id 't4' and sample_index 1"),
    (rollout(task_id="task3"), {}, "rollout t3-s1: task_id 'task3' is not of the form t<seq>"),
    (rollout(task_id="t03"), {}, "rollout t3-s1: task_id 't03' is not of the form t<seq>"),
])
def test_metadata_rejected_with_the_reason(r, kw, reason):
    with pytest.raises(PoisonMessage) as exc:
        check(r, **kw)
    assert exc.value.reason.startswith(reason), exc.value.reason


def test_reject_streak():
    s = RejectStreak(3, keep=2)
    assert not s.reject("a") and not s.reject("b")
    s.admitted()  # one admitted rollout: transient
    assert not s.reject("c") and not s.reject("d")
    assert s.reject("e")
    msg = s.message()
    assert "3 rollouts in a row" in msg and "queue.max_rejected_in_a_row = 3" in msg
    assert "  - d\n  - e" in msg and "- c" not in msg  # the most recent reasons
    with pytest.raises(ValueError):
        RejectStreak(0)


def test_random_fkl_draws_differ_by_step_and_repeat_on_resume():
    """The learner's generator keys (seed, iteration, optimizer step, rank, micro-batch): the
    positions random_fkl picks differ between steps and are the same when a step is redone."""
    from eopd_trainer.objective import LossConfig, LossInputs, compute_loss, step_generator

    cfg = LossConfig(variant="random_fkl", tau=0.5, random_seed=7)
    g = torch.Generator().manual_seed(0)
    n, v, k = 64, 32, 4
    logits = torch.randn(n, v, generator=g)
    inputs = LossInputs(sampled_ids=torch.randint(0, v, (n,), generator=g), old_logprobs=-torch.rand(n, generator=g),
                        teacher_logprobs=-torch.rand(n, generator=g), teacher_entropies=torch.rand(n, generator=g) * 2,
                        teacher_topk_ids=torch.randint(0, v, (n, k), generator=g),
                        teacher_topk_logprobs=torch.log_softmax(torch.randn(n, k, generator=g), -1))

    def fkl(*keys: int) -> float:
        return compute_loss(logits, inputs, cfg, generator=step_generator(cfg.random_seed, *keys))[1]["fkl_loss"]

    step0, step1, rank1, micro1 = fkl(1, 0, 0, 0), fkl(1, 1, 0, 0), fkl(1, 0, 1, 0), fkl(1, 0, 0, 1)
    assert len({step0, step1, rank1, micro1}) == 4
    assert fkl(1, 0, 0, 0) == step0  # a resumed run redoing the step draws the same positions


def test_step_metrics_over_ranks_equal_the_whole_minibatch():
    """The all-reduced step metrics (sum of each rank's tensor) equal the token-weighted means
    over every micro-batch of every rank, and the loss terms the mean of the ranks' shares."""
    from eopd_trainer.learner.distributed import step_metrics_from_tensor, step_metrics_tensor
    from eopd_trainer.learner.metrics import token_weighted_mean

    keys, loss_keys = ("clip_frac", "approx_kl", "student_entropy"), ("loss", "pg_loss")
    rank0 = [({"clip_frac": 0.1, "approx_kl": 0.02, "student_entropy": 3.0}, 10),
             ({"clip_frac": 0.3, "approx_kl": float("nan"), "student_entropy": 2.0}, 30)]
    rank1 = [({"clip_frac": 0.0, "approx_kl": -0.01}, 25)]  # no student_entropy on this rank
    losses = [{"loss": 2.0, "pg_loss": 1.5}, {"loss": 4.0, "pg_loss": 0.5}]
    t = step_metrics_tensor(rank0, losses[0], keys, loss_keys) + step_metrics_tensor(rank1, losses[1], keys, loss_keys)
    got = step_metrics_from_tensor(t, keys, loss_keys, world=2)
    want = token_weighted_mean(rank0 + rank1)
    assert {k: got[k] for k in keys} == pytest.approx(want, rel=1e-12)
    assert want["approx_kl"] == pytest.approx((0.02 * 10 - 0.01 * 25) / 35)  # the NaN row is skipped
    assert (got["loss"], got["pg_loss"]) == pytest.approx((3.0, 1.0))
    alone = step_metrics_from_tensor(step_metrics_tensor(rank0, losses[0], keys, loss_keys), keys, loss_keys, world=1)
    assert alone == pytest.approx({**token_weighted_mean(rank0), **losses[0]})


# The learner's loss path: fused hidden-state loss only where lm_head(hidden) is the logits -------

@pytest.mark.parametrize("kind", ["llama", "gemma2", "granite", "cohere"])
def test_loss_path_keeps_the_students_logit_transform(kind):
    """Gemma 2 soft-capping, Granite's logits_scaling and Cohere's logit_scale are applied after the
    output projection: the fused hidden-state loss would compute the student's log-probs without
    them, so its ratio against the worker's old log-probs (which apply them) would not start at 1.
    The learner takes the model's logits for those students, and the ratio is 1 on either path it
    takes; the fused path is shown to be wrong for them, so the choice is needed."""
    from eopd_trainer.config import TrainConfig
    from eopd_trainer.learner.trainer import fused_loss_path
    from eopd_trainer.objective import LossConfig, LossInputs, compute_loss, compute_loss_from_hidden
    from eopd_trainer.rollout.samplers.transformers_sampler import sequence_logprobs
    from tests.trainer.test_pipeline_units import RAGGED_PROMPTS, RAGGED_RESPONSES, tiny_causal_lm

    model = tiny_causal_lm(kind)
    fused, why = fused_loss_path(TrainConfig(), model)
    assert fused == (kind == "llama")
    assert (why == "") == (kind == "llama") and (kind == "llama" or type(model).__name__ in why)
    assert fused_loss_path(TrainConfig(loss_from_hidden=False), model) == (False, "")

    p, r = RAGGED_PROMPTS[0], RAGGED_RESPONSES[0]
    old = torch.tensor(sequence_logprobs(model, [p], [r], temperature=1.0, pad_id=0)[0], dtype=torch.float32)
    ids = torch.tensor([list(p) + list(r)])
    pos = torch.arange(len(p) - 1, len(p) + len(r) - 1)
    n = len(r)
    inputs = LossInputs(sampled_ids=torch.tensor(r), old_logprobs=old, teacher_logprobs=old - 0.1,
                        teacher_entropies=torch.ones(n), teacher_topk_ids=torch.tensor(r)[:, None],
                        teacher_topk_logprobs=torch.zeros(n, 1))
    opd = LossConfig(variant="opd")
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, pos]
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state[0, pos]
        head = model.get_output_embeddings()
        _, via_logits = compute_loss(logits, inputs, opd)
        _, via_hidden = compute_loss_from_hidden(hidden, head.weight, inputs, bias=head.bias, config=opd)
    chosen = via_hidden if fused else via_logits
    assert chosen["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and abs(chosen["approx_kl"]) < 1e-4
    if not fused:  # what the fused path would have trained on
        assert abs(via_hidden["ratio_mean"] - 1.0) > 1e-2 or abs(via_hidden["approx_kl"]) > 1e-2


# The learner's Redis side (RolloutFeed, torch-free) and the loop's collection, on fakeredis ------

def _feed(monkeypatch):
    import fakeredis
    from eopd_trainer.config.load import load_config
    from eopd_trainer.learner.feed import RolloutFeed
    from eopd_trainer.learner.state import LearnerState
    from eopd_trainer.queue.namespace import RunQueue

    from tests.trainer.pipeline_helpers import TINY

    cfg = load_config(TINY, ["train.batch_size=2", "train.mini_batch_size=2", "train.micro_batch_size=2"])
    feed = RolloutFeed(cfg)
    feed.queue = RunQueue(fakeredis.FakeRedis(), "ns", signer=feed.signer)  # what acquire_lease sets
    state = LearnerState()
    feed.setup_queues(state, num_prompts=4, vocab_size=100)
    decoded = []
    import eopd_trainer.learner.feed as feed_module

    def counting_decode(data, **kw):
        decoded.append(data)
        return decode_rollout(data, **kw)

    monkeypatch.setattr(feed_module, "decode_rollout", counting_decode)
    return feed, state, decoded


def test_learner_state_round_trips_and_reads_unversioned_files():
    """trainer_state.json: LearnerState.to_json / from_json with a schema version; a file from before
    the version (same flat keys, some missing) still loads, a newer schema is refused."""
    from eopd_trainer.learner.state import SCHEMA_VERSION, LearnerState, StateSchemaError

    state = LearnerState(iteration=3, policy_version=3, optimizer_steps=6, global_steps=6,
                         last_entry_ids=["1-0"], metrics=[{"step": 6, "values": {"loss": 1.0}}])
    state.ledger.record(3, ["t0-s0", "t0-s1"])
    state.feed.counters.duplicates = 2
    state.feed.settled.append("t1-s0")
    state.feed.tasks_published = 4
    data = state.to_json()
    assert data["schema_version"] == SCHEMA_VERSION and data["ledger"] == {"3": ["t0-s0", "t0-s1"]}
    assert data["counters"] == {"stale_dropped": 0, "duplicates": 2, "dead_letters": 0, "replacement_tasks": 0}
    assert LearnerState.from_json(data).to_json() == data
    old = {"iteration": 1, "policy_version": 1, "optimizer_steps": 2, "ledger": {"1": ["t0-s0"]},
           "counters": {"stale_dropped": 1, "duplicates": 0, "dead_letters": 0}}  # no schema_version
    loaded = LearnerState.from_json(old)
    assert loaded.iteration == 1 and "t0-s0" in loaded.ledger and loaded.feed.counters.stale_dropped == 1
    assert loaded.feed.tasks_published is None and loaded.feed.settled == [] and loaded.global_steps is None
    with pytest.raises(StateSchemaError, match="schema_version"):
        LearnerState.from_json({**data, "schema_version": SCHEMA_VERSION + 1})


def _push(feed, r: Rollout | bytes) -> None:
    feed.queue.client.xadd(feed.queue.keys.rollouts, {b"data": r if isinstance(r, bytes) else encode_rollout(r)})


def test_feed_collects_a_batch_decoding_each_rollout_once(monkeypatch):
    feed, state, decoded = _feed(monkeypatch)
    k, t = feed.cfg.teacher.top_k, feed.cfg.loss.temperature
    a, b = rollout("t0-s0", k=k, sampling_temperature=t), rollout("t0-s1", k=k, sampling_temperature=t)
    for entry in (b"not a rollout", a, a, b):  # a dead letter, a duplicate in the batch
        _push(feed, entry)
    collected = feed.collect(1)
    assert [r.rollout_id for r in collected.rollouts] == ["t0-s0", "t0-s1"]
    assert [decode_rollout(x).rollout_id for x in collected.blobs] == ["t0-s0", "t0-s1"]  # the broadcast's bytes
    assert len(decoded) == 4 and len(collected.entry_ids) == 2  # each entry decoded once, here only
    assert dataclasses.asdict(state.feed.counters) == {"stale_dropped": 0, "duplicates": 1, "dead_letters": 1, "replacement_tasks": 0}
    assert collected.stats["dead_letters_total"] == 1.0 and collected.stats["duplicates_total"] == 1.0
    assert collected.stats["staleness_mean"] == 0.0 and collected.stats["response_length_mean"] == 4.0
    assert int(feed.queue.client.get(feed.queue.keys.tasks_next)) == 1  # sync: B / n_samples tasks for iteration 1
    feed.record_tasks_published()
    assert state.feed.tasks_published == 1


def test_feed_settles_stale_rollouts_and_stops_on_request(monkeypatch):
    feed, state, _ = _feed(monkeypatch)
    state.policy_version = 5  # the learner is at version 5: version 0 is too stale (max 0 in sync mode)
    k, t = feed.cfg.teacher.top_k, feed.cfg.loss.temperature
    _push(feed, rollout("t0-s0", k=k, sampling_temperature=t))
    feed.stop_requested = True
    assert feed.collect(6) is None  # a stop while waiting: nothing collected
    feed.stop_requested = False
    _push(feed, rollout("t0-s1", k=k, sampling_temperature=t, policy_version=5))
    _push(feed, rollout("t1-s0", k=k, sampling_temperature=t, policy_version=5))
    collected = feed.collect(6)
    assert [r.rollout_id for r in collected.rollouts] == ["t0-s1", "t1-s0"]
    assert state.feed.settled == ["t0-s0"] and state.feed.counters.stale_dropped == 1


def test_feed_aborts_on_a_rejection_streak(monkeypatch):
    from eopd_trainer.learner.feed import EXIT_REJECTED, LearnerAbort

    feed, _, _ = _feed(monkeypatch)
    for _ in range(feed.rejects.limit):
        _push(feed, b"junk")
    with pytest.raises(LearnerAbort) as exc:
        feed.collect(1)
    assert exc.value.code == EXIT_REJECTED


def test_loop_trains_rank_0_on_the_feeds_decoded_rollouts(monkeypatch):
    """Rank 0 does not decode the broadcast bytes again (single process: no broadcast)."""
    import eopd_trainer.learner.loop as loop_module
    from eopd_trainer.config.stages import plan_iteration
    from eopd_trainer.learner.loop import LearnerLoop

    feed, _, decoded = _feed(monkeypatch)
    k, t = feed.cfg.teacher.top_k, feed.cfg.loss.temperature
    _push(feed, rollout("t0-s0", k=k, sampling_temperature=t))
    _push(feed, rollout("t0-s1", k=k, sampling_temperature=t))
    loop = LearnerLoop(feed.cfg)
    loop.rank, loop.feed = 0, feed
    monkeypatch.setattr(loop_module, "decode_rollout", lambda *a, **kw: pytest.fail("rank 0 decoded twice"))
    plan = plan_iteration(feed.cfg.loss, feed.cfg.train.warmup_kd_iterations, 1)
    collected = loop._collect_everywhere(1, plan)
    assert [r.rollout_id for r in collected.rollouts] == ["t0-s0", "t0-s1"] and len(decoded) == 2
    loop.request_stop()
    assert loop._collect_everywhere(2, plan) is None


def test_metrics_sink_sets_every_gauge_before_the_record_reaches_the_file(tmp_path):
    """Whoever sees an iteration's record in the JSONL file (a test, `eopd report` on a live run) can
    scrape every one of its values from Prometheus: the gauges are set first (stop 42's CI: a scrape
    right after the record appeared missed the record's last key)."""
    from eopd_trainer.learner.metrics import MetricsSink
    from prometheus_client import REGISTRY

    sink = MetricsSink(tmp_path, "order_check", tensorboard=False)
    seen: list[dict] = []
    real_write = sink._fh.write

    def write(text):  # the gauges' values at the moment the record is written
        seen.append({k: REGISTRY.get_sample_value(f"eopd_order_check_{k}") for k in ("iter_loss", "iter_idle_frac")})
        return real_write(text)

    sink._fh.write = write
    sink.log(3, {"iter/loss": 1.5, "iter/idle_frac": 0.25}, iteration=1, kind="iteration")
    sink.close()
    assert seen == [{"iter_loss": 1.5, "iter_idle_frac": 0.25}]
    assert '"iter/idle_frac": 0.25' in (tmp_path / "order_check_metrics.jsonl").read_text()


class _ArchProbe:
    """DeepSpeed's own CUDA op builder (never built): its `compute_capability_args` is the parser of
    TORCH_CUDA_ARCH_LIST that killed the learner on a lent H200 ('0a', from a `9.0a` entry)."""

    @staticmethod
    def args(monkeypatch, value: str) -> list[str]:
        from deepspeed.ops.op_builder.builder import CUDAOpBuilder

        class Probe(CUDAOpBuilder):
            BUILD_VAR, NAME = "DS_BUILD_EOPD_PROBE", "eopd_probe"

            def __init__(self):
                super().__init__(name=self.NAME)

            def absolute_name(self):
                return self.NAME

            def sources(self):
                return []

        probe = Probe()
        probe.jit_mode = True
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", value)
        return probe.compute_capability_args()


@pytest.mark.parametrize("value, want", [
    ("9.0a", "9.0"), ("8.0 8.6 9.0a", "8.0;8.6;9.0"), ("9.0;9.0a;10.0f+PTX", "9.0;10.0+PTX"),
    ("12.0a+PTX", "12.0+PTX"), ("8.0;9.0", None), ("7.5 8.0+PTX", None), ("", None),
])
def test_the_arch_list_is_cut_to_what_deepspeed_parses(monkeypatch, value, want):
    from eopd_trainer.learner.distributed import deepspeed_arch_list

    assert deepspeed_arch_list(value) == want
    if want is not None:
        with pytest.raises(ValueError, match="invalid literal for int"):  # DeepSpeed 0.19, as on the H200
            _ArchProbe.args(monkeypatch, value)
        _ArchProbe.args(monkeypatch, want)  # parses


def test_the_learner_start_adapts_the_arch_list(tmp_path):
    """`init_process_group` (the learner's first step) rewrites a variant list for its own process and says so."""
    import subprocess
    import sys

    code = ("import logging, os; logging.basicConfig(level=logging.INFO); "
            "from eopd_trainer.learner.distributed import init_process_group; "
            "print(init_process_group('gloo'), os.environ['TORCH_CUDA_ARCH_LIST'])")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    res = subprocess.run([sys.executable, "-c", code], env={**env, "TORCH_CUDA_ARCH_LIST": "8.0 9.0a"},
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().endswith("(0, 1) 8.0;9.0")
    assert "TORCH_CUDA_ARCH_LIST '8.0 9.0a' -> '8.0;9.0'" in res.stderr


def test_the_learner_start_builds_no_deepspeed_op(tmp_path):
    """DeepSpeed's CPU backend would JIT-compile its shared-memory all-reduce op at the learner's first
    start on a fresh install (40-60 s of C++; used by `inference_all_reduce` only): `init_process_group`
    marks it not to be built. In a fresh process with an empty extensions directory: the op is one
    DeepSpeed's CPU accelerator offers and its probe calls buildable (so DeepSpeed would build it), the
    backend starts without it, nothing is compiled, and DeepSpeed's collectives work."""
    import subprocess
    import sys

    code = (
        "import torch, deepspeed\n"
        "from deepspeed.accelerator import get_accelerator\n"
        "from deepspeed.ops.op_builder.builder import probe_is_compatible\n"
        "builder = get_accelerator().create_op_builder('ShareMemCommBuilder')\n"
        "assert builder is not None and builder.NAME == 'deepspeed_shm_comm', builder\n"
        "assert probe_is_compatible(builder)  # buildable here: DeepSpeed would compile it\n"
        "from eopd_trainer.learner.distributed import init_process_group\n"
        "assert init_process_group('gloo') == (0, 1)\n"
        "import deepspeed.comm as dscomm\n"
        "assert dscomm.comm.cdb.shm_comm_op is None\n"
        "t = torch.ones(3)\n"
        "dscomm.all_reduce(t)\n"
        "assert t.tolist() == [1.0, 1.0, 1.0]\n"
        "print('ok')\n"
    )
    ext = tmp_path / "torch_extensions"
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    res = subprocess.run([sys.executable, "-c", code], env={**env, "TORCH_EXTENSIONS_DIR": str(ext), "DS_ACCELERATOR": "cpu"},
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().endswith("ok")
    assert not ext.exists() or not any(ext.rglob("*.so")), sorted(ext.rglob("*"))


def test_gradient_norm_is_what_clip_grad_norm_measures_without_clipping():
    """The step's `grad_norm` metric at ZeRO stage 0, where DeepSpeed keeps none: the gradients' L2
    norm taken together, before `train.grad_clip`; parameters without a gradient left out."""
    from eopd_trainer.learner.trainer import gradient_norm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    model[2].requires_grad_(False)
    (model(torch.randn(4, 7)) ** 2).sum().backward()
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    got = gradient_norm(model.parameters())
    assert all(torch.equal(a, p.grad) for a, p in zip(before, (p for p in model.parameters() if p.grad is not None)))
    want = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm=1e-3)
    assert got == pytest.approx(float(want), rel=1e-6) and got > 1e-3
    assert gradient_norm(torch.nn.Linear(2, 2).parameters()) == 0.0  # no gradient yet
