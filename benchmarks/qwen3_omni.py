"""Qwen3-Omni and Qwen2.5-Omni chat with audio: `omni serve` vs the same engines in one process.

The tiny Qwen3-Omni and/or Qwen2.5-Omni (random seeded weights, float32; built into a temp dir
unless a folder is given), greedy thinker and talker with fixed max tokens, so both sides make
the same audio (Qwen2.5's token2wav draws noise: every request carries seed 0).
Streamed chat with `modalities: ["text", "audio"]` at concurrency 1 and 4 (bursts of the
concurrency level, after a warm-up request). Per request: time to the first text token
(TTFT), to the end of the thinker's first sentence (or of its text when it has none), to the
first audio byte (TTFA), to the end; audio seconds; RTF = wall time / audio seconds.
`TTFA-sent` is TTFA minus the first-sentence time: what the speech stages add once a sentence
is there (negative: audio started before the sentence ended, as the talker streams per token).
`text end` is the thinker's last text. Qwen2.5's token2wav decodes each utterance whole, so its
TTFA = the talker's end + one whole decode: compare it with TTFT and `text end` to see the speech
stages' share (the talker steps one text row per frame, so it ends well after the thinker).
The in-process side is benchmarks/qwen3_inprocess.py (one loop stepping the three engines).
Both sides are up at once (the server starts while the in-process engines load) but only one
runs at a time: they alternate burst by burst, each side going first in turn, so both see the
same load on this shared machine. Where the time goes: seconds inside each engine's steps and
CPU seconds (omni: each stage process's and the frontend's, from the master's load reports and
/metrics; in-process: the one process's; vLLM's EngineCore on either side is not counted).

Goals (issues 13, 14): omni's TTFA overhead over in-process < 10% at concurrency 1; at
concurrency 4 omni ahead (lower TTFA p50 and lower aggregate RTF).

    .venv/bin/python benchmarks/qwen3_omni.py                  # --quick, Qwen3-Omni, under 2 minutes
    .venv/bin/python benchmarks/qwen3_omni.py --model qwen25   # Qwen2.5-Omni (--quick under 2 minutes)
    .venv/bin/python benchmarks/qwen3_omni.py --model both     # both, one after the other, one table
    .venv/bin/python benchmarks/qwen3_omni.py --full       # more requests
    .venv/bin/python benchmarks/qwen3_omni.py --json       # one JSON document
    .venv/bin/python benchmarks/qwen3_omni.py --model DIR  # an existing tiny folder (by its model_type)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RATE = 24000


@dataclass(frozen=True)
class Model:
    key: str
    name: str               # the served model name
    voice: str
    builder: str            # the module whose build(DIR) makes the tiny folder
    model_type: str         # config.json's, for --model DIR
    talker_tokens: int      # default talker max tokens (frames + 1)
    seed: int | None        # sent with every request (Qwen2.5's token2wav draws noise)


MODELS = {
    "qwen3": Model("qwen3", "qwen3-omni-tiny", "ethan", "omni.models.qwen3_omni.tiny", "qwen3_omni_moe", 24, None),
    # 48 codes at 50 Hz: ~1 s of audio (Qwen3's 23 frames at 12.5 Hz: 1.8 s).
    "qwen25": Model("qwen25", "qwen25-omni-tiny", "chelsie", "omni.models.qwen25_omni.tiny", "qwen2_5_omni", 48, 0),
}
PROMPTS = [
    "What is the capital of France?",
    "Tell me about the sea.",
    "Where is the river?",
    "Read me a short story.",
]
_SENTENCE_END = re.compile(r"[.!?](\s|$)")


def sentence_done(text: str) -> bool:
    """True once `text` holds a whole sentence (ends in . ! or ? followed by space or the end)."""
    return _SENTENCE_END.search(text) is not None


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _ms(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(1000 * statistics.median(xs), 1) if xs else None


def summarize(model: str, mode: str, level: int, recs: list[dict], wall: float) -> dict:
    """One table row from per-request records (seconds since submission; keys ttft, sentence,
    ttfa, done, samples) and the summed wall time of the bursts."""
    ttfa = [r["ttfa"] for r in recs if r["ttfa"] is not None]
    gaps = [r["ttfa"] - r["sentence"] for r in recs if r["ttfa"] is not None and r["sentence"] is not None]
    audio_s = sum(r["samples"] for r in recs) / RATE
    rtf = [r["done"] / (r["samples"] / RATE) for r in recs if r["samples"]]
    return {
        "model": model, "mode": mode, "concurrency": level, "requests": len(recs),
        "ttft_ms_p50": _ms([r["ttft"] for r in recs]),
        "sentence_ms_p50": _ms([r["sentence"] for r in recs]),
        "text_done_ms_p50": _ms([r["text_done"] for r in recs]),
        "ttfa_ms_p50": _ms(ttfa),
        "ttfa_ms_p90": round(1000 * pct(ttfa, 0.9), 1) if ttfa else None,
        "ttfa_after_sentence_ms_p50": _ms(gaps),
        "latency_ms_p50": _ms([r["done"] for r in recs]),
        "request_rtf_mean": round(statistics.mean(rtf), 3) if rtf else None,
        "aggregate_rtf": round(wall / audio_s, 3) if audio_s else None,
        "audio_seconds": round(audio_s, 2),
    }


def compare(rows: list[dict]) -> list[dict]:
    """Per model and concurrency level with both modes: omni's TTFA overhead in % and RTF ratio, and the goal."""
    by = {(r["model"], r["mode"], r["concurrency"]): r for r in rows}
    out = []
    for model, level in sorted({(r["model"], r["concurrency"]) for r in rows}):
        o, i = by.get((model, "omni", level)), by.get((model, "in-process", level))
        if not (o and i and o["ttfa_ms_p50"] and i["ttfa_ms_p50"] and o["aggregate_rtf"] and i["aggregate_rtf"]):
            continue
        overhead = round(100 * (o["ttfa_ms_p50"] / i["ttfa_ms_p50"] - 1), 1)
        ratio = round(o["aggregate_rtf"] / i["aggregate_rtf"], 3)
        c = {"model": model, "concurrency": level, "ttfa_overhead_pct": overhead, "rtf_ratio": ratio}
        if level == 1:
            c["goal"], c["met"] = "TTFA overhead < 10%", overhead < 10
        else:
            c["goal"], c["met"] = "omni ahead: TTFA p50 and aggregate RTF below in-process", overhead < 0 and ratio < 1
        out.append(c)
    return out


def scrape_stage_hist(text: str, name: str) -> dict[str, tuple[float, float]]:
    """(sum, count) per stage of the histogram `omni_stage_<name>_seconds` in /metrics text,
    summed over frontends."""
    out: dict[str, list[float]] = {}
    pat = re.compile(rf'^omni_stage_{name}_seconds_(sum|count)\{{[^}}]*stage="(\d+)"[^}}]*\}} (\S+)$')
    for line in text.splitlines():
        m = pat.match(line)
        if m:
            acc = out.setdefault(m.group(2), [0.0, 0.0])
            acc[m.group(1) == "count"] += float(m.group(3))
    return {k: (v[0], v[1]) for k, v in out.items()}


def hist_mean_ms(before: dict, after: dict, names: tuple[str, ...]) -> dict[str, float | None]:
    """Mean in ms per stage name of the observations between two scrapes."""
    out = {}
    for stage, (s, n) in after.items():
        s0, n0 = before.get(stage, (0.0, 0.0))
        out[_name(names, stage)] = round(1000 * (s - s0) / (n - n0), 1) if n > n0 else None
    return out


def _name(names: tuple[str, ...], stage_id) -> str:
    i = int(stage_id)
    return names[i] if 0 <= i < len(names) else str(stage_id)


def mean_ms(recs: list[dict], key: str) -> float | None:
    xs = [r[key] for r in recs if r.get(key) is not None]
    return round(1000 * statistics.mean(xs), 1) if xs else None


COLS = ["model", "mode", "concurrency", "requests", "ttft_ms_p50", "sentence_ms_p50", "text_done_ms_p50",
        "ttfa_ms_p50", "ttfa_ms_p90", "ttfa_after_sentence_ms_p50", "latency_ms_p50", "request_rtf_mean",
        "aggregate_rtf", "audio_seconds"]
HEAD = ["model", "mode", "conc", "reqs", "TTFT", "1st sent", "text end", "TTFA p50", "TTFA p90", "TTFA-sent",
        "lat p50", "req RTF", "agg RTF", "audio s"]


def table(doc: dict) -> str:
    rows = doc["rows"]
    cells = [HEAD] + [["-" if r.get(c) is None else str(r[c]) for c in COLS] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLS))]
    tokens = "; ".join(f"{m['name']} thinker {m['thinker_tokens']} / talker {m['talker_tokens']} tokens, "
                       f"load average {m['load_average_start']} at its start, up in {m.get('startup_seconds')} s"
                       for m in doc["models"])
    lines = [f"streamed chat with audio, omni vs the same engines in one process (bursts of <conc> requests, "
             f"p50 in ms), greedy; {tokens}; {doc['cpus']} CPUs (shared machine: noisy); {doc['seconds']} s"]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    lines.append("")
    for c in doc["comparison"]:
        lines.append(f"{c['model']} concurrency {c['concurrency']}: omni TTFA overhead {c['ttfa_overhead_pct']:+.1f}%, "
                     f"RTF ratio omni/in-process {c['rtf_ratio']}; goal ({c['goal']}): "
                     f"{'met' if c['met'] else 'NOT met'}")
    for level, sides in doc.get("first_output_ms_mean", {}).items():
        lines.append(f"first output per stage, mean ms from the request ({level}): " + "; ".join(
            f"{side} " + " ".join(f"{k} {v}" for k, v in d.items()) for side, d in sides.items()))
    lines.append("where the time goes (seconds inside engine steps / process CPU seconds, per level):")
    for label, per in doc.get("stage_load", {}).items():
        lines.append(f"  {label:21s} " + "; ".join(
            f"{k} " + " ".join(f"{m} {v}" for m, v in d.items()) for k, d in per.items()))
    if "seconds" in doc:
        lines.append(f"total wall time {doc['seconds']} s")
    return "\n".join(lines)


# ---------------------------------------------------------------- omni side

async def one_chat(client, url: str, model: Model, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    rec = {"ttft": None, "sentence": None, "text_done": None, "ttfa": None, "done": None, "samples": 0}
    text, last_text = "", None
    body = {"model": model.name, "messages": [{"role": "system", "content": "You are helpful."},
                                              {"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "modalities": ["text", "audio"],
            "audio": {"voice": model.voice, "format": "pcm16"}}
    if model.seed is not None:
        body["seed"] = model.seed
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"chat: HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"chat: {chunk['error']}")
            now = time.perf_counter() - t0
            for c in chunk["choices"]:
                delta = c["delta"]
                if delta.get("content"):
                    text += delta["content"]
                    last_text = now
                    rec["ttft"] = rec["ttft"] if rec["ttft"] is not None else now
                    if rec["sentence"] is None and sentence_done(text):
                        rec["sentence"] = now
                data = (delta.get("audio") or {}).get("data")
                if data:
                    rec["ttfa"] = rec["ttfa"] if rec["ttfa"] is not None else now
                    rec["samples"] += len(base64.b64decode(data)) // 2
    rec["done"] = time.perf_counter() - t0
    rec["text_done"] = last_text
    if rec["sentence"] is None:
        rec["sentence"] = last_text        # no sentence end: the thinker's text ended there
    return rec


async def omni_burst(url: str, model: Model, indices: list[int], max_tokens: int) -> list[dict]:
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        return list(await asyncio.gather(*[one_chat(client, url, model, PROMPTS[i % len(PROMPTS)], max_tokens)
                                           for i in indices]))


def frontend_cpu(text: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(r"^omni_frontend_cpu_seconds_total\{[^}]*\} (\S+)", text, re.M))


def stage_loads(client, names: tuple[str, ...]) -> dict[str, dict]:
    """Each stage process's load report (from the master): requests, in flight, CPU s, step s."""
    st = client.get_status()
    return {_name(names, r.stage_id): {
        "requests": r.requests_total, "in_flight": r.in_flight, "cpu_s": r.cpu_seconds,
        "steps": r.extra.get("steps", 0.0), "step_s": r.extra.get("step_s_total", 0.0)}
        for r in st.replicas if r.role == "STAGE"}


def settled_loads(client, names: tuple[str, ...], before: dict[str, dict], n: int,
                  deadline_s: float = 10.0) -> dict[str, dict]:
    """The load reports once every stage has reported the n new requests come and gone (they
    come with keep-alives, a moment behind); after the deadline, what is there."""
    from omni.errors import Unavailable

    deadline = time.monotonic() + deadline_s
    now = before
    while True:
        try:
            now = stage_loads(client, names)
        except Unavailable:      # a busy machine can drop one poll; the deadline still holds
            if time.monotonic() > deadline:
                raise
        if all(v["requests"] >= before[k]["requests"] + n and not v["in_flight"] for k, v in now.items()) \
                or time.monotonic() > deadline:
            return now
        time.sleep(0.2)   # polling a report with a deadline, not synchronising with it


def load_delta(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict]:
    out = {}
    for k, a in after.items():
        b = before.get(k, {})
        steps = a["steps"] - b.get("steps", 0.0)
        step_s = a["step_s"] - b.get("step_s", 0.0)
        out[k] = {"cpu_s": round(a["cpu_s"] - b.get("cpu_s", 0.0), 2), "step_s": round(step_s, 2),
                  "steps": int(steps)}
    return out


class Omni:
    """`omni serve` on the tiny folder, started in the background."""

    def __init__(self, folder: Path, model: Model, overrides: dict):
        from tests.e2e.harness import OmniProcess, omni_env

        from benchmarks.qwen3_inprocess import ENGINE_ENV

        self.model = model
        self.proc = OmniProcess("serve", str(folder), "--port", "0", "--served-model-name", model.name,
                                "--stage-overrides", json.dumps(overrides), env=omni_env(**ENGINE_ENV))
        self.url = ""
        self.master = None      # a MasterClient once the server is up

    def wait(self) -> None:
        from omni.master.client import MasterClient

        address = self.proc.master_address(600)
        self.url = self.proc.http(600)
        self.master = MasterClient(address, timeout_s=10.0)

    def burst(self, indices: list[int], max_tokens: int) -> list[dict]:
        return asyncio.run(omni_burst(self.url, self.model, indices, max_tokens))

    def metrics(self) -> str:
        import httpx

        return httpx.get(f"{self.url}/metrics", timeout=30).text

    def stop(self) -> None:
        if self.master is not None:
            self.master.close()
        self.proc.interrupt(60)


def run(omni: Omni, ip, levels, max_tokens: int, doc: dict) -> list[dict]:
    """Both sides burst by burst, alternating which goes first, so they see the same machine load."""
    key, names = omni.model.key, ip.names
    omni.burst([0], max_tokens)                                    # warm-up, not reported
    ip.burst([(0, PROMPTS[0])], max_tokens, "warm", sentence_done)
    rows = []
    for level, n in levels:
        recs: dict[str, list] = {"omni": [], "in-process": []}
        wall = {"omni": 0.0, "in-process": 0.0}
        loads0, fe0, busy0, cpu0 = stage_loads(omni.master, names), frontend_cpu(omni.metrics()), dict(ip.busy), 0.0
        hist0 = scrape_stage_hist(omni.metrics(), "first_output")
        for k, b in enumerate(range(0, n, level)):
            indices = list(range(b, min(b + level, n)))
            for side in (("omni", "in-process") if k % 2 == 0 else ("in-process", "omni")):
                t0 = time.perf_counter()
                c0 = time.process_time()
                if side == "omni":
                    recs[side] += omni.burst(indices, max_tokens)
                else:
                    recs[side] += [vars(r) for r in ip.burst([(i, PROMPTS[i % len(PROMPTS)]) for i in indices],
                                                             max_tokens, f"c{level}b{b}", sentence_done)]
                    cpu0 += time.process_time() - c0
                wall[side] += time.perf_counter() - t0
        rows += [summarize(key, side, level, recs[side], wall[side]) for side in recs]
        # omni's stage times count from the orchestrator's admission (after HTTP and tokenizing).
        firsts = hist_mean_ms(hist0, scrape_stage_hist(omni.metrics(), "first_output"), names)
        doc["first_output_ms_mean"][f"{key} c{level}"] = {
            "omni": {**firsts, "client_ttft": mean_ms(recs["omni"], "ttft"), "client_ttfa": mean_ms(recs["omni"], "ttfa")},
            "in-process": {names[0]: mean_ms(recs["in-process"], "ttft"),
                           names[1]: mean_ms(recs["in-process"], "talker_first"),
                           names[2]: mean_ms(recs["in-process"], "ttfa")}}
        omni_load = load_delta(loads0, settled_loads(omni.master, names, loads0, n))
        omni_load["frontend"] = {"cpu_s": round(frontend_cpu(omni.metrics()) - fe0, 2)}
        doc["stage_load"][f"{key} omni c{level}"] = omni_load
        doc["stage_load"][f"{key} in-process c{level}"] = {
            **{k: {"step_s": round(v - busy0[k], 2)} for k, v in ip.busy.items()},
            "process": {"cpu_s": round(cpu0, 2)}}
    return rows


def pick_models(arg: str) -> list[tuple[Model, Path | None]]:
    """--model: qwen3 | qwen25 | both | a tiny folder (picked by its config.json model_type)."""
    if arg == "both":
        return [(MODELS["qwen3"], None), (MODELS["qwen25"], None)]
    if arg in MODELS:
        return [(MODELS[arg], None)]
    config = Path(arg) / "config.json"
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError) as e:
        raise SystemExit(f"--model {arg}: not qwen3, qwen25 or both, and {config} is unreadable: {e}") from None
    for m in MODELS.values():
        if m.model_type == model_type:
            return [(m, Path(arg))]
    raise SystemExit(f"--model {arg}: model_type {model_type!r} is neither "
                     f"{' nor '.join(m.model_type for m in MODELS.values())}")


def bench_model(model: Model, folder: Path | None, levels, thinker_tokens: int, talker_tokens: int | None,
                doc: dict) -> list[dict]:
    """One model: build its tiny folder (unless given), start omni and the in-process engines, run."""
    import importlib

    from benchmarks.qwen3_inprocess import InProcess

    talker_tokens = talker_tokens or model.talker_tokens
    overrides = {"1": {"default_sampling_params": {"temperature": 0, "max_tokens": talker_tokens}}}
    t0 = time.perf_counter()
    info = {"key": model.key, "name": model.name, "voice": model.voice, "seed": model.seed,
            "thinker_tokens": thinker_tokens, "talker_tokens": talker_tokens,
            "load_average_start": [round(x, 2) for x in os.getloadavg()]}
    doc["models"].append(info)
    with tempfile.TemporaryDirectory() as tmp:
        if folder is None:
            folder = importlib.import_module(model.builder).build(Path(tmp) / "tiny")
        omni = Omni(folder, model, overrides)      # starts while the in-process engines load
        ip = None
        try:
            ip = InProcess(folder, overrides, model.voice, seed=model.seed)
            info["inprocess_load_seconds"] = round(ip.load_seconds, 1)
            omni.wait()
            info["startup_seconds"] = round(time.perf_counter() - t0, 1)
            rows = run(omni, ip, levels, thinker_tokens, doc)
        finally:
            omni.stop()
            if ip is not None:
                ip.shutdown()
    info["seconds"] = round(time.perf_counter() - t0, 1)
    info["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3",
                    help="qwen3 (the default), qwen25, both, or a tiny Qwen3-Omni / Qwen2.5-Omni folder "
                         "(default: build the tiny model in a temp dir)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true",
                      help="the default: a short run (< 2 min per model on a quiet machine; start-up dominates)")
    mode.add_argument("--full", action="store_true", help="more requests per setting")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.add_argument("--thinker-tokens", type=int, default=16, help="thinker max tokens per request")
    ap.add_argument("--talker-tokens", type=int, default=None,
                    help="talker max tokens (frames + 1; default 24 for Qwen3-Omni, 48 for Qwen2.5-Omni)")
    a = ap.parse_args()
    models = pick_models(a.model)
    levels = [(1, 16), (4, 32)] if a.full else [(1, 6), (4, 12)]
    t0 = time.perf_counter()
    doc = {"sample_rate": RATE, "cpus": os.cpu_count(), "models": [],
           "levels": [{"concurrency": c, "requests": n} for c, n in levels],
           "stage_load": {}, "first_output_ms_mean": {}}
    from benchmarks.qwen3_inprocess import ENGINE_ENV

    for k, v in ENGINE_ENV.items():      # before torch is imported: one OpenMP thread from the start
        os.environ.setdefault(k, v)
    rows = []
    for model, folder in models:
        rows += bench_model(model, folder, levels, a.thinker_tokens, a.talker_tokens, doc)
    order = [m.key for m, _ in models]
    doc["rows"] = sorted(rows, key=lambda r: (order.index(r["model"]), r["concurrency"], r["mode"]))
    doc["comparison"] = compare(rows)
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    if a.json:
        print(json.dumps(doc, indent=1))
    else:
        print(table(doc))


if __name__ == "__main__":
    main()
