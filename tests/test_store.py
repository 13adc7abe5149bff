"""The store's own promises: the stat cache trusts unchanged stat data, commits are read-only
and named by content, damage is found and reported per file, and nothing is ever deleted."""
from __future__ import annotations

import mmap
import os

from stages.engine.store import StatCache, Store, hash_file, merkle


def test_stat_cache_trusts_unchanged_files_and_rereads_changed_ones(tmp_path):
    cache = StatCache(tmp_path / "stat.sqlite")
    big = tmp_path / "weights.bin"
    big.write_bytes(b"a" * 1_000_000)
    first = cache.digest(big)
    assert first == hash_file(big)
    assert cache.digest(big) == first  # unchanged: trusted
    st = big.stat()
    with open(big, "r+b") as f:  # same inode, same size; the mtime put back: only the ctime moved
        f.write(b"b")
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert big.stat().st_mtime_ns == st.st_mtime_ns and big.stat().st_ctime_ns != st.st_ctime_ns
    assert cache.digest(big) == hash_file(big) != first  # re-read


def test_commit_is_read_only_and_damage_names_the_file(tmp_path):
    store = Store(tmp_path / "artifacts")
    tmp = store.temp_dir("shards", "k1")
    (tmp / "train").mkdir()
    (tmp / "train" / "a.bin").write_bytes(b"\x00\x01")
    (tmp / "stats.json").write_text("{}")
    meta = store.commit("shards", "k1", tmp, {"inputs": {}})
    obj = store.path("shards", "k1")
    assert not tmp.exists() and obj.is_dir()
    assert meta["digest"] == merkle({"stats.json": hash_file(obj / "stats.json"),
                                     "train/a.bin": hash_file(obj / "train" / "a.bin")})
    assert oct((obj / "stats.json").stat().st_mode & 0o777) == "0o444"
    assert store.damage("shards", "k1") == []

    (obj / "train" / "a.bin").chmod(0o644)
    (obj / "train" / "a.bin").write_bytes(b"\x00\x02")
    (obj / "extra.txt").write_text("x")
    problems = store.damage("shards", "k1")
    assert any(p.startswith("train/a.bin differs") for p in problems), problems
    assert any("extra.txt" in p for p in problems), problems

    tmp = store.temp_dir("shards", "k1")  # rebuilding a damaged object keeps the old one aside
    (tmp / "stats.json").write_text("{}")
    store.commit("shards", "k1", tmp, {"inputs": {}})
    assert store.damage("shards", "k1") == []
    assert len(list((tmp_path / "artifacts" / "store" / "shards").glob(".damaged-k1-*"))) == 1


def test_merkle_depends_on_names_and_contents():
    assert merkle({"a": "1", "b": "2"}) == merkle({"b": "2", "a": "1"})
    assert merkle({"a": "1", "b": "2"}) != merkle({"a": "2", "b": "1"})
    assert merkle({"a": "1"}) != merkle({"b": "1"})


def test_files_are_hashed_window_by_window_as_one_blake3(tmp_path, monkeypatch):
    import blake3

    from stages.engine import store

    monkeypatch.setattr(store, "HASH_WINDOW", mmap.ALLOCATIONGRANULARITY)  # many windows, quickly
    for size in (0, 1, mmap.ALLOCATIONGRANULARITY, 5 * mmap.ALLOCATIONGRANULARITY + 7):
        data = bytes(range(256)) * (size // 256) + bytes(size % 256)
        (tmp_path / "f").write_bytes(data)
        assert store.hash_file(tmp_path / "f") == blake3.blake3(data).hexdigest()
