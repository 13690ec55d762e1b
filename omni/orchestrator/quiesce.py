"""Sleep with vLLM's `mode=wait`: the requests in flight finish, then the stages sleep.

A stage cannot tell a new request from the next piece of one in flight at another stage, and every
frontend holds requests of its own, so the wait is the frontends': the one asked sends QUIESCE through
the master to every live frontend; each refuses new requests (503) and acks once it has none in flight.
Then every stage sleeps with mode=abort (what a stage still holds belongs to requests that have ended),
and a second QUIESCE (hold_s 0) admits again: the asleep stages refuse what comes meanwhile. A gate whose
frontend never lifts it (the one asked died) lifts itself after hold_s."""

from __future__ import annotations

import contextvars
import logging
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any, Callable

from omni.errors import BadRequest, Unavailable

logger = logging.getLogger(__name__)

# Set while a job accepted before a hold runs (api/jobs.py): it is in flight, as a request is, not new.
ACCEPTED: contextvars.ContextVar[bool] = contextvars.ContextVar("omni_accepted", default=False)
POLL_S = 0.02          # the keep-alive thread looks at the frontend's in-flight count this often
MAX_WAIT_S = 560.0     # under the master's 600 s command bound, with the sleep and the lift after it


class Gate:
    """New requests refused while a hold is on: one per sleep with mode=wait (its token -> its end, by
    time.monotonic()), so one sleep's lift leaves another's hold up. Holds are set from the keep-alive thread
    and read on the event loop (the dict is replaced whole)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, loop: Any = None):
        self.clock = clock
        self.loop = loop          # the event loop that admits requests (see on_quiesce)
        self.holds: dict[str, float] = {}
        self._lifts: dict[str, threading.Event] = {}   # a hold's token -> set when it is lifted
        self.closing = threading.Event()

    def closed(self) -> bool:
        now = self.clock()
        return any(now < until for until in self.holds.values())

    def check(self) -> None:
        if self.closed() and not ACCEPTED.get():
            raise Unavailable("the stages are going to sleep (a sleep with mode=wait waits for the requests in "
                              "flight): new requests are refused until they are asleep; wake them after that "
                              "with POST /v1/omni/wakeup")

    def on_command(self, args: dict, in_flight: Callable[[], int]) -> tuple[bool, str] | Future:
        """QUIESCE from the keep-alive thread, which runs a replica's commands one after another: a hold goes
        up at once and its wait runs on a thread of its own, acked when it ends (a Future), so the lift that
        calls it off (the asker's Ctrl-C) is not queued behind the wait it ends."""
        token, hold_s = str(args.get("token", "")), float(args.get("hold_s", 0.0))
        if hold_s <= 0:
            return self._lift(token)
        lifted = self._hold(token, hold_s)
        done: Future = Future()

        def wait() -> None:
            try:
                done.set_result(self._wait(args, hold_s, in_flight, lifted))
            except BaseException as e:   # noqa: BLE001 -- the ack says it; the thread ends either way
                done.set_exception(e)

        threading.Thread(target=wait, name="omni-quiesce-wait", daemon=True).start()
        return done

    def on_quiesce(self, args: dict, in_flight: Callable[[], int]) -> tuple[bool, str]:
        """on_command's answer, waited for: hold the gate, then wait for no request in flight (or lift it)."""
        got = self.on_command(args, in_flight)
        return got.result() if isinstance(got, Future) else got

    def close(self) -> None:
        """The frontend stops: every wait ends now (its ack no longer matters)."""
        self.closing.set()

    def _hold(self, token: str, hold_s: float) -> threading.Event:
        now = self.clock()
        self.holds = {**{t: u for t, u in self.holds.items() if u > now and t != token}, token: now + hold_s}
        # one event per hold: a hold that ran out with no lift (its asker died) leaves none behind
        self._lifts = {t: e for t, e in self._lifts.items() if t in self.holds}
        return self._lifts.setdefault(token, threading.Event())

    def _lift(self, token: str) -> tuple[bool, str]:
        now = self.clock()
        self.holds = {t: u for t, u in self.holds.items() if u > now and t != token}
        lifted = self._lifts.pop(token, None)
        if lifted is not None:
            lifted.set()
        return True, "admitting requests"

    def _wait(self, args: dict, hold_s: float, in_flight: Callable[[], int],
              lifted: threading.Event) -> tuple[bool, str]:
        self._admitted()
        wait_s = min(float(args.get("wait_s", hold_s)), hold_s)
        deadline = self.clock() + wait_s
        while (n := in_flight()) and self.clock() < deadline and not (lifted.is_set() or self.closing.is_set()):
            lifted.wait(POLL_S)
        if lifted.is_set() or self.closing.is_set():
            return False, "called off: the hold was lifted (or the frontend stopped) before the requests ended"
        n = in_flight()
        if n:
            return False, f"{n} request(s) still in flight after {wait_s:g} s"
        return True, "no request in flight"

    def _admitted(self) -> None:
        """Wait one turn of the event loop: a request that passed check() before the hold went up is then
        counted in flight (check and submit run in one step of the loop, with no await between)."""
        if self.loop is None:
            return
        turned = threading.Event()
        try:
            self.loop.call_soon_threadsafe(turned.set)
        except RuntimeError:   # the loop is closed: nothing is admitted any more
            return
        turned.wait(5.0)


def wait_s_for(request_timeout_s: float) -> float:
    """Every request ends within the pipeline's request timeout: waiting a little longer sees them end."""
    return min(request_timeout_s + 5.0, MAX_WAIT_S)


def check_stage_ids(stage_ids: tuple[int, ...], known: list[int]) -> None:
    unknown = sorted(set(stage_ids) - set(known))
    if unknown:
        shown = ", ".join(str(i)[:20] for i in unknown[:8]) + (", ..." if len(unknown) > 8 else "")
        raise BadRequest(f"stage_ids: {shown} not in the pipeline (stages: "
                         f"{', '.join(map(str, known))})")


async def sleep_when_idle(master: Any, level: int, wait_s: float, stage_ids: tuple[int, ...] = (),
                          token: str = "", **sleep_kw: Any) -> tuple[list, list | None]:
    """-> (the frontends' QUIESCE results, the stages' SLEEP results: None when a frontend stayed busy).
    `sleep_kw`: more of the SLEEP's send_command arguments (the CLI's replica_ids, keep_serving)."""
    token = token or uuid.uuid4().hex
    hold = {"hold_s": wait_s + 30.0, "wait_s": wait_s, "token": token}
    try:
        quiet = await master.send_command("QUIESCE", (), hold, timeout_s=wait_s + 10.0)
        if all(r.ok for r in quiet):
            # Once more, to every frontend live now: the holds start again (a long wait must not outlast the
            # first ones), and a frontend that registered meanwhile (a restarted one) holds too. The others
            # are idle and held: they ack at once.
            quiet = await master.send_command("QUIESCE", (), hold, timeout_s=wait_s + 10.0)
        if not all(r.ok for r in quiet):
            return quiet, None
        return quiet, await master.send_command("SLEEP", stage_ids, {"level": level, "mode": "abort"}, timeout_s=60.0,
                                                **sleep_kw)
    finally:
        try:
            await master.send_command("QUIESCE", (), {"hold_s": 0.0, "token": token}, timeout_s=10.0)
        except Exception as e:   # the gates lift themselves after hold_s
            logger.warning("sleep (mode=wait): could not tell the frontends to admit requests again: %s", e)


class SyncMaster:
    """sleep_when_idle's master over a synchronous MasterClient (the CLI's, on a thread of its own)."""

    def __init__(self, client: Any):
        self.client = client

    async def send_command(self, *args: Any, **kw: Any) -> list:
        return self.client.send_command(*args, **kw)
