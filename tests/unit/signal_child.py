"""A StageWorker in its own process, busy with one long request, stopped by signals
(run by test_signals.py): prints its endpoint, then `stopped` when its loop ends."""

from omni.config import StageConfig
from omni.engines.base import EngineRequest, SamplingParams
from omni.signals import StopRequest
from omni.stage.worker import StageWorker
from tests.unit.test_stage_worker import CountEngine

stop = StopRequest().install()
engine = CountEngine()
engine.add_request(EngineRequest(request_id="long", prompt_token_ids=[0],
                                 sampling=SamplingParams(max_tokens=10**9)))
w = StageWorker(StageConfig(stage_id=0, engine="count"), engine, stop_request=stop)
w._reqs["long"] = None   # held by nobody: the loop steps it until the stop
w._idle.idle = lambda reqs, held: []   # no InFlight to expire (omni/stage/expiry.py)
print("ready", flush=True)
w.run(grace_s=0.2)
print("stopped", flush=True)
