"""A job's submit-time preparation kept for its run (omni/api/jobs.py): a job's check runs its route's own work
up to the stages (a chat's templating and audio decoding, on the frontend's one tokenizer thread) to refuse a bad
body at submit; the run hands that result to the route handler instead of doing the work again. Jobs run on the
frontend that accepted them, in this process, so the result is at hand; one not kept is prepared again."""

from __future__ import annotations

from typing import Any, Callable

from starlette.requests import Request

# The ASGI scope key under which a job hands its route handler the check's result.
PREPARED = "omni.job_prepared"


def prepared(request: Request) -> Any:
    """What the job check of this request's body returned at submit, for its route handler to use in place of
    preparing the body again; None: prepare it (a client's request, or a job whose result was not kept)."""
    return request.scope.get(PREPARED)


class _Cell:
    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


class Kept:
    """Check results kept for their jobs' runs, at most `limit` at once: decoded audio is up to 2.4x its body
    (float32 at 16 kHz), and a frontend already holds the bodies of all its queued jobs."""

    def __init__(self, limit: int):
        self.limit = limit
        self._cells: set[_Cell] = set()

    def __len__(self) -> int:
        return len(self._cells)

    def keep(self, value: Any) -> tuple[Callable[[], Any], Callable[[], None]]:
        """(take, drop) for one job: take() gives `value` once (None if it was not kept, or after), drop() lets
        it go (the job ended without running)."""
        cell = _Cell(value) if value is not None and len(self._cells) < self.limit else None
        if cell is not None:
            self._cells.add(cell)

        def drop() -> None:
            if cell is not None:
                self._cells.discard(cell)
                cell.value = None

        def take() -> Any:
            value = cell.value if cell is not None else None
            drop()
            return value

        return take, drop
