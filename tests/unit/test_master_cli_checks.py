"""`omni master` and the client commands (status, drain, undrain, sleep, wakeup) refuse bad flags before
anything starts or connects: one line naming the flag, exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from omni.cli import app
from omni.master.registry import Registry
from tests.certs import make_certs
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


@pytest.fixture
def not_pem(tmp_path):
    path = tmp_path / "hostname"
    path.write_text("myhost\n")
    return str(path)


@pytest.mark.parametrize("command", ["status", "drain", "undrain", "sleep", "wakeup"])
def test_client_commands_check_their_tls_files_naming_the_flag(command, not_pem, monkeypatch):
    """They built the credentials unchecked: gRPC's C-core printed its error lines and the message blamed the
    connection. The files are checked as `omni serve` and `omni master` check theirs."""
    monkeypatch.delenv("OMNI_TOKEN", raising=False)
    for flags, message in (
            (["--tls-ca", not_pem], f"omni {command}: --tls-ca {not_pem}: not a PEM certificate"),
            (["--tls-cert", not_pem], f"omni {command}: --tls-cert and --tls-key go together"),
            (["--tls-ca", "/nonexistent/ca.pem"], f"omni {command}: --tls-ca /nonexistent/ca.pem: cannot read it")):
        r = CliRunner().invoke(app, [command, "--master", "127.0.0.1:1", *flags])
        assert r.exit_code == 2, r.output
        lines = r.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(message), r.output


def test_good_client_tls_files_pass_the_check(tmp_path, monkeypatch):
    monkeypatch.delenv("OMNI_TOKEN", raising=False)
    certs = make_certs(tmp_path)
    r = CliRunner().invoke(app, ["status", "--master", "127.0.0.1:1", "--tls-ca", certs["ca"],
                                 "--tls-cert", certs["client"], "--tls-key", certs["client_key"]])
    assert r.exit_code == 2 and "omni status: cannot reach the omni master at 127.0.0.1:1" in r.output, r.output


def test_omni_status_with_a_bad_ca_prints_one_line_and_no_grpc_errors(not_pem):
    r = omni("status", "--master", "127.0.0.1:1", "--tls-ca", not_pem)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"omni status: --tls-ca {not_pem}: not a PEM certificate (no '-----BEGIN CERTIFICATE-----')"], r.stderr


@pytest.mark.parametrize("address, message", [
    ("::1:1", "must be HOST:PORT, got '::1:1' (an IPv6 address goes in brackets: [::1]:1)"),
    ("fe80::1%eth0:5", "(an IPv6 address goes in brackets: [fe80::1%eth0]:5)"),
    ("\x00:1", "omni master address '\\x00:1' holds a control character; give HOST:PORT"),
    ("127.0.0.1:1\n", "holds a control character"),
    ("127.0.0.1:1:2", "must be HOST:PORT, got '127.0.0.1:1:2'"),
    ("h:" + "1" * 5000, "must be HOST:PORT, got 'h:111"),   # int() raised its own ValueError past 4,300 digits
])
def test_a_master_address_grpc_would_misread_is_refused(address, message):
    """gRPC read `::1:1` as the IPv6 address ::0.1.0.1 on port 443 (omni status then tried that), and a NUL
    reached its C core, which printed its own error lines."""
    from omni.errors import BadRequest
    from omni.master.client import check_address

    with pytest.raises(BadRequest) as e:
        check_address(address)
    assert message in str(e.value)
    assert check_address("[::1]:1") == "[::1]:1"


def test_omni_status_names_the_brackets_an_ipv6_master_needs():
    r = CliRunner().invoke(app, ["status", "--master", "::1:1"])
    assert r.exit_code == 2, r.output
    assert r.output.strip() == ("omni status: omni master address must be HOST:PORT, got '::1:1' (an IPv6 address "
                                "goes in brackets: [::1]:1)"), r.output
