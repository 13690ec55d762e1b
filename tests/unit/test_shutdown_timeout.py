"""vLLM's --shutdown-timeout N on `omni serve`: at a stop the API frontends take no new requests and let in-flight
ones run for up to N s while the stages serve them, then end open streams (0: at once; unset: the 5 s grace).
It was refused on a torch pipeline ("no stage of this pipeline takes it") and went, unused, into a vLLM stage's
engine args; and a connection made during a frontend's stop sat in the shared listener's queue unanswered."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from omni import config as cfg
from omni.api.limits import HttpLimits
from omni.api.serve import bind_socket, serve
from omni.config_stage_checks import unused_engine_arg
from omni.errors import ConfigError
from omni.launcher import Child, LaunchPlan, Launcher
from tests.unit.test_cli import HEADLESS, omni, planned_frontends  # noqa: F401 (a fixture)

pytestmark = pytest.mark.anyio


def test_the_flag_reaches_the_frontends(planned_frontends):
    """Before: `omni serve smollm2 --shutdown-timeout 30` failed with 'no stage of this pipeline takes it'."""
    from omni.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "smollm2", "--port", "0", "--shutdown-timeout", "30"])
    assert e.value.code == 0
    limits = [json.loads(c.argv[c.argv.index("--http-limits") + 1]) for c in planned_frontends]
    assert limits and all(d["shutdown_timeout"] == 30 for d in limits)


@pytest.mark.parametrize("args, message", [
    (["serve", "smollm2", "--shutdown-timeout", "-1", "--dry-run"], "--shutdown-timeout must be a whole number"),
    (["serve", "smollm2", "--shutdown-timeout", "2.5", "--dry-run"], "'--shutdown-timeout'"),
    ([*HEADLESS, "--shutdown-timeout", "5"], "--shutdown-timeout: not with --headless"),
])
def test_bad_or_misplaced_values_are_refused_by_name(args, message):
    r = omni(*args)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_a_stage_engine_arg_is_refused():
    """A vLLM stage's engine would drain at omni's own 3 s engine stop, after the frontends drained already."""
    assert "omni serve --shutdown-timeout" in unused_engine_arg({"shutdown_timeout": 5})
    with pytest.raises(ConfigError, match="--shutdown-timeout must be a whole number"):
        HttpLimits(shutdown_timeout=1.5)


def test_drain_times():
    """(seconds streams run on after the stop, Hypercorn's grace): a second more for the closing events."""
    from omni.api.serve import drain_times

    assert drain_times(None, 5.0) == (4.0, 5.0)     # unset: today's grace
    assert drain_times(30, 5.0) == (30.0, 31.0)
    assert drain_times(0, 5.0) == (0.0, 1.0)       # at once


async def _slow(request):
    await asyncio.sleep(float(request.query_params["s"]))
    return PlainTextResponse("done")


async def test_a_stop_refuses_new_connections_and_lets_in_flight_requests_finish():
    app = Starlette(routes=[Route("/slow", _slow)])
    listener = bind_socket()            # handed in, as the launcher hands the frontends its listener
    port = listener.getsockname()[1]
    stop = asyncio.Event()
    server = asyncio.create_task(serve(app, sock=listener, shutdown_event=stop,
                                       limits=HttpLimits(shutdown_timeout=3)))
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            for _ in range(100):
                try:
                    await c.get("/slow", params={"s": 0})
                    break
                except httpx.ConnectError:
                    await asyncio.sleep(0.05)
            in_flight = asyncio.create_task(c.get("/slow", params={"s": 1.5}))
            await asyncio.sleep(0.3)
            stop.set()
            await asyncio.sleep(0.3)
            # before: the connection was accepted by the kernel and never answered (the listener stayed open)
            with pytest.raises(OSError):
                _, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 2)
                w.close()
            r = await in_flight
            assert (r.status_code, r.text) == (200, "done")
    finally:
        stop.set()
        await asyncio.wait_for(server, 10)
        listener.close()


# A frontend that, once stopped, tries the launcher's port and takes 1.5 s to drain.
FRONTEND = """
import signal, socket, sys, threading, time
stopped = threading.Event()
signal.signal(signal.SIGTERM, lambda *a: stopped.set())
print("ready", file=sys.stderr, flush=True)
stopped.wait(30)
time.sleep(0.3)
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=2).close()
    print("accepted", file=sys.stderr, flush=True)
except OSError:
    print("refused", file=sys.stderr, flush=True)
time.sleep(1.2)
"""


def test_the_launcher_waits_out_the_drain_with_its_listener_closed():
    """Before: the frontend was killed at the launcher's grace (here 0.5 s), and its port still took connections."""
    plan = LaunchPlan(cfg.load("smollm2"), stages=[], host_master=False, port=0,
                      http_limits=HttpLimits(shutdown_timeout=3))
    launcher = Launcher(plan)
    launcher._listener = launcher._bind_http()
    child = Child("api0", "frontend", [sys.executable, "-c", FRONTEND, str(launcher.http_port)])
    launcher.children.append(child)
    child.start()
    deadline = time.monotonic() + 30
    while "ready" not in child.tail and time.monotonic() < deadline:
        time.sleep(0.05)
    launcher.shutdown(grace_s=0.5)
    assert child.proc.returncode == 0, list(child.tail)
    assert "refused" in child.tail, list(child.tail)
