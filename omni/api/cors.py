"""vLLM's CORS flags: --allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials.

vLLM's server answers every origin ("*") unless told otherwise; omni answers none by default, so a page of
another site reads nothing, and its cross-site writes on routes no key guards are refused (browser.py). With
--allowed-origins the frontends answer CORS as vLLM's server does (Starlette's CORSMiddleware, outermost: a
preflight carries no key), and the Origin check lets those origins through.
"""

from __future__ import annotations

from typing import Any

from omni.errors import ConfigError

KEYS = ("allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials")
MAX_ENTRIES, MAX_CHARS = 64, 512


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _strings(value: Any, key: str) -> tuple[str, ...]:
    """vLLM takes a JSON list ('["https://a.example"]'); one bare string is read as a list of one."""
    items = [value] if isinstance(value, str) else value
    if (not isinstance(items, list) or not 0 < len(items) <= MAX_ENTRIES
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_CHARS for s in items)):
        raise ConfigError(f"{_flag(key)} takes a JSON list of 1-{MAX_ENTRIES} non-empty strings "
                          f"(as vLLM's: '[\"https://app.example\"]'), got {str(value)[:200]!r}")
    return tuple(items)


def take(flags: dict[str, Any], headless: bool) -> dict[str, Any]:
    """vLLM's CORS flags popped from the parsed extra flags and checked, as HttpLimits fields ({}: none given)."""
    got = {k: flags.pop(k) for k in KEYS if k in flags}
    if not got:
        return {}
    named = ", ".join(_flag(k) for k in got)
    if headless:
        raise ConfigError(f"{named}: not with --headless (a headless stage runs no HTTP frontend); give "
                          f"{'it' if len(got) == 1 else 'them'} to the head")
    if "allowed_origins" not in got:
        raise ConfigError(f"{named}: needs --allowed-origins (omni answers CORS for no origin unless it names them; "
                          "vLLM's default is '[\"*\"]')")
    out: dict[str, Any] = {k: _strings(got[k], k) for k in KEYS[:3] if k in got}
    if "allow_credentials" in got:
        if not isinstance(got["allow_credentials"], bool):
            raise ConfigError(f"--allow-credentials takes no value (or true / false), got {got['allow_credentials']!r}")
        out["allow_credentials"] = got["allow_credentials"]
    return out


def middleware(limits) -> list:
    """Starlette's CORSMiddleware set as vLLM sets it, when `limits` (HttpLimits) names origins; else none."""
    if not limits.allowed_origins:
        return []
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware

    return [Middleware(CORSMiddleware, allow_origins=list(limits.allowed_origins),
                       allow_methods=list(limits.allowed_methods), allow_headers=list(limits.allowed_headers),
                       allow_credentials=limits.allow_credentials)]
