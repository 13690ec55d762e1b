"""Frontends' /metrics through the master's KV store: a large text is still published, a refused one
leaves no frozen copy behind, and a counter never goes back whichever frontend answers."""

from __future__ import annotations

import asyncio
import logging
import re
from types import SimpleNamespace as NS

import httpx
import pytest

from tests.unit.api_fakes import FakeOrchestrator, chat_body, tokenizer  # noqa: F401
from omni.api import build_app
from omni.api.metrics_merge import NAMESPACE, Publisher
from omni.errors import BadRequest
from omni.frontend import publish_metrics
from omni.master.kv import KvError, KvStore

pytestmark = pytest.mark.anyio


class FakeMaster:
    """AsyncMasterClient over the master's own KvStore, its errors mapped as the client maps them."""

    def __init__(self, kv=None):
        self.kv = kv or KvStore()

    async def kv_put(self, ns, k, v, only_if_exists=False):
        await asyncio.sleep(0)
        try:
            return self.kv.put(ns, k, v, only_if_exists)
        except KvError as e:
            raise BadRequest(str(e)) from None

    async def kv_list(self, ns, prefix=""):
        return self.kv.list(ns, prefix)[0]

    async def kv_delete(self, ns, k):
        return self.kv.delete(ns, k)


def test_a_large_metrics_text_fits():
    # A 3-stage deploy is ~35 KB before audio and each voice used adds ~6.7 KB.
    KvStore().put(NAMESPACE, "0", b"x" * (1 << 20))


async def test_a_refused_publish_removes_the_old_copy_and_warns(caplog):
    master = FakeMaster()
    texts = ["small\n"]
    pub = Publisher(lambda: texts[0], master, 0)
    assert await pub.publish() == "small\n"
    assert master.kv.get(NAMESPACE, "0") == b"small\n"
    texts[0] = "x" * (4 << 20)
    with caplog.at_level(logging.WARNING, logger="omni.api.metrics_merge"):
        for _ in range(8):
            with pytest.raises(BadRequest):
                await pub.publish()
    assert master.kv.get(NAMESPACE, "0") is None      # no frozen figures for the others to serve
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "not published" in r.getMessage()]
    assert 1 <= len(warned) <= 5                       # rate-limited


async def test_scrapes_queued_behind_a_write_share_the_next_and_each_gets_a_text_rendered_after_it_asked():
    """A burst of scrapes was a master write each, in a row; now those waiting share the next write."""
    master = FakeMaster()
    gate, writes, renders = asyncio.Event(), [], [0]

    async def slow_put(ns, k, v, only_if_exists=False):
        writes.append(v)
        await gate.wait()
        master.kv.put(ns, k, v)
    master.kv_put = slow_put

    def render():
        renders[0] += 1
        return f"n {renders[0]}\n"
    pub = Publisher(render, master, 0)
    first = asyncio.create_task(pub.publish())
    while not writes:
        await asyncio.sleep(0)
    burst = [asyncio.create_task(pub.publish()) for _ in range(20)]   # asked while the first write is out
    await asyncio.sleep(0)
    gate.set()
    assert await first == "n 1\n"
    assert [await t for t in burst] == ["n 2\n"] * 20                   # rendered after each of them asked
    assert len(writes) == 2 and master.kv.get(NAMESPACE, "0") == b"n 2\n"
    assert await pub.publish() == "n 3\n"                              # a later scrape: a write of its own


def _count(text: str, fe: int) -> int:
    m = re.search(r'^omni_api_requests_total\{frontend="%d",route="/v1/chat/completions",status="200"\} (\d+)'
                  % fe, text, re.M)
    return int(m.group(1)) if m else 0


async def test_a_counter_never_goes_back_whichever_frontend_answers(tokenizer):  # noqa: F811
    master = FakeMaster()
    topo = NS(replicas={f"fe{i}": NS(role="FRONTEND", state="READY", extra={"frontend_index": i}) for i in (0, 1)})
    apps = [build_app(FakeOrchestrator(tokenizer), tokenizer, served_model_name="tiny", max_model_len=128,
                      frontend_index=i) for i in (0, 1)]
    stop = asyncio.Event()
    stop.set()      # wire /metrics to the store; no background rounds, so only the scrapes publish
    for i in (0, 1):
        await publish_metrics(apps[i], master, topo, i, stop)
    cs = [httpx.AsyncClient(transport=httpx.ASGITransport(app=a), base_url="http://t") for a in apps]
    seen = []
    for k in range(6):     # a load balancer alternates the scrapes between the frontends
        for _ in range(3):
            assert (await cs[0].post("/v1/chat/completions", json=chat_body())).status_code == 200
        seen.append(_count((await cs[k % 2].get("/metrics")).text, 0))
    assert seen == sorted(seen)            # never back; via FE1, FE0's are as it last published them
    assert seen[::2] == [3, 9, 15]         # a frontend's own, fresh
