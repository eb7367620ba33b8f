"""The mapped weights buffer (`weight_sync: mapped`, queue/weights_buffer.py) loaded into vLLM: each
vLLM worker process maps the buffer itself and copies the announced tensors out, so no tensor
crosses vLLM's process boundary (only the announcement does), as with the file path's
`reload_weights(weights_path=...)`.

`load_in_worker` runs inside each vLLM worker (`LLM.collective_rpc` with a callable; vLLM passes
the worker as its first argument). With the engine core in the rollout worker's process (eopd's
default, `prepare_vllm_process`) nothing is serialised; with vLLM's worker processes the callable is
sent with cloudpickle, which vLLM allows only with `VLLM_ALLOW_INSECURE_SERIALIZATION=1`
(`allow_callable_rpc`: set only then; the channel is vLLM's own local IPC between this worker's
processes). The copy is checked as every reader of the buffer checks it (its sequence number and
checksum); a buffer rewritten since the announcement is reported, not loaded, and the model keeps
its weights.
"""

from __future__ import annotations

import os

import torch

from ...queue.messages import PolicyVersion
from ...queue.weights import WeightsUnavailable
from ...queue.weights_buffer import read_buffer

UNAVAILABLE = "unavailable: "
MISMATCH = "mismatch: "


def allow_callable_rpc() -> None:
    """vLLM refuses to unpickle a callable RPC unless told to; needed only with worker processes."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0":
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def load_in_worker(worker, announced: dict, names: list[str]) -> str:
    """Reads the announced buffer and loads it into this vLLM worker's model; "" when loaded, else
    UNAVAILABLE + why (not the announced version now: retry) or MISMATCH + why (not the student's
    tensors). Nothing is loaded unless the whole copy checked out."""
    try:
        state = read_buffer(PolicyVersion(**announced))
    except WeightsUnavailable as exc:
        return UNAVAILABLE + str(exc)
    if set(state) != set(names):
        missing, unexpected = sorted(set(names) - set(state)), sorted(set(state) - set(names))
        return MISMATCH + f"not the student's tensors (missing {missing[:5]}, unexpected {unexpected[:5]})"
    return load_tensors_in_worker(worker, state)


def load_tensors_in_worker(worker, tensors: dict[str, torch.Tensor]) -> str:
    """Loads `tensors` (the student's, checked by the caller) into this vLLM worker's model: vLLM's
    in-place reload (as `reload_weights(weights_path=...)` for files, here from tensors); the model's
    own load_weights alone fails once its parameters are processed after the first load. Also the
    broadcast path's load (weight_sync: broadcast): the engine core in this process, nothing is
    serialised."""
    with torch.no_grad():
        worker.reload_weights(weights_iterator=iter(tensors.items()))
    return ""
