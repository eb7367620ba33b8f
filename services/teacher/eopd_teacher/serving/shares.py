"""Per-client shares of the teacher's global limits (issue 33, section 2).

Each global limit (unary calls at once, ScoreStreams open, request bytes in flight, tokens in flight,
health Watch streams) is also split by client: one client may hold at most
`max(1, floor(limit x max_client_share))` of it, so one client cannot take all of it and the rest
stays usable by others. `PerClientLimit` is that pure bookkeeping (no asyncio, no gRPC), usable by
any front end that has a client key.

Which key (`Identities.key`). Shares key on who a caller is, as far as the server can tell, never on
what a caller says about itself: `x-eopd-client` is chosen by the caller, who could name itself anew
on every call and get a fresh share each time.

- The address (`share_key`) is what an attacker cannot forge over TCP. IPv6 addresses count by their
  /64 prefix (a host usually holds a whole /64), and every loopback address (127.0.0.0/8, ::1) is one
  client, `loopback`: any local user can connect from 127.0.0.2, 127.0.0.3, ... and must not get a
  share per address (issue 49, finding 3). Clients behind one NAT or proxy, and all local clients,
  share one share (`max_client_share` 1.0 turns shares off).
- An authenticated caller is keyed by its identity at its address: `cert:<common name>@<address>`
  under mutual TLS, `token@<address>` for a caller that presented the bearer token. The token is one
  secret every legitimate client holds, so it names no one client: keyed on the token alone, the
  share would cap every legitimate client together. What it does tell apart is the holder from a
  stranger at the same address: a local process without the token (on one host every worker
  connects from 127.0.0.1) counts against `loopback`, never against the workers' `token@loopback`.
  A stranger's calls never get that far on a teacher with a token (refused before the body is read);
  what it can still open (health Watch streams, HTTP connections) counts against its own share.

`x-eopd-client` still keys the batcher's fair queue and `max_inflight_tokens_per_client`, where a
caller naming itself only shares its own turn.
"""

from __future__ import annotations

import hmac
import ipaddress
import urllib.parse

LOOPBACK = "loopback"  # the one share key of every loopback address


def share_key(peer: str) -> str:
    """The share key of a peer given as the front ends name it without its port ("ipv4:1.2.3.4",
    "ipv6:[2001:db8::1]", "unix:/path", "unknown"): `LOOPBACK` for any loopback address, the IPv4
    address, the /64 prefix of an IPv6 address, else the peer string itself."""
    peer = urllib.parse.unquote(peer)  # gRPC names IPv6 peers "ipv6:%5B::1%5D"
    if peer.startswith("ipv6:"):
        host = peer[5:].strip("[]").split("%", 1)[0]
        try:
            addr = ipaddress.IPv6Address(host)
        except ValueError:
            return peer
        if addr.ipv4_mapped is not None:
            return share_key(f"ipv4:{addr.ipv4_mapped}")
        if addr.is_loopback:
            return LOOPBACK
        return f"ipv6:{ipaddress.IPv6Network((addr, 64), strict=False)}"
    if peer.startswith("ipv4:"):
        try:
            if ipaddress.IPv4Address(peer[5:]).is_loopback:
                return LOOPBACK
        except ValueError:
            return peer
    return peer


def peer_name(host: str) -> str:
    """A bare host address ("127.0.0.2", "::1", as ASGI servers give it) named as gRPC names peers."""
    return f"ipv6:[{host}]" if ":" in host else f"ipv4:{host}"


class Identities:
    """The share key of a caller (module docstring): its authenticated identity at its address, or
    its address alone. `token`: the server's bearer token (None: no caller presents one)."""

    def __init__(self, token: str | None = None):
        self._expected = f"Bearer {token}".encode() if token else None

    def key(self, peer: str, authorization: str | bytes | None = None, certificate: str | None = None) -> str:
        """`peer` as the front ends name it (`share_key`); `authorization`: the caller's header, if
        any; `certificate`: the verified client certificate's common name under mutual TLS, if any."""
        address = share_key(peer)
        if certificate:
            return f"cert:{certificate}@{address}"
        if self.holds_token(authorization):
            return f"token@{address}"
        return address

    def holds_token(self, authorization: str | bytes | None) -> bool:
        """Whether an `authorization` header (or gRPC metadata value) is `Bearer <the token>`,
        compared in constant time."""
        if self._expected is None or authorization is None:
            return False
        given = authorization.encode() if isinstance(authorization, str) else bytes(authorization)
        return hmac.compare_digest(given, self._expected)


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
