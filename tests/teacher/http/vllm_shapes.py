"""Shape-for-shape comparison of `/v1/completions` answers (eopd's and stock vLLM's), shared by the
vLLM tier's live test (test_openai_compat_vllm.py) and the main suite's test against the recorded
vLLM answers (fixtures/vllm_completions.json, written by the live test with EOPD_RECORD_VLLM=1).

The requests are the scoring requests TRL/verl send, on the tiny-random model (the same weights
for both servers: eopd_common.model_dirs.materialise_model_dir)."""

from __future__ import annotations

import math
from pathlib import Path

FIXTURE = Path(__file__).parent / "fixtures" / "vllm_completions.json"
SEQS = [[17, 4031, 950, 12, 8811, 301, 77, 2048, 9], [5, 60, 700, 8000, 40000, 123]]
REQUESTS = {
    # what TRL 1.16's VLLMClient.get_sequence_logprobs sends
    "trl_prompt_logprobs": {"prompt": SEQS, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 5},
    # echo with completion logprobs, only the prompt's own token in prompt_logprobs
    "echo_logprobs": {"prompt": SEQS[:1], "max_tokens": 1, "temperature": 0.0, "echo": True, "logprobs": 3, "prompt_logprobs": 0},
    # max_tokens > 1 (eopd: the Generate path), greedy on both, with completion log-probs, the token ids
    # and the stop id that ends it (its text left out, its id kept, stop_reason)
    "generate_greedy": {"prompt": SEQS, "max_tokens": 5, "temperature": 0.0, "logprobs": 2, "return_token_ids": True},
    "generate_stop": {"prompt": SEQS[:1], "max_tokens": 8, "temperature": 0.0, "logprobs": 0, "stop_token_ids": [38670],
                      "return_token_ids": True},
    # a field eopd refuses (n > 1: it scores): vLLM answers it, so only the error shape of a field
    # both refuse is compared
    "bad_prompt_logprobs": {"prompt": SEQS[:1], "max_tokens": 1, "prompt_logprobs": -5},
}
# Keys only one side has, documented in docs/teacher.md: eopd's extension, and vLLM 0.32 fields
# of its own machinery (encoder-cache transfer, request metrics, MoE routing) eopd does not send.
EOPD_ONLY = {"prompt_entropies", "completion_entropies"}
VLLM_ONLY = {"ec_transfer_params", "metrics", "routed_experts"}


def shape(x, path: str = "") -> dict | list | str:
    """The structure of a JSON value: dict keys (token-id keys kept: they are compared too), list
    lengths, leaf types (int and float both "number"; null "null")."""
    if isinstance(x, dict):
        return {k: shape(v, f"{path}.{k}") for k, v in x.items() if k not in EOPD_ONLY | VLLM_ONLY}
    if isinstance(x, list):
        return [shape(v, f"{path}[{i}]") for i, v in enumerate(x)]
    if x is None:
        return "null"
    if isinstance(x, bool):
        return "bool"
    if isinstance(x, (int, float)):
        return "number"
    return type(x).__name__


def numbers(x, path: str = "", out: list | None = None) -> list[tuple[str, float]]:
    """Every float of an answer (the log-probs), with its path, for the value comparison."""
    out = [] if out is None else out
    if isinstance(x, dict):
        for k, v in x.items():
            if k not in EOPD_ONLY | VLLM_ONLY:
                numbers(v, f"{path}.{k}", out)
    elif isinstance(x, list):
        for i, v in enumerate(x):
            numbers(v, f"{path}[{i}]", out)
    elif isinstance(x, float):
        out.append((path, x))
    return out


def compare(eopd: dict, vllm: dict, atol: float = 1e-4) -> None:
    """Asserts the same structure (keys, token-id keys, lengths, types) and the same log-probs."""
    assert shape(eopd).keys() == shape(vllm).keys(), (sorted(shape(eopd)), sorted(shape(vllm)))
    for key in ("choices", "usage", "object"):
        assert shape(eopd[key]) == shape(vllm[key]), key
    # the completion token (greedy at temperature 0 on both) and the echoed text. vLLM's incremental
    # detokenizer prepends prompt-tail text when a prompt ends inside a UTF-8 character (SEQS[1]
    # ends with a byte token: its text is 'Lcess rect neoliberal\ufffdiscal' for the token 'iscal'),
    # so the completion is compared as a suffix.
    for e, v in zip(eopd["choices"], vllm["choices"], strict=True):
        assert e["text"] and v["text"].endswith(e["text"]), (e["text"], v["text"])
    a, b = dict(numbers(eopd["choices"])), dict(numbers(vllm["choices"]))
    assert a.keys() == b.keys()
    worst = max((abs(a[k] - b[k]) for k in a), default=0.0)
    assert worst <= atol, worst
