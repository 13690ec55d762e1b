"""Pure parts of the master: the KV store's files, load -> heartbeat, the status table."""

import json

import pytest

from omni.master import wire
from omni.master.commands import render_table
from omni.master.kv import ENTRY_OVERHEAD, MAX_VALUE_BYTES, PAGE_BYTES, KvError, KvFull, KvStore, Limits
from omni.master.types import ReplicaInfo, StageStatus, Status


def test_kv_persists_atomically_and_reloads(tmp_path):
    kv = KvStore(tmp_path)
    kv.put("voices", "alice", b"\x00\xff")
    kv.put("voices", "bob", b"b")
    kv.put("jobs", "j1", b"{}")
    files = sorted(p.name for p in (tmp_path / "kv").iterdir())
    assert files == ["jobs.log", "voices.log"]  # changes are logged (kv_journal.py); no temp files
    again = KvStore(tmp_path)
    assert again.list("voices") == ({"alice": b"\x00\xff", "bob": b"b"}, "")
    assert again.list("voices", prefix="b") == ({"bob": b"b"}, "")
    assert again.delete("jobs", "j1") and not again.delete("jobs", "j1")
    assert not (tmp_path / "kv" / "jobs.log").exists()    # an emptied namespace leaves no file
    assert KvStore(tmp_path).get("jobs", "j1") is None


def test_kv_metrics_are_never_persisted(tmp_path):
    """Frontends' published metrics are live data: with --state-dir they came back after a
    restart as another deployment's stale figures."""
    from omni.api.metrics_merge import NAMESPACE

    kv = KvStore(tmp_path)
    kv.put(NAMESPACE, "0", b"omni_api_requests_total 5\n")
    kv.put("voices", "alice", b"{}")
    assert kv.get(NAMESPACE, "0") == b"omni_api_requests_total 5\n"   # served while the master lives
    assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == ["voices.log"]
    (tmp_path / "kv" / f"{NAMESPACE}.json").write_text(json.dumps({"1": {"v": "eA==", "t": 0}}))  # an older omni's
    again = KvStore(tmp_path)
    assert again.list(NAMESPACE) == ({}, "") and again.get("voices", "alice") == b"{}"
    assert not (tmp_path / "kv" / f"{NAMESPACE}.json").exists()

def test_kv_refuses_bad_names_and_sizes(tmp_path):
    kv = KvStore()
    for ns in ("", "../x", ".hidden", "a/b", "x" * 200):
        with pytest.raises(KvError, match="bad kv namespace"):
            kv.put(ns, "k", b"")
    with pytest.raises(KvError, match="bad kv key"):
        kv.get("ns", "")
    with pytest.raises(KvError, match="limit"):
        kv.put("ns", "k", b"x" * (MAX_VALUE_BYTES + 1))


def test_kv_lists_in_bounded_pages(tmp_path):
    kv = KvStore()
    for i in range(30):
        kv.put("jobs", f"j{i:02d}", b"x" * (60 << 10))
    pages, after = [], ""
    while True:
        page, after = kv.list("jobs", start_after=after)
        assert 0 < sum(len(v) for v in page.values()) <= PAGE_BYTES
        pages.append(page)
        if not after:
            break
    assert len(pages) > 1
    assert [k for p in pages for k in p] == [f"j{i:02d}" for i in range(30)]
    assert list(kv.list("jobs", limit=3)[0]) == ["j00", "j01", "j02"]


def test_kv_namespaces_have_caps_and_jobs_expire(tmp_path):
    now = [1000.0]
    cap = 2 * (2 + ENTRY_OVERHEAD) + 5                  # two 1-byte keys of 1-byte values, with room to spare
    kv = KvStore(tmp_path, limits={"small": Limits(max_entries=2, max_bytes=cap), "jobs": Limits(ttl_s=60)},
                 clock=lambda: now[0])
    kv.put("small", "a", b"1")
    kv.put("small", "b", b"2")
    kv.put("small", "b", b"3")                  # replacing is not growing
    with pytest.raises(KvFull, match="2 entries"):
        kv.put("small", "c", b"4")
    kv.delete("small", "a")
    with pytest.raises(KvFull, match=f"limit of {cap}"):
        kv.put("small", "c", b"x" * 10)
    kv.put("jobs", "old", b"{}")
    now[0] += 50
    kv.put("jobs", "new", b"{}")
    now[0] += 20                                 # old: 70 s since its write, new: 20 s
    assert kv.get("jobs", "old") is None and kv.get("jobs", "new") == b"{}"
    assert list(kv.list("jobs")[0]) == ["new"]
    # The write times persist: a restarted master expires on schedule.
    again = KvStore(tmp_path, limits={"jobs": Limits(ttl_s=60)}, clock=lambda: now[0] + 50)
    assert again.list("jobs") == ({}, "")


def test_kv_reads_the_older_file_format(tmp_path):
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "voices.json").write_text(json.dumps({"alice": "AP8="}))   # key -> base64 only
    kv = KvStore(tmp_path)
    assert kv.get("voices", "alice") == b"\x00\xff"
    kv.put("voices", "bob", b"b")
    kv.close()
    assert KvStore(tmp_path).list("voices") == ({"alice": b"\x00\xff", "bob": b"b"}, "")


def test_kv_corrupt_file_is_named(tmp_path):
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "voices.json").write_text("{not json")
    from omni.errors import ConfigError

    with pytest.raises(ConfigError, match="voices.json is damaged"):
        KvStore(tmp_path)


@pytest.mark.parametrize("text", ['{"k": 5}', '[1, 2]', '"x"', '{"k": "not base64!"}', '{"k": null}'])
def test_kv_wrong_shaped_file_is_refused_naming_it(tmp_path, text):
    from omni.errors import ConfigError

    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "jobs.json").write_text(text)
    with pytest.raises(ConfigError, match=r"kv/jobs.json is damaged .*fix or remove it"):
        KvStore(tmp_path)


def test_kv_temp_file_of_an_interrupted_write_is_swept(tmp_path):
    kv = KvStore(tmp_path)
    kv.put("jobs", "j1", b"done")
    torn = tmp_path / "kv" / ".jobs.json.abc123.tmp"   # what a kill between write and rename leaves
    torn.write_text('{"j1": "dG9ybg')
    again = KvStore(tmp_path)
    assert again.get("jobs", "j1") == b"done" and not torn.exists()


def test_heartbeat_from_load_maps_known_fields_and_extra():
    hb = wire.heartbeat_from_load({"queue_len": 2, "in_flight": 1.0, "is_sleeping": True, "gpu": 0.5,
                                   "name": "ignored", "extra": {"frontend_index": 1}}, "L", "s0r0", [])
    assert (hb.queue_len, hb.in_flight, hb.is_sleeping) == (2, 1, True)
    assert dict(hb.extra) == {"gpu": 0.5, "frontend_index": 1.0}


def _rep(**kw):
    base = dict(stage_id=0, replica_id="s0r0", replica_index=0, role="STAGE", host="h", pid=7, endpoints={},
                state="READY", queue_len=4, in_flight=1, requests_total=9, cpu_seconds=0.0, is_sleeping=True,
                draining=False, extra={}, heartbeat_age_s=0.25, version="", capabilities={})
    return ReplicaInfo(**{**base, **kw})


def test_render_table_and_problems():
    st = Status(replicas=[_rep(), _rep(stage_id=-1, replica_id="fe0", role="FRONTEND", is_sleeping=False)],
                stages=[StageStatus(0, 1, 1), StageStatus(1, 0, 0)], config_hash="ab" * 32, has_config=True,
                lease_ttl_s=5.0, pipeline_config={})
    lines = render_table(st).splitlines()
    assert lines[0] == "pipeline: 2 stage(s), config abababababab, lease ttl 5 s"
    assert lines[3].split() == ["0", "s0r0", "h", "7", "READY", "4", "1", "0.2s", "yes"]
    assert lines[4].split()[:2] == ["1", "-"] and "NO REPLICA" in lines[4]
    assert lines[-1].split() == ["fe0", "h", "7", "READY", "9", "1"]
    assert st.problems() == ["stage 0 has no awake READY replica (s0r0 asleep: `omni wakeup --stage 0`)",
                             "stage 1 has no READY replica"]
    empty = Status([], [], "", False, 5.0, {})
    assert empty.problems() == ["the master has no pipeline config yet (nothing has registered)"]
    assert json.loads(json.dumps(wire.command_kind("sleep"))) == 2


def test_a_stage_whose_ready_replicas_all_sleep_is_a_problem():
    """Every request to an asleep stage is a 503 (`omni wakeup --stage K`): `omni status` said healthy, exit 0."""
    awake, asleep = _rep(replica_id="s0r0", is_sleeping=False), _rep(replica_id="s0r1", replica_index=1)

    def status(*reps):
        return Status(replicas=list(reps), stages=[StageStatus(0, sum(r.state == "READY" for r in reps), len(reps))],
                      config_hash="", has_config=True, lease_ttl_s=5.0, pipeline_config={})
    assert status(asleep).problems() == ["stage 0 has no awake READY replica (s0r1 asleep: `omni wakeup --stage 0`)"]
    assert status(awake, asleep).problems() == []
    # an awake replica that is not READY serves nothing either: the asleep READY one is still the stage's verdict
    assert status(asleep, _rep(replica_id="s0r2", state="DRAINING", is_sleeping=False)).problems() == [
        "stage 0 has no awake READY replica (s0r1 asleep: `omni wakeup --stage 0`)"]


def test_a_stages_serving_replicas_are_its_ready_awake_ones():
    """One definition for `omni status` (problems) and `omni sleep --force` (admin._what_stops)."""
    reps = [_rep(replica_id="s0r0", is_sleeping=False), _rep(replica_id="s0r1", replica_index=1),
            _rep(replica_id="s0r2", state="DRAINING", is_sleeping=False),
            _rep(stage_id=1, replica_id="s1r0", is_sleeping=False),
            _rep(stage_id=-1, replica_id="fe0", role="FRONTEND", is_sleeping=False)]
    st = Status(reps, [StageStatus(0, 2, 3), StageStatus(1, 1, 1)], "", True, 5.0, {})
    assert [r.replica_id for r in st.ready(0)] == ["s0r0", "s0r1"]
    assert [r.replica_id for r in st.serving(0)] == ["s0r0"]
    assert [r.replica_id for r in st.serving(-1)] == []


def test_kv_put_only_if_exists_never_brings_back_a_deleted_key(tmp_path):
    """A conditional write: an update (a job's status) that a delete in between must not undo."""
    now = [1000.0]
    kv = KvStore(tmp_path, limits={"jobs": Limits(ttl_s=60)}, clock=lambda: now[0])
    assert kv.put("jobs", "j", b"queued") is True
    assert kv.put("jobs", "j", b"running", only_if_exists=True) is True and kv.get("jobs", "j") == b"running"
    assert kv.delete("jobs", "j")
    assert kv.put("jobs", "j", b"done", only_if_exists=True) is False
    assert kv.get("jobs", "j") is None and not (tmp_path / "kv" / "jobs.json").exists()
    assert kv.put("other", "k", b"v", only_if_exists=True) is False and kv.list("other") == ({}, "")
    kv.put("jobs", "old", b"queued")
    now[0] += 61                                  # expired: as good as deleted
    assert kv.put("jobs", "old", b"done", only_if_exists=True) is False and kv.get("jobs", "old") is None
    with pytest.raises(KvError, match="bad kv namespace"):   # still checked first
        kv.put("../x", "k", b"", only_if_exists=True)


def test_kv_put_only_if_exists_over_grpc_sync_and_async():
    import asyncio

    from omni.master.client import AsyncMasterClient, MasterClient
    from omni.master.configdiff import hash_config
    from omni.master.server import MasterServer

    cfg = {"model": "m", "stages": [{"stage_id": 0, "engine_args": {}}]}
    server = MasterServer(cfg, hash_config(cfg))
    server.start()
    try:
        client = MasterClient(server.address)
        assert client.kv_put("jobs", "j", b"queued") is True
        assert client.kv_put("jobs", "j", b"running", only_if_exists=True) is True
        assert client.kv_get("jobs", "j") == b"running" and client.kv_delete("jobs", "j")
        assert client.kv_put("jobs", "j", b"done", only_if_exists=True) is False
        assert client.kv_get("jobs", "j") is None
        client.close()

        async def via_asyncio():
            ac = AsyncMasterClient(server.address)
            try:
                made = await ac.kv_put("jobs", "a", b"queued")
                updated = await ac.kv_put("jobs", "a", b"done", only_if_exists=True)
                await ac.kv_delete("jobs", "a")
                return made, updated, await ac.kv_put("jobs", "a", b"x", only_if_exists=True), \
                    await ac.kv_get("jobs", "a")
            finally:
                await ac.close()

        assert asyncio.run(via_asyncio()) == (True, True, False, None)
    finally:
        server.stop(grace=0.2)
