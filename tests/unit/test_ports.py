from __future__ import annotations

import socket

import pytest

from kvmesh.mesh import ports
from kvmesh.mesh.ports import PortError, free_port, free_ports, is_reserved


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_free_port_is_bindable_and_not_reserved():
    port = free_port()
    assert 0 < port < 65536
    assert not is_reserved(port)
    assert _bindable(port)


def test_free_ports_distinct():
    got = free_ports(8)
    assert len(got) == len(set(got)) == 8
    assert not any(is_reserved(p) for p in got)
    assert free_ports(0) == []


def test_reserved_range_bounds():
    assert is_reserved(12300) and is_reserved(17000) and is_reserved(15000)
    assert not is_reserved(12299) and not is_reserved(17001)


class _FakeSock:
    def __init__(self, port: int, closed: list[int]):
        self.port, self.closed = port, closed

    def getsockname(self):
        return ("127.0.0.1", self.port)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.closed.append(self.port)


def test_reserved_and_repeated_ports_are_skipped(monkeypatch):
    handed = iter([13000, 40000, 40000, 16999, 40001])
    closed: list[int] = []
    monkeypatch.setattr(ports, "_bind_ephemeral", lambda host: _FakeSock(next(handed), closed))
    assert free_ports(2) == [40000, 40001]
    assert sorted(closed) == [13000, 16999, 40000, 40000, 40001]  # all released at the end


def test_gives_up_when_only_reserved_ports(monkeypatch):
    monkeypatch.setattr(ports, "_bind_ephemeral", lambda host: _FakeSock(14000, []))
    with pytest.raises(PortError):
        free_port()


def test_negative_n_rejected():
    with pytest.raises(ValueError):
        free_ports(-1)
