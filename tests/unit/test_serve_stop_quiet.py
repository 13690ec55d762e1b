"""A stop with streams open cancels their connections' tasks; Python 3.11's asyncio stream protocol then
logged each CancelledError as 'Exception in callback' with a traceback at ERROR, one per frontend on every
Ctrl-C. During a stop (omni.api.serve) that is one INFO line; other errors keep asyncio's own handling."""

from __future__ import annotations

import asyncio
import logging

from omni.api.serve import _quiet_cancel


def test_a_cancelled_callback_during_a_stop_is_one_info_line_and_other_errors_still_reach_asyncio(caplog):
    loop = asyncio.new_event_loop()
    stopping, seen = asyncio.Event(), []
    handle = _quiet_cancel(stopping, lambda lp, ctx: seen.append(ctx["message"]))
    cancelled = {"message": "Exception in callback StreamReaderProtocol.connection_made.<locals>.callback",
                 "exception": asyncio.CancelledError()}
    try:
        with caplog.at_level(logging.INFO, logger="omni.api.serve"):
            handle(loop, cancelled)                        # not stopping: asyncio's (here: recorded)
            stopping.set()
            handle(loop, cancelled)                        # stopping: one INFO line
            handle(loop, {"message": "boom", "exception": RuntimeError("x")})
    finally:
        loop.close()
    assert seen == [cancelled["message"], "boom"]
    lines = [r for r in caplog.records if r.name == "omni.api.serve"]
    assert [r.levelno for r in lines] == [logging.INFO] and "task was cancelled" in lines[0].getMessage()
