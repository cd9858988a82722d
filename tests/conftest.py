"""Suite-wide fixtures."""

from __future__ import annotations

import pytest
from _harness import close_pools


@pytest.fixture(autouse=True, scope="module")
def _shared_pools_per_module():
    """Shared worker pools (``get_pool``) live for one test module, not the session.

    Every test makes process groups (meshes) that live as long as the worker; over the whole
    suite the long-lived workers reached ~600 gloo threads each and used CPU while idle, which
    made the tests after them up to 10x slower (the suite took 45 minutes instead of 15)."""
    yield
    close_pools()
