"""The content-addressed store: artifacts/store/<stage>/<key>/, written once, never mutated.

Beside each object sit <key>.json (its file hashes, digest, the key's inputs and
run-time measurements, none of which are in the hashed tree) and <key>.log.
Per-recipe pointers artifacts/<recipe>/<stage>.json say what a recipe resolves to.
A stat cache (size, mtime_ns, ctime_ns, inode) -> BLAKE3 keeps up-to-date checks from
re-reading large unchanged files, like git's index.
"""
from __future__ import annotations

import fcntl
import fnmatch
import json
import mmap
import os
import shutil
import sqlite3
import stat
import time
from contextlib import contextmanager
from pathlib import Path

import blake3

from stages.engine import jsontext
from stages.engine.errors import UserError

HASH_WINDOW = 64 << 20


def hash_file(path: Path) -> str:
    """BLAKE3 of a file, hashed on every core a memory-mapped window at a time (shards, weights
    and sources run to GBs; a window keeps the mapping, and so the RSS, small)."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        for at in range(0, size, HASH_WINDOW):
            with mmap.mmap(f.fileno(), min(HASH_WINDOW, size - at), offset=at, access=mmap.ACCESS_READ) as window:
                h.update(window)
    return h.hexdigest()


def merkle(files: dict[str, str]) -> str:
    """Digest of a tree: BLAKE3 over sorted (relative path, file BLAKE3) pairs."""
    h = blake3.blake3()
    for rel in sorted(files):
        h.update(f"{rel}\0{files[rel]}\n".encode())
    return h.hexdigest()


def select(files: dict[str, str], patterns: list[str]) -> dict[str, str]:
    """The files of a tree that a downstream stage reads (fnmatch patterns)."""
    return {r: d for r, d in files.items() if any(fnmatch.fnmatchcase(r, p) for p in patterns)}


OTHER_KINDS = {stat.S_IFLNK: "a symlink", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket",
               stat.S_IFCHR: "a device", stat.S_IFBLK: "a device"}
UNREADABLE = "cannot be read"


def shown(name: str) -> str:
    """A name as a message may print it: a newline or other control character in a file name
    would let it write lines of its own into verify's output, so those are escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in name)


def scan(root: Path) -> tuple[list[str], list[str], dict[str, str]]:
    """A tree as it is on disk, links not followed: its regular files and its directories
    (relative paths, sorted), and everything else (a symlink, a FIFO...) with what it is. An
    artifact holds regular files only: a symlink could point out of the store, a FIFO block a read."""
    files, dirs, others = [], [], {}
    for top, subdirs, names in os.walk(root):  # a symlink to a directory is listed, never entered
        for name in subdirs + names:
            path = Path(top, name)
            rel, mode = path.relative_to(root).as_posix(), path.lstat().st_mode
            if stat.S_ISREG(mode):
                files.append(rel)
            elif stat.S_ISDIR(mode):
                dirs.append(rel)
            else:
                others[rel] = OTHER_KINDS.get(stat.S_IFMT(mode), "not a regular file")
    return sorted(files), sorted(dirs), others


def list_files(root: Path) -> list[str]:
    return scan(root)[0]


def write_json(path: Path, obj) -> None:
    """Write JSON atomically (temp file + rename), so a kill never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read_json(path: Path):
    try:
        return jsontext.read(path)
    except (OSError, ValueError):
        return None


def stat_key(path: Path) -> tuple[int, int, int, int]:
    """What the quick check trusts: size, mtime, ctime and inode. A write that puts the mtime
    back (os.utime, cp -p) still moves the ctime, which no user call can set; only a change
    below the filesystem (bit rot, a raw disk write) or a clock set back slips past it."""
    st = path.stat()
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


class StatCache:
    """(path, size, mtime_ns, ctime_ns, inode) -> BLAKE3, in sqlite so a kill cannot corrupt it."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(path, timeout=30)
        self.db.execute("CREATE TABLE IF NOT EXISTS files (path TEXT PRIMARY KEY, size INT, "
                        "mtime_ns INT, ctime_ns INT, ino INT, digest TEXT)")

    def digest(self, path: Path) -> str:
        row = self.db.execute("SELECT size, mtime_ns, ctime_ns, ino, digest FROM files WHERE path=?",
                              (str(path),)).fetchone()
        if row and tuple(row[:4]) == stat_key(path):
            return row[4]
        return self.remember(path, hash_file(path))

    def remember(self, path: Path, digest: str) -> str:
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO files VALUES (?,?,?,?,?,?)",
                            (str(path), *stat_key(path), digest))
        return digest


class Store:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.objects = self.root / "store"
        self._stat = None

    @property
    def stat(self) -> StatCache:
        if self._stat is None:
            self._stat = StatCache(self.root / "statcache.sqlite")
        return self._stat

    # objects -----------------------------------------------------------------
    def path(self, stage: str, key: str) -> Path:
        return self.objects / stage / key

    def sidecar(self, stage: str, key: str) -> dict | None:
        return read_json(self.objects / stage / f"{key}.json")

    def damage(self, stage: str, key: str, full: bool = False, files: dict | None = None) -> list[str]:
        """What differs between an object and its recorded hashes ([] when intact).

        `files` defaults to the hashes recorded at build time (a manifest passes its
        own). Uses the stat cache unless full=True, so the everyday check never
        re-reads unchanged files."""
        obj = self.path(stage, key)
        if files is None:
            meta = self.sidecar(stage, key)
            files = meta and meta["files"]
        if obj.is_symlink() or not obj.is_dir() or files is None:
            return [f"artifact {key} is missing from the store"]
        problems = []
        regular, dirs, others = scan(obj)
        present = set(regular)
        for rel, want in sorted(files.items()):
            if rel in others:
                problems.append(f"{shown(rel)} is {others[rel]}, not a regular file")
                continue
            if rel not in present:
                problems.append(f"{shown(rel)} is missing")
                continue
            try:
                got = hash_file(obj / rel) if full else self.stat.digest(obj / rel)
            except OSError as e:
                problems.append(f"{shown(os.path.relpath(obj / rel))} {UNREADABLE} ({e.strerror}): "
                                f"restore its permissions")
                continue
            if got != want:
                problems.append(f"{shown(rel)} differs (blake3 {got[:12]}, expected {want[:12]})")
        holding = {parent.as_posix() for rel in [*files, *regular, *others] for parent in Path(rel).parents}
        problems += [f"{shown(rel)} is not part of the artifact" for rel in sorted(present - set(files))]
        problems += [f"{shown(rel)}, {kind}, is not part of the artifact" for rel, kind in sorted(others.items())
                     if rel not in files]
        problems += [f"{shown(rel)}/, a directory, is not part of the artifact" for rel in dirs if rel not in holding]
        return problems

    def commit(self, stage: str, key: str, tmp: Path, sidecar: dict) -> dict:
        """Hash a finished temp dir, record it, and rename it into place atomically. Empty
        directories are no part of a tree's digest, so they are left out of the object."""
        regular, dirs, others = scan(tmp)
        if others:
            rel, kind = next(iter(sorted(others.items())))
            raise UserError(f"{stage}: the build wrote {shown(rel)}, {kind}; an artifact holds regular files only")
        for rel in reversed(dirs):  # deepest first
            if not any((tmp / rel).iterdir()):
                (tmp / rel).rmdir()
        files = {rel: hash_file(tmp / rel) for rel in regular}
        sidecar = dict(sidecar, files=files, digest=merkle(files))
        for p in tmp.rglob("*"):
            if p.is_file():
                p.chmod(0o444)
        final = self.path(stage, key)
        if final.exists():  # a damaged object: keep it aside, never delete data
            os.replace(final, final.with_name(f".damaged-{key}-{int(time.time())}"))
        write_json(self.objects / stage / f"{key}.json", sidecar)
        os.replace(tmp, final)
        for rel, digest in files.items():
            self.stat.remember(final / rel, digest)
        return sidecar

    @contextmanager
    def building(self, stage: str, key: str, waiting):
        """Held while one process builds (stage, key): another process that would build the
        same key calls waiting() and blocks until this one is done, then finds the object
        built. (An flock: released by the kernel when a build is killed.)"""
        path = self.root / "locks" / stage / f"{key}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                waiting()
                fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def temp_dir(self, stage: str, key: str) -> Path:
        """A fresh private dir for building (called under building(), so leftovers for this key
        are of a killed build, never a live one, and are removed)."""
        parent = self.objects / stage
        parent.mkdir(parents=True, exist_ok=True)
        for old in parent.glob(f".tmp-{key}-*"):  # its dir, its log, its inputs' links
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)
        tmp = parent / f".tmp-{key}-{os.getpid()}"
        tmp.mkdir()
        return tmp

    def work_dir(self, stage: str, key: str) -> Path:
        """Scratch space that survives a kill (training checkpoints to resume from)."""
        return self.root / "work" / stage / key

    # pointers ----------------------------------------------------------------
    def pointer(self, recipe: str, stage: str) -> dict | None:
        return read_json(self.root / recipe / f"{stage}.json")

    def set_pointer(self, recipe: str, stage: str, key: str, digest: str) -> None:
        """Point the recipe at an object, and its readable view at it: artifacts/<recipe>/latest/<stage>
        links to the object, so the current build's files are found by name (latest/eval/eval.json)."""
        if self.pointer(recipe, stage) != {"key": key, "digest": digest}:
            write_json(self.root / recipe / f"{stage}.json", {"key": key, "digest": digest})
        link, target = self.root / recipe / "latest" / stage, Path("..", "..", "store", stage, key)
        if not link.is_symlink() or Path(os.readlink(link)) != target:
            link.parent.mkdir(parents=True, exist_ok=True)
            tmp = link.with_name(f".{stage}.{os.getpid()}.tmp")
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(target, target_is_directory=True)
            os.replace(tmp, link)
