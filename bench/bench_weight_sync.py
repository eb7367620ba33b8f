"""Weight sync, file on disk vs files in shared memory vs one mapped buffer vs a broadcast, side by side in one run:
the learner's publish (`save_weights`: the state dict copied out, a safetensors file written to a
temporary name, fsynced, renamed, its sha256; mapped: `BufferWriter.publish`, the tensors copied into
the buffer and its checksum) and a worker's load (`load_weights`: the sha256 verified, the file
read, the tensors loaded into the model in place; mapped: the buffer copied out, its checksum
checked, loaded in place), into a directory on the run's disk and into ones in /dev/shm
(`weight_sync: disk`, `shm` and `mapped`); and the broadcast (`weight_sync: broadcast`: the tensors
copied into one payload and broadcast over a gloo group on the loopback to a receiver thread, which
checks its checksum; load = the wait for the receive to complete plus the load in place),
interleaved rounds, medians.

    .venv/bin/python -m bench.bench_weight_sync [--quick] [--model smollm2-135m] [--rounds 5]

Writes the `weight_sync` section of docs/benchmarks.md (not with --quick).
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.report import ROOT, markdown_table, measure_and_report


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def measure(model_spec: str, rounds: int) -> dict:
    import torch

    from eopd_common.models import load_causal_lm
    from eopd_trainer.queue.policy_load import load_policy
    from eopd_trainer.job.supervisor import free_port
    from eopd_trainer.queue.weights import ensure_private_dir, load_tensors, save_weights
    from eopd_trainer.queue.weights_broadcast import BroadcastReceiver, BroadcastSender, Endpoint
    from eopd_trainer.queue.weights_buffer import BufferWriter

    learner = load_causal_lm(model_spec).model
    worker = load_causal_lm(model_spec).model
    with torch.no_grad():  # the worker's copy differs until it loads
        for p in worker.parameters():
            p.mul_(0.5)
    disk_root = Path(tempfile.mkdtemp(prefix="eopd-bench-weights-", dir=ROOT / "bench" / "results"))
    shm_root = Path(tempfile.mkdtemp(prefix="eopd-bench-weights-", dir="/dev/shm"))
    dirs = {"disk": disk_root / "weights", "shm": ensure_private_dir(shm_root) / "weights",
            "mapped": ensure_private_dir(shm_root / "mapped")}
    buffer = BufferWriter(dirs["mapped"], learner)
    endpoint = Endpoint(address=f"127.0.0.1:{free_port()}", workers=1, join_timeout_s=120, timeout_s=120,
                        key=secrets.token_hex(32).encode())  # the run's message key (queue.auth_key_file)
    sender = BroadcastSender(endpoint, learner)
    receiver = BroadcastReceiver(endpoint).start()
    dirs["broadcast"] = shm_root / "unused"
    publishers = {"disk": lambda d, r: save_weights(learner, d, r, r), "shm": lambda d, r: save_weights(learner, d, r, r),
                  "mapped": lambda d, r: buffer.publish(learner, r, r), "broadcast": lambda d, r: sender.publish(learner, r, r)}

    def received(pv) -> None:  # the receive completes in the receiver's thread: its wait is part of the load
        while receiver.ready_header is None or receiver.ready_header[1] != int(pv.sha256[4:]):
            time.sleep(0.0005)
        with receiver.holding(pv) as tensors:
            load_tensors(worker, tensors, pv.uri)

    loaders = {path: (lambda pv, d: load_policy(worker, pv, weights_dir=d)) for path in dirs}
    loaders["broadcast"] = lambda pv, d: received(pv)
    per_round: list[dict] = []
    try:
        for r in range(rounds + 1):  # round 0 warms up (allocator, page cache of the libraries)
            rec = {}
            for path, d in dirs.items():
                with torch.no_grad():  # the worker's copy differs from the learner's before each load
                    for p in worker.parameters():
                        p.mul_(0.5)
                publish_s, pv = _timed(lambda d=d, path=path: publishers[path](d, r))
                load_s, _ = _timed(lambda d=d, pv=pv, path=path: loaders[path](pv, d))
                rec[path] = {"publish_s": publish_s, "load_s": load_s, "mb": pv.num_bytes / 1e6}
                for f in d.glob("v*.safetensors"):
                    f.unlink()
            if r:
                per_round.append(rec)
            print(json.dumps({"round": r, **rec}), flush=True)
        same = all(torch.equal(a, b) for a, b in zip(learner.state_dict().values(), worker.state_dict().values()))
    finally:
        buffer.close()
        receiver.close()
        sender.close()
        shutil.rmtree(disk_root, ignore_errors=True)
        shutil.rmtree(shm_root, ignore_errors=True)
    med = statistics.median
    out = {"model": model_spec, "rounds": per_round, "loaded_equal": same, "mb": per_round[0]["disk"]["mb"]}
    for path in dirs:
        for k in ("publish_s", "load_s"):
            out[f"{path}_{k}"] = med([x[path][k] for x in per_round])
        out[f"{path}_total_s"] = med([x[path]["publish_s"] + x[path]["load_s"] for x in per_round])
    total = lambda x, path: x[path]["publish_s"] + x[path]["load_s"]  # noqa: E731
    out["shm_vs_disk_total"] = med([total(x, "shm") / total(x, "disk") for x in per_round])
    out["mapped_vs_shm_total"] = med([total(x, "mapped") / total(x, "shm") for x in per_round])
    out["broadcast_vs_mapped_total"] = med([total(x, "broadcast") / total(x, "mapped") for x in per_round])
    return out


def section_text(data: dict) -> str:
    rows = [[path, f"{data[f'{path}_publish_s']:.2f}", f"{data[f'{path}_load_s']:.2f}", f"{data[f'{path}_total_s']:.2f}"]
            for path in ("disk", "shm", "mapped", "broadcast")]
    return "\n".join([
        "## Weight sync: disk vs shared memory vs broadcast (`python -m bench.bench_weight_sync`)", "",
        f"{data['model']} ({data['mb']:.0f} MB of float32 weights), {len(data['rounds'])} interleaved rounds, medians; "
        "publish = the learner's `save_weights` (copy out, write, fsync, rename, sha256; mapped: the tensors copied into "
        "the buffer, its checksum), load = a worker's `load_weights` (sha256 verified, read, loaded in place; mapped: "
        "the buffer copied out, its checksum checked, loaded in place; broadcast: the tensors copied into one payload and "
        "broadcast over a gloo group on the loopback to a receiver thread of the same process, which checks the "
        "checksum; load = the wait for that receive plus the load in place); the loaded weights equal the published ones: "
        f"{data['loaded_equal']}. Load average {data.get('load_avg', '?')} (1/5/15 min, start -> end).", "",
        markdown_table(["path", "publish s", "load s", "publish + load s"], rows), "",
        f"Publish + load, medians of per-round ratios: files in shared memory / disk {data['shm_vs_disk_total']:.2f}x, "
        f"**mapped buffer / files in shared memory {data['mapped_vs_shm_total']:.2f}x**, broadcast / mapped buffer "
        f"{data['broadcast_vs_mapped_total']:.2f}x. `eopd run` (`weight_sync: auto`) uses the mapped buffer where "
        "/dev/shm has room (transformers and vLLM workers), the disk path otherwise; `weight_sync: broadcast` is for "
        "GPUs (NCCL, device to device, one node or several). On a CPU most of the file paths is the copy out of the "
        "model and the two sha256 passes, not the disk; the mapped buffer is one copy each side and a checksum pass; "
        "the broadcast adds gloo's TCP transfer on the loopback. A GPU learner adds its device-to-host copy to the "
        "mapped buffer, a GPU worker its host-to-device copy; NCCL's broadcast has neither (not measured: no GPU "
        "was lent to the session that built it).", ""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the tiny random model, 2 rounds; prints, writes nothing")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="quick: write the results JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.rounds = "tiny-random", 2
    return measure_and_report("weight_sync", lambda: measure(args.model, args.rounds), section_text, quick=args.quick, out=args.out)


if __name__ == "__main__":
    raise SystemExit(main())
