"""Unit tests of the pipeline's pure parts: config, message codec, ledger, batching, data, DS config."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from eopd_trainer.batching import (
    aggregation_units,
    gradient_accumulation_steps,
    pack_rollouts,
    pack_sequences,
    shard,
    shuffle_for_iteration,
    split,
)
from eopd_trainer.config import ConfigError, apply_overrides, load_config
from eopd_trainer.data import DataError, load_prompts, prompt_index
from eopd_trainer.learner.distributed import build_ds_config
from eopd_trainer.learner.ledger import Admit, Ledger, admit, replacement_tasks_needed, tasks_to_publish
from eopd_trainer.queue.messages import (
    PoisonMessage,
    PolicyVersion,
    PromptTask,
    Rollout,
    decode_policy,
    decode_rollout,
    decode_task,
    encode_policy,
    encode_rollout,
    encode_task,
)
from eopd_trainer.rollout.samplers.base import cut_response

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"


def make_rollout(rid: str = "t0-s0", n: int = 3, k: int = 4, p: int = 2, version: int = 0, seed: int = 0) -> Rollout:
    rng = np.random.default_rng(seed)
    return Rollout(
        rollout_id=rid, task_id=rid.split("-")[0], prompt_index=1, sample_index=0,
        prompt_ids=rng.integers(0, 100, p).astype(np.int32), response_ids=rng.integers(0, 100, n).astype(np.int32),
        old_logprobs=-rng.random(n).astype(np.float32), teacher_logprobs=-rng.random(n).astype(np.float32),
        teacher_entropies=rng.random(n).astype(np.float32) * 2,
        teacher_topk_ids=rng.integers(0, 100, (n, k)).astype(np.int32),
        teacher_topk_logprobs=np.sort(-rng.random((n, k)).astype(np.float32) * 3, axis=1)[:, ::-1].copy(),
        policy_version=version,
    )


# Config ----------------------------------------------------------------------------------------

def test_paper_defaults():
    cfg = load_config(None, ["data.train_files=[x.jsonl]"])
    assert (cfg.train.lr, cfg.train.batch_size, cfg.train.mini_batch_size) == (3e-6, 128, 32)
    assert cfg.steps_per_iteration == 4
    assert (cfg.teacher.top_k, cfg.loss.tau, cfg.loss.alpha, cfg.loss.clip_low, cfg.loss.clip_high) == (16, 0.8, 1.0, 0.2, 0.2)
    assert (cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.max_response_length, cfg.rollout.n_samples) == (1.0, 1.0, 4096, 1)
    assert cfg.mode == "sync" and cfg.effective_max_staleness == 0


def test_tiny_config_and_overrides():
    cfg = load_config(TINY, ["train.lr=1e-4", "loss.variant=opd", "mode=async", "teacher.token_remap={2: 3}",
                             "faults=[{point: learner.after_step, iteration: 2}]"])
    assert cfg.train.lr == 1e-4 and cfg.loss.variant == "opd" and cfg.effective_max_staleness == 1
    assert cfg.teacher.token_remap == {2: 3}
    assert cfg.faults[0].point == "learner.after_step" and cfg.faults[0].iteration == 2
    assert all(p.is_file() for p in cfg.data.train_files)  # relative to the config file
    assert cfg.total_iterations(32) == 12 and load_config(TINY, ["train.iterations=null", "train.epochs=1"]).total_iterations(32) == 8
    with pytest.raises(Exception):
        cfg.train.lr = 1.0  # frozen


@pytest.mark.parametrize("overrides, message", [
    (["train.lrr=1"], "train.lrr: unknown key"),
    (["loss.tau=-1"], "loss.tau"),
    (["loss.variant=nope"], "unknown loss variant"),
    (["train.batch_size=6"], "multiple of train.mini_batch_size"),
    (["rollout.temperature=0.5"], "must equal loss.temperature"),
    (["mode=sideways"], "mode"),
    (["train"], "not of the form key=value"),
    (["train.lr.x=1"], "train.lr is not a mapping"),
    (["teacher.token_remap={2: 7, 5: 7}"], "teacher.token_remap: ids [2, 5] are all mapped to 7: the remap must be invertible"),
    (["teacher.token_remap={-1: 7}"], "teacher.token_remap: token ids must be >= 0, got [-1]"),
    (["teacher.streams=0"], "teacher.streams"),
    (["rollout.logprob_chunk_size=0"], "rollout.logprob_chunk_size"),
])
def test_config_errors_name_the_field(overrides, message):
    with pytest.raises(ConfigError) as exc:
        load_config(TINY, overrides)
    assert message in str(exc.value)


def test_teacher_streams_and_invertible_remaps():
    """teacher.streams: 2 by default, any count >= 1; an invertible token_remap (distinct targets,
    a swap included) is accepted and its inverse maps every target back to its source."""
    assert load_config(TINY).teacher.streams == 2
    assert load_config(TINY, ["teacher.streams=3"]).teacher.streams == 3
    swap = load_config(TINY, ["teacher.token_remap={2: 7, 7: 2, 0: 9}"]).teacher.token_remap
    inverse = {v: k for k, v in swap.items()}
    assert len(inverse) == len(swap) and all(inverse[swap[s]] == s for s in swap)


def test_config_needs_data_and_file():
    with pytest.raises(ConfigError, match="data.train_files"):
        load_config(None, [])
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent.yaml", [])


def test_model_paths_in_a_file_are_relative_to_it(tmp_path):
    """A model spec with a "/" is a path, relative to the config file (configs/smollm2-far.yaml's
    built student); presets are left alone; overrides stay relative to the current directory."""
    conf = tmp_path / "configs" / "far.yaml"
    conf.parent.mkdir()
    data = yaml.safe_load(TINY.read_text())
    data["data"]["train_files"] = [str(ROOT / "configs" / f) for f in data["data"]["train_files"]]
    data["student"]["model"] = "../runs/far/student"
    data["teacher"]["model"] = "tiny-random@0"
    conf.write_text(yaml.safe_dump(data))
    cfg = load_config(conf)
    assert cfg.student.model == str(tmp_path / "runs" / "far" / "student") and cfg.teacher.model == "tiny-random@0"
    assert load_config(conf, ["student.model=runs/x"]).student.model == "runs/x"
    data["student"]["model"] = "smollm2-135m[drop=14]"
    conf.write_text(yaml.safe_dump(data))
    assert load_config(conf).student.model == "smollm2-135m[drop=14]"


def test_apply_overrides_creates_paths():
    assert apply_overrides({"a": {"b": 1}}, ["a.c.d=[1, 2]", "e=x"]) == {"a": {"b": 1, "c": {"d": [1, 2]}}, "e": "x"}


def test_ds_config():
    cfg = load_config(TINY, ["train.zero_stage=2", "train.precision=bf16"])
    ds = build_ds_config(cfg, world_size=2, total_steps=8)
    assert ds["train_batch_size"] == 4 and ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 1 and ds["zero_optimization"]["stage"] == 2
    assert ds["bf16"]["enabled"] and ds["optimizer"]["params"]["torch_adam"]
    assert "scheduler" not in ds  # the learner's own schedule: tests/trainer/learner/test_learner_schedule.py
    with pytest.raises(ValueError, match="multiple"):
        gradient_accumulation_steps(4, 3, 1)


# Messages --------------------------------------------------------------------------------------

def test_rollout_roundtrip():
    r = make_rollout(n=5, k=3)
    back = decode_rollout(encode_rollout(r), vocab_size=100)
    for name in ("prompt_ids", "response_ids", "old_logprobs", "teacher_logprobs", "teacher_entropies",
                 "teacher_topk_ids", "teacher_topk_logprobs"):
        np.testing.assert_array_equal(getattr(back, name), getattr(r, name))
    assert back.rollout_id == r.rollout_id and back.top_k == 3 and back.policy_version == 0


def test_packed_wire_size():
    r = make_rollout(n=100, k=16)
    per_token = len(encode_rollout(r)) / 100
    assert per_token < 16 * 8 + 40  # packed: ~5 bytes per top-k (id varint + float) + per-token scalars


@pytest.mark.parametrize("mutate, reason", [
    (lambda b: b"\xff\xff\xff garbage", "undecodable"),
    (lambda b: b"", "empty rollout_id"),
])
def test_poison_bytes(mutate, reason):
    with pytest.raises(PoisonMessage, match=reason):
        decode_rollout(mutate(encode_rollout(make_rollout())))


def test_inconsistent_rollouts():
    from eopd.v1 import rollout_pb2 as pb

    msg = pb.ScoredRollout()
    msg.ParseFromString(encode_rollout(make_rollout(n=3, k=4)))
    del msg.old_logprobs[-1]
    with pytest.raises(PoisonMessage, match="old_logprobs has 2 values, expected 3"):
        decode_rollout(msg.SerializeToString())
    with pytest.raises(PoisonMessage, match="outside the vocabulary"):
        decode_rollout(encode_rollout(make_rollout()), vocab_size=10)
    bad = make_rollout()
    object.__setattr__(bad, "teacher_logprobs", np.full(3, np.nan, dtype=np.float32))
    with pytest.raises(PoisonMessage, match="non-finite"):
        decode_rollout(encode_rollout(bad))


def test_task_and_policy_roundtrip():
    t = PromptTask(7, 3, 2, 5)
    back = decode_task(encode_task(t))
    assert (back.task_id, back.prompt_index, back.num_samples, back.min_policy_version) == ("t7", 3, 2, 5)
    with pytest.raises(PoisonMessage):
        decode_task(b"\x08")
    pv = PolicyVersion(3, "/x/v3.safetensors", "ab" * 32, 10, 3)
    assert decode_policy(encode_policy(pv)).uri == pv.uri


# Ledger ----------------------------------------------------------------------------------------

def test_admit_rules():
    led = Ledger()
    led.record(1, ["a"])
    kw = dict(current_version=3, max_staleness=1, trained=led, in_batch={"b"})
    assert admit("a", 3, **kw).kind is Admit.DUPLICATE
    assert admit("b", 3, **kw).kind is Admit.DUPLICATE
    assert admit("c", 3, **kw) .kind is Admit.TRAIN
    assert admit("c", 2, **kw).kind is Admit.TRAIN and admit("c", 2, **kw).staleness == 1
    assert admit("c", 1, **kw).kind is Admit.STALE
    assert admit("c", 4, **kw).kind is Admit.FUTURE
    assert admit("c", 2, **{**kw, "max_staleness": 0}).kind is Admit.STALE  # sync mode


def test_corrupt_fault_makes_an_undecodable_entry():
    from eopd_trainer.config import FaultConfig
    from eopd_trainer.faults import Faults, corrupt_bytes

    faults = Faults([FaultConfig(point="rollout.publish", count=2, action="corrupt")])
    assert faults.hit("rollout.publish", count=1) is False
    assert faults.hit("rollout.after_publish", count=2) is False
    assert faults.hit("rollout.publish", count=2) is True
    data = encode_rollout(make_rollout())
    with pytest.raises(PoisonMessage, match="undecodable ScoredRollout"):
        decode_rollout(corrupt_bytes(data))
    assert decode_rollout(corrupt_bytes(data)[1:]).rollout_id == "t0-s0"  # the payload is kept for inspection

def test_ledger_json_and_no_double_training():
    led = Ledger()
    led.record(1, ["x", "y"])
    led.record(2, ["z"])
    back = Ledger.from_json(json.loads(json.dumps(led.to_json())))
    assert back.trained == {"x": 1, "y": 1, "z": 2}
    with pytest.raises(ValueError, match="already trained"):
        back.record(3, ["y"])


def test_tasks_to_publish():
    kw = dict(batch_size=8, n_samples=2)
    assert tasks_to_publish(iteration=1, max_staleness=0, published_tasks=0, replacement_tasks=0, **kw) == 4
    assert tasks_to_publish(iteration=1, max_staleness=0, published_tasks=4, replacement_tasks=0, **kw) == 0  # restart
    assert tasks_to_publish(iteration=2, max_staleness=0, published_tasks=4, replacement_tasks=0, **kw) == 4
    assert tasks_to_publish(iteration=1, max_staleness=2, published_tasks=0, replacement_tasks=0, **kw) == 12  # async
    assert tasks_to_publish(iteration=1, max_staleness=0, published_tasks=4, replacement_tasks=2, **kw) == 2


def test_replacement_tasks_only_when_nothing_can_arrive():
    kw = dict(n_samples=2)
    assert replacement_tasks_needed(missing_rollouts=3, tasks_outstanding=0, rollouts_waiting=0, **kw) == 2
    assert replacement_tasks_needed(missing_rollouts=3, tasks_outstanding=1, rollouts_waiting=0, **kw) == 0
    assert replacement_tasks_needed(missing_rollouts=3, tasks_outstanding=0, rollouts_waiting=1, **kw) == 0
    assert replacement_tasks_needed(missing_rollouts=0, tasks_outstanding=0, rollouts_waiting=0, **kw) == 0


# Batching --------------------------------------------------------------------------------------

def test_pack_sequences_positions():
    packed = pack_sequences([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]], pad_id=0)
    assert packed.input_ids.tolist() == [[1, 2, 3, 5, 6], [4, 7, 8, 9, 0]]
    assert packed.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    flat = packed.input_ids.reshape(-1)
    # the token at flat position pos + 1 is the sampled token predicted at pos
    assert flat[packed.positions + 1].tolist() == packed.sampled_ids.tolist() == [5, 6, 7, 8, 9]
    assert packed.seq_index.tolist() == [0, 0, 1, 1, 1]


def test_pack_rollouts_pads_topk():
    a, b = make_rollout("t0-s0", n=2, k=4), make_rollout("t1-s0", n=3, k=2, seed=1)
    packed = pack_rollouts([a, b], pad_id=0)
    assert packed.loss_inputs.teacher_topk_ids.shape == (5, 4) and packed.num_tokens == 5
    assert torch.isinf(packed.loss_inputs.teacher_topk_logprobs[2:, 2:]).all()
    np.testing.assert_array_equal(packed.loss_inputs.old_logprobs.numpy(), np.concatenate([a.old_logprobs, b.old_logprobs]))


def test_minibatch_split_and_shuffle_deterministic():
    rs = [make_rollout(f"t{i}-s0", seed=i) for i in range(8)]
    a = [r.rollout_id for r in shuffle_for_iteration(rs, 0, 3)]
    b = [r.rollout_id for r in shuffle_for_iteration(list(reversed(rs)), 0, 3)]
    assert a == b and sorted(a) == sorted(r.rollout_id for r in rs)
    assert [len(m) for m in split(rs, 3)] == [3, 3, 2]
    assert shard(list(range(5)), 1, 2) == [1, 3]


def test_aggregation_units_per_mode():
    """The whole mini-batch's normaliser: its tokens, its sequences, or the configured constant
    (token-sum: TRL GKDTrainer's num_items_in_batch), whatever the tokens."""
    from eopd_trainer.objective import LossConfig

    mini = [make_rollout("t0-s0", n=2), make_rollout("t1-s0", n=5, seed=1)]
    assert aggregation_units(LossConfig(), mini) == 7.0
    assert aggregation_units(LossConfig(aggregation="seq-mean-token-mean"), mini) == 2.0
    assert aggregation_units(LossConfig(aggregation="token-sum", sum_divisor=16), mini) == 16.0
    assert aggregation_units(LossConfig(aggregation="token-sum"), mini[:1]) == 1.0


def test_cut_response():
    assert cut_response([5, 2, 7], {2}, 10) == ([5, 2], False)
    assert cut_response([5, 6, 7], {2}, 2) == ([5, 6], True)


# Data ------------------------------------------------------------------------------------------

def test_prompts_and_order(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"q": "a"}\n\n{"q": "b"}\n{"q": "c"}\n')
    assert load_prompts([f], "q") == ["a", "b", "c"]
    with pytest.raises(DataError, match=r"p.jsonl:1: no field 'prompt'"):
        load_prompts([f], "prompt")
    order = [prompt_index(s, 3, seed=0) for s in range(6)]
    assert sorted(order[:3]) == [0, 1, 2] and sorted(order[3:]) == [0, 1, 2]
    assert [prompt_index(s, 3, seed=0, shuffle=False) for s in range(4)] == [0, 1, 2, 0]


def test_parquet_prompts(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "p.parquet"
    pq.write_table(pa.table({"problem": ["What is 1 + 1?", "What is 2 * 3?"], "answer": ["2", "6"]}), f)
    assert load_prompts([f], "problem") == ["What is 1 + 1?", "What is 2 * 3?"]
    with pytest.raises(DataError, match="no field 'prompt'"):
        load_prompts([f], "prompt")


# Weight sync -----------------------------------------------------------------------------------

def test_weights_roundtrip_tied_and_verified(tmp_path):
    from eopd_trainer.queue.weights import load_weights, prune_weights, save_weights
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    a, b = AutoModelForCausalLM.from_config(cfg), AutoModelForCausalLM.from_config(cfg)
    pv = save_weights(a, tmp_path, version=3, iteration=3)
    assert pv.uri.endswith("v000003.safetensors") and len(pv.sha256) == 64
    load_weights(b, pv)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert b.lm_head.weight is b.model.embed_tokens.weight  # still tied
    with pytest.raises(ValueError, match="sha256"):
        load_weights(b, PolicyVersion(3, pv.uri, "0" * 64, pv.num_bytes, 3))
    for v in (4, 5, 6):
        save_weights(a, tmp_path, version=v, iteration=v)
    prune_weights(tmp_path, keep=2, protect=3)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["v000003.safetensors", "v000005.safetensors",
                                                                        "v000006.safetensors"]


def test_unreadable_weights_are_transient_and_leave_the_model_untouched(tmp_path, monkeypatch):
    """WeightsUnavailable (a ValueError, retried by the worker) for a missing file, a sha256
    mismatch, a truncated file and a file replaced between the check and the read; a file with
    the wrong tensors is a plain ValueError. In every case the model keeps its weights."""
    from eopd_trainer.queue import weights as W
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1)
    torch.manual_seed(0)
    src, dst = AutoModelForCausalLM.from_config(cfg), AutoModelForCausalLM.from_config(cfg)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    pv = W.save_weights(src, tmp_path, version=1, iteration=1)
    path = Path(pv.uri)
    good = path.read_bytes()

    def untouched():
        return all(torch.equal(before[k], v) for k, v in dst.state_dict().items())

    path.rename(tmp_path / "away")
    with pytest.raises(W.WeightsUnavailable, match="file not found"):
        W.load_weights(dst, pv)
    (tmp_path / "away").rename(path)
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(W.WeightsUnavailable, match="the announcement says"):  # the size, checked before hashing
        W.load_weights(dst, pv)
    path.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # same size, other bytes
    with pytest.raises(W.WeightsUnavailable, match="sha256"):
        W.load_weights(dst, pv)
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(W.WeightsUnavailable, match="not a readable safetensors file"):
        W.load_weights(dst, pv, verify=False)
    path.write_bytes(good)
    real_load = __import__("safetensors.torch", fromlist=["load_file"]).load_file

    def load_then_replace(name):  # a learner re-announcing this version number rewrites the file meanwhile
        out = real_load(name)
        tmp = tmp_path / "new.tmp"
        tmp.write_bytes(good)
        tmp.replace(path)
        return out

    monkeypatch.setattr("eopd_trainer.queue.weights.load_file", load_then_replace)
    with pytest.raises(W.WeightsUnavailable, match="changed while it was read"):
        W.load_weights(dst, pv)
    monkeypatch.setattr("eopd_trainer.queue.weights.load_file", real_load)
    assert untouched()
    from safetensors.torch import save_file

    partial = tmp_path / "partial.safetensors"
    save_file({"lm_head.weight": src.lm_head.weight.detach().clone()}, str(partial))
    with pytest.raises(ValueError, match="missing tensors") as exc:
        W.load_weights(dst, PolicyVersion(2, str(partial), W.file_sha256(partial), partial.stat().st_size, 2))
    assert not isinstance(exc.value, W.WeightsUnavailable) and untouched()
    W.load_weights(dst, pv)
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values()))


def test_token_remap_both_ways():
    from eopd_trainer.rollout.requests import TokenRemap, remap_ids

    ids = np.array([1, 2, 3, 2])
    assert remap_ids(ids, {2: 7}).tolist() == [1, 7, 3, 7]
    assert remap_ids(np.array([[7, 5]]), {7: 2}).tolist() == [[2, 5]]  # the inverse map on top-k ids
    assert remap_ids(ids, {}) is ids
    # the one value holding both directions
    remap = TokenRemap.of({2: 7})
    assert remap.teacher_ids(ids).tolist() == [1, 7, 3, 7]
    assert remap.student_ids(np.array([[7, 5]])).tolist() == [[2, 5]]
    assert (remap.teacher_id(2), remap.teacher_id(4)) == (7, 4)
    assert TokenRemap.of({}).teacher_ids(ids) is ids and TokenRemap.of({}).student_ids(ids) is ids


def test_make_rollout_builds_scored_graded_and_teacher_rollouts():
    """The one Rollout builder: the teacher's top-k ids come back through the inverse remap, a graded
    sample has empty teacher arrays (top_k 0), a teacher-generated one is of origin teacher; the
    candidates' log-probs are kept only with candidate ids; each encodes and decodes."""
    from eopd_teacher.types import SequenceScores

    from eopd_trainer.config import RolloutConfig
    from eopd_trainer.queue.messages import ORIGIN_TEACHER, PromptTask, decode_rollout, encode_rollout
    from eopd_trainer.rollout.publisher import make_rollout
    from eopd_trainer.rollout.requests import TokenRemap

    task = PromptTask(task_seq=4, prompt_index=2, num_samples=2, min_policy_version=0)
    n, remap = 3, TokenRemap.of({2: 7})
    scores = SequenceScores("x", np.full(n, -1.0, np.float32), np.ones(n, np.float32),
                            np.array([[7, 1], [3, 7], [4, 5]], np.int32), np.full((n, 2), -2.0, np.float32),
                            candidate_logprobs=np.full((n, 1), -3.0, np.float32))
    common = dict(remap=remap, rollout_cfg=RolloutConfig(temperature=0.5), worker_id="w", policy_version=3,
                  truncated=False, sampled_unix_ns=10, scored_unix_ns=11)
    old = np.full(n, -0.5, np.float32)
    scored = make_rollout(task, 1, [1, 2], [5, 6, 2], old, scores, teacher_model="T", **common,
                          candidate_ids=np.array([[1], [2], [3]], np.int32))
    assert scored.rollout_id == "t4-s1" and scored.prompt_index == 2 and scored.sampling_temperature == 0.5
    assert scored.teacher_topk_ids.tolist() == [[2, 1], [3, 2], [4, 5]] and scored.num_candidates == 1
    assert scored.candidate_logprobs.tolist() == [[-3.0]] * n and scored.teacher_model == "T"
    assert make_rollout(task, 1, [1, 2], [5, 6, 2], old, scores, **common).candidate_logprobs is None
    graded = make_rollout(task, 0, [1, 2], [5, 6, 2], old, None, reward=1.0, **common)
    assert graded.top_k == 0 and not graded.has_teacher_scores and graded.reward == 1.0
    assert graded.teacher_logprobs.shape == (0,) and graded.teacher_topk_ids.shape == (0, 0)
    teacher = make_rollout(task, 0, [1, 2], [5, 6, 2], np.zeros(n, np.float32), scores, origin=ORIGIN_TEACHER,
                           **common)
    assert teacher.off_policy and teacher.top_k == 2
    for r in (scored, graded, teacher):
        back = decode_rollout(encode_rollout(r))
        assert back.rollout_id == r.rollout_id and back.top_k == r.top_k and back.origin == r.origin


def test_token_remap_applies_to_response_tokens_only():
    """The remap translates what the student generates: a prompt's own special tokens (the chat
    template's end of turn, id 2 here) reach the teacher unchanged, the response's are remapped."""
    from eopd_trainer.rollout.requests import TokenRemap, teacher_tokens

    sent = teacher_tokens([1, 2, 5], [6, 2], TokenRemap.of({2: 7}))
    assert sent.dtype == np.int64 and sent.tolist() == [1, 2, 5, 6, 7]
    assert teacher_tokens([1, 2], [3], TokenRemap.of({})).tolist() == [1, 2, 3]


# Prompts as the student sees them, and the tokenizer check ---------------------------------------

@pytest.fixture(scope="module")
def smol_tokenizer():
    """SmolLM2's tokenizer (the tiny-random presets' tokenizer; it has a chat template)."""
    from eopd_common.models import load_tokenizer

    return load_tokenizer("tiny-random")


def test_render_prompt_applies_the_chat_template_and_the_suffix(smol_tokenizer):
    from eopd_trainer.data import render_prompt

    tok = smol_tokenizer
    suffix = " Please reason step by step, and put your final answer within \\boxed{}."
    ids = render_prompt(tok, "What is 2 + 3?", suffix=suffix)
    text = tok.decode(ids)
    # The user turn holds prompt + suffix; the text ends with the assistant's generation prompt.
    assert f"<|im_start|>user\nWhat is 2 + 3?{suffix}<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n") and text.startswith("<|im_start|>system\n")
    expected = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?" + suffix}],
                                       add_generation_prompt=True, tokenize=False)
    assert ids == tok(expected, add_special_tokens=False)["input_ids"]
    assert ids[-4:] == tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    # A template string with {query}, or no template at all.
    assert render_prompt(tok, "2 + 3?", suffix=" Go.", chat_template="Q: {query}\nA:") == \
        tok("Q: 2 + 3? Go.\nA:", add_special_tokens=False)["input_ids"]
    assert render_prompt(tok, "2 + 3?", suffix=" Go.", chat_template=False) == \
        tok("2 + 3? Go.", add_special_tokens=False)["input_ids"]


def test_render_prompt_truncates_from_the_left(smol_tokenizer):
    from eopd_trainer.data import render_prompt

    full = render_prompt(smol_tokenizer, "word " * 200, suffix=" End.")
    assert len(full) > 200
    cut = render_prompt(smol_tokenizer, "word " * 200, suffix=" End.", max_length=64)
    # The last tokens stay: the suffix and the generation prompt survive, the start is dropped.
    assert cut == full[-64:]
    assert smol_tokenizer.decode(cut).endswith(" End.<|im_end|>\n<|im_start|>assistant\n")
    assert render_prompt(smol_tokenizer, "short", max_length=10_000) == render_prompt(smol_tokenizer, "short")


def test_render_prompt_errors(smol_tokenizer):
    import copy

    from eopd_trainer.data import render_prompt

    no_template = copy.deepcopy(smol_tokenizer)
    no_template.chat_template = None
    with pytest.raises(DataError, match="no chat template"):
        render_prompt(no_template, "hi")
    assert render_prompt(no_template, "hi", chat_template=False) == smol_tokenizer("hi", add_special_tokens=False)["input_ids"]
    with pytest.raises(DataError, match="renders to no tokens"):
        render_prompt(smol_tokenizer, "", chat_template=False)


def test_tokenizer_check_modulo_the_token_remap(smol_tokenizer):
    """An instruct teacher ending turns on another token than the base student's eos: the same
    vocabulary, a different eos, so a different fingerprint. The remap student eos -> teacher eos
    explains the difference exactly; nothing else is accepted."""
    import copy
    from types import SimpleNamespace

    from eopd_common.models import tokenizer_fingerprint
    from eopd_trainer.rollout.teacher_checks import TokenizerMismatch, _TokenizerView, check_tokenizer

    student = smol_tokenizer  # eos <|im_end|> (id 2), pad <|im_end|>, unk <|endoftext|> (id 0)
    roles = {r: getattr(student, f"{r}_token") for r in ("bos", "eos", "unk", "pad")}
    # The candidates are hashed through a view: it must read like the tokenizer itself.
    assert tokenizer_fingerprint(_TokenizerView(student.get_vocab(), roles, student.all_special_tokens)) == \
        tokenizer_fingerprint(student)

    def info(tok):
        return SimpleNamespace(tokenizer_fingerprint=tokenizer_fingerprint(tok), model_name="tiny-random",
                               vocab_size=len(tok))

    assert check_tokenizer(info(student), student, "student", {}) is None
    teacher = copy.deepcopy(student)
    teacher.eos_token = "<|endoftext|>"
    assert tokenizer_fingerprint(teacher) != tokenizer_fingerprint(student)
    assert check_tokenizer(info(teacher), student, "student", {2: 0}) == "eos '<|im_end|>' -> '<|endoftext|>'"
    with pytest.raises(TokenizerMismatch, match="tokenizer mismatch"):
        check_tokenizer(info(teacher), student, "student", {})
    with pytest.raises(TokenizerMismatch, match=r"not explained by teacher.token_remap \{2: 1\}"):
        check_tokenizer(info(teacher), student, "student", {2: 1})
    # Both eos and pad moved (the student's pad is its eos).
    both = copy.deepcopy(teacher)
    both.pad_token = "<|endoftext|>"
    assert check_tokenizer(info(both), student, "student", {2: 0}) == \
        "eos '<|im_end|>' -> '<|endoftext|>', pad '<|im_end|>' -> '<|endoftext|>'"
    # A vocabulary that differs is never explained by a remap.
    grown = copy.deepcopy(teacher)
    grown.add_tokens(["<|eopd_extra|>"], special_tokens=True)
    with pytest.raises(TokenizerMismatch, match="not explained by teacher.token_remap"):
        check_tokenizer(info(grown), student, "student", {2: 0})


# Old log-probs: the decoder body once, the output projection in chunks --------------------------

VOCAB = 300


def tiny_causal_lm(kind: str):
    """A tiny random causal LM in fp32: a Llama, or an architecture with a logit transform after
    the output projection (Gemma 2 soft-capping, Granite's logits_scaling, Cohere's logit_scale)."""
    import transformers
    from eopd_common.models import build_tiny_random

    if kind == "llama":
        return build_tiny_random(VOCAB, seed=3)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config = {
        "gemma2": lambda: transformers.Gemma2Config(**common, final_logit_softcapping=5.0, sliding_window=64),
        "granite": lambda: transformers.GraniteConfig(**{k: v for k, v in common.items() if k != "head_dim"},
                                                      logits_scaling=4.0),
        "cohere": lambda: transformers.CohereConfig(**{k: v for k, v in common.items() if k != "head_dim"},
                                                    logit_scale=0.25),
    }[kind]()
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # large logits, so the transform matters (soft-capping saturates)
        model.get_output_embeddings().weight.normal_(0.0, 2.0)
    return model.eval()


def naive_sequence_logprobs(model, prompts, responses, temperature):
    """The reference: each sequence alone, the model's full [T, V] logits, log-softmax at T."""
    out = []
    for p, r in zip(prompts, responses, strict=True):
        ids = torch.tensor([list(p) + list(r)])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].double()
        lp = torch.log_softmax(logits / temperature, dim=-1)
        out.append(np.array([lp[len(p) - 1 + i, tok].item() for i, tok in enumerate(r)]))
    return out


RAGGED_PROMPTS = [[5, 9, 14], [3, 1, 4, 1, 5, 9, 2], [7], [20, 30, 40, 50, 60]]
RAGGED_RESPONSES = [[11, 12, 13, 2], [99], [8, 17, 250, 3, 3, 3, 41, 42, 2], [6, 7]]


@pytest.mark.parametrize("kind", ["llama", "gemma2", "granite", "cohere"])
@pytest.mark.parametrize("chunk_size", [1, 4, 1024])
def test_sequence_logprobs_equal_the_full_logits(kind, chunk_size):
    """Ragged batch (right padding inside the packed batch), temperature 0.7, chunk sizes that do
    and do not divide the 16 response tokens: equal to each sequence's full logits (fp32, 1e-5),
    logit transforms (soft-capping, scaling) included."""
    from eopd_trainer.rollout.samplers.transformers_sampler import check_head_reproduces_logits, sequence_logprobs

    model = tiny_causal_lm(kind)
    check_head_reproduces_logits(model)
    got = sequence_logprobs(model, RAGGED_PROMPTS, RAGGED_RESPONSES, temperature=0.7, pad_id=0, chunk_size=chunk_size)
    want = naive_sequence_logprobs(model, RAGGED_PROMPTS, RAGGED_RESPONSES, 0.7)
    assert [g.shape for g in got] == [(len(r),) for r in RAGGED_RESPONSES]
    for g, w in zip(got, want, strict=True):
        assert g.dtype == np.float32
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)


def test_sequence_logprobs_never_build_batch_seq_vocab_logits():
    """Every tensor created during the pass (recorded with a TorchDispatchMode; views of the weights,
    such as lm_head's transpose, left out) with the vocabulary as its last dimension holds at most
    chunk_size x V elements; the full-logits reference, under the same recorder, does create a
    [B, T, V] tensor (the recorder sees what it should)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from eopd_trainer.rollout.samplers.transformers_sampler import sequence_logprobs

    model = tiny_causal_lm("llama")
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    class Sizes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.vocab_numels: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if (isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == VOCAB
                        and t.untyped_storage().data_ptr() not in weights):
                    self.vocab_numels.append(t.numel())
            return out

    chunk = 4
    b, t = len(RAGGED_PROMPTS), max(len(p) + len(r) for p, r in zip(RAGGED_PROMPTS, RAGGED_RESPONSES))
    with Sizes() as ours:
        sequence_logprobs(model, RAGGED_PROMPTS, RAGGED_RESPONSES, temperature=1.0, pad_id=0, chunk_size=chunk)
    assert ours.vocab_numels, "no logits block recorded"
    assert max(ours.vocab_numels) <= chunk * VOCAB < b * t * VOCAB, max(ours.vocab_numels)
    with Sizes() as full, torch.no_grad():
        ids = torch.zeros(b, t, dtype=torch.long)
        model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert max(full.vocab_numels) >= b * t * VOCAB


def test_an_unknown_logit_transform_is_refused_at_start():
    """A causal LM whose logits are not its output projection (nor a known transform of it) would get
    wrong old log-probs from the hidden-state pass: the sampler refuses it, naming the model class."""
    from types import SimpleNamespace

    from eopd_common.models import tiny_random_config
    from eopd_trainer.rollout.samplers.base import SamplerUnavailable
    from eopd_trainer.rollout.samplers.transformers_sampler import TransformersSampler
    from transformers import LlamaForCausalLM

    class OddLogits(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 3.0
            return out

    torch.manual_seed(0)
    model = OddLogits(tiny_random_config(VOCAB)).eval()
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=2)
    with pytest.raises(SamplerUnavailable, match="OddLogits: the output projection .* does not reproduce"):
        TransformersSampler("odd", model=model, tokenizer=tok)
    plain = LlamaForCausalLM(tiny_random_config(VOCAB)).eval()
    assert TransformersSampler("plain", model=plain, tokenizer=tok, logprob_chunk_size=7).logprob_chunk_size == 7


# The worker's checks of the teacher (pure logic) -------------------------------------------------

def test_check_teacher_limits_names_every_config_key():
    from types import SimpleNamespace

    from eopd_trainer.rollout.teacher_checks import TeacherIncompatible, check_teacher_limits

    info = SimpleNamespace(model_name="t", max_context_length=1000, max_top_k=16, max_sequences_per_request=2,
                           vocab_size=100)
    tok = [0] * 100  # len() is all the check reads of the tokenizer
    ok = load_config(TINY, ["data.max_prompt_length=984", "rollout.max_response_length=16", "teacher.top_k=16",
                            "teacher.sequences_per_request=2", "teacher.token_remap={2: 99}"])
    check_teacher_limits(info, ok, tok)  # every limit met exactly
    bad = load_config(TINY, ["data.max_prompt_length=985", "rollout.max_response_length=16", "teacher.top_k=17",
                             "teacher.sequences_per_request=3", "teacher.token_remap={2: 100}"])
    with pytest.raises(TeacherIncompatible) as exc:
        check_teacher_limits(info, bad, [0] * 101)
    msg = str(exc.value)
    for part in ("data.max_prompt_length (985) + rollout.max_response_length (16) = 1001 exceeds the teacher's "
                 "max_context_length (1000)", "teacher.top_k (17) exceeds the teacher's max_top_k (16)",
                 "teacher.sequences_per_request (3) exceeds the teacher's max_sequences_per_request (2)",
                 "its tokenizer has 101 ids, more than the teacher's vocabulary (100)",
                 "teacher.token_remap: target ids [100] outside the teacher's vocabulary [0, 100)"):
        assert part in msg, (part, msg)


def test_answer_problems_match_ids_and_positions():
    from types import SimpleNamespace

    from eopd_trainer.rollout.requests import answer_problems

    def pending(rid, n):
        return SimpleNamespace(rollout_id=rid, response_ids=[1] * n)

    def scores(sid, n, k=2, rows=None):
        r = n if rows is None else rows
        return SimpleNamespace(seq_id=sid, token_logprobs=np.zeros(n), entropies=np.zeros(n),
                               topk_ids=np.zeros((r, k)), topk_logprobs=np.zeros((n, k)))

    group = [pending("t0-s0", 3), pending("t0-s1", 2), pending("t1-s0", 4)]
    assert answer_problems(group, [scores("t0-s0", 3), scores("t0-s1", 2), scores("t1-s0", 4)]) == [None] * 3
    got = answer_problems(group, [scores("t0-s1", 3), scores("t0-s1", 2, rows=1)])
    assert got[0] == "the answer's sequence 0 has id 't0-s1', expected 't0-s0'"
    assert got[1] == "the teacher returned {'topk_ids': 1} positions for 2 response tokens"
    assert got[2] == "the answer holds 2 sequences for the 3 sent"


def test_request_groups_respect_sequences_and_tokens():
    from eopd_trainer.rollout.requests import request_groups

    def groups(lengths, seqs, tokens):
        return [list(g) for g in request_groups(lengths, seqs, tokens)]

    assert groups([5, 5, 5, 5, 5], 2, None) == [[0, 1], [2, 3], [4]]
    assert groups([5, 5, 5, 5, 5], 4, 12) == [[0, 1], [2, 3], [4]]
    assert groups([3, 20, 3, 3], 4, 10) == [[0], [1], [2, 3]]  # the long one alone (the teacher rejects it)
    assert groups([10, 10], 4, 10) == [[0], [1]]
    assert groups([], 4, 10) == []
    for lengths, seqs, tokens in (([4, 9, 1, 7, 3, 3, 8], 3, 12), ([2] * 9, 4, 5)):
        got = request_groups(lengths, seqs, tokens)
        assert [i for g in got for i in g] == list(range(len(lengths)))
        assert all(len(g) <= seqs and (len(g) == 1 or sum(lengths[i] for i in g) <= tokens) for g in got)
