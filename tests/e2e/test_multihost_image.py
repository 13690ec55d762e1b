"""Issue 26, item 5: the diffusion stage headless on another host.

Two network namespaces (tests/e2e/netns.py). Host A runs the head with `--num-replicas 0`: the master and
the HTTP frontend only. Host B runs the Qwen-Image DiT stage `--stage-id 0 --headless`. An image asked of
the head is made on B, comes back over TCP, and equals diffusers' QwenImagePipeline's; so does an image job.
`omni sleep --level 2` on A puts B's stage to sleep (a 503 meanwhile) and `omni wakeup` gives the same image.

The bundled qwen-image deploy has one stage (the DiT, stage 0). For an AR -> DiT deploy (an LM stage 0,
the DiT stage 1: qwen-image-prompt-expand, from another branch) set DEPLOY to ("--deploy-config", NAME), DIT_STAGE
to 1 and HEAD to () (the head then runs the LM itself); images are compared for the answer's
`revised_prompt` when it has one.
"""

from __future__ import annotations

import json
import re
import sys

import httpx
import numpy as np
import pytest

from tests.e2e.harness import SERVING, OmniProcess, omni_env, omni_shm_entries, wait_until
from tests.e2e.netns import METRIC, TOKEN, hosts, kill_all, status  # noqa: F401 (fixture)
from tests.e2e.test_qwen_image import NAME, pipe, pixels, reference, tiny  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]
pytest.importorskip("diffusers")

DEPLOY: tuple[str, ...] = ()              # the bundled one-stage deploy, chosen by the folder
DIT_STAGE = 0
HEAD: tuple[str, ...] = ("--num-replicas", "0")   # the head runs no stage: the DiT is B's alone
BODY = {"model": NAME, "prompt": "a red cat on the mountain", "size": "64x48", "num_inference_steps": 3,
        "seed": 11, "guidance_scale": 4.0}
ENV = {"OMNI_TOKEN": TOKEN, "OMNI_PLATFORM": "cpu", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def deployment(hosts, tiny):  # noqa: F811
    a, b = hosts
    procs: list[OmniProcess] = []
    shm_before = set(omni_shm_entries())
    try:
        head = OmniProcess("serve", str(tiny), *DEPLOY, "--stage-id", "0", *HEAD, "--omni-master-address", a.addr,
                           "--omni-master-port", "0", "--port", "0", "--host", a.addr, "--served-model-name", NAME,
                           prefix=a.prefix, env=omni_env(**ENV))
        procs.append(head)
        master = head.master_address(120)
        port = master.rsplit(":", 1)[1]
        procs.append(OmniProcess("serve", str(tiny), *DEPLOY, "--stage-id", str(DIT_STAGE), "--headless",
                                 "--omni-master-address", a.addr, "--omni-master-port", port, prefix=b.prefix,
                                 env=omni_env(**ENV)))
        m = head.wait_for(SERVING, 300)
        yield a, b, master, f"http://{a.addr}:{m.group(2)}", procs, shm_before
    finally:
        kill_all(procs)


@pytest.fixture(scope="module")
def is_the_pipelines(pipe):  # noqa: F811
    """Whether an answer's image is QwenImagePipeline's for the prompt the DiT rendered: an AR stage's
    `revised_prompt`, else the client's."""
    refs: dict[str, np.ndarray] = {}

    def check(r: httpx.Response) -> bool:
        assert r.status_code == 200, r.text
        [item] = r.json()["data"]
        prompt = item.get("revised_prompt") or BODY["prompt"]
        if prompt not in refs:
            refs[prompt] = reference(pipe, prompt)[0]
        return np.array_equal(pixels(item["b64_json"]), refs[prompt])
    return check


def test_the_dit_stage_runs_on_b_only(deployment):
    a, b, master, *_ = deployment
    r = status(a, master, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    replicas = json.loads(r.stdout)["replicas"]
    dit = [x for x in replicas if x["role"] == "STAGE" and x["stage_id"] == DIT_STAGE]
    assert [x["host"] for x in dit] == [b.addr], replicas
    assert [x["host"] for x in replicas if x["role"] == "FRONTEND"] == [a.addr]


def test_an_image_through_the_head_is_the_pipelines_and_crosses_over_tcp(deployment, is_the_pipelines):
    a, _, _, url, *_ = deployment
    assert is_the_pipelines(a.call(httpx.post, f"{url}/v1/images/generations", json=BODY, timeout=120))
    metrics = a.call(httpx.get, f"{url}/metrics", timeout=30).text
    by_transport = {t: int(n) for t, n in METRIC.findall(metrics)}
    assert by_transport.get("tcp", 0) > 0, by_transport
    channels = {k: float(n) for k, n in re.findall(r'omni_stage_channels\{[^}]*kind="(\w+)"\} (\S+)', metrics)}
    assert channels["zmq"] == 1, channels     # the DiT's, on B
    if HEAD == ("--num-replicas", "0"):        # no stage on A: nothing local, no shared memory
        assert channels["local"] == 0 and "shm" not in by_transport, (channels, by_transport)


def test_an_image_job_through_the_head_is_the_pipelines(deployment, is_the_pipelines):
    a, _, _, url, *_ = deployment
    r = a.call(httpx.post, f"{url}/v1/omni/jobs", json={"endpoint": "/v1/images/generations", "body": BODY},
               timeout=30)
    assert r.status_code == 200, r.text
    job_url = f"{url}/v1/omni/jobs/{r.json()['id']}"

    def ended():
        job = a.call(httpx.get, job_url, timeout=30).json()
        return job if job["status"] not in ("queued", "in_progress") else None
    job = wait_until(ended, 120, "the image job to end")
    assert job["status"] == "completed", job
    assert is_the_pipelines(a.call(httpx.get, f"{job_url}/content", timeout=30))
    assert a.call(httpx.delete, job_url, timeout=30).status_code == 200


def test_omni_sleep_on_a_reaches_the_dit_on_b_and_wakeup_gives_the_same_image(deployment, is_the_pipelines):
    a, b, master, url, *_ = deployment
    r = a.run(sys.executable, "-m", "omni.cli", "sleep", "--master", master, "--stage", str(DIT_STAGE),
              "--level", "2", "--force", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    refused = a.call(httpx.post, f"{url}/v1/images/generations", json=BODY, timeout=60)
    assert refused.status_code == 503 and "asleep" in refused.json()["error"]["message"], refused.text
    r = a.run(sys.executable, "-m", "omni.cli", "wakeup", "--master", master, "--stage", str(DIT_STAGE), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert is_the_pipelines(a.call(httpx.post, f"{url}/v1/images/generations", json=BODY, timeout=120))


def test_ctrl_c_stops_both_hosts(deployment):
    *_, procs, shm_before = deployment
    for p in procs:
        assert p.interrupt(60) == 0, p.output()
    assert set(omni_shm_entries()) <= shm_before
