"""Per-client shares of the teacher's global limits (issue 33, section 2).

Each global limit (unary calls at once, ScoreStreams open, request bytes in flight, tokens in flight,
health Watch streams) is also split by client: one client may hold at most
`max(1, floor(limit x max_client_share))` of it, so one client cannot take all of it and the rest
stays usable by others. `PerClientLimit` is that pure bookkeeping (no asyncio, no gRPC), usable by
any front end that has a client key.

Which key. Shares key on the peer's network address (`share_key`), never on what a caller says
about itself: `x-eopd-client` is chosen by the caller, who could name itself anew on every call and
get a fresh share each time; the bearer token is one secret that every holder presents, so keying on
it would make the share a cap on every legitimate client together. The address is what an attacker
cannot forge over TCP; IPv6 addresses count by their /64 prefix (a host usually holds a whole /64).
Clients behind one NAT or proxy share one share (`max_client_share` 1.0 turns shares off).
`x-eopd-client` still keys the batcher's fair queue and `max_inflight_tokens_per_client`, where a
caller naming itself only shares its own turn.
"""

from __future__ import annotations

import ipaddress


def share_key(peer: str) -> str:
    """The share key of a peer given as the front ends name it without its port ("ipv4:1.2.3.4",
    "ipv6:[2001:db8::1]", "unix:/path", "unknown"): the IPv4 address, the /64 prefix of an IPv6
    address, else the peer string itself."""
    if peer.startswith("ipv6:"):
        host = peer[5:].strip("[]").split("%", 1)[0]
        try:
            addr = ipaddress.IPv6Address(host)
        except ValueError:
            return peer
        if addr.ipv4_mapped is not None:
            return f"ipv4:{addr.ipv4_mapped}"
        return f"ipv6:{ipaddress.IPv6Network((addr, 64), strict=False)}"
    return peer


def client_share(limit: int, fraction: float) -> int:
    """What one client may hold of `limit`: max(1, floor(limit x fraction))."""
    return max(1, int(limit * fraction))


class PerClientLimit:
    """Units (calls, streams, bytes, tokens) held, at most `limit` in total and `share`
    (`client_share`) per client. A taker that holds nothing is admitted while the total allows
    (for bytes and tokens: even alone over the limit, the caller's per-request bounds cap it).
    `client=None` counts against the total only."""

    def __init__(self, limit: int, fraction: float = 1.0):
        self.limit = limit
        self.share = client_share(limit, fraction)
        self.held = 0
        self.peak = 0  # the most ever held at once (tests, diagnostics)
        self._by_client: dict[str, int] = {}

    def held_by(self, client: str | None) -> int:
        return 0 if client is None else self._by_client.get(client, 0)

    def clients(self) -> dict[str, int]:
        """What each client holds now."""
        return dict(self._by_client)

    def refusal(self, n: int, client: str | None = None) -> str | None:
        """Why `n` more units may not be taken for `client` now ("total" or "share"), or None."""
        if self.held + n > self.limit and self.held > 0:
            return "total"
        mine = self.held_by(client)
        if client is not None and mine + n > self.share and mine > 0:
            return "share"
        return None

    def try_take(self, n: int = 1, client: str | None = None) -> bool:
        """Takes `n` units for `client` if `refusal` allows; False otherwise (nothing taken)."""
        if self.refusal(n, client) is not None:
            return False
        self.take(n, client)
        return True

    def take(self, n: int = 1, client: str | None = None) -> None:
        """Takes `n` units for `client` unconditionally (a caller that checked `refusal` itself)."""
        self.held += n
        self.peak = max(self.peak, self.held)
        if client is not None:
            self._by_client[client] = self._by_client.get(client, 0) + n

    def give(self, n: int = 1, client: str | None = None) -> None:
        """Gives back `n` units taken for `client`."""
        self.held -= n
        if client is not None:
            left = self._by_client.get(client, 0) - n
            if left > 0:
                self._by_client[client] = left
            else:
                self._by_client.pop(client, None)

    def share_message(self, what: str, setting: str, client: str | None) -> str:
        """The RESOURCE_EXHAUSTED message of a refusal for `client`'s share (`what`: e.g. "calls")."""
        return (f"client {client} holds {self.held_by(client)} {what}, its share of {setting} "
                f"({self.limit} x max_client_share = {self.share}); retry later")
