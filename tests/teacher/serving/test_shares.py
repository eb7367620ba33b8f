"""Per-client shares of the global limits (`serving/shares.py`, `ByteBudget`'s share): pure logic."""

from __future__ import annotations

import asyncio

import pytest

from eopd_teacher.serving.batcher import Overloaded
from eopd_teacher.serving.metrics import TeacherMetrics
from eopd_teacher.serving.resources import ByteBudget
from eopd_teacher.serving.service import TeacherService
from eopd_teacher.serving.shares import Identities, PerClientLimit, client_share, share_key
from eopd_teacher.serving.state import ServerState
from eopd_teacher.settings import TeacherSettings


@pytest.mark.parametrize(("limit", "fraction", "share"), [(64, 0.5, 32), (8, 0.5, 4), (3, 0.5, 1), (1, 0.5, 1), (8, 1.0, 8), (10, 0.25, 2)])
def test_client_share_is_a_floored_fraction_and_at_least_one(limit, fraction, share):
    assert client_share(limit, fraction) == share


def test_one_client_is_held_to_its_share_and_the_rest_stays_for_others():
    lim = PerClientLimit(8, 0.5)
    assert all(lim.try_take(1, "a") for _ in range(4))
    assert not lim.try_take(1, "a") and lim.refusal(1, "a") == "share"
    assert lim.held == 4 and lim.held_by("a") == 4
    assert all(lim.try_take(1, "b") for _ in range(4))  # the victim gets the rest
    assert lim.refusal(1, "c") == "total" and not lim.try_take(1, "c")
    lim.give(1, "a")
    assert lim.try_take(1, "c")  # freed by anyone: taken by anyone under their share
    assert lim.clients() == {"a": 3, "b": 4, "c": 1}
    for client, n in lim.clients().items():
        lim.give(n, client)
    assert lim.held == 0 and lim.clients() == {} and lim.peak == 8


def test_refused_take_changes_nothing_and_unkeyed_takers_count_against_the_total_only():
    lim = PerClientLimit(4, 0.5)
    assert lim.try_take(2, "a") and not lim.try_take(1, "a")
    assert lim.held == 2 and lim.held_by("a") == 2
    assert lim.try_take(2, None) and lim.held == 4 and lim.held_by(None) == 0
    assert lim.refusal(1, None) == "total"
    lim.give(2, None)
    assert lim.held == 2 and lim.clients() == {"a": 2}


def test_a_client_holding_nothing_is_admitted_alone_over_its_share():
    """Bytes and tokens: one request larger than the share is admitted when its client holds
    nothing (its size is bounded by the per-request limits), not a second one beside it."""
    lim = PerClientLimit(100, 0.5)
    assert lim.try_take(80, "a") and lim.held_by("a") == 80
    assert lim.refusal(1, "a") == "share"
    assert lim.refusal(30, "b") == "total"  # 110 > 100 with something held
    assert lim.try_take(20, "b")
    lim.take(500, "c")  # unconditional: the caller checked the share itself
    assert lim.held == 600 and lim.held_by("c") == 500


def test_share_message_names_the_client_the_setting_and_the_numbers():
    lim = PerClientLimit(8, 0.5)
    for _ in range(4):
        lim.try_take(1, "ipv4:10.0.0.1")
    assert lim.share_message("calls in progress", "max_concurrent_calls", "ipv4:10.0.0.1") == (
        "client ipv4:10.0.0.1 holds 4 calls in progress, its share of max_concurrent_calls (8 x max_client_share = 4); retry later")


@pytest.mark.parametrize(("peer", "key"), [
    ("ipv4:10.1.2.3", "ipv4:10.1.2.3"),
    ("ipv6:[2001:db8:1:2::17]", "ipv6:2001:db8:1:2::/64"),
    ("ipv6:[2001:db8:1:2:ffff::1]", "ipv6:2001:db8:1:2::/64"),  # the same /64: one share
    ("ipv6:[::ffff:10.1.2.3]", "ipv4:10.1.2.3"),  # IPv4-mapped: the IPv4 client it is
    ("ipv6:[fe80::1%eth0]", "ipv6:fe80::/64"),
    ("unix:/tmp/sock", "unix:/tmp/sock"),
    ("unknown", "unknown"),
    ("ipv6:[not-an-address]", "ipv6:[not-an-address]"),
    ("ipv4:127.0.0.1", "loopback"),  # every loopback address is one client (issue 49)
    ("ipv4:127.45.6.7", "loopback"),
    ("ipv6:[::1]", "loopback"),
    ("ipv6:[::ffff:127.0.0.2]", "loopback"),
    ("ipv6:%5B::1%5D", "loopback"),  # as gRPC's context.peer() names it
    ("ipv6:%5B::ffff:10.1.2.3%5D", "ipv4:10.1.2.3"),
    ("ipv6:%5B2001:db8:1:2::17%5D", "ipv6:2001:db8:1:2::/64"),
    ("ipv4:not-an-address", "ipv4:not-an-address"),
])
def test_share_key_is_the_address_an_ipv6_slash_64_or_loopback(peer, key):
    assert share_key(peer) == key


def test_identities_key_a_token_holder_apart_from_a_stranger_at_the_same_address():
    ids = Identities("s3cret")
    assert ids.key("ipv4:127.0.0.1", "Bearer s3cret") == "token@loopback"
    assert ids.key("ipv4:127.0.0.9", b"Bearer s3cret") == "token@loopback"  # gRPC metadata may be bytes
    assert ids.key("ipv4:127.0.0.2", "Bearer wrong") == "loopback"  # a wrong token is no identity
    assert ids.key("ipv4:127.0.0.3") == "loopback"
    assert ids.key("ipv4:10.0.0.5", "Bearer s3cret") == "token@ipv4:10.0.0.5"
    assert ids.key("ipv4:10.0.0.5", None, certificate="worker-1") == "cert:worker-1@ipv4:10.0.0.5"
    assert Identities(None).key("ipv4:127.0.0.4", "Bearer s3cret") == "loopback"  # no token configured


def test_byte_budget_share_per_client():
    b = ByteBudget(100, 0.5)
    assert b.share == 50
    assert b.try_take(40, "a") and b.try_take(10, "a") and not b.try_take(1, "a")
    assert b.refusal(1, "a") == "share" and not b.has_room_for("a") and b.has_room_for("b")
    assert b.refused_message(1, "a") == ("client a has 50 request bytes in flight, this call adds 1, its share 50 "
                                         "(max_inflight_request_bytes 100 x max_client_share); retry later")
    assert b.try_take(50, "b") and not b.has_room and b.refusal(1, "c") == "total"
    assert b.refused_message(1, "c", what="this request", where=" on the server") == (
        "100 request bytes in flight on the server, this request adds 1, limit 100 (max_inflight_request_bytes); retry later")
    b.give(50, "a")
    assert b.held == 50 and b.held_by("a") == 0 and b.has_room_for("a")
    assert b.try_take(10) and b.held == 60  # the old API: no client, the total only
    b.give(10)
    b.give(50, "b")
    assert b.held == 0 and b.peak == 100


def test_byte_budget_wait_room_for_a_client_returns_once_its_share_has_room():
    async def main():
        b = ByteBudget(100, 0.5)
        b.try_take(50, "a")
        waiter = asyncio.ensure_future(b.wait_room("a"))
        b.try_take(10, "b")
        b.give(10, "b")  # room in the total, none in a's share
        await asyncio.sleep(0.05)
        assert not waiter.done()
        b.give(1, "a")
        await asyncio.wait_for(waiter, 5)
        return b.has_room_for("a")

    assert asyncio.run(main())


def test_settings_bound_the_share():
    assert TeacherSettings().max_client_share == 0.5
    assert TeacherSettings(max_client_share=1).max_client_share == 1
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValueError, match="max_client_share"):
            TeacherSettings(max_client_share=bad)
    with pytest.raises(ValueError, match="request_receive_timeout_s"):
        TeacherSettings(request_receive_timeout_s=0)
    with pytest.raises(ValueError, match="max_health_watches"):
        TeacherSettings(max_health_watches=0)


def test_tokens_in_flight_share_keys_on_the_address_whatever_the_client_calls_itself():
    """The service's share of max_queue_tokens (tokens in flight) is the address's: a client that
    renames itself (x-eopd-client) per request still meets it; another address does not."""
    state = ServerState(settings=TeacherSettings(device="cpu", max_queue_tokens=1000), metrics=TeacherMetrics(), engine=None)
    service = TeacherService(state)
    with service._in_flight("id:a", 400, "ipv4:10.0.0.1"), service._in_flight("id:b", 100, "ipv4:10.0.0.1"):
        with pytest.raises(Overloaded, match=r"client ipv4:10.0.0.1 has 500 tokens in flight, this request adds 1, its share "
                                             r"of max_queue_tokens \(1000 x max_client_share = 500\)"):
            with service._in_flight("id:c", 1, "ipv4:10.0.0.1"):
                pass
        with service._in_flight("id:d", 500, "ipv4:10.0.0.2"):
            assert state.tokens.clients() == {"ipv4:10.0.0.1": 500, "ipv4:10.0.0.2": 500}
    assert state.tokens.held == 0 and state.inflight_tokens == {}
