"""Which process listens on a local TCP port, read from Linux' /proc (no connection made).

`eopd run` starts `redis-server` on a port it picked a moment before; another local user may have
taken that port in between. Before it sends the new server its password, `eopd run` proves that the
socket listening on 127.0.0.1:<port> is one of its child's open files: the LISTEN row of
/proc/net/tcp for that address and port names a socket inode, and /proc/<pid>/fd of the child holds
a link `socket:[<inode>]` to it. Nothing is sent to the port before that (local_queue.py).
"""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path

PROC = Path("/proc")
LISTEN = "0A"  # the st column of /proc/net/tcp


def supported() -> bool:
    """Whether this machine has the /proc files `listening_owner_is` reads (Linux)."""
    return (PROC / "net" / "tcp").is_file()


def _hex_address(host: str, port: int) -> str:
    """`host:port` as /proc/net/tcp writes it: the IPv4 address as a native-endian 32-bit hex word."""
    return f"{struct.unpack('=I', socket.inet_aton(host))[0]:08X}:{port:04X}"


def listening_inodes(port: int, host: str = "127.0.0.1") -> set[int]:
    """The inodes of the IPv4 sockets listening on exactly `host:port`."""
    want = _hex_address(host, port)
    inodes = set()
    for line in (PROC / "net" / "tcp").read_text().splitlines()[1:]:
        cols = line.split()
        if len(cols) > 9 and cols[1] == want and cols[3] == LISTEN:
            inodes.add(int(cols[9]))
    return inodes


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process `pid` holds open (empty once it has exited)."""
    inodes = set()
    try:
        fds = os.listdir(PROC / str(pid) / "fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(PROC / str(pid) / "fd" / fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def listening_owner_is(pid: int, port: int, host: str = "127.0.0.1") -> bool:
    """True when the socket listening on `host:port` is held by process `pid` (Linux only)."""
    listening = listening_inodes(port, host)
    return bool(listening) and bool(listening & socket_inodes(pid))
