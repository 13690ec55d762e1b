"""Sleep with vLLM's `mode=wait`: the requests in flight finish, then the stages sleep.

A stage cannot tell a new request from the next piece of one in flight at another stage, and every
frontend holds requests of its own, so the wait is the frontends': the one asked sends QUIESCE through
the master to every live frontend; each refuses new requests (503) and acks once it has none in flight.
Then every stage sleeps with mode=abort (what a stage still holds belongs to requests that have ended),
and a second QUIESCE (hold_s 0) admits again: the asleep stages refuse what comes meanwhile. A gate whose
frontend never lifts it (the one asked died) lifts itself after hold_s."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from omni.errors import BadRequest, Unavailable

logger = logging.getLogger(__name__)

POLL_S = 0.02          # the keep-alive thread looks at the frontend's in-flight count this often
MAX_WAIT_S = 560.0     # under the master's 600 s command bound, with the sleep and the lift after it


class Gate:
    """New requests refused until `until` (time.monotonic()): set from the keep-alive thread, read on the
    event loop (one float, replaced whole)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.until = 0.0

    def check(self) -> None:
        if self.clock() < self.until:
            raise Unavailable("the stages are going to sleep (POST /v1/omni/sleep with mode=wait): new requests "
                              "are refused until they are asleep; POST /v1/omni/wakeup wakes them")

    def on_quiesce(self, args: dict, in_flight: Callable[[], int],
                   stop: threading.Event | None = None) -> tuple[bool, str]:
        """The QUIESCE command (keep-alive thread): hold the gate, then wait for no request in flight."""
        hold_s = float(args.get("hold_s", 0.0))
        if hold_s <= 0:
            self.until = 0.0
            return True, "admitting requests"
        self.until = self.clock() + hold_s
        wait_s = min(float(args.get("wait_s", hold_s)), hold_s)
        deadline = self.clock() + wait_s
        stop = stop or threading.Event()
        while (n := in_flight()) and self.clock() < deadline:
            stop.wait(POLL_S)
        n = in_flight()
        if n:
            return False, f"{n} request(s) still in flight after {wait_s:g} s"
        return True, "no request in flight"


def wait_s_for(request_timeout_s: float) -> float:
    """Every request ends within the pipeline's request timeout: waiting a little longer sees them end."""
    return min(request_timeout_s + 5.0, MAX_WAIT_S)


def check_stage_ids(stage_ids: tuple[int, ...], known: list[int]) -> None:
    unknown = sorted(set(stage_ids) - set(known))
    if unknown:
        raise BadRequest(f"stage_ids: {', '.join(map(str, unknown))} not in the pipeline (stages: "
                         f"{', '.join(map(str, known))})")


async def sleep_when_idle(master: Any, level: int, wait_s: float, stage_ids: tuple[int, ...] = ()) -> tuple[list, list]:
    """-> (the frontends' QUIESCE results, the stages' SLEEP results: [] when a frontend stayed busy)."""
    try:
        quiet = await master.send_command("QUIESCE", (), {"hold_s": wait_s + 30.0, "wait_s": wait_s},
                                          timeout_s=wait_s + 10.0)
        if not all(r.ok for r in quiet):
            return quiet, []
        return quiet, await master.send_command("SLEEP", stage_ids, {"level": level, "mode": "abort"}, timeout_s=60.0)
    finally:
        try:
            await master.send_command("QUIESCE", (), {"hold_s": 0.0}, timeout_s=10.0)
        except Exception as e:   # the gates lift themselves after hold_s
            logger.warning("sleep (mode=wait): could not tell the frontends to admit requests again: %s", e)
