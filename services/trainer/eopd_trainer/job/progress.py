"""`eopd run`'s progress bar: the learner's train_metrics.jsonl followed into tqdm, with the
iterations' alarms (learner/alarms.py) on the bar and, the first time each fires, on a line of their
own; a record of kind "stop" (train.stop_on) is kept as `stopped_by`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tqdm import tqdm


class Progress:
    """Follows `<run_dir>/train_metrics.jsonl` into a tqdm bar, from iteration `initial` (a resumed
    run: the file was trimmed to the committed iteration before the learner started)."""

    def __init__(self, path: Path, total: int, initial: int = 0):
        self.path, self.done = path, initial
        self.offset = path.stat().st_size if initial and path.exists() else 0
        self.last: dict = {}
        self.alarms_seen: set[str] = set()
        self.stopped_by: str | None = None  # the reason of a stop by train.stop_on
        self.bar = tqdm(total=total, initial=initial, desc="eopd run", unit="it", dynamic_ncols=True, file=sys.stderr)

    def poll(self) -> None:
        if not self.path.exists():
            return
        with self.path.open() as fh:
            fh.seek(self.offset)
            chunk = fh.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        self.offset += len(complete.encode())
        for line in complete.splitlines():
            rec = json.loads(line)
            if rec.get("kind") == "stop":
                self.stopped_by = str(rec.get("reason", "train.stop_on"))
                continue
            if rec.get("kind") != "iteration" or int(rec["iteration"]) <= self.done:
                continue
            self.last = rec
            alarms = rec.get("alarms", {})
            for name in alarms.keys() - self.alarms_seen:
                self.bar.write(f"eopd run: warning: iteration {rec['iteration']}: alarm {name}: {alarms[name]}",
                               file=sys.stderr)
            self.alarms_seen.update(alarms)
            self.bar.set_postfix(stage=rec.get("stage", "-"), loss=f"{rec.get('iter/loss', 0):.4f}", gate=f"{rec.get('iter/gate_ratio', 0):.2f}",
                                 fkl=f"{rec.get('iter/fkl_gated_mean', 0):.3f}",
                                 **({"reward": f"{rec['iter/reward_mean']:.2f}"} if "iter/reward_mean" in rec else {}),
                                 **({"alarm": ",".join(alarms)} if alarms else {}))
            self.bar.update(int(rec["iteration"]) - self.done)
            self.done = int(rec["iteration"])

    def close(self) -> None:
        self.poll()
        self.bar.close()
