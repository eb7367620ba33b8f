"""The learner's weights out (rank 0): every published version through the run's `weight_sync`:
versioned files (disk, shm), the mapped buffer (mapped), or a broadcast to the workers' group
(broadcast; files in <run_dir>/weights from the first failed broadcast on)."""

from __future__ import annotations

import torch

from ..config import RunConfig
from ..queue.messages import PolicyVersion
from ..queue.weights import ensure_private_dir, prune_weights, save_weights
from ..queue.weights_broadcast import BroadcastSender, endpoint_of
from ..queue.weights_buffer import BufferWriter


class WeightsOut:
    """Publishes versions; opens the mapped buffer or the broadcast group at the first publish."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self._buffer: BufferWriter | None = None
        self._sender: BroadcastSender | None = None

    def publish(self, model: torch.nn.Module, version: int, iteration: int) -> PolicyVersion:
        sync = self.cfg.weight_sync
        if sync in ("shm", "mapped"):  # learner and workers of one user on one node
            ensure_private_dir(self.cfg.weights_dir.parent)
        if sync == "mapped":  # one buffer rewritten in place (queue/weights_buffer.py)
            if self._buffer is None:
                ensure_private_dir(self.cfg.weights_dir)
                self._buffer = BufferWriter(self.cfg.weights_dir, model)
            return self._buffer.publish(model, version, iteration)
        if sync == "broadcast":
            if self._sender is None:
                self._sender = BroadcastSender(endpoint_of(self.cfg.weight_broadcast, self.cfg.queue.auth_key_file), model)
            pv = self._sender.publish(model, version, iteration)
            if pv is not None:
                return pv
        return save_weights(model, self.cfg.weights_dir, version, iteration)

    def prune(self, protect: int) -> None:
        prune_weights(self.cfg.weights_dir, self.cfg.checkpoint.keep_weights, protect=protect)

    def finish(self) -> None:
        """The run is over (before the workers are told): the broadcast's receivers end their threads."""
        if self._sender is not None:
            self._sender.finish()

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
        if self._buffer is not None:
            self._buffer.close()
