"""What the orchestrator core takes in (events) and hands out (actions).

The core (omni/orchestrator/core.py) never touches a socket: the Orchestrator feeds it
these events and carries out the actions it returns, in order.
"""

from __future__ import annotations

from dataclasses import dataclass

from omni.errors import OmniError
from omni.master.types import ReplicaInfo
from omni.orchestrator.types import PipelineOutput
from omni.stage import messages as m
from omni.transport.base import TensorRef

# ------------------------------------------------------------------ events


@dataclass(frozen=True)
class StageOutput:
    """An output arrived on the channel of `replica_id` (a replica of `stage_id`)."""
    replica_id: str
    stage_id: int
    output: m.Output


@dataclass(frozen=True)
class StageError:
    """A stage replica failed one of its (sub-)requests."""
    replica_id: str
    stage_id: int
    error: m.RequestError


@dataclass(frozen=True)
class ReplicaGone:
    """A replica turned SUSPECT/DEAD or left the topology; `why` ends up in error messages."""
    replica: ReplicaInfo
    why: str


@dataclass(frozen=True)
class Cancel:
    """The request ends early: `error` None is a client abort (client gone, stop string),
    else it fails with `error` (timeout, shutdown, a send the executor could not make)."""
    request_id: str
    error: OmniError | None = None


@dataclass(frozen=True)
class EndText:
    """A stop string ended the request's text while its audio goes on (the frontend matched it)."""
    request_id: str


Event = StageOutput | StageError | ReplicaGone | Cancel | EndText

# ------------------------------------------------------------------ actions


@dataclass(frozen=True)
class Send:
    """Send `message` to `replica` (open a channel to it first if there is none)."""
    request_id: str
    replica: ReplicaInfo
    message: m.AddRequest


@dataclass(frozen=True)
class Free:
    """The producer replica may free these tensors (no consumer will read them again)."""
    replica_id: str
    transport: str
    keys: tuple[int, ...]
    incarnation: str = ""    # the producer that made them (TensorRef.incarnation)


@dataclass(frozen=True)
class AbortStage:
    replica_id: str
    request_ids: tuple[str, ...]
    keep_published: bool = False    # what it sent stays for its readers (messages.Abort)


@dataclass(frozen=True)
class ReleaseHold:
    """The replica may step these held requests again (their first final output is out)."""
    replica_id: str
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class Emit:
    """Hand `output` to the client. With `tensor`, the executor reads it first (into
    `audio_pcm` or `embedding`, by the output's modality); `producer` is the replica that
    published it (a `Free` of it names that replica: keys are unique per producer only)."""
    request_id: str
    output: PipelineOutput
    tensor: TensorRef | None = None
    producer: str = ""


@dataclass(frozen=True)
class Fail:
    request_id: str
    error: OmniError


@dataclass(frozen=True)
class Finished:
    """The request left the core: outcome "ok" | "aborted" | "failed". Always the last
    action of a request; nothing is sent for it afterwards."""
    request_id: str
    outcome: str
    seconds: float


Action = Send | Free | AbortStage | ReleaseHold | Emit | Fail | Finished
