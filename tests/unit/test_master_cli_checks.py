"""`omni master` refuses bad flags before anything starts: one line naming the flag, exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from omni.master.registry import Registry
from tests.e2e.harness import REPO


def omni(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omni.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("ttl", [float("inf"), float("nan"), 0.0, -1.0])
def test_the_registry_refuses_a_lease_that_never_expires(ttl):
    """inf and nan passed the `<= 0` check: no replica of such a master ever went DEAD."""
    with pytest.raises(ValueError, match=r"lease_ttl_s must be > 0 and finite"):
        Registry(lease_ttl_s=ttl)


def test_omni_master_refuses_a_lease_ttl_that_is_not_finite():
    """typer's min=0.1 let inf through (nan it refuses): the master ran with leases that never expired."""
    try:
        r = omni("master", "--port", "0", "--lease-ttl", "inf", timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("omni master --lease-ttl inf started (killed after 30 s)")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == "omni master: --lease-ttl must be finite seconds (>= 0.1), got inf", r.stderr
