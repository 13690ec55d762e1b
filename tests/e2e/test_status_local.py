"""A bare `omni status` finds the `omni serve` started on this host (issue 15, item 6)."""

import json
import subprocess
import sys

from tests.e2e.harness import REPO, OmniProcess, omni_env


def test_bare_status_finds_the_local_deployment_and_forgets_it_when_it_stops(tmp_path):
    env = omni_env(OMNI_RUN_DIR=str(tmp_path))
    # vllm-omni's own options: its heartbeat timeout becomes the master's lease (5 s in the deploy)
    p = OmniProcess("serve", "smollm2", "--port", "0", "--omni-heartbeat-timeout", "2.5", "--init-timeout", "900",
                    "--worker-backend", "multi_process", env=env)
    try:
        master = p.master_address(120)   # a random port: 50051 would find nothing
        r = subprocess.run([sys.executable, "-m", "omni.cli", "status", "--json"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode in (0, 1), r.stderr            # 2 would be "master unreachable"
        assert f"found `omni serve smollm2` (pid {p.proc.pid}), master {master}" in r.stderr, r.stderr
        assert '"stages"' in r.stdout or '"stage_id"' in r.stdout, r.stdout
        assert json.loads(r.stdout)["lease_ttl_s"] == 2.5
        assert list(tmp_path.glob("*.json"))
        p.interrupt(60)   # during start-up: exit 1, still a clean stop
        assert not list(tmp_path.glob("*.json")), "the run file outlived its deployment"
    finally:
        if p.proc.poll() is None:
            p.kill()
