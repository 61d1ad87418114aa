"""Ports the test harness hands out: each pytest-xdist worker draws from its
own slice, and a port comes with the ``PORT_SPAN - 1`` ports above it free."""

from __future__ import annotations

import socket

from vllm_afd_dev.harness import generate
from vllm_afd_dev.harness.generate import PORT_SPAN, free_port


def spans(worker: str, monkeypatch, draws: int = 300) -> set[int]:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    ports = [free_port() for _ in range(draws)]
    return {p for port in ports for p in range(port, port + PORT_SPAN)}


def test_two_workers_never_hand_out_neighbouring_ports(monkeypatch):
    first, second = spans("gw0", monkeypatch), spans("gw1", monkeypatch)
    assert min(len(first), len(second)) > 100 * PORT_SPAN  # many distinct draws
    assert not first & second


def test_a_port_whose_span_holds_a_listener_is_passed_over(monkeypatch):
    busy = free_port()
    spare = next(p for p in iter(free_port, None) if abs(p - busy) >= PORT_SPAN)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", busy + PORT_SPAN - 1))
        listener.listen()
        draws = iter([busy, spare])
        monkeypatch.setattr(generate.random, "choice", lambda _: next(draws))
        assert free_port() == spare
