"""The KV store's disk form (omni/master/kv_journal.py): a put appends a line, a snapshot is rewritten on a
thread, and a load after a kill at any point returns every answered change."""

import shutil
import threading

import pytest

from omni.errors import ConfigError
from omni.master import kv as kv_mod
from omni.master import kv_journal
from omni.master.kv import KvFull, KvStore


def _state(kv: KvStore, ns: str) -> dict:
    page, after = kv.list(ns)
    assert not after
    return page


def test_a_put_appends_instead_of_rewriting_the_namespace(tmp_path):
    """Before, each put rewrote the whole namespace on the master's event loop (0.6 s at 62 MiB)."""
    kv = KvStore(tmp_path)
    for i in range(200):
        kv.put("jobs", f"j{i:03d}", b"x" * 1000)
    log = tmp_path / "kv" / "jobs.log"
    before = log.stat().st_size
    kv.put("jobs", "j007", b"y" * 1000)
    grew = log.stat().st_size - before
    assert 1000 < grew < 1500            # one line of about the value's base64 size, not 200 entries
    kv.close()
    again = KvStore(tmp_path)
    assert again.get("jobs", "j007") == b"y" * 1000 and len(_state(again, "jobs")) == 200


def test_the_snapshot_is_rewritten_on_a_thread_and_changes_meanwhile_survive_a_kill(tmp_path, monkeypatch):
    monkeypatch.setattr(kv_journal, "MIN_COMPACT_BYTES", 1)
    entered, release = threading.Event(), threading.Event()
    write_snapshot = kv_journal.Journal._write_snapshot

    def held(self, path, entries):
        entered.set()
        assert release.wait(10)
        write_snapshot(self, path, entries)

    monkeypatch.setattr(kv_journal.Journal, "_write_snapshot", held)
    kv = KvStore(tmp_path)
    kv.put("voices", "a", b"1")
    kv.put("voices", "b", b"2" * 100)    # the log now outgrows the live data: a rewrite starts
    assert entered.wait(10)
    kv.put("voices", "c", b"3")          # while the rewrite waits, changes go to the next log
    kv.delete("voices", "a")
    kv.put("voices", "b", b"4")
    want = {"b": b"4", "c": b"3"}
    killed = tmp_path / "killed"
    shutil.copytree(tmp_path / "kv", killed / "kv")    # a kill now: old snapshot (none), log and next
    assert sorted(p.name for p in (killed / "kv").iterdir()) == ["voices.log", "voices.log.next"]
    release.set()
    assert kv._journal.wait_compacted(10)
    assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == ["voices.json", "voices.log"]
    kv.put("voices", "d", b"5")
    monkeypatch.setattr(kv_journal.Journal, "_write_snapshot", write_snapshot)
    kv.close()
    assert _state(KvStore(killed), "voices") == want
    assert _state(KvStore(tmp_path), "voices") == {**want, "d": b"5"}
    # The master restarted from the kill goes on: its changes are not replayed under the old next log
    restarted = KvStore(killed)
    restarted.put("voices", "b", b"NEW")
    restarted.delete("voices", "c")
    restarted.close()
    assert _state(KvStore(killed), "voices") == {"b": b"NEW"}
    again = KvStore(killed)                    # and after a rewrite of its own
    again.put("voices", "e", b"6" * 100)
    assert again._journal.wait_compacted(10)
    again.close()
    assert _state(KvStore(killed), "voices") == {"b": b"NEW", "e": b"6" * 100}


def test_a_line_cut_by_a_kill_is_dropped_and_the_next_put_starts_a_line_of_its_own(tmp_path, caplog):
    kv = KvStore(tmp_path)
    kv.put("voices", "a", b"1")
    kv.close()
    log = tmp_path / "kv" / "voices.log"
    with open(log, "ab") as f:
        f.write(b'{"k": "b", "v": "Mg=')     # the put was never answered
    again = KvStore(tmp_path)
    assert _state(again, "voices") == {"a": b"1"}
    assert "cut-off last line" in caplog.text
    again.put("voices", "c", b"3")
    again.close()
    assert _state(KvStore(tmp_path), "voices") == {"a": b"1", "c": b"3"}


def test_a_damaged_line_inside_a_log_is_named(tmp_path):
    kv = KvStore(tmp_path)
    kv.put("voices", "a", b"1")
    kv.put("voices", "b", b"2")
    kv.close()
    log = tmp_path / "kv" / "voices.log"
    first, second, _ = log.read_bytes().split(b"\n")
    log.write_bytes(b"not json\n" + second + b"\n")
    with pytest.raises(ConfigError, match=r"voices.log is damaged at line 1"):
        KvStore(tmp_path)


def test_namespaces_with_dots_keep_apart(tmp_path):
    kv = KvStore(tmp_path)
    for ns in ("a", "a.log", "a.json", "a.log.next"):
        kv.put(ns, "k", ns.encode())
    kv.close()
    again = KvStore(tmp_path)
    assert {ns: again.get(ns, "k") for ns in ("a", "a.log", "a.json", "a.log.next")} == {
        "a": b"a", "a.log": b"a.log", "a.json": b"a.json", "a.log.next": b"a.log.next"}


def test_the_store_as_a_whole_is_capped(monkeypatch):
    """Each namespace had a cap but the store had none: 64 namespaces of 64 MiB."""
    monkeypatch.setattr(kv_mod, "MAX_TOTAL_BYTES", 1000 + kv_mod.ENTRY_OVERHEAD + 1)
    kv = KvStore()
    kv.put("one", "k", b"x" * 600)
    with pytest.raises(KvFull, match=f"the kv store holds {600 + 1 + kv_mod.ENTRY_OVERHEAD} bytes"):
        kv.put("two", "k", b"x" * 600)
    kv.put("one", "k", b"x" * 900)           # replacing counts only the growth
    kv.delete("one", "k")
    kv.put("two", "k", b"x" * 600)


def test_keys_and_entries_count_against_the_caps(tmp_path, monkeypatch):
    """Only values counted: 1 KiB keys with empty values held 43.6 MiB of heap (and as much on disk) at
    40,000 entries while the store counted 0 bytes, so 64 namespaces passed the 256 MiB cap uncounted."""
    entry = 1024 + kv_mod.ENTRY_OVERHEAD
    limits = {"keys": kv_mod.Limits(max_bytes=10 * entry)}
    kv = KvStore(tmp_path, limits=limits)
    for i in range(10):
        kv.put("keys", f"{i:04d}" + "k" * 1020, b"")
    with pytest.raises(KvFull, match=rf"holds {10 * entry} bytes; {1 + kv_mod.ENTRY_OVERHEAD} more would pass"):
        kv.put("keys", "x", b"")
    kv.put("keys", "0000" + "k" * 1020, b"")         # the key it holds: no growth
    with pytest.raises(KvFull, match=f"; {6 + 1 + kv_mod.ENTRY_OVERHEAD} more"):
        kv.put("keys", "é" * 3, b"v")                  # a key counts its UTF-8 bytes
    assert kv._bytes == {"keys": 10 * entry}
    kv.close()
    again = KvStore(tmp_path, limits=limits)
    assert again._bytes == {"keys": 10 * entry}           # a replayed journal counts the same
    again.delete("keys", "0000" + "k" * 1020)
    assert again._bytes == {"keys": 9 * entry}
    again.close()
    monkeypatch.setattr(kv_mod, "MAX_TOTAL_BYTES", 3 * entry)
    store = KvStore()
    for ns in ("a", "b", "c"):
        store.put(ns, "k" * 1024, b"")
    with pytest.raises(KvFull, match=f"the kv store holds {3 * entry} bytes"):
        store.put("d", "k", b"")


def test_the_files_are_the_owners_alone(tmp_path, monkeypatch):
    """They were made with the umask's modes (0755, 0644): job prompts readable by every local user."""
    monkeypatch.setattr(kv_journal, "MIN_COMPACT_BYTES", 1)
    kv = KvStore(tmp_path)
    kv.put("jobs", "j1", b'{"prompt": "private"}')
    assert kv._journal.wait_compacted(10)
    monkeypatch.setattr(kv_journal, "MIN_COMPACT_BYTES", 1 << 20)
    kv.put("jobs", "j2", b"{}")
    kv.close()
    folder = tmp_path / "kv"
    assert sorted(p.name for p in folder.iterdir()) == ["jobs.json", "jobs.log"]
    assert [oct(p.stat().st_mode & 0o777) for p in (folder, *sorted(folder.iterdir()))] == ["0o700", "0o600", "0o600"]


def test_an_expiry_logs_its_deletes_with_one_fsync(tmp_path, monkeypatch):
    """Before, each expired job was its own fsynced line, all on the master's event loop: one list expiring
    3,000 jobs blocked heartbeats for 0.9 s on a test VM (seconds on a slow disk)."""
    now = [1000.0]
    kv = KvStore(tmp_path, clock=lambda: now[0])
    for i in range(300):
        kv.put("jobs", f"old-{i:03d}", b"x" * 50)
    now[0] += 86400.0
    kv.put("jobs", "new", b"y")
    now[0] += kv_mod.LIMITS["jobs"].ttl_s - 1.0       # the 300 are past the TTL, "new" is not
    fsyncs = []
    real = kv_journal.os.fsync
    monkeypatch.setattr(kv_journal.os, "fsync", lambda fd: (fsyncs.append(fd), real(fd)))
    assert _state(kv, "jobs") == {"new": b"y"}
    assert len(fsyncs) == 1
    monkeypatch.undo()
    kv.close()
    again = KvStore(tmp_path, clock=lambda: now[0])    # the deletes are durable
    assert _state(again, "jobs") == {"new": b"y"}
    again.close()
