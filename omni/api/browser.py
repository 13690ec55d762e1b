"""What a web page open in the operator's browser can make a frontend do. A page may send "simple"
cross-site requests (no preflight) to 127.0.0.1: a POST with no body, a text/plain body, or a form.
Omni answers no CORS preflight (but for --allowed-origins: cors.py), so a request with an Authorization
header never leaves such a page;
a server without an API key is open to the rest, hence two checks (FrontendMiddleware runs them):
- a JSON route takes only a JSON Content-Type (vLLM's 400 with its message; FastAPI's CVE-2021-32677),
  so a text/plain or form body is never parsed as JSON;
- a state-changing request whose Origin is not the server's own (Host, or X-Forwarded-Host, which a
  page cannot set without a preflight) is a 403 on a route no key guards.
A page on a name its attacker re-points at 127.0.0.1 (DNS rebinding) is same-origin to the browser, so
neither check sees it; its requests name that domain in Host, hence a third (host_refusal): a server with
no API key answers a request that arrives on a loopback address only for a Host that is loopback by name
(localhost, *.localhost), an IP literal, this host's name, an /etc/hosts loopback name, or one of
--allowed-hosts.
"""

from __future__ import annotations

import re
import socket
from urllib.parse import urlsplit

from starlette.responses import Response

from omni.api.errors import error_response
from omni.netaddr import is_ip, is_loopback_ip

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
FORMS = ("multipart/form-data", "application/x-www-form-urlencoded")
_DEFAULT_PORT = {"http": ":80", "https": ":443"}
_PORT = re.compile(r":[0-9]{1,5}")
_ALLOWED = re.compile(r"(\*?\.)?[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*\.?(:[0-9]{1,5})?|\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?")


def _header(scope, name: bytes) -> bytes | None:
    for k, v in scope["headers"]:
        if k == name:
            return v
    return None


def is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def content_type_refusal(scope, *, forms: bool = False) -> Response | None:
    """A body on a JSON route that does not say it is JSON (none said, text/plain, a form unless
    `forms`) is refused before it is read; a request without a body is the route's to judge."""
    length = _header(scope, b"content-length")
    if (length is None or length == b"0") and _header(scope, b"transfer-encoding") is None:
        return None
    raw = _header(scope, b"content-type")
    ctype = raw.decode("latin-1") if raw is not None else ""
    if is_json(ctype) or (forms and ctype.split(";", 1)[0].strip().lower() in FORMS):
        return None
    takes = "application/json" + (" or a form (multipart/form-data, application/x-www-form-urlencoded)" if forms else "")
    got = f"got {ctype[:100]!r}" if raw is not None else "none was sent"
    return error_response(400, f"Unsupported Media Type: Content-Type must be {takes}; {got}",
                          "invalid_request_error", param="Content-Type", code="unsupported_media_type")


def _netloc(value: str, scheme: str) -> str:
    value = value.strip().lower()
    default = _DEFAULT_PORT.get(scheme)
    return value[: -len(default)] if default and value.endswith(default) else value


def origin_refusal(scope, allowed: frozenset[str] = frozenset()) -> Response | None:
    """A state-changing request from another site's page (its Origin is not this server, nor one of
    --allowed-origins: `allowed`) is refused. A request without Origin (curl, SDKs, a same-origin GET) passes."""
    if scope["method"] in SAFE_METHODS:
        return None
    raw = _header(scope, b"origin")
    if raw is None:
        return None
    origin = raw.decode("latin-1")
    if "*" in allowed or origin in allowed:
        return None
    parts = urlsplit(origin) if origin != "null" else None
    if parts is not None and parts.scheme and parts.netloc:
        theirs = _netloc(parts.netloc, parts.scheme)
        for name in (b"host", b"x-forwarded-host"):
            ours = _header(scope, name)
            if ours is not None and _netloc(ours.decode("latin-1").split(",")[0], parts.scheme) == theirs:
                return None
    host = (_header(scope, b"host") or b"").decode("latin-1")
    return error_response(403, f"cross-site request refused: Origin {origin[:200]!r} is not this server "
                               f"({host[:200]!r}), and no API key guards {scope['path']} (a browser app of another "
                               "origin: --allowed-origins, and --api-key to keep other pages out; a proxy that "
                               "rewrites Host passes the Host or X-Forwarded-Host on)",
                          "permission_error", param="Origin", code="cross_site_request")


def _hostname(host: str) -> str:
    """The name in a Host header: lower case, no port, no brackets, no trailing dot. A value that is not
    NAME[:PORT] or [IPv6][:PORT] comes back whole (and matches nothing)."""
    host = host.strip().lower()
    if host.startswith("["):
        inside, _, rest = host[1:].partition("]")
        return inside if not rest or _PORT.fullmatch(rest) else host
    if host.count(":") == 1:
        name, port = host.split(":")
        return name.rstrip(".") if _PORT.fullmatch(":" + port) else host
    return host.rstrip(".")


def allowed_host_names(allowed, hosts_file: str = "/etc/hosts") -> frozenset[str]:
    """--allowed-hosts' names as host_refusal compares them (`*.a.example` as `.a.example`), with this host's
    own name (and its first label) and the names `hosts_file` gives a loopback address (localhost.localdomain,
    Debian's 127.0.1.1 line): only this host's administrator can make those, no page's DNS."""
    own = socket.gethostname().lower().rstrip(".")
    names = {own, own.partition(".")[0], *_loopback_names(hosts_file)}
    for h in allowed:
        names.add(h if h == "*" else _hostname(h.removeprefix("*")))
    return frozenset(names - {""})


def _loopback_names(path: str) -> set[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(1 << 20)
    except OSError:
        return set()
    names: set[str] = set()
    for line in text.splitlines():
        fields = line.partition("#")[0].split()
        if len(fields) > 1 and is_loopback_ip(fields[0]):
            names.update(n.lower().rstrip(".") for n in fields[1:])
    return names


def allowed_host_ok(entry: str) -> bool:
    """An --allowed-hosts entry: `*`, a name (`.a.example` or `*.a.example`: its subdomains too), an IP, a port
    allowed after either."""
    return entry == "*" or bool(_ALLOWED.fullmatch(entry))


def host_refusal(scope, allowed: frozenset[str]) -> Response | None:
    """A request to a loopback address whose Host names some other domain is refused, unless `allowed`
    (allowed_host_names) names it: a browser's page on a rebound domain, or a proxy that forwards a public
    name to a loopback-bound server (which then needs --allowed-hosts). No Host (HTTP/1.0) passes."""
    server = scope.get("server")
    if not server or not is_loopback_ip(str(server[0])) or "*" in allowed:
        return None
    raw = _header(scope, b"host")
    if raw is None:
        return None
    name = _hostname(raw.decode("latin-1"))
    if (name in allowed or name == "localhost" or name.endswith(".localhost") or is_ip(name)
            or any(a.startswith(".") and (name.endswith(a) or name == a[1:]) for a in allowed)):
        return None
    return error_response(403, f"request refused: Host {name[:200]!r} is not a loopback name, this host's name or "
                               f"one of --allowed-hosts, and this server has no API key (on a loopback listener a "
                               "web page on a domain that resolves to 127.0.0.1 could send it: DNS rebinding). A "
                               "proxy that forwards this name: --allowed-hosts NAME; or set --api-key",
                          "permission_error", param="Host", code="host_not_allowed")
