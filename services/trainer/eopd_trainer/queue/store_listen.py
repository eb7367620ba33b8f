"""Where a torch.distributed store and gloo listen (issue 49 ask 1): on the interface they are given,
never on every interface.

`TCPStore(host, port, is_master=True)` binds `*:port` whatever `host` says; handed a socket already
bound (`master_listen_fd`, the libuv server takes the descriptor over) it listens there only. Gloo's
default device binds the address the machine's hostname resolves to (the external one on most
hosts); `gloo_options(host)` names the address instead (`ProcessGroupGloo.create_device(hostname=)`).
A process that connects to a store listens for gloo on the address it reaches the store from
(`local_address_towards`): the loopback on one node, the interface that routes to the learner on
several."""

from __future__ import annotations

import datetime
import ipaddress
import socket

import torch.distributed as dist


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1, their IPv4-mapped form (::ffff:127.0.0.1) and `localhost`."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host == "localhost"
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def bound_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host:port` (port 0: one the OS picks)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def server_store(host: str, port: int, timeout_s: float, world_size: int | None = None) -> dist.TCPStore:
    """A TCPStore server listening on `host:port` only (see the module doc)."""
    sock = bound_socket(host, port)
    # the store owns the descriptor from here on (it closes it when it is destroyed)
    return dist.TCPStore(host, sock.getsockname()[1], world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=sock.detach(),
                         use_libuv=True)


def local_address_towards(host: str, port: int) -> str:
    """This machine's address on the route to `host:port` (no packet is sent: a UDP socket's
    connect only picks the route)."""
    info = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(info[0], socket.SOCK_DGRAM) as s:
        s.connect(info[4])
        return s.getsockname()[0]


def gloo_options(host: str, timeout_s: float) -> dist.ProcessGroupGloo._Options:
    """Options of a gloo group whose device listens on `host` only."""
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return options
