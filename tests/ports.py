"""A free TCP port for a test's rendezvous, that the kernel hands no one else meanwhile.

Binding port 0 and closing it returns a port of the kernel's ephemeral range, which it may hand
to any outgoing connection before the rendezvous binds it: with 16 xdist workers running gloo and
NCCL tests at once on a GPU machine, one did (EADDRINUSE). Ports below that range are only ever
taken by a process binding them by number, so each worker takes its own block of them, in turn
from a random start (a port a finished test left in TIME_WAIT is passed over: it does not bind).
"""

import itertools
import os
import random
import socket
from pathlib import Path

LOWEST = 10_000  # most services listen below this (one in use above it is passed over anyway)
BLOCKS = 64  # one per xdist worker (gw0, gw1, ...); more workers share blocks


def ephemeral_start() -> int:
    """The first port the kernel hands out by itself (Linux's default where it is not told)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _block() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    width = (ephemeral_start() - LOWEST) // BLOCKS
    start = LOWEST + (int(worker) if worker.isdigit() else 0) % BLOCKS * width
    return range(start, start + width)


_turn = itertools.count(random.randrange(1 << 16))


def _binds(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port that binds now, of this worker's block; successive calls give different ones."""
    block = _block()
    for _ in block:
        port = block[next(_turn) % len(block)]
        if _binds(port):
            return port
    raise RuntimeError(f"no port of {block.start}-{block.stop - 1} binds on 127.0.0.1")
