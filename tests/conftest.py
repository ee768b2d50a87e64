import pytest

from lablib import Cluster


@pytest.fixture(scope="session", params=[2, 4], ids=lambda n: f"ws{n}")
def cluster(request):
    """A pool shared by the tests that leave it healthy (one per world size)."""
    with Cluster(request.param, backend="gloo", timeout=5, quiet=True) as c:
        yield c


@pytest.fixture(scope="session", params=[2, 4], ids=lambda n: f"ws{n}")
def fragile(request):
    """A pool for the failure tests: short timeout, and it must recover from whatever they do."""
    with Cluster(request.param, backend="gloo", timeout=2, quiet=True) as c:
        yield c
