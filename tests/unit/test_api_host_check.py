"""DNS rebinding: a page on a domain its attacker re-points at 127.0.0.1 is same-origin to the browser, so it
could put a keyless frontend to sleep, list its jobs and run the model; the Origin check saw nothing (Origin and
Host both named the page's domain). On a loopback listener a route no key guards now answers only a loopback
name, an IP literal, this host's name or --allowed-hosts (omni/api/browser.py: host_refusal)."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from omni.api.app import build_app
from omni.api.browser import allowed_host_names, host_refusal
from omni.netaddr import is_loopback_ip
from omni.api.limits import HttpLimits
from omni.errors import ConfigError
from tests.unit.api_fakes import FakeOrchestrator, assert_error, chat_body, served_in_thread, tokenizer  # noqa: F401
from tests.unit.test_cli import HEADLESS, omni, planned_frontends  # noqa: F401 (a fixture)


def _served(tokenizer, **kw):
    orch = FakeOrchestrator(tokenizer, "hello world")
    limits = kw.pop("limits", HttpLimits())
    app = build_app(orch, tokenizer, served_model_name="tiny", max_model_len=128, limits=limits, **kw)
    return orch, served_in_thread(app, limits)


def _get(addr, path, host, **kw):
    return httpx.get(f"http://{addr[0]}:{addr[1]}{path}", headers={"Host": host, **kw.pop("headers", {})}, **kw)


def _post(addr, path, host, **kw):
    return httpx.post(f"http://{addr[0]}:{addr[1]}{path}", headers={"Host": host, **kw.pop("headers", {})}, **kw)


@pytest.mark.parametrize("path", ["/v1/models", "/v1/omni/jobs", "/v1/omni/is_sleeping"])
@pytest.mark.parametrize("host", ["evil.example", "evil.example:8091", "EVIL.example.", "localhost.evil.example"])
def test_a_rebound_domain_is_refused_reads_and_writes(tokenizer, path, host):
    orch, server = _served(tokenizer)
    with server as addr:
        err = assert_error(_get(addr, path, host), 403, param="Host", contains="DNS rebinding")
        assert err["code"] == "host_not_allowed" and "--allowed-hosts" in err["message"]
        assert_error(_post(addr, "/v1/omni/sleep", host, headers={"Origin": f"http://{host}"}), 403, param="Host")
        assert_error(_post(addr, "/v1/chat/completions", host, json=chat_body()), 403, param="Host")
    assert orch.sleeping is False and orch.requests == []


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:8091", "localhost.", "app.localhost:8091",
                                  "127.0.0.1:8091", "127.1.2.3", "[::1]:8091", "10.0.0.5:80",
                                  socket.gethostname()])
def test_loopback_names_ip_literals_and_this_hosts_name_pass(tokenizer, host):
    orch, server = _served(tokenizer)
    with server as addr:
        assert _get(addr, "/v1/models", host).status_code == 200
        assert _post(addr, "/v1/omni/sleep", host).status_code == 200
    assert orch.sleeping is True


def test_allowed_hosts_lets_a_proxys_names_through(tokenizer):
    """nginx's `proxy_set_header Host $host` in front of a server on 127.0.0.1."""
    limits = HttpLimits(allowed_hosts=("API.example", ".corp.example"))
    _, server = _served(tokenizer, limits=limits)
    with server as addr:
        for host in ("api.example", "api.example:443", "corp.example", "a.b.corp.example"):
            assert _get(addr, "/v1/models", host).status_code == 200, host
        for host in ("evil.example", "xcorp.example", "api.example.evil"):
            assert_error(_get(addr, "/v1/models", host), 403, param="Host")
    _, server = _served(tokenizer, limits=HttpLimits(allowed_hosts=("*",)))
    with server as addr:
        assert _get(addr, "/v1/models", "evil.example").status_code == 200


def test_a_server_with_a_key_is_not_checked(tokenizer):
    """A page cannot know the key; what no key guards (/health, /metrics ...) answers anyone there, as it always
    did (a proxy's health check with its public Host included)."""
    orch, server = _served(tokenizer, api_key="k")
    with server as addr:
        assert_error(_post(addr, "/v1/omni/sleep", "evil.example"), 401)
        r = _post(addr, "/v1/omni/sleep", "evil.example", headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and orch.sleeping is True
        for path in ("/health", "/ping", "/metrics", "/version", "/openapi.json"):
            assert _get(addr, path, "api.example.com").status_code == 200, path


def test_only_a_loopback_connection_is_checked():
    scope = {"server": ("192.0.2.7", 8091), "headers": [(b"host", b"evil.example")], "path": "/v1/models"}
    assert host_refusal(scope, frozenset()) is None   # a wide listener's names are the operator's
    for address in ("127.0.0.1", "::1", "::ffff:127.0.0.1", "127.9.9.9"):
        assert host_refusal({**scope, "server": (address, 8091)}, frozenset()) is not None, address
        assert is_loopback_ip(address)
    assert host_refusal({**scope, "server": None}, frozenset()) is None   # a unix socket: no address
    assert host_refusal({**scope, "server": ("127.0.0.1", 1), "headers": []}, frozenset()) is None   # HTTP/1.0
    assert not is_loopback_ip("::ffff:192.0.2.7") and not is_loopback_ip("not an address")
    assert "api.example" in allowed_host_names(["Api.Example:8443"])


@pytest.mark.parametrize("hosts", [("",), ("a b",), ("http://a.example/",), ("http:",), ("[::1",), ("a/b",),
                                   ("a,b",), ("*a.example",), tuple(f"h{i}" for i in range(65))])
def test_a_bad_allowed_hosts_is_refused_naming_the_flag(hosts):
    with pytest.raises(ConfigError, match="--allowed-hosts"):
        HttpLimits(allowed_hosts=hosts)


def test_the_flag_reaches_the_frontends(planned_frontends):
    from omni.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "smollm2", "--port", "0", "--allowed-hosts", "api.example", ".corp.example"])
    assert e.value.code == 0
    limits = [json.loads(c.argv[c.argv.index("--http-limits") + 1]) for c in planned_frontends]
    assert limits and all(d["allowed_hosts"] == ["api.example", ".corp.example"] for d in limits)


def test_the_flag_is_refused_with_headless():
    r = omni(*HEADLESS, "--allowed-hosts", "api.example")
    assert r.returncode != 0 and "--allowed-hosts" in r.stderr and "Traceback" not in r.stderr


def test_names_the_hosts_file_gives_a_loopback_address_pass(tmp_path):
    """RHEL's localhost.localdomain, Debian's `127.0.1.1 host.domain host`: only this host's administrator
    writes them. `omni serve --host NAME` prints http://NAME:PORT, which had answered 403."""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost localhost.localdomain localhost4  # comment\n127.0.1.1 Box.Lan box\n"
                     "::1 ip6-localhost\n10.0.0.5 public.example\n# 127.0.0.1 commented.example\n")
    names = allowed_host_names((), str(hosts))
    assert {"localhost.localdomain", "localhost4", "box.lan", "box", "ip6-localhost"} <= names
    assert not {"public.example", "commented.example"} & names
    assert allowed_host_names((), str(tmp_path / "none"))   # no file: this host's own name still


@pytest.mark.parametrize("host, refused", [("api.corp.example", False), ("corp.example", False),
                                           ("api.corp.example:443", False), ("xcorp.example", True)])
def test_a_star_dot_entry_takes_the_subdomains(host, refused):
    scope = {"server": ("127.0.0.1", 8091), "headers": [(b"host", host.encode())], "path": "/v1/models"}
    assert (host_refusal(scope, allowed_host_names(["*.corp.example"])) is not None) is refused


@pytest.mark.parametrize("host", ["[::1]evil.example", "localhost:80@evil.example", "localhost:", "[::1]:x",
                                  "localhost:8091:1"])
def test_a_host_that_is_not_name_and_port_is_refused(host):
    scope = {"server": ("127.0.0.1", 8091), "headers": [(b"host", host.encode())], "path": "/v1/models"}
    assert host_refusal(scope, allowed_host_names(())) is not None
