"""`omni serve --tls-cert/--tls-key/--tls-ca`: the master it hosts speaks TLS (mTLS with a CA), and every
process that connects to a master (the launcher, stage and frontend children, a headless stage) does so
with the TLS files, by path. Bad files are refused at start-up naming the flag; a certificate the client
cannot verify is a final error naming the address and the CA."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from omni.errors import ConfigError, OmniError
from omni.master.auth import TlsFiles, TlsRefused, serve_tls
from omni.master.client import MasterClient
from omni.master.configdiff import hash_config
from omni.master.server import MasterServer
from tests.certs import make_certs
from tests.e2e.harness import REPO

pytest.importorskip("cryptography")

CFG = {"model": "tiny", "stages": [{"stage_id": 0, "engine_args": {}}]}
HASH = hash_config(CFG)


@pytest.fixture
def certs(tmp_path):
    return make_certs(tmp_path)


@pytest.fixture
def planned(monkeypatch) -> dict:
    """`omni serve` only plans: its LaunchPlan and the children it would start land here."""
    from omni.launcher import Launcher

    out: dict = {}

    def plan_only(self):
        out["plan"] = self.plan
        self._plan_children()
        out["children"] = list(self.children)
        self.shutdown()
        return 0

    monkeypatch.setattr(Launcher, "run", plan_only)
    return out


def _serve(*args: str):
    from typer.testing import CliRunner

    from omni.cli import app

    port = [] if "--headless" in args else ["--port", "0"]     # a headless stage serves no HTTP: refused there
    return CliRunner().invoke(app, ["serve", "smollm2", *port, *args])


def _child_tls(child) -> TlsFiles | None:
    from omni import children

    a = children.parser().parse_args(child.argv[3:])
    return TlsFiles(a.tls_cert, a.tls_key, a.tls_ca) if a.tls else None


def test_single_command_mtls_the_master_gets_the_files_and_every_child_connects_with_them(planned, certs):
    r = _serve("--tls-cert", certs["server"], "--tls-key", certs["server_key"], "--tls-ca", certs["ca"])
    assert r.exit_code == 0, r.output
    files = TlsFiles(certs["server"], certs["server_key"], certs["ca"])
    assert planned["plan"].master_tls == files and planned["plan"].client_tls == files
    kids = planned["children"]
    assert {c.kind for c in kids} == {"stage", "frontend"}
    key = open(certs["server_key"]).read()
    for c in kids:
        assert _child_tls(c) == files, c.argv          # paths, absolute: each child reads the files
        assert not any(key.strip() in a for a in c.argv) and key.strip() not in str(c.env)


def test_tls_without_a_ca_the_children_verify_with_the_system_cas(planned, certs):
    r = _serve("--tls-cert", certs["server"], "--tls-key", certs["server_key"])
    assert r.exit_code == 0, r.output
    assert planned["plan"].master_tls == TlsFiles(certs["server"], certs["server_key"])
    assert planned["plan"].client_tls == TlsFiles()
    assert all(_child_tls(c) == TlsFiles() for c in planned["children"])


def test_without_tls_flags_nothing_changes(planned):
    r = _serve()
    assert r.exit_code == 0, r.output
    assert planned["plan"].master_tls is None and planned["plan"].client_tls is None
    assert all(_child_tls(c) is None for c in planned["children"])


def test_headless_group_connects_with_the_files(planned, certs):
    r = _serve("--stage-id", "0", "--headless", "--num-replicas", "2", "--omni-master-address", "127.0.0.1",
               "--omni-master-port", "1", "--tls-ca", certs["ca"], "--tls-cert", certs["client"],
               "--tls-key", certs["client_key"])
    assert r.exit_code == 0, r.output
    files = TlsFiles(certs["client"], certs["client_key"], certs["ca"])
    assert planned["plan"].master_tls is None and planned["plan"].client_tls == files
    assert len(planned["children"]) == 2 and all(_child_tls(c) == files for c in planned["children"])


def test_headless_stage_in_the_cli_process_gets_the_files(monkeypatch, certs):
    from omni import cli_argv
    from omni.stage import main as stage_main

    seen = {}
    monkeypatch.setattr(cli_argv, "reexec_with_env", lambda env: None)
    monkeypatch.setattr(stage_main, "run_stage", lambda config, stage_id, opts, engine_flags: seen.update(o=opts) or 0)
    r = _serve("--stage-id", "0", "--headless", "--omni-master-address", "127.0.0.1", "--omni-master-port", "1",
               "--tls-ca", certs["ca"])
    assert r.exit_code == 0, r.output
    assert seen["o"].tls == TlsFiles(ca=certs["ca"])


def test_single_command_replica_address_reaches_the_stages(planned):
    """--omni-replica-address did nothing in single-command mode (the one the wildcard warning names)."""
    from omni import children

    r = _serve("--omni-replica-address", "10.1.2.3", "--omni-token", "t0ken")   # beyond loopback: needs one
    assert r.exit_code == 0, r.output
    assert planned["plan"].replica_address == "10.1.2.3"
    stages = [c for c in planned["children"] if c.kind == "stage"]
    assert stages and all(children.parser().parse_args(c.argv[3:]).replica_address == "10.1.2.3" for c in stages)


@pytest.mark.parametrize("case, message", [
    ("missing", "--tls-cert /nonexistent/cert.pem: cannot read it: No such file or directory"),
    ("not_pem", "--tls-key {server}: not a PEM private key"),
    ("other_key", "--tls-key {client_key}: not the private key of --tls-cert {server}"),
    ("ca_alone", "--tls-cert and --tls-key: the master this command runs needs both"),
    ("bad_ca", "--tls-ca {server_key}: not a PEM certificate"),
    ("encrypted", "--tls-key {encrypted}: an encrypted key"),
])
def test_bad_files_are_refused_at_start_naming_the_flag(tmp_path, certs, case, message):
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(open(certs["server_key"], "rb").read(), None)
    certs["encrypted"] = str(tmp_path / "encrypted.pem")
    open(certs["encrypted"], "wb").write(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"pw")))
    args = {"encrypted": (certs["server"], certs["encrypted"], None),
            "missing": ("/nonexistent/cert.pem", certs["server_key"], None),
            "not_pem": (certs["server"], certs["server"], None),
            "other_key": (certs["server"], certs["client_key"], None),
            "ca_alone": (None, None, certs["ca"]),
            "bad_ca": (certs["server"], certs["server_key"], certs["server_key"])}[case]
    with pytest.raises(ConfigError) as e:
        serve_tls(*args, hosts_master=True)
    assert message.format(**certs) in str(e.value)


def test_headless_needs_cert_and_key_together(certs):
    with pytest.raises(ConfigError, match="--tls-cert and --tls-key go together"):
        serve_tls(certs["client"], None, certs["ca"], hosts_master=False)
    assert serve_tls(None, None, certs["ca"], hosts_master=False) == (None, TlsFiles(ca=certs["ca"]))


@pytest.mark.parametrize("hosts_master", [True, False])
def test_an_empty_file_is_refused_by_name(certs, hosts_master):
    """An empty --tls-* read as unset: the head's master ran plaintext, a headless stage connected without TLS."""
    for args, flag in (((certs["server"], "", None), "--tls-key"), ((None, None, ""), "--tls-ca"),
                       (("", "", certs["ca"]), "--tls-cert")):
        with pytest.raises(ConfigError, match=f"^{flag} is empty; give a PEM file's path, or leave it unset"):
            serve_tls(*args, hosts_master=hosts_master)


def test_cli_refuses_a_bad_file_with_one_line_exit_2(certs):
    r = subprocess.run([sys.executable, "-m", "omni.cli", "serve", "smollm2", "--tls-cert", certs["server"],
                        "--tls-key", "/nonexistent/key.pem", "--dry-run"], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == "omni: error: --tls-key /nonexistent/key.pem: cannot read it: No such file or directory"


@pytest.fixture
def tls_master(certs):
    server = MasterServer(CFG, HASH, token="t", tls=TlsFiles(certs["server"], certs["server_key"], certs["ca"]))
    server.start()
    yield server
    server.stop(grace=0.2)


def test_headless_stage_asks_the_master_over_tls(tls_master, certs):
    """master_refusal (before the engine load) reaches the TLS master with the stage's files: the config
    differs, and the master says so."""
    from omni import config as cfg
    from omni.stage.main import StageOptions, master_refusal

    config = cfg.load("smollm2")
    tls = TlsFiles(certs["client"], certs["client_key"], certs["ca"])
    said = master_refusal(config, 0, StageOptions(tls_master.address, token="t", tls=tls))
    assert said and f"differs from the master's at {tls_master.address}" in said
    # a CA that does not verify the master: refused before the engine load, not after the registration's wait
    said = master_refusal(config, 0, StageOptions(tls_master.address, token="t", tls=TlsFiles(ca=certs["client"])))
    assert said and f"TLS: its certificate does not verify with --tls-ca {certs['client']}" in said


def test_frontend_child_hands_the_files_to_the_frontend(monkeypatch, tmp_path, certs):
    from omni import children, frontend

    seen = {}
    monkeypatch.setattr(frontend, "main_from_args", lambda config_json, **kw: seen.update(kw) or 0)
    (tmp_path / "c.json").write_text("{}")
    assert children.main(["frontend", "--config", str(tmp_path / "c.json"), "--master", "127.0.0.1:1",
                          "--tls", "--tls-ca", certs["ca"]]) == 0
    assert seen["tls"] == TlsFiles(ca=certs["ca"])


def test_frontend_clients_connect_with_the_files(tls_master, certs):
    """serve_frontend's two clients (sync and asyncio) are built with the files it is given."""
    import asyncio

    from omni.master.client import AsyncMasterClient

    tls = TlsFiles(certs["client"], certs["client_key"], certs["ca"])
    assert MasterClient(tls_master.address, token="t", tls=tls).get_status().config_hash == HASH

    async def ask():
        c = AsyncMasterClient(tls_master.address, token="t", tls=tls)
        try:
            return (await c.get_status()).config_hash
        finally:
            await c.close()
    assert asyncio.run(ask()) == HASH


def test_a_certificate_the_client_cannot_verify_names_the_ca_and_is_final(tls_master, tmp_path, certs):
    (tmp_path / "other").mkdir()
    other = make_certs(tmp_path / "other")
    c = MasterClient(tls_master.address, token="t", tls=TlsFiles(certs["client"], certs["client_key"], other["ca"]),
                     timeout_s=3)
    with pytest.raises(TlsRefused) as e:
        c.get_status()
    assert f"omni master at {tls_master.address}: TLS: its certificate does not verify with --tls-ca {other['ca']}" \
        in str(e.value)
    # the registration's wait (wait_for_ready) ends at once too, not at its deadline
    stop = threading.Event()
    with pytest.raises(TlsRefused):
        c.register("STAGE", 0, config_hash=HASH, wait_s=30, stop=stop)
    c.close()


def test_an_address_not_in_the_certificate_is_named(tmp_path):
    certs = make_certs(tmp_path, server_names=("omni.test",))
    server = MasterServer(CFG, HASH, tls=TlsFiles(certs["server"], certs["server_key"]))
    server.start()
    try:
        with pytest.raises(TlsRefused, match=r"TLS: 127\.0\.0\.1 is not a name or IP address in the master's "
                                             r"certificate"):
            MasterClient(server.address, tls=TlsFiles(ca=certs["ca"]), timeout_s=3).get_status()
    finally:
        server.stop(grace=0.2)


def test_tls_to_a_plaintext_master_is_final(certs):
    server = MasterServer(CFG, HASH)
    server.start()
    try:
        with pytest.raises(TlsRefused, match=f"omni master at {server.address}: TLS: it does not answer with TLS"):
            MasterClient(server.address, tls=TlsFiles(ca=certs["ca"]), timeout_s=3).get_status()
    finally:
        server.stop(grace=0.2)


def test_plaintext_to_a_tls_master_says_so(tls_master):
    with pytest.raises(OmniError, match="if it runs with --tls-cert, connect with --tls-ca"):
        MasterClient(tls_master.address, token="t", timeout_s=3).get_status()


@pytest.mark.parametrize("names, usage, message", [
    (("localhost", "127.0.0.1"), ("serverAuth",), "needs the clientAuth key usage besides serverAuth"),
    (("omni.test",), None, "127.0.0.1 is not a name or IP address in the master's certificate"),
])
def test_a_head_whose_processes_cannot_use_the_certificate_fails_at_once(tmp_path, names, usage, message):
    from omni import config as cfg
    from omni.launcher import LaunchPlan, Launcher

    certs = make_certs(tmp_path, server_names=names, server_usage=usage)
    files = TlsFiles(certs["server"], certs["server_key"], certs["ca"])
    launcher = Launcher(LaunchPlan(cfg.load("smollm2"), stages=[], api_server_count=0, master_tls=files,
                                   client_tls=files.client_view()))
    try:
        with pytest.raises(OmniError, match="this host's processes cannot connect to its TLS master") as e:
            launcher.start_master()
        assert message in str(e.value)
    finally:
        launcher.shutdown()


@pytest.mark.parametrize("files, hint", [
    (None, "a master with TLS closes plaintext connections: if it runs with --tls-cert, connect with --tls-ca"),
    ("ca", "a master that requires client certificates closes the connection when none is presented"),
])
def test_a_stage_connecting_the_wrong_way_to_a_tls_master_is_told_why(tls_master, certs, files, hint):
    """Plaintext to a TLS master, or no client certificate for an mTLS one: the master closes every
    connection. master_refusal says so before the engine load (after one retry, as a master that is
    starting may close one), and the registration's wait ends naming it, not only 'no answer'."""
    from omni import config as cfg
    from omni.stage.main import StageOptions, master_refusal

    tls = TlsFiles(ca=certs["ca"]) if files else None
    said = master_refusal(cfg.load("smollm2"), 0, StageOptions(tls_master.address, token="t", tls=tls))
    assert said and hint in said
    with MasterClient(tls_master.address, token="t", tls=tls) as c, pytest.raises(OmniError) as e:
        c.register("STAGE", 0, config_hash=HASH, wait_s=2.5, stop=threading.Event())
    assert "no answer within 2.5 s" in str(e.value) and hint in str(e.value)


def test_a_master_closing_one_connection_is_asked_again(monkeypatch):
    """One closed connection (a master still starting) is not a refusal: the second answer counts."""
    from omni import config as cfg
    from omni.master.errors import ClosedByMaster
    from omni.stage.main import StageOptions, master_refusal

    real, calls = MasterClient.get_status, []

    def get_status(self, *a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise ClosedByMaster("cannot reach the omni master: Socket closed")
        return real(self, *a, **kw)
    monkeypatch.setattr(MasterClient, "get_status", get_status)
    config = cfg.load("smollm2")
    server = MasterServer(config.to_dict(), config.config_hash(), token="t")
    server.start()
    try:
        assert master_refusal(config, 0, StageOptions(server.address, token="t")) is None
    finally:
        server.stop(grace=0.2)
    assert len(calls) == 2


def test_a_plaintext_headless_stage_fails_before_its_engine_loads(tls_master):
    host, port = tls_master.address.rsplit(":", 1)
    r = subprocess.run([sys.executable, "-m", "omni.cli", "serve", "smollm2", "--stage-id", "0", "--headless",
                        "--omni-master-address", host, "--omni-master-port", port], cwd=REPO,
                       env={**os.environ, "OMNI_TOKEN": "t"}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "a master with TLS closes plaintext connections" in r.stderr and "the engine is not loaded" in r.stderr
    assert "loading engine" not in r.stderr


@pytest.mark.parametrize("error, refused", [
    ("closed", True), ("tls", True), ("unavailable", False)])
def test_the_launcher_refuses_a_master_its_processes_cannot_reach_by_error_type(error, refused):
    """The launcher's own TLS check goes by the error's type, not its wording: a connection the master
    closed fails the start whatever its details say; a master not answering yet is waited for."""
    from types import SimpleNamespace

    from omni.errors import Unavailable
    from omni.launcher import Launcher
    from omni.master.errors import ClosedByMaster

    raised = {"closed": ClosedByMaster("cannot reach the omni master: connection reset by peer"),
              "tls": TlsRefused("omni master: TLS: certificate does not verify"),
              "unavailable": Unavailable("cannot reach the omni master: no answer before the deadline")}[error]

    def status():
        raise raised
    launcher = SimpleNamespace(_status=status, plan=SimpleNamespace(master_tls=TlsFiles(ca=None)))
    if refused:
        with pytest.raises(OmniError, match="cannot connect to its TLS master"):
            Launcher._check_own_master(launcher)
    else:
        assert Launcher._check_own_master(launcher) is None
