"""Issue 3: master + 2 headless stage processes + an orchestrator in the test,
a 2-stage pipeline (LM -> pooler consuming hidden states over the data plane)."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid

import pytest
import torch

from omni import config as cfg
from omni.engines.base import SamplingParams
from omni.master.client import AsyncMasterClient
from omni.master.server import MasterServer
from omni.orchestrator.executor import Orchestrator
from omni.orchestrator.topology import Topology
from omni.orchestrator.types import PipelineRequest
from omni.frontend import follow_topology
from omni.transport.factory import MultiConsumer
from tests.e2e.harness import READY, OmniProcess, omni_shm_entries

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = ["The capital of France is", "One, two, three,", "def fibonacci(n):"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_path() -> str:
    from omni.models.resolve import resolve_model

    return resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def reference(model_path):
    """Greedy tokens and the pooled final hidden states, in process, from HF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    out = {}
    for p in PROMPTS:
        ids = tok(p)["input_ids"]
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
            hidden = model.model(torch.tensor([ids + gen[:-1]])).last_hidden_state[0]
        emb = torch.nn.functional.normalize(hidden.mean(0), dim=0)
        out[p] = (ids, gen, emb)
    return tok, out


@pytest.fixture(scope="module")
def deployment(model_path):
    config = cfg.load(model_path, str(cfg.DEPLOY_DIR / "lm-pooler.yaml"))
    master = MasterServer(config.to_dict(), config.config_hash(), lease_ttl_s=2.0)
    port = master.start()
    procs = []
    try:
        for stage_id in (0, 1):
            p = OmniProcess("serve", model_path, "--deploy-config", str(cfg.DEPLOY_DIR / "lm-pooler.yaml"),
                            "--stage-id", str(stage_id), "--headless",
                            "--omni-master-address", "127.0.0.1", "--omni-master-port", str(port))
            procs.append(p)
        for p in procs:
            p.wait_for(READY, 180)
        yield config, f"127.0.0.1:{port}", procs
    finally:
        for p in procs:
            p.kill()
        master.stop()


async def _orchestrator(config, address, tok):
    topology = Topology()
    master = AsyncMasterClient(address)
    stop = asyncio.Event()
    task = asyncio.create_task(follow_topology(master, topology, stop))
    orch = Orchestrator(config, frontend_id=f"test-{uuid.uuid4().hex[:6]}", topology=topology,
                        detokenize=lambda ids: tok.decode(ids), master=master,
                        consumer=MultiConsumer())
    healthy = asyncio.Event()
    topology.on_change(lambda r, kind: orch.health()[0] and healthy.set())
    await asyncio.wait_for(healthy.wait(), 60)

    async def close():
        stop.set()
        task.cancel()
        await orch.close()
        await master.close()
    return orch, close


async def _run(orch, ids, modalities=("text", "embedding")):
    tokens, emb, last = [], None, None
    req = PipelineRequest(request_id=uuid.uuid4().hex, prompt_token_ids=ids, modalities=modalities,
                          sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    async for out in orch.generate(req):
        tokens += out.token_ids
        if out.embedding is not None:
            emb = torch.tensor(out.embedding)
        last = out
    assert last is not None and last.finished
    return tokens, emb


def test_two_stage_pipeline_matches_reference(deployment, reference):
    config, address, _ = deployment
    tok, ref = reference

    async def main():
        orch, close = await _orchestrator(config, address, tok)
        try:
            # Concurrent requests share the LM's batch.
            results = await asyncio.gather(*(_run(orch, ref[p][0]) for p in PROMPTS))
            for p, (tokens, emb) in zip(PROMPTS, results):
                _, gen, ref_emb = ref[p]
                assert tokens == gen, (p, tok.decode(tokens), tok.decode(gen))
                assert emb is not None and emb.shape == ref_emb.shape
                assert torch.nn.functional.cosine_similarity(emb, ref_emb, dim=0) > 0.999
            # Text only stops at the LM: no embedding.
            tokens, emb = await _run(orch, ref[PROMPTS[0]][0], modalities=("text",))
            assert tokens == ref[PROMPTS[0]][1] and emb is None
        finally:
            await close()

    asyncio.run(main())


def test_sigkill_of_a_stage_fails_requests_clearly_and_leaves_no_shm(deployment, reference):
    config, address, procs = deployment
    tok, ref = reference

    async def main():
        orch, close = await _orchestrator(config, address, tok)
        try:
            os.kill(procs[1].proc.pid, signal.SIGKILL)   # the pooler
            procs[1].proc.wait(10)
            with pytest.raises(Exception) as info:
                await asyncio.wait_for(_run(orch, ref[PROMPTS[0]][0]), 60)
            assert "stage 1" in str(info.value) or "pooler" in str(info.value), info.value
        finally:
            await close()

    asyncio.run(main())
    assert omni_shm_entries() == []
