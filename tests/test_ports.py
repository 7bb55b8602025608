"""The tests' rendezvous ports: never of the range the kernel hands to outgoing connections (a
port from binding 0 was, and a GPU machine's 16 workers took one meanwhile: EADDRINUSE)."""

import socket

import pytest

from ports import ephemeral_start, free_port


@pytest.mark.parametrize("worker", ["gw0", "gw7", "gw63", "gw64", "gw200"])
def test_ports_bind_below_the_ephemeral_range_and_differ(monkeypatch, worker):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == len(ports)
    assert all(1024 < port < ephemeral_start() for port in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_workers_take_disjoint_blocks(monkeypatch):
    seen = {}
    for worker in range(16):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{worker}")
        seen[worker] = {free_port() for _ in range(8)}
    blocks = list(seen.values())
    assert all(a.isdisjoint(b) for i, a in enumerate(blocks) for b in blocks[i + 1:])


def test_a_port_in_use_is_passed_over(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    taken = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", taken))
        s.listen()
        assert taken not in {free_port() for _ in range(400)}
