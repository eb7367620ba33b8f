"""Which waiting sequences the next engine batch holds: fair queuing by client, grouping by length.

Pure logic (no asyncio, no engine): the batcher (`batcher.py`) keeps its waiting sequences in a
`FairQueue` and takes one batch at a time from it.

Fairness (start-time fair queuing over tokens). Every waiting sequence belongs to a client (the
servicer's `client_key`: the `x-eopd-client` metadata, else the peer address without its port).
Each client with work waiting has a virtual time: the tokens it was served since its work started
waiting, counted from the virtual time of the client served last when it arrived. The next batch
is anchored on the oldest sequence of the client with the smallest virtual time (ties: the older
sequence). So clients take turns in proportion to tokens, a large request is served over several
batches, and a request from another client waits for at most the batch in progress and the turns
of clients that are behind it, never for the rest of a large request. Within one client,
sequences keep arrival order (its oldest is always its next anchor).

A batch is the anchor plus the waiting sequences (of any client) closest to it in length, while
- its padded size (width x count) stays within `max_batch_tokens` (the anchor always goes, even
  alone over the budget: a sequence is never split);
- its width stays within max(MAX_WIDEN x the anchor's length, MIN_WIDTH_CAP): a short request's
  batch is not padded to a long one's length, which would make it wait as long as the long one;
- each client's tokens in it stay within `max_client_tokens` (the per-client share of one
  batch; the anchor always goes): a large request is split into batches of at most that many
  tokens, so the batch in progress when another client's request arrives is short.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..types import ScoreItem

# A batch anchored on a sequence of L tokens is at most max(MAX_WIDEN * L, MIN_WIDTH_CAP) wide.
MAX_WIDEN = 2
MIN_WIDTH_CAP = 64


@dataclass(eq=False)
class Waiting:
    """One waiting sequence: `seq` is its arrival number; `ticket` is the caller's (the batcher's
    future), opaque here."""

    seq: int
    item: ScoreItem
    client: str
    ticket: Any = None
    enqueued: float = 0.0


class FairQueue:
    """The waiting sequences, by client; `take_batch` forms the next engine batch."""

    def __init__(self, *, max_batch_tokens: int, max_client_tokens: int | None = None):
        self.max_batch_tokens = max_batch_tokens
        self.max_client_tokens = min(max_client_tokens or max_batch_tokens, max_batch_tokens)
        self._waiting: dict[str, deque[Waiting]] = {}  # client -> its sequences in arrival order
        self._vtime: dict[str, int] = {}  # client -> virtual time (clients with work waiting only)
        self._vclock = 0  # virtual time of the client served last
        self._tokens = 0
        self._count = 0

    # -- state -------------------------------------------------------------------------------
    @property
    def tokens(self) -> int:
        """Tokens waiting (all clients)."""
        return self._tokens

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Waiting]:
        for q in self._waiting.values():
            yield from q

    def oldest(self) -> Waiting | None:
        """The sequence waiting longest (any client), or None."""
        heads = [q[0] for q in self._waiting.values()]
        return min(heads, key=lambda w: w.seq) if heads else None

    def clients(self) -> dict[str, int]:
        """Tokens waiting per client."""
        return {c: sum(w.item.num_tokens for w in q) for c, q in self._waiting.items()}

    # -- changes -----------------------------------------------------------------------------
    def add(self, entries: list[Waiting]) -> None:
        for w in entries:
            if w.client not in self._waiting:  # its work starts waiting: it joins at the clock
                self._waiting[w.client] = deque()
                self._vtime[w.client] = self._vclock
            self._waiting[w.client].append(w)
            self._tokens += w.item.num_tokens
            self._count += 1

    def drop(self, gone: Callable[[Waiting], bool]) -> list[Waiting]:
        """Removes (and returns) the waiting sequences for which `gone` is true."""
        dropped = [w for w in self if gone(w)]
        self._remove(dropped)
        return dropped

    def clear(self) -> list[Waiting]:
        everything = list(self)
        self._remove(everything)
        return everything

    def next_client(self) -> str | None:
        """The client whose oldest sequence anchors the next batch (None if nothing waits)."""
        if not self._waiting:
            return None
        return min(self._waiting, key=lambda c: (self._vtime[c], self._waiting[c][0].seq))

    def take_batch(self) -> list[Waiting]:
        """Removes and returns the next batch (the anchor first); [] if nothing waits."""
        if not self._waiting:
            return []
        client = self.next_client()
        anchor = self._waiting[client][0]
        self._vclock = self._vtime[client]
        chosen = self._fill(anchor)
        for w in chosen:  # charge each client for its tokens
            self._vtime[w.client] += w.item.num_tokens
        self._remove(chosen)
        return chosen

    # -- internals ---------------------------------------------------------------------------
    def _fill(self, anchor: Waiting) -> list[Waiting]:
        """The anchor plus the closest-in-length sequences the three bounds allow."""
        others = sorted((w for w in self if w is not anchor), key=lambda w: w.item.num_tokens)
        lengths = [w.item.num_tokens for w in others]
        width = anchor.item.num_tokens
        width_cap = max(MAX_WIDEN * width, MIN_WIDTH_CAP)
        chosen = [anchor]
        per_client = {anchor.client: width}
        lo = hi = bisect.bisect_left(lengths, width)
        while lo > 0 or hi < len(others):
            longer = hi < len(others) and (lo == 0 or lengths[hi] - width <= width - lengths[lo - 1])
            if longer:
                cand, new_width = others[hi], max(width, lengths[hi])
                hi += 1
                if new_width > width_cap or new_width * (len(chosen) + 1) > self.max_batch_tokens:
                    hi = len(others)  # nothing longer fits either
                    continue
            else:
                cand, new_width = others[lo - 1], width
                lo -= 1
                if new_width * (len(chosen) + 1) > self.max_batch_tokens:
                    break  # the batch is full (longer ones would not fit either)
            share = per_client.get(cand.client, 0) + cand.item.num_tokens
            if share > self.max_client_tokens:
                continue  # this client's share of the batch is used up
            per_client[cand.client] = share
            chosen.append(cand)
            width = new_width
        return chosen

    def _remove(self, entries: list[Waiting]) -> None:
        if not entries:
            return
        ids = {id(w) for w in entries}
        for client in {w.client for w in entries}:
            kept = deque(w for w in self._waiting[client] if id(w) not in ids)
            if kept:
                self._waiting[client] = kept
            else:  # no work waiting: it leaves the fair queue (no credit, no debt kept)
                del self._waiting[client]
                del self._vtime[client]
        self._tokens -= sum(w.item.num_tokens for w in entries)
        self._count -= len(entries)
