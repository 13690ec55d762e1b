"""Where a token's latency goes: joins the OMNI_LATENCY_TRACE files of one run.

Run a deployment with OMNI_LATENCY_TRACE=DIR (every stage and frontend writes
DIR/<role>-<pid>.jsonl, omni/latency_trace.py), load it (benchmarks/vllm_bench.py
--trace DIR does both), then:

    .venv/bin/python benchmarks/latency_trace_report.py DIR [--json]

Per hop (stage sent -> frontend received -> text handed to the HTTP stream) and per
gap between consecutive tokens of a request: p50/p90/p99/max in ms; outputs whose text
was held back (half a character, a possible stop string); GC pauses over 1 ms; for
/v1/audio/speech requests, each hop to the first audio (`speech_report`, used by
benchmarks/audio.py --trace).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.stats import pct  # noqa: E402


def summary(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "p50": pct(xs, 0.5), "p90": pct(xs, 0.9), "p99": pct(xs, 0.99), "max": max(xs)}


def load(where: str) -> dict[str, list[dict]]:
    events: dict[str, list[dict]] = collections.defaultdict(list)
    for path in glob.glob(os.path.join(where, "*.jsonl")):
        role = os.path.basename(path).split("-")[0]
        with open(path) as f:
            for line in f:
                try:
                    e = json.loads(line)
                except json.JSONDecodeError:
                    continue   # a line cut by a kill
                e["role"] = role
                events[e["p"]].append(e)
    return events


def report(where: str) -> dict:
    ev = load(where)
    per = collections.defaultdict(lambda: collections.defaultdict(list))   # rid -> point -> times
    for point in ("arrived", "added", "core", "sent", "recv", "text", "no_text"):
        for e in ev[point]:
            if point not in ("sent", "core") or e["role"] == "stage0":   # the entry stage's reach the client
                per[e["r"]]["out" if point in ("text", "no_text") else point].append(e.get("at", e["t"]))
    hops = {"request in -> entry stage added": [], "request in -> first text": [],
            "stage sent -> frontend recv": [], "frontend recv -> text": [], "EngineCore made -> text": []}
    gaps = {"stage sends": [], "frontend texts": []}
    for times in per.values():
        sent, recv, out = sorted(times["sent"]), sorted(times["recv"]), sorted(times["out"])
        if times["arrived"] and times["added"]:   # TTFT's part before the engine: HTTP, template, hop
            hops["request in -> entry stage added"].append(1000 * (min(times["added"]) - times["arrived"][0]))
        if times["arrived"] and out:
            hops["request in -> first text"].append(1000 * (out[0] - times["arrived"][0]))
        # All that omni adds to a token after vLLM's EngineCore made it (vLLM stage only).
        hops["EngineCore made -> text"] += [1000 * (b - a) for a, b in zip(sorted(times["core"]), out)]
        hops["stage sent -> frontend recv"] += [1000 * (b - a) for a, b in zip(sent, recv)]
        hops["frontend recv -> text"] += [1000 * (b - a) for a, b in zip(recv, out)]
        # From the second token on: inter-token gaps (the first is the prefill).
        gaps["stage sends"] += [1000 * (b - a) for a, b in zip(sent[1:], sent[2:])]
        gaps["frontend texts"] += [1000 * (b - a) for a, b in zip(out[1:], out[2:])]
    # vLLM stage: from the EngineCore making a step's outputs to the stage holding them as
    # RequestOutputs (ZMQ, vLLM's output thread, the stage loop's wake-up, output processing).
    hops["EngineCore -> stage step done"] = [1000 * (e["t"] - e["at"]) for e in ev["core"]]
    gc = collections.defaultdict(list)
    for e in ev["gc"]:
        gc[f"{e['role']} gen{e['gen']}"].append(e["ms"])
    n_out = len(ev["text"]) + len(ev["no_text"])
    return {"requests": len(per), "outputs": n_out, "held_back_outputs": len(ev["no_text"]),
            "hops_ms": {k: summary(v) for k, v in hops.items()},
            "gaps_ms": {k: summary(v) for k, v in gaps.items()},
            "gc_pauses_ms": {k: summary(v) for k, v in sorted(gc.items())}}


SPEECH_HOPS = ("request in -> talker added", "talker added -> sent (its step)", "talker sent -> code2wav added",
               "code2wav added -> sent (its step)", "code2wav sent -> frontend audio", "request in -> frontend audio")


def speech_report(where: str, since: float = float("-inf"), until: float = float("inf")) -> dict:
    """/v1/audio/speech requests' first audio, hop by hop: the entry (talker) stage's first
    output, the code2wav stage's first output, the frontend handing the audio to the stream.
    Only requests that arrived between `since` and `until` (time.monotonic())."""
    ev = load(where)
    first: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for point in ("arrived", "added", "sent", "audio"):
        for e in ev[point]:
            if not e["r"].startswith("speech-"):
                continue
            key = point if e["role"].startswith("frontend") else f"{e['role']}.{point}"
            t, rid = e.get("at", e["t"]), e["r"].split("/")[0]     # a stage's sub-request: rid/sub
            first[rid][key] = min(t, first[rid].get(key, t))
    hops: dict[str, list[float]] = {k: [] for k in SPEECH_HOPS}
    for t in first.values():
        stages = sorted({k.split(".")[0] for k in t if "." in k})
        if len(stages) != 2 or "arrived" not in t or "audio" not in t or not since <= t["arrived"] <= until:
            continue
        talk, c2w = stages
        chain = [t["arrived"], t.get(f"{talk}.added"), t.get(f"{talk}.sent"), t.get(f"{c2w}.added"),
                 t.get(f"{c2w}.sent"), t["audio"]]
        if None in chain:
            continue
        for name, a, b in zip(SPEECH_HOPS, chain, chain[1:]):
            hops[name].append(1000 * (b - a))
        hops[SPEECH_HOPS[-1]].append(1000 * (t["audio"] - t["arrived"]))
    return {k: summary(v) for k, v in hops.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    a = ap.parse_args()
    if not glob.glob(os.path.join(a.dir, "*.jsonl")):
        print(f"latency_trace_report: no trace files in {a.dir}", file=sys.stderr)
        return 2
    doc = report(a.dir)
    if a.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"{doc['requests']} requests, {doc['outputs']} outputs, {doc['held_back_outputs']} with text held back")
    print(f"{'ms':<34}{'n':>7}{'p50':>9}{'p90':>9}{'p99':>9}{'max':>9}")
    for section in ("hops_ms", "gaps_ms", "gc_pauses_ms"):
        for name, s in doc[section].items():
            label = ("gc " if section == "gc_pauses_ms" else "gap " if section == "gaps_ms" else "") + name
            if s["n"]:
                print(f"{label:<34}{s['n']:>7}" + "".join(f"{s[k]:>9.1f}" for k in ("p50", "p90", "p99", "max")))
    if not doc["gc_pauses_ms"]:
        print("no GC pause over 1 ms")
    speech = speech_report(a.dir)
    if speech[SPEECH_HOPS[-1]]["n"]:
        print("speech, first audio:")
        for name, s in speech.items():
            print(f"  {name:<32}{s['n']:>7}" + "".join(f"{s[k]:>9.1f}" for k in ("p50", "p90", "p99", "max")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
