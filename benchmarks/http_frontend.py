"""HTTP frontend per process: omni's frontend against vLLM's OpenAI server, same client, one run.

Starts, on loopback, vLLM's server (`python -m vllm.entrypoints.openai.api_server`, access log
off like omni's) on the SmolLM2 folder and `omni serve smollm2-vllm` with its thinker stage alone
(one frontend; the thinker is a vLLM EngineCore with the same engine args), plus bare ASGI apps that answer every request
with a fixed 15-byte JSON body: on Hypercorn (asyncio loop, uvloop) and on uvicorn
(httptools + uvloop, vLLM's stack). The bare rows are each server's ceiling: no handler work
can beat them. Then, in rounds that alternate the servers (so load from other processes
falls on all of them alike), `wrk -t1 -c32` on GET /health and GET /v1/models, and streamed
chat (SSE, `ignore_eos`, fixed length) from an httpx client that counts content chunks as they
arrive (the same client for both). Prints requests/s (medians over rounds), omni/vLLM ratios and the load average, and
the HTTP process's CPU time per request (per chunk for SSE): on a machine shared with other
work, requests/s follow the CPU share a process gets, while CPU per request stays put, so
`capacity` (1 / CPU per request) is the figure to compare when the load average is high.
The HTTP process is vLLM's API server (it detokenizes too) and omni's frontend process.

    .venv/bin/python benchmarks/http_frontend.py            # --quick (default): 3 rounds (1 s wrk, 3 s SSE), no bare
                                                            # hypercorn-asyncio, under 2 minutes
    .venv/bin/python benchmarks/http_frontend.py --full     # 8 longer rounds, every bare app
    .venv/bin/python benchmarks/http_frontend.py --json     # one JSON document on stdout
Needs `wrk` (Debian: apt-get install wrk).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.vllm_bench import OMNI_MODEL, Server, omni_argv  # noqa: E402

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def wait_ready(servers: list[Server], timeout: float) -> None:
    for s in servers:
        s.wait_ready(timeout)


# deploy/smollm2-135m-instruct-vllm.yaml's stage 0 on this CPU machine (float32, eager).
VLLM_ARGS = ["--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "8", "--enforce-eager",
             "--kv-cache-memory-bytes", str(512 * 2**20), "--disable-log-stats", "--disable-uvicorn-access-log"]
BARE = ("hypercorn-asyncio", "hypercorn-uvloop", "uvicorn-uvloop")

def bare_server(kind: str) -> None:
    """A bare ASGI app on an ephemeral port; prints `serving bare on http://127.0.0.1:PORT`."""
    import asyncio
    import socket

    body = b'{"status":"ok"}'
    headers = [(b"content-type", b"application/json"), (b"content-length", b"15")]

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    sock = socket.socket()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # accepted sockets inherit it
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    print(f"serving bare on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    if kind == "uvicorn-uvloop":
        import uvicorn

        config = uvicorn.Config(app, loop="uvloop", http="httptools", access_log=False, log_level="warning")
        asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))
        return
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"fd://{sock.fileno()}"]
    config.accesslog = None
    if kind == "hypercorn-uvloop":
        import uvloop

        uvloop.run(serve(app, config))
    else:
        asyncio.run(serve(app, config))


def http_process(s: Server):
    """The process that answers HTTP: vLLM's top process; omni's frontend child."""
    import psutil

    top = psutil.Process(s.proc.pid)
    if s.name != "omni":
        return top
    for c in top.children(recursive=True):
        if "frontend" in c.cmdline():
            return c
    raise SystemExit("http_frontend: no omni frontend process found")


def cpu_s(p) -> float:
    t = p.cpu_times()
    return t.user + t.system


def wrk(url: str, seconds: float, connections: int, proc=None) -> dict:
    cpu0 = cpu_s(proc) if proc is not None else 0.0
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--timeout", "120s"]
    out = subprocess.run([*argv, url], capture_output=True, text=True, timeout=seconds + 180).stdout
    cpu = cpu_s(proc) - cpu0 if proc is not None else None
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    n = re.search(r"(\d+) requests in", out)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    socket_errors = re.search(r"Socket errors: (.*)", out)
    row = {"requests_s": float(m.group(1)) if m else 0.0, "errors": int(errors.group(1)) if errors else 0,
           "socket_errors": socket_errors.group(1) if socket_errors else None,
           "loadavg_1m": round(os.getloadavg()[0], 2)}
    count = int(n.group(1)) if n else 0
    if cpu is not None and count:
        row["cpu_us_per"] = 1e6 * cpu / count
    return row


def sse(url: str, model: str, seconds: float, connections: int, max_tokens: int, proc=None) -> dict:
    """Streamed chat on `connections` loops for `seconds`: content chunks counted as they
    arrive (a stream cut off by the end of the window counts what it got)."""
    import asyncio

    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": "Write about the sea."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    counts = {"chunks": 0, "errors": 0}

    async def loop(client: httpx.AsyncClient, stop_at: float) -> None:
        while time.monotonic() < stop_at:
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    counts["errors"] += 1
                    await r.aread()
                    continue
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                        counts["chunks"] += 1
                    if time.monotonic() >= stop_at:
                        return

    async def run() -> float:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=connections)) as client:
            t0 = time.monotonic()
            await asyncio.gather(*(loop(client, t0 + seconds) for _ in range(connections)))
            return time.monotonic() - t0

    cpu0 = cpu_s(proc) if proc is not None else 0.0
    wall = asyncio.run(run())
    row = {"chunks_s": counts["chunks"] / wall, "errors": counts["errors"], "loadavg_1m": round(os.getloadavg()[0], 2)}
    if proc is not None and counts["chunks"]:
        row["cpu_us_per"] = 1e6 * (cpu_s(proc) - cpu0) / counts["chunks"]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short rounds (the default)")
    ap.add_argument("--full", action="store_true", help="more and longer rounds")
    ap.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    ap.add_argument("--no-bare", action="store_true", help="skip the bare ASGI ceiling rows")
    ap.add_argument("--no-sse", action="store_true", help="skip streamed chat")
    ap.add_argument("--bare-server", choices=BARE, help=argparse.SUPPRESS)
    ap.add_argument("--startup-timeout", type=float, default=600)
    a = ap.parse_args()
    t0 = time.monotonic()
    if a.bare_server:
        bare_server(a.bare_server)
        return 0
    if shutil.which("wrk") is None:
        raise SystemExit("http_frontend: needs wrk (Debian: apt-get install wrk)")
    rounds, seconds, sse_s, sse_tokens, sse_conns = (8, 4, 15, 64, 8) if a.full else (3, 1, 3, 32, 8)
    # --quick leaves out Hypercorn's asyncio loop (omni's frontend runs on uvloop when it is there).
    bare = () if a.no_bare else BARE if a.full else BARE[1:]

    from omni.models.resolve import resolve_model

    servers: dict[str, Server] = {}
    tmp = tempfile.mkdtemp(prefix="http-frontend-")
    try:
        # Every server starts at once: start-up is not measured, and each round has the
        # others idle. (One after the other took ~40 s more on a 2-core box.)
        servers["vllm"] = Server("vllm", [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                                          "--model", resolve_model(MODEL), "--served-model-name", MODEL,
                                          "--host", "127.0.0.1", "--port", "0", *VLLM_ARGS])
        # omni: the smollm2-vllm pipeline's thinker stage alone (no request here reaches the audio stages).
        servers["omni"] = Server("omni", omni_argv(tmp))
        for kind in bare:
            # named "omni" while starting: wait_ready reads the port it prints
            servers[kind] = Server("omni", [sys.executable, __file__, "--bare-server", kind])
        wait_ready(list(servers.values()), a.startup_timeout)
        startup_s = round(time.monotonic() - t0, 1)
        for kind in bare:
            servers[kind].name = f"bare {kind}"
        procs = {name: http_process(s) for name, s in servers.items()}
        runs: dict[str, dict[str, list[dict]]] = {}
        for r in range(rounds):
            for path in ("/health", "/v1/models"):
                for name, s in servers.items():
                    if name in BARE and path != "/health":
                        continue
                    if r == 0:
                        wrk(f"{s.url}{path}", 1, 32)   # warm-up
                    runs.setdefault(path, {}).setdefault(s.name, []).append(
                        wrk(f"{s.url}{path}", seconds, 32, proc=procs[name]))
            if not a.no_sse:
                for name in ("vllm", "omni"):
                    model = MODEL if name == "vllm" else OMNI_MODEL
                    if r == 0:
                        sse(servers[name].url, model, 1, sse_conns, sse_tokens)   # warm-up
                    runs.setdefault("sse", {}).setdefault(name, []).append(
                        sse(servers[name].url, model, sse_s, sse_conns, sse_tokens, procs[name]))
    finally:
        for s in servers.values():
            s.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    def med(rows: list[dict], key: str) -> float:
        return statistics.median(x.get(key, 0.0) for x in rows)

    summary = {}
    for what, by_server in runs.items():
        key = "chunks_s" if what == "sse" else "requests_s"
        summary[what] = {name: {"median": med(rows, key), "runs": [x.get(key) for x in rows],
                                "cpu_us_per": med(rows, "cpu_us_per"),
                                "errors": sum(x["errors"] for x in rows),
                                "loadavg_1m": [x["loadavg_1m"] for x in rows]}
                         for name, rows in by_server.items()}
        v = summary[what].get("vllm", {}).get("median")
        vc = summary[what].get("vllm", {}).get("cpu_us_per")
        for d in summary[what].values():
            d["vs_vllm"] = round(d["median"] / v, 3) if v else None
            d["capacity_vs_vllm"] = round(vc / d["cpu_us_per"], 3) if vc and d["cpu_us_per"] else None
    doc = {"client": "wrk -t1 -c32; SSE: httpx, %d streams of %d tokens (ignore_eos)" % (sse_conns, sse_tokens),
           "rounds": rounds, "seconds": seconds, "sse_seconds": sse_s, "summary": summary,
           "startup_s": startup_s, "total_seconds": round(time.monotonic() - t0, 1),
           "loadavg_end": [round(x, 2) for x in os.getloadavg()]}
    if a.json:
        print(json.dumps(doc, indent=1))
        return 0
    print(f"{doc['client']}, {rounds} rounds x {seconds} s (SSE {sse_s} s), servers alternating; medians")
    print(f"{'what':<12}{'server':<24}{'req/s':>10}{'vs vLLM':>9}{'CPU us/req':>11}{'capacity vs vLLM':>17}"
          f"{'errors':>8}  load 1m per round")
    for what, by_server in summary.items():
        unit = "chunks/s" if what == "sse" else ""
        for name, d in by_server.items():
            ratio = f"{d['vs_vllm']:.2f}x" if d["vs_vllm"] is not None else "-"
            cap = f"{d['capacity_vs_vllm']:.2f}x" if d["capacity_vs_vllm"] is not None else "-"
            print(f"{what:<12}{name:<24}{d['median']:>10.0f}{ratio:>9}{d['cpu_us_per']:>11.0f}{cap:>17}{d['errors']:>8}  "
                  f"{' '.join(f'{x:.1f}' for x in d['loadavg_1m'])} {unit}")
    print(f"start-up (every server at once) {doc['startup_s']} s; total wall time {doc['total_seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
