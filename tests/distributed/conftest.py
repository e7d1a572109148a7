"""A real local Ray cluster, started once for the whole test session, and a hard time limit per test."""

from __future__ import annotations

import signal

import pytest

from tests.distributed.ray_cluster import ensure_ray

TEST_TIME_LIMIT_S = 300


@pytest.fixture(scope="session")
def ray_cluster():
    ensure_ray()
    import ray

    yield ray


@pytest.fixture(autouse=True)
def time_limit(request):
    """Fail (instead of hanging CI) when a distributed test runs past its limit (`@pytest.mark.limit(s)`)."""
    marker = request.node.get_closest_marker("limit")
    seconds = int(marker.args[0]) if marker else TEST_TIME_LIMIT_S

    def expired(signum, frame):
        raise TimeoutError(f"{request.node.name} ran past its {seconds} s limit")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def pytest_configure(config):
    config.addinivalue_line("markers", "limit(seconds): hard time limit of a distributed test")
