"""Fault injection against real omni processes: how fast a fault is seen, what it costs, how fast
the pipeline recovers. The LM -> pooler pipeline with the real SmolLM2 weights.

    .venv/bin/python benchmarks/faults.py            # --quick: standalone master + headless stages
    .venv/bin/python benchmarks/faults.py --vllm     # also SIGKILL a vLLM stage (three vLLM start-ups)
    .venv/bin/python benchmarks/faults.py --full     # --vllm, plus `omni serve` (2 LM replicas): SIGKILL,
                                                     # frontend kill
    .venv/bin/python benchmarks/faults.py --json     # {"faults": [{"fault", "detect_s", "failed", "hung",
                                                     #   "completed", "recover_s", "false_deaths", "orphans",
                                                     #   "took_s", "skipped"}, ...], "loadavg": [1, 5, 15 min]}

Wall time of the default (--quick) on the shared 2-core box: 43 s at load average 2-3, 101 s at 8,
146 s at 14 (the headless deployment's start-up 6-28 s, the replacement pooler of sigkill_stage
9-40 s); printed at the end, and in the JSON (`seconds`);
--vllm adds about 2.5 minutes (232 s in all at load 7: three vLLM start-ups), --full a few more.
Rows a run leaves out stay in the table and the JSON, with `skipped` saying why.

Columns: detect_s, fault -> the master publishing the new state (SUSPECT/DEAD/removed; for
restart_master: until every stage is READY on the new master); failed / hung / completed, requests
sent during the fault (hung must be 0: every request has a deadline); recover_s, fault -> the first
request served by the replacement (or by the resumed component; for sigstop_stage: SIGCONT -> READY again;
for sigstop_replay: requests sent to a stopped replica, all done once they moved to the other one).
false_deaths: replicas the master declared DEAD that were not the fault's victim (master_pause:
the master SIGSTOPped for 3 TTLs and more with one pooler, SIGCONT the master only; detect_s: master
resumed -> the stopped pooler DEAD; recover_s: DEAD -> READY again after its SIGCONT). orphans:
processes of a SIGKILLed vLLM stage (EngineCore, Worker, resource tracker) still alive 10 s later
(vllm_kill_bootstrap: while its EngineCore is still in interpreter bootstrap, before omni's entry;
vllm_kill_startup: while its engine loads; vllm_kill_steady: once it serves; detect_s: SIGKILL -> the
last of them gone); those rows need vLLM and `--vllm` or `--full`. took_s: the scenario's own wall
time. skipped: why a row was not run (its figures are then "-" / null). "-": not measured by that fault.
The scenarios themselves live in tests/e2e/test_faults.py, test_lifecycle.py and harness.py and are reused here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e import test_faults as tf            # noqa: E402
from tests.e2e import test_lifecycle as tl         # noqa: E402
from tests.e2e.harness import READY, OmniProcess   # noqa: E402


COLUMNS = ["fault", "detect_s", "failed", "hung", "completed", "recover_s", "false_deaths", "orphans", "took_s",
           "skipped"]


def row(fault: str, detect_s, outcomes, recover_s, false_deaths=None, orphans=None) -> dict:
    c = tf.count(outcomes)
    return {"fault": fault, "detect_s": None if detect_s is None else round(detect_s, 3),
            "failed": c["failed"], "hung": c["hung"], "completed": c["completed"],
            "recover_s": None if recover_s is None else round(recover_s, 3),
            "false_deaths": false_deaths, "orphans": orphans, "took_s": None, "skipped": None}


def skipped(fault: str, why: str) -> dict:
    """A row that was not run: it stays in the table and the JSON, every figure null."""
    return {**dict.fromkeys(COLUMNS), "fault": fault, "skipped": why}


# ------------------------------------------------------------------ headless deployment

async def sigstop(d: tf.Headless) -> dict:
    res = await tf.sigstop_stage(d)
    return row("sigstop_stage", res["detect_s"], res["results"], res["rejoin_s"])


async def sigkill_pooler(d: tf.Headless, n: int = 4) -> dict:
    """SIGKILL one of two pooler replicas while requests run through it; start a replacement."""
    victim = d.stages[2]
    watcher = tf.Watcher(d.address)
    try:
        async with tf.TestOrchestrator(d) as t:
            rep = next(r for r in t.topology.replicas.values() if r.pid == victim.proc.pid)
            tasks = [asyncio.create_task(t.run(max_tokens=24)) for _ in range(n)]
            deadline = time.monotonic() + 60
            while not t.orch.core.by_replica.get(rep.replica_id):   # until the victim holds a request
                if time.monotonic() > deadline or all(x.done() for x in tasks):
                    break
                await asyncio.sleep(0.01)
            t0 = time.monotonic()
            victim.proc.send_signal(signal.SIGKILL)
            ev = await asyncio.to_thread(watcher.wait, lambda e: e[1] == rep.replica_id and
                                         (e[3] in ("SUSPECT", "DEAD") or e[4] == "REMOVED"), 10, "victim gone", t0)
            outcomes = list(await asyncio.gather(*tasks))
            outcomes += [await t.run() for _ in range(2)]
            new = OmniProcess("serve", d.model, "--deploy-config", str(d.config_path), "--stage-id", "1",
                              "--headless", "--omni-master-address", "127.0.0.1",
                              "--omni-master-port", str(d.master_port))
            d.stages[2] = new
            await asyncio.to_thread(new.wait_for, READY, 120)
            recover_s = None
            for _ in range(20):   # bounded: concurrent requests spread over both poolers
                outcomes += await asyncio.gather(*(t.run() for _ in range(3)))
                try:   # requests_total rides on heartbeats (one a second)
                    await asyncio.to_thread(tf.wait_until, lambda: any(
                        r.pid == new.proc.pid and r.requests_total > 0 for r in tf.status(d.address).replicas),
                        1.5, "a heartbeat")
                except AssertionError:
                    continue
                recover_s = time.monotonic() - t0
                break
    finally:
        watcher.close()
    return row("sigkill_stage", ev[0] - t0, outcomes, recover_s)


async def replay_stopped(d: tf.Headless) -> dict:
    res = await tf.replay_off_stopped_pooler(d)
    return row("sigstop_replay", res["detect_s"], res["outcomes"], res["elapsed_s"])


async def master_pause(d: tf.Headless) -> dict:
    res = await tf.pause_master(d)
    return row("master_pause", res["dead_after_resume_s"], res["outcomes"], res["rejoin_s"],
               false_deaths=len(res["false_deaths"]))


async def restart_master(d: tf.Headless) -> dict:
    res = await tf.restart_master(d)
    return row("restart_master", res["reregistered_s"], [res["first"], *res["results"]], res["recover_s"])


def timed(fn, *args) -> dict:
    t0 = time.monotonic()
    r = fn(*args)
    return {**r, "took_s": round(time.monotonic() - t0, 1)}


def run_headless(folder: Path) -> list[dict]:
    t0 = time.monotonic()
    d = tf.start_headless(folder)
    print(f"headless deployment up in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    try:
        return [timed(asyncio.run, f(d)) for f in (sigstop, replay_stopped, master_pause, sigkill_pooler,
                                                   restart_master)]
    finally:
        d.stop()


# ------------------------------------------------------------------ omni serve deployment

def kill_frontend(d: tf.Served) -> dict:
    """SIGKILL the API frontend with a request in flight; the launcher starts a new one."""
    fe = next(r for r in tf.status(d.master, tf.TOKEN).replicas if r.role == "FRONTEND" and r.state == "READY")
    watcher = tf.Watcher(d.master, tf.TOKEN)
    try:
        with ThreadPoolExecutor(2) as pool:
            out = tf.Outcome()
            fut = pool.submit(tf.stream_chat, d.url, "Count to fifty.", 48, out, tf.API_KEY, 30.0)
            if not out.first_chunk.wait(60):
                raise AssertionError(f"no output before the fault: {out.status} {out.error}")
            t0 = time.monotonic()
            os.kill(fe.pid, signal.SIGKILL)
            ev = watcher.wait(lambda e: e[1] == fe.replica_id and (e[3] in ("SUSPECT", "DEAD") or e[4] == "REMOVED"),
                              10, "frontend gone", t0)
            fut.result(60)
        outcomes = [out]
        recover_s = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            o = tf.stream_chat(d.url, "Say hi.", 4, tf.Outcome(), tf.API_KEY, 30.0)
            if o.status == "completed":
                recover_s = time.monotonic() - t0
                outcomes.append(o)
                break
            time.sleep(0.5)   # a benchmark's retry pace: the port refuses until the new frontend binds
    finally:
        watcher.close()
    return row("kill_frontend", ev[0] - t0, outcomes, recover_s)


WHEN = {"vllm_kill_bootstrap": "bootstrap", "vllm_kill_startup": "startup", "vllm_kill_steady": "steady"}
VLLM_KILLS = tuple(WHEN)
SERVED = ("sigkill_stage_http", "kill_frontend")


def run_vllm_kills() -> list[dict]:
    """SIGKILL a headless vLLM stage in its EngineCore's bootstrap, at start-up and at steady
    state; count what outlives it."""
    if not tl.HAVE_VLLM:
        return [skipped(f, "no vllm") for f in VLLM_KILLS]
    master, address = tl.start_master()
    try:
        rows = []
        for fault, when in WHEN.items():
            t0 = time.monotonic()
            res = tl.sigkill_vllm_stage(address, when)
            r = row(fault, res["clean_s"], [], None, orphans=len(res["orphans"]))
            rows.append({**r, "took_s": round(time.monotonic() - t0, 1)})
        return rows
    finally:
        master.kill()


def run_served(folder: Path) -> list[dict]:
    d = tf.start_served(folder)
    try:
        t0 = time.monotonic()
        res = tf.sigkill_under_load(d)
        r = row("sigkill_stage_http", res["detect_s"], res["outcomes"] + res["after"], res["recover_s"])
        return [{**r, "took_s": round(time.monotonic() - t0, 1)}, timed(kill_frontend, d)]
    finally:
        d.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the headless faults only (the default)")
    ap.add_argument("--vllm", action="store_true", help="also the vLLM stage kills (three vLLM start-ups)")
    ap.add_argument("--full", action="store_true",
                    help="everything: the headless faults, the vLLM stage kills, the `omni serve` faults")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    args = ap.parse_args()
    t0 = time.monotonic()
    os.environ.setdefault("OMNI_TEST", "1")
    with tempfile.TemporaryDirectory(prefix="omni-faults-") as tmp:
        rows = run_headless(Path(tmp))
        if args.vllm or args.full:
            rows += run_vllm_kills()
        else:
            rows += [skipped(f, "needs --vllm") for f in VLLM_KILLS]
        if args.full:
            rows += run_served(Path(tmp))
        else:
            rows += [skipped(f, "needs --full") for f in SERVED]
    load = [round(x, 2) for x in os.getloadavg()]
    seconds = round(time.monotonic() - t0, 1)
    if args.json:
        print(json.dumps({"faults": rows, "loadavg": load, "seconds": seconds}))
        return
    print(f"load average: {load}")
    widths = [20] + [13] * (len(COLUMNS) - 1)
    print(" ".join(f"{c:>{w}}" for c, w in zip(COLUMNS, widths)))
    for r in rows:
        print(" ".join(f"{'-' if r[c] is None else r[c]:>{w}}" for c, w in zip(COLUMNS, widths)))
    print(f"total wall time {seconds} s")
    if any(r["hung"] or r["false_deaths"] or r["orphans"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
