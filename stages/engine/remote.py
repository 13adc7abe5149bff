"""A remote cache of store entries at an fsspec URL (a directory, s3:// through s3fs), laid out as
Bazel's remote cache is: cas/<ab>/<blake3> holds each file's bytes by content, and
ac/<stage>/<key>.json (the key's sidecar: inputs, file digests and sizes, tree digest, the log's
digest and size) is written last, so an entry is visible only once every byte it names is there.
A push killed halfway leaves blobs no entry names yet, which the next push reuses.

The remote is untrusted input (DESIGN.md, trust model): whoever can write it can recompute every
hash, so an entry is read within a cap and checked for shape before any blob is fetched or anything
written: its stage and key those of its path, `also` (a manifest's entry only, one level deep, and
only what its manifest.json names) naming stages of the stage table, keys and digests of their exact
hex form, each file path relative and inside its object, sizes declared and under a cap, then
enforced while downloading, its run-time measurements of the shape their readers format. It is
installed only if its inputs hash to its key and every byte matches its digest.
"""
from __future__ import annotations

import errno
import functools
import json
import math
import os
import shutil
import stat
import tempfile
import uuid
from pathlib import Path

import blake3
import fsspec.core

from stages.engine import jsontext, keys
from stages.engine.errors import UserError
from stages.engine.names import is_digest, named, path_problem
from stages.engine.store import Store, hash_file, merkle

SETTING = "MINDXTRAIN_REMOTE"
CHUNK = 8 << 20
# Object stores show an object only once its upload is whole; anywhere else (a directory, a mount)
# a file is written beside its place and renamed into it.
WHOLE_OR_NOTHING = {"s3", "s3a", "gs", "gcs", "az", "abfs", "memory"}

# An entry is a key's inputs (recipe slice, code digests, versions: a few KB) and ~150 bytes per
# file (its digest and size): tiny's are 1.5-3 KB, a model's checkpoint or shards a few dozen
# files. 4 MiB holds some 25,000 files, and bounds what a hostile entry costs to parse (json.loads
# of 4 MiB of `[{},{},...]` takes about 100 MB; the 400 MB entry of issue 36 took 860 MB).
ENTRY_CAP = 4 << 20
# One file of an artifact: the largest real ones are checkpoint weights, a few GB a shard (a whole
# 405B-parameter bf16 model in one file is ~810 GB). 1 TiB is above any of them, so an entry may
# not ask for more disk than any real artifact does.
FILE_CAP = 1 << 40
ENTRY_FIELDS = {"stage", "key", "sidecar", "sizes", "log", "also"}
SIDECAR_FIELDS = {"inputs", "run", "files", "digest"}
NAMED = "a stage of the stage table with a key of 32 lowercase hex characters"
# Filesystems where a path can be a FIFO or a device: a file there is opened, then checked on its handle.
LOCAL = {"file", "local"}


class Rejected(UserError):
    """A remote entry that is malformed, or does not match its key or its digests: not installed."""


def quoted(value) -> str:
    """A value from an entry as an error line quotes it: escaped (a newline in it cannot end the line)
    and short."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_size(value) -> bool:
    return type(value) is int and 0 <= value <= FILE_CAP


def run_problem(run) -> str | None:
    """What is wrong with a sidecar's run-time measurements, which no hash covers, for the readers
    that format them (show and the report: the seconds a stage took, the probe's measurement rows);
    None when they have the shape a build writes."""
    if not isinstance(run, dict):
        return "is not an object"
    seconds = run.get("seconds")
    if seconds is not None and not (type(seconds) in (int, float) and math.isfinite(seconds) and seconds >= 0):
        return f"has seconds {quoted(seconds)}, not a number of seconds"
    probe = run.get("probe")
    if probe is not None and not (isinstance(probe, dict) and isinstance(probe.get("measurements", []), list)
                                  and all(isinstance(m, dict) for m in probe.get("measurements", []))):
        return "has a probe that is not an object with a list of measurement rows"
    return None


def checked(data: bytes, stage: str, key: str, stages, where: str) -> dict:
    """The entry read from `where` for (stage, key), once it has exactly the shape push writes: stage
    and key those of its path, files at relative paths inside the object with 64-hex digests and
    sizes up to FILE_CAP, `also` of stages in `stages` with 32-hex keys. Anything else is a one-line
    Rejected naming `where`, raised before any blob is fetched or anything written."""
    def refuse(problem: str, todo: str = "push it again from a store that has it intact") -> Rejected:
        return Rejected(f"{where}: {problem}; not installed: {todo}")

    try:
        entry = jsontext.loads(data)
    except jsontext.TooDeep as e:
        raise refuse(str(e)) from None
    except ValueError as e:  # not JSON, not UTF-8, or an integer longer than Python reads
        raise refuse(f"not JSON ({quoted(str(e))})") from None
    if not isinstance(entry, dict):
        raise refuse(f"not a JSON object but {quoted(entry)}")
    if "sizes" not in entry:
        raise refuse("it declares no file sizes (pushed by an earlier mindxtrain)", "push it again with this one")
    if set(entry) != ENTRY_FIELDS:
        raise refuse(f"its fields are {quoted(sorted(entry))}, not {sorted(ENTRY_FIELDS)}")
    if entry["stage"] != stage or entry["key"] != key:
        raise refuse(f"it says it is the entry of {quoted(entry['stage'])} {quoted(entry['key'])}")
    meta, sizes, log, also = entry["sidecar"], entry["sizes"], entry["log"], entry["also"]
    if not (isinstance(meta, dict) and set(meta) == SIDECAR_FIELDS and isinstance(meta["inputs"], dict)
            and isinstance(meta["files"], dict) and is_digest(meta["digest"])):
        raise refuse("its sidecar is not an object of inputs, run, files and a digest")
    if problem := run_problem(meta["run"]):
        raise refuse(f"its run-time measurements {problem}")
    files = meta["files"]
    for rel, digest in files.items():
        if problem := path_problem(rel):
            raise refuse(f"the file path {quoted(rel)} {problem}")
        if not is_digest(digest):
            raise refuse(f"{quoted(rel)}'s digest {quoted(digest)} is not 64 lowercase hex characters")
    folders = {"/".join(rel.split("/")[:n]) for rel in files for n in range(1, rel.count("/") + 1)}
    if both := sorted(folders & files.keys()):
        raise refuse(f"{quoted(both[0])} is both a file and a folder")
    if not isinstance(sizes, dict) or sizes.keys() != files.keys():
        raise refuse("its sizes do not name exactly its files")
    if wrong := sorted(rel for rel, size in sizes.items() if not is_size(size)):
        raise refuse(f"{quoted(wrong[0])}'s size {quoted(sizes[wrong[0]])} is not 0 to {FILE_CAP} bytes")
    if log is not None and not (isinstance(log, dict) and set(log) == {"digest", "size"}
                                and is_digest(log["digest"]) and is_size(log["size"])):
        raise refuse(f"its log {quoted(log)} is not a digest and a size up to {FILE_CAP} bytes")
    if not (isinstance(also, list) and all(isinstance(pair, list) and len(pair) == 2 for pair in also)):
        raise refuse("its also is not a list of [stage, key] pairs")
    for other_stage, other_key in also:
        if not named(other_stage, other_key, stages):
            raise refuse(f"it names {quoted(other_stage)} {quoted(other_key)}, not {NAMED}")
    if also and stage != "manifest":
        raise refuse("it names entries to install with it, which only a manifest's entry does")
    if len({other_stage for other_stage, _ in also}) != len(also):
        raise refuse("its also names a stage twice (a manifest names one entry a stage)")
    try:
        inputs_key = keys.key_of(meta["inputs"])
    except ValueError:  # a string JSON holds but UTF-8 cannot (an unpaired surrogate)
        inputs_key = None
    if inputs_key != key or merkle(files) != meta["digest"]:
        raise refuse(f"the entry does not match its key {key[:12]} (its inputs or digests were changed)")
    return entry


class Remote:
    def __init__(self, url: str):
        self.url = url
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as e:
            raise UserError(f"remote {url}: cannot open it ({e}); give a directory or s3://bucket/prefix") from None
        protocols = set(self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))
        self.whole_or_nothing = bool(WHOLE_OR_NOTHING & protocols)
        self.local = bool(LOCAL & protocols)

    def entry_path(self, stage: str, key: str) -> str:
        return f"{self.root}/ac/{stage}/{key}.json"

    def where(self, stage: str, key: str) -> str:
        """The entry's URL, as a one-line rejection names it."""
        return f"{self.url.rstrip('/')}/ac/{stage}/{key}.json"

    def blob_path(self, digest: str) -> str:
        return f"{self.root}/cas/{digest[:2]}/{digest}"

    def opened(self, path: str):
        """(what path is, its size, the file opened for reading or None where it is not a regular
        file). On a local filesystem the path is opened first, without blocking (a FIFO opens at
        once), and checked on the open handle: a file swapped for a FIFO or a link to a device
        between a look and an open is refused, never read or waited on. FileNotFoundError where
        there is nothing."""
        if self.local:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
            except OSError as e:
                if e.errno == errno.ENXIO:  # a UNIX socket, or a device with nothing behind it
                    return "non-file", None, None
                raise
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                return "directory" if stat.S_ISDIR(st.st_mode) else "non-file", st.st_size, None
            os.set_blocking(fd, True)
            return "file", st.st_size, os.fdopen(fd, "rb")
        info = self.fs.info(path)
        if info.get("type") != "file":
            return info.get("type"), info.get("size"), None
        return "file", info.get("size"), self.fs.open(path, "rb")

    def read_entry(self, stage: str, key: str) -> bytes | None:
        """The entry's bytes, or None where the remote has none. A non-file (a link to /dev/zero, a
        FIFO) or one above ENTRY_CAP is refused unread, and no more than ENTRY_CAP + 1 bytes are read
        in any case (a file can grow, or change, between the look and the read)."""
        path, where = self.entry_path(stage, key), self.where(stage, key)
        try:
            kind, size, f = self.opened(path)
        except FileNotFoundError:
            return None
        if f is None or (size or 0) > ENTRY_CAP:
            if f is not None:
                f.close()
            raise Rejected(f"{where}: not a file of at most {ENTRY_CAP >> 20} MiB ({kind}, {size} bytes); not "
                           f"installed: push it again from a store that has it")
        with f:
            data = f.read(ENTRY_CAP + 1)
        if len(data) > ENTRY_CAP:
            raise Rejected(f"{where}: longer than {ENTRY_CAP >> 20} MiB; not installed: push it again from a "
                           f"store that has it")
        return data

    def has(self, stage: str, key: str) -> bool:
        return self.fs.exists(self.entry_path(stage, key))

    def _put(self, local: Path | None, data: bytes | None, path: str) -> None:
        """Write a file (from disk) or bytes to path so that a reader sees all of it or nothing."""
        target = path
        if not self.whole_or_nothing:
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            target = f"{path}.tmp-{uuid.uuid4().hex}"
        if local is not None:
            self.fs.put_file(str(local), target)
        else:
            self.fs.pipe_file(target, data)
        if target != path:
            self.fs.mv(target, path)

    def file_size(self, path: str) -> int | None:
        """The size of the regular file at path; None where there is none, or it is something else
        (a link to a device, a FIFO, a directory)."""
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            return None
        return info.get("size") if info.get("type") == "file" else None

    def holds(self, path: str, data: bytes) -> bool:
        """Whether path is a file of exactly these bytes (read no further than their length)."""
        try:
            _, size, f = self.opened(path)
        except FileNotFoundError:
            return False
        if f is None:
            return False
        with f:
            return size == len(data) and f.read(len(data)) == data

    def push(self, store: Store, stage: str, key: str, also: list[tuple[str, str]] = ()) -> tuple[int, int]:
        """Upload a local entry's files the remote lacks (or holds at another size: a truncated or
        tampered copy), then its entry, with every file's size, which a fetch enforces. Returns
        (files uploaded, bytes uploaded). Pushing what is there already uploads nothing and rewrites
        nothing. `also` names entries (pushed before this one) that a fetch of it installs with it."""
        meta, obj = store.sidecar(stage, key), store.path(stage, key)
        log = obj.with_suffix(".log")
        blobs = {digest: obj / rel for rel, digest in meta["files"].items()}
        sizes = {rel: (obj / rel).stat().st_size for rel in meta["files"]}
        log_blob = None
        if log.is_file():
            log_blob = {"digest": hash_file(log), "size": log.stat().st_size}
            blobs[log_blob["digest"]] = log
        entry = {"stage": stage, "key": key, "sidecar": meta, "sizes": sizes, "log": log_blob,
                 "also": sorted(map(list, also))}
        data = json.dumps(entry, indent=1, sort_keys=True).encode()
        if len(data) > ENTRY_CAP or max(sizes.values(), default=0) > FILE_CAP:
            raise UserError(f"push: {stage} {key[:12]} is larger than a fetch accepts (an entry of {len(data)} bytes, "
                            f"at most {ENTRY_CAP}; files up to {FILE_CAP} bytes): raise ENTRY_CAP or FILE_CAP in "
                            f"stages/engine/remote.py, with the reason")
        sent = size = 0
        for digest, local in sorted(blobs.items()):
            if self.file_size(self.blob_path(digest)) != local.stat().st_size:
                self._put(local, None, self.blob_path(digest))
                sent, size = sent + 1, size + local.stat().st_size
        if not self.holds(self.entry_path(stage, key), data):
            self._put(None, data, self.entry_path(stage, key))
        return sent, size

    def _download(self, digest: str, size: int, dest: Path, what: str) -> None:
        """Copy a blob of `size` bytes (as its entry declares) to dest, hashing it on the way; Rejected
        if it is not a file of that size, or its bytes are not its digest. Never reads more than size + 1
        bytes, whatever the remote says its size is (a link to /dev/zero says 0)."""
        path, h, got = self.blob_path(digest), blake3.blake3(), 0
        try:
            kind, found, src = self.opened(path)
        except FileNotFoundError:
            raise Rejected(f"{what}: its content {digest[:12]} is missing from the remote {self.url}; "
                           f"not installed: push it again from a store that has it") from None
        if src is None or found != size:
            if src is not None:
                src.close()
            raise Rejected(f"{what}: its content {digest[:12]} in the remote {self.url} is not a file of the {size} "
                           f"bytes declared (a {kind} of {found} bytes); not installed: "
                           f"push it again from a store that has it intact")
        with src, open(dest, "wb") as out:
            while chunk := src.read(min(CHUNK, size + 1 - got)):
                got += len(chunk)
                if got > size:
                    raise Rejected(f"{what}: its content {digest[:12]} in the remote {self.url} runs past the {size} "
                                   f"bytes declared; not installed: push it again from a store that has it intact")
                h.update(chunk)
                out.write(chunk)
        if got < size or h.hexdigest() != digest:
            raise Rejected(f"{what} differs in the remote {self.url} ({got} bytes, blake3 {h.hexdigest()[:12]}; "
                           f"expected {size}, {digest[:12]}); not installed: push it again from a store that has it "
                           f"intact")

    def fetch(self, store: Store, stage: str, key: str, stages, waiting=lambda: None) -> bool:
        """Install the remote's entry for (stage, key) into the store, its shape checked before any blob
        is fetched (`stages`: the stage table's names, the only ones its `also` may name) and its bytes
        checked before it is committed; False where the remote has none. A manifest's entry names the
        entries to install with it (`also`: upstreams its manifest names under earlier keys, which early
        cutoff kept): each is read and checked, and must be named by the manifest's own manifest.json,
        before anything is installed; they are installed first, the manifest last, and none of them
        names others in turn. Each under the store's build lock of its key, so a build of the same key
        elsewhere waits for it (or it for the build)."""
        where = self.where(stage, key)
        data = self.read_entry(stage, key)
        if data is None:
            return False
        entry = checked(data, stage, key, stages, where)
        others = [(other_stage, other_key, self.named_entry(other_stage, other_key, stages, where))
                  for other_stage, other_key in entry["also"]]
        if others:
            self.check_named_by_manifest(entry, where)
        for other_stage, other_key, other in others:
            self.install(store, other_stage, other_key, other, self.where(other_stage, other_key), waiting)
        self.install(store, stage, key, entry, where, waiting)
        return True

    def named_entry(self, stage: str, key: str, stages, where: str) -> dict:
        """The entry a manifest's entry (at `where`) names to install with it, read and checked."""
        data = self.read_entry(stage, key)
        if data is None:
            raise Rejected(f"{where}: names {stage} {key[:12]}, which the remote lacks; not installed: push it "
                           f"again from the store that built it")
        return checked(data, stage, key, stages, self.where(stage, key))

    def check_named_by_manifest(self, entry: dict, where: str) -> None:
        """Rejected unless every entry `also` names is one the entry's manifest.json names (its bytes
        checked against their digest first)."""
        refuse = "not installed: push it again from a store that has it intact"
        files, sizes = entry["sidecar"]["files"], entry["sizes"]
        if "manifest.json" not in files:
            raise Rejected(f"{where}: it names entries to install with it but holds no manifest.json; {refuse}")
        if sizes["manifest.json"] > jsontext.SIZE_CAP:  # refused before a byte of it lands in the temp dir
            raise Rejected(f"{where}: its manifest.json is declared {sizes['manifest.json']} bytes, over the "
                           f"{jsontext.SIZE_CAP} any JSON file of an artifact may be; {refuse}")
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / "manifest.json"
            self._download(files["manifest.json"], sizes["manifest.json"], local, f"{where}: manifest.json")
            try:
                named = {(name, art["key"]) for name, art in jsontext.read(local)["artifacts"].items()}
            except (ValueError, TypeError, KeyError, AttributeError):
                raise Rejected(f"{where}: its manifest.json is not a manifest; {refuse}") from None
        for other_stage, other_key in entry["also"]:
            if (other_stage, other_key) not in named:
                raise Rejected(f"{where}: it names {other_stage} {other_key[:12]} to install with it, which its "
                               f"manifest.json does not name; {refuse}")

    def install(self, store: Store, stage: str, key: str, entry: dict, where: str, waiting) -> None:
        """A checked entry's files downloaded, each checked against its digest and size, then committed."""
        meta = entry["sidecar"]
        with store.building(stage, key, waiting):
            if not store.damage(stage, key):
                return  # installed meanwhile, by another pull or a build
            tmp = store.temp_dir(stage, key)
            log = tmp.with_suffix(".log")
            try:
                for rel, digest in sorted(meta["files"].items()):
                    (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                    self._download(digest, entry["sizes"][rel], tmp / rel, f"{where}: {rel}")
                if entry["log"]:
                    self._download(entry["log"]["digest"], entry["log"]["size"], log, f"{where}: its log")
                store.commit(stage, key, tmp, {k: v for k, v in meta.items() if k not in ("files", "digest")})
                if log.exists():
                    log.replace(store.path(stage, key).with_suffix(".log"))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
                log.unlink(missing_ok=True)


@functools.lru_cache(maxsize=None)
def remote(url: str) -> Remote:
    return Remote(url)


def configured(url: str | None = None) -> Remote:
    """The remote named by url, else by MINDXTRAIN_REMOTE; UserError naming both where neither is."""
    url = url or os.environ.get(SETTING)
    if not url:
        raise UserError(f"no remote: set {SETTING}=<url> (a directory or s3://bucket/prefix) or pass --remote <url>")
    return remote(url)


def fill(store: Store, stage: str, key: str, label: str, stages) -> bool:
    """A local miss tried in the remote MINDXTRAIN_REMOTE names before building: True once the
    entry is installed (`stages`: the stage table's names, as fetch takes them). A remote that
    cannot be read, or an entry it rejects, never fails the build: it says so in one line and the
    stage builds locally."""
    url = os.environ.get(SETTING)
    if not url:
        return False
    try:
        waiting = lambda: print(f"{label}: another process is installing {key[:12]}; waiting", flush=True)  # noqa: E731
        got = remote(url).fetch(store, stage, key, stages, waiting)
    except Rejected as e:
        print(f"{label}: remote entry rejected: {e}; building it here", flush=True)
        return False
    except Exception as e:  # noqa: BLE001 -- a remote cache that fails (network, credentials) must not fail a build
        print(f"{label}: cannot read the remote {url} ({type(e).__name__}: {e}); building it here", flush=True)
        return False
    if got:
        print(f"{label}: fetched {key[:12]} from the remote {url}", flush=True)
    return got


def present(stage: str, key: str) -> str | None:
    """The URL of the configured remote where it holds (stage, key); None otherwise or unreadable."""
    url = os.environ.get(SETTING)
    try:
        return url if url and remote(url).has(stage, key) else None
    except Exception:  # noqa: BLE001 -- status reports a remote it cannot read as not having it
        return None
