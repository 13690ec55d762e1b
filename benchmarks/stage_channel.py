"""The real stage channel, frontend <-> stage replica process: ZMQ DEALER/ROUTER + CURVE vs LocalChannel.

A child process runs a real StageWorker (its loop, codecs, token check) around a tiny engine that
emits one token per request per step; this process holds the frontend's end, the very classes the
orchestrator uses (StageChannel, LocalStageChannel) on an asyncio loop (uvloop when installed, as
the frontends run). Two round trips, each timed one at a time, carriers alternating in blocks so
load from other processes falls on both alike. CPU per round trip (process CPU time of each end,
all its threads: libzmq's I/O threads count) is the part that load does not inflate:

    ping:    call("ping") -> Utility -> the worker's control -> UtilityResult (about 60 bytes each way)
    request: post(AddRequest, 1 token) -> engine step -> Output back (about 120 / 200 bytes)

    .venv/bin/python benchmarks/stage_channel.py          # --quick (default, about 10 s)
    .venv/bin/python benchmarks/stage_channel.py --full
    .venv/bin/python benchmarks/stage_channel.py --json   # one JSON document on stdout
    .venv/bin/python benchmarks/stage_channel.py --compare ../main   # before/after: that checkout's omni
        # and this one's, in turns (3 runs each, alternating), one table

`--tree DIR` runs omni from another checkout (both ends); `--compare` uses it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import select
import subprocess
import sys
import time
from pathlib import Path


def _tree() -> Path:
    """--tree DIR, read before omni is imported: whose omni both ends run."""
    argv = sys.argv[1:]
    for i, a in enumerate(argv):
        if a.startswith("--tree="):
            return Path(a.split("=", 1)[1]).resolve()
        if a == "--tree" and i + 1 < len(argv):
            return Path(argv[i + 1]).resolve()
    return Path(__file__).resolve().parents[1]


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.stats import pct  # noqa: E402  (this checkout's, whichever tree --tree runs)

REPO = _tree()
sys.path.insert(0, str(REPO))

from omni.engines.base import SamplingParams  # noqa: E402
from omni.stage import messages as m  # noqa: E402

GOAL_US = 50.0
QUICK = (10, 1000)    # blocks per carrier, round trips per block
FULL = (10, 2000)
RUN_DEADLINE_S = 600

CHILD = """
import sys
import time
from omni.config import StageConfig
from omni.engines.base import Engine, EngineOutput
from omni.stage.worker import StageWorker

class OneToken(Engine):
    def __init__(self):
        self.reqs = []
    def add_request(self, r):
        self.reqs.append(r.request_id)
    def abort(self, rid):
        pass
    def step(self):
        outs = [EngineOutput(request_id=rid, token_ids=[7], finished=True, finish_reason="length")
                for rid in self.reqs]
        self.reqs = []
        return outs
    def has_unfinished(self):
        return bool(self.reqs)
    def stats(self):
        return {"cpu_s": time.process_time()}

w = StageWorker(StageConfig(stage_id=0, engine="one"), OneToken(), token=sys.argv[1], replica_id="bench",
                local_channel=True)
print(w.endpoint, w.local_endpoint, flush=True)
w.run()
"""


def new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


async def measure(blocks: int, per_block: int, endpoint: str, local: str, token: str) -> dict:
    import zmq.asyncio

    from omni.orchestrator.channel import StageChannel
    from omni.orchestrator.local_channel import LocalStageChannel
    from omni.stage.local_link import connect_stage

    waiting: dict[str, asyncio.Future] = {}

    def on_message(ch, msg) -> None:
        fut = waiting.pop(msg.request_id, None)
        if fut is not None:
            fut.set_result(msg)

    kw = dict(replica_id="bench", stage_id=0, token=token, on_message=on_message)
    ctx = zmq.asyncio.Context()
    link = connect_stage(local, token)
    if link is None:
        raise SystemExit(f"no local connection to {local}")
    chans = {"zmq": StageChannel(ctx, frontend_id="bench-zmq", endpoint=endpoint, **kw),
             "local": LocalStageChannel(link, frontend_id="bench-local", endpoint=local, **kw)}
    for ch in chans.values():
        ch.start()
        assert (await asyncio.wait_for(ch.welcomed, 30)).ok
    loop = asyncio.get_running_loop()
    n = iter(range(1 << 62))

    async def ping(ch) -> float:
        t0 = time.perf_counter()
        await ch.call("ping", timeout=30)
        return time.perf_counter() - t0

    async def request(ch) -> float:
        rid = f"r{next(n)}"
        fut = waiting[rid] = loop.create_future()
        t0 = time.perf_counter()
        ch.post(m.AddRequest(request_id=rid, prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=1)))
        await fut       # no wait_for here (its cost is the harness's, not omni's): the whole run has a deadline
        return time.perf_counter() - t0

    async def stage_cpu() -> float:
        return (await chans["local"].call("stats"))["cpu_s"]

    samples = {(k, c): [] for k in ("ping", "request") for c in chans}
    cpu = {key: [0.0, 0.0] for key in samples}     # frontend, stage CPU seconds
    for kind, fn in (("ping", ping), ("request", request)):
        for ch in chans.values():        # warm-up
            for _ in range(100):
                await fn(ch)
        for b in range(blocks):
            order = list(chans) if b % 2 == 0 else list(chans)[::-1]
            for c in order:
                stage0, fe0 = await stage_cpu(), time.process_time()
                samples[kind, c].extend([await fn(chans[c]) for _ in range(per_block)])
                fe1 = time.process_time()
                stage1 = await stage_cpu()
                cpu[kind, c][0] += fe1 - fe0
                cpu[kind, c][1] += stage1 - stage0
    for ch in chans.values():
        ch.close()
    ctx.term()
    return samples, cpu


def table(samples: dict, cpu: dict) -> list[dict]:
    """One row per (round trip, carrier) from the round trips' seconds and (frontend, stage) CPU seconds."""
    rows = []
    for (kind, carrier), xs in samples.items():
        rows.append({"round_trip": kind, "carrier": carrier, "n": len(xs), "p50_us": round(pct(xs, 0.5) * 1e6, 1),
                     "p99_us": round(pct(xs, 0.99) * 1e6, 1), "mean_us": round(sum(xs) / len(xs) * 1e6, 1),
                     "frontend_cpu_us": round(cpu[kind, carrier][0] / len(xs) * 1e6, 1),
                     "stage_cpu_us": round(cpu[kind, carrier][1] / len(xs) * 1e6, 1)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="fewer round trips (default)")
    mode.add_argument("--full", action="store_true", help="more round trips")
    ap.add_argument("--json", action="store_true", help="print one JSON document and nothing else")
    ap.add_argument("--tree", help="run omni from this checkout (default: the one holding this script)")
    ap.add_argument("--compare", metavar="DIR", help="before/after: DIR's omni, then this checkout's, in turns")
    args = ap.parse_args()
    if args.compare:
        compare(Path(args.compare).resolve(), args)
        return
    blocks, per_block = FULL if args.full else QUICK
    token = secrets.token_hex(16)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    child = subprocess.Popen([sys.executable, "-c", CHILD, token], stdout=subprocess.PIPE, text=True, env=env)
    load = [os.getloadavg()[0]]
    t0 = time.monotonic()
    try:
        if not select.select([child.stdout], [], [], 60)[0]:
            raise SystemExit("the stage worker did not start within 60 s")
        endpoint, local = child.stdout.readline().split()
        loop = new_loop()
        samples, cpu = loop.run_until_complete(asyncio.wait_for(
            measure(blocks, per_block, endpoint, local, token), RUN_DEADLINE_S))
        loop_name = type(loop).__module__.split(".")[0]
        loop.close()
    finally:
        child.kill()
        child.wait(10)
    load.append(os.getloadavg()[0])
    rows = table(samples, cpu)
    ratios = {}
    for kind in ("ping", "request"):
        z, lo = (next(r for r in rows if r["round_trip"] == kind and r["carrier"] == c) for c in ("zmq", "local"))
        ratios[kind] = {"zmq_over_local_p50": round(z["p50_us"] / lo["p50_us"], 2),
                        "local_p50_under_goal": lo["p50_us"] < GOAL_US}
    doc = {"benchmark": "stage_channel", "mode": "full" if args.full else "quick", "event_loop": loop_name,
           "loadavg_1m": load, "seconds": round(time.monotonic() - t0, 1), "goal_us": GOAL_US,
           "rows": rows, "ratios": ratios}
    if args.json:
        print(json.dumps(doc, indent=1))
        return
    print(f"stage channel round trips ({doc['mode']}, {loop_name} loop), load average "
          f"{load[0]:.2f} -> {load[1]:.2f}, {doc['seconds']} s")
    print(f"{'round trip':<10} {'carrier':<8} {'n':>6} {'p50 us':>9} {'p99 us':>9} {'mean us':>9} "
          f"{'CPU us: frontend':>17} {'stage':>7}")
    for r in rows:
        print(f"{r['round_trip']:<10} {r['carrier']:<8} {r['n']:>6} {r['p50_us']:>9} {r['p99_us']:>9} "
              f"{r['mean_us']:>9} {r['frontend_cpu_us']:>17} {r['stage_cpu_us']:>7}")
    for kind, r in ratios.items():
        print(f"{kind}: ZMQ p50 / local p50 = {r['zmq_over_local_p50']}x; local p50 < {GOAL_US:g} us: "
              f"{'yes' if r['local_p50_under_goal'] else 'no'}")


COMPARE_RUNS = 3


def compare(before: Path, args: argparse.Namespace) -> None:
    """Run this script on `before`'s omni and on this checkout's in turns; the local carrier's rows."""
    here = Path(__file__).resolve().parents[1]
    runs = []
    for i in range(COMPARE_RUNS * 2):
        tree = (before, here)[i % 2]
        cmd = [sys.executable, __file__, "--json", "--tree", str(tree)] + (["--full"] if args.full else [])
        doc = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout)
        runs.append({"tree": "before" if tree == before else "after", "loadavg_1m": doc["loadavg_1m"],
                     "rows": [r for r in doc["rows"] if r["carrier"] == "local"]})
    doc = {"benchmark": "stage_channel", "compare": {"before": str(before), "after": str(here)},
           "goal_us": GOAL_US, "runs": runs}
    if args.json:
        print(json.dumps(doc, indent=1))
        return
    print(f"stage channel on LocalChannel, before ({before}) / after ({here}), runs alternating")
    print(f"{'run':<7} {'load 1m':<11} {'round trip':<10} {'p50 us':>8} {'p99 us':>9} {'CPU us: frontend':>17} "
          f"{'stage':>7}")
    for run in runs:
        load = "-".join(f"{x:.1f}" for x in run["loadavg_1m"])
        for r in run["rows"]:
            print(f"{run['tree']:<7} {load:<11} {r['round_trip']:<10} {r['p50_us']:>8} {r['p99_us']:>9} "
                  f"{r['frontend_cpu_us']:>17} {r['stage_cpu_us']:>7}")


if __name__ == "__main__":
    main()
