"""dqcoll.cli.ports: the launchers' rendezvous port."""

from __future__ import annotations

import socket

import pytest

from dqcoll.cli import ports


def _free_now(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_port_is_free_and_below_the_ephemeral_range() -> None:
    low, high = ports.ephemeral_range()
    assert 0 < low <= high < 65536
    picked = {ports.rendezvous_port() for _ in range(20)}
    for port in picked:
        assert ports.LOWEST_PORT <= port < low, (port, low)
        assert _free_now(port)
    assert len(picked) > 1  # random, not one fixed port every launcher would share


def test_a_taken_port_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Candidates that cannot be bound are passed over."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        draws = iter([busy, busy])

        class Pick:
            def randrange(self, low: int, high: int) -> int:
                return next(draws, low + 7)

        monkeypatch.setattr(ports.random, "SystemRandom", Pick)
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (busy + 2000, 60999))
        monkeypatch.setattr(ports, "LOWEST_PORT", busy - 1000 if busy > 2000 else 1025)
        port = ports.rendezvous_port()
        assert port != busy and _free_now(port)


def test_falls_back_to_the_kernels_pick(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no room below the ephemeral range, the port is ``bind(0)``'s without a random draw:
    a free port inside the kernel's ephemeral range."""
    low, high = ports.ephemeral_range()  # the machine's range, where bind(0) picks

    class NoDraws:
        def randrange(self, low: int, high: int) -> int:
            raise AssertionError(f"drew from [{low}, {high}) with no room below the range")

    monkeypatch.setattr(ports.random, "SystemRandom", NoDraws)
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.LOWEST_PORT + 10, 60999))
    port = ports.rendezvous_port()
    assert low <= port <= high and _free_now(port), (port, low, high)


def test_falls_back_when_every_candidate_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """When all ``attempts`` candidates below the range are taken, the port is ``bind(0)``'s: a
    free port inside the kernel's ephemeral range, not the taken one."""
    low, high = ports.ephemeral_range()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        draws = []

        class AlwaysBusy:
            def randrange(self, low: int, high: int) -> int:
                draws.append(busy)
                return busy

        monkeypatch.setattr(ports.random, "SystemRandom", AlwaysBusy)
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.LOWEST_PORT + 1024, 60999))
        port = ports.rendezvous_port(attempts=5)
        assert len(draws) == 5
        assert port != busy and low <= port <= high and _free_now(port), (port, busy, low, high)


def test_unreadable_range_reads_as_linux_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unreadable range file gives Linux's default range."""
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", "/nonexistent/ip_local_port_range")
    assert ports.ephemeral_range() == (32768, 60999)
