"""A remote cache of store entries at an fsspec URL (a directory, s3:// through s3fs), laid out as
Bazel's remote cache is: cas/<ab>/<blake3> holds each file's bytes by content, and
ac/<stage>/<key>.json (the key's sidecar: inputs, file digests, tree digest, the log's digest) is
written last, so an entry is visible only once every byte it names is there. A push killed
halfway leaves blobs no entry names yet, which the next push reuses. A fetched entry is
installed only if its inputs hash to its key and every byte matches its digest.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import uuid
from pathlib import Path

import blake3
import fsspec.core

from stages.engine import keys
from stages.engine.errors import UserError
from stages.engine.store import Store, hash_file, merkle

SETTING = "MINDXTRAIN_REMOTE"
CHUNK = 8 << 20
# Object stores show an object only once its upload is whole; anywhere else (a directory, a mount)
# a file is written beside its place and renamed into it.
WHOLE_OR_NOTHING = {"s3", "s3a", "gs", "gcs", "az", "abfs", "memory"}


class Rejected(UserError):
    """A remote entry that does not match its key or its digests: not installed."""


class Remote:
    def __init__(self, url: str):
        self.url = url
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as e:
            raise UserError(f"remote {url}: cannot open it ({e}); give a directory or s3://bucket/prefix") from None
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.whole_or_nothing = bool(WHOLE_OR_NOTHING & set(protocols))

    def entry_path(self, stage: str, key: str) -> str:
        return f"{self.root}/ac/{stage}/{key}.json"

    def blob_path(self, digest: str) -> str:
        return f"{self.root}/cas/{digest[:2]}/{digest}"

    def entry(self, stage: str, key: str) -> dict | None:
        """The key's entry, or None where the remote has none."""
        try:
            return json.loads(self.fs.cat_file(self.entry_path(stage, key)))
        except FileNotFoundError:
            return None

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

    def push(self, store: Store, stage: str, key: str, also: list[tuple[str, str]] = ()) -> tuple[int, int]:
        """Upload a local entry's files the remote lacks, then its entry. Returns (files uploaded,
        bytes uploaded). Pushing what is there already uploads nothing and rewrites nothing.
        `also` names entries (pushed before this one) that a fetch of it installs with it."""
        meta, obj = store.sidecar(stage, key), store.path(stage, key)
        log = obj.with_suffix(".log")
        blobs = {digest: obj / rel for rel, digest in meta["files"].items()}
        log_digest = None
        if log.is_file():
            log_digest = hash_file(log)
            blobs[log_digest] = log
        sent = size = 0
        for digest, local in sorted(blobs.items()):
            if not self.fs.exists(self.blob_path(digest)):
                self._put(local, None, self.blob_path(digest))
                sent, size = sent + 1, size + local.stat().st_size
        entry = {"stage": stage, "key": key, "sidecar": meta, "log": log_digest, "also": sorted(map(list, also))}
        if self.entry(stage, key) != entry:
            self._put(None, json.dumps(entry, indent=1, sort_keys=True).encode(), self.entry_path(stage, key))
        return sent, size

    def _download(self, digest: str, dest: Path, what: str) -> None:
        """Copy a blob to dest, hashing it on the way; Rejected if its bytes are not its digest."""
        h = blake3.blake3()
        try:
            with self.fs.open(self.blob_path(digest), "rb") as src, open(dest, "wb") as out:
                while chunk := src.read(CHUNK):
                    h.update(chunk)
                    out.write(chunk)
        except FileNotFoundError:
            raise Rejected(f"{what}: its content {digest[:12]} is missing from the remote {self.url}; "
                           f"not installed: push it again from a store that has it") from None
        if h.hexdigest() != digest:
            raise Rejected(f"{what} differs in the remote {self.url} (blake3 {h.hexdigest()[:12]}, expected "
                           f"{digest[:12]}); not installed: push it again from a store that has it intact")

    def fetch(self, store: Store, stage: str, key: str, waiting=lambda: None) -> bool:
        """Install the remote's entry for (stage, key) into the store, checked byte for byte before
        it is committed; False where the remote has none. Under the store's build lock, so a build
        of the same key elsewhere waits for it (or it for the build)."""
        entry = self.entry(stage, key)
        if entry is None:
            return False
        meta, where = entry.get("sidecar") or {}, f"{self.url.rstrip('/')}/ac/{stage}/{key}.json"
        files = meta.get("files") or {}
        if entry.get("key") != key or keys.key_of(meta.get("inputs")) != key or merkle(files) != meta.get("digest"):
            raise Rejected(f"{where}: the entry does not match its key {key[:12]} (its inputs or digests were "
                           f"changed); not installed: push it again from a store that has it intact")
        with store.building(stage, key, waiting):
            if not store.damage(stage, key):
                return True  # installed meanwhile, by another pull or a build
            tmp = store.temp_dir(stage, key)
            log = tmp.with_suffix(".log")
            try:
                for rel, digest in sorted(files.items()):
                    (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                    self._download(digest, tmp / rel, f"{where}: {rel}")
                if entry.get("log"):
                    self._download(entry["log"], log, f"{where}: its log")
                store.commit(stage, key, tmp, {k: v for k, v in meta.items() if k not in ("files", "digest")})
                if log.exists():
                    log.replace(store.path(stage, key).with_suffix(".log"))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
                log.unlink(missing_ok=True)
        for other_stage, other_key in entry.get("also") or []:
            if not self.fetch(store, other_stage, other_key, waiting):
                raise Rejected(f"{where}: names {other_stage} {other_key[:12]}, which the remote lacks: "
                               f"push it again from the store that built it")
        return True


@functools.lru_cache(maxsize=None)
def remote(url: str) -> Remote:
    return Remote(url)


def configured(url: str | None = None) -> Remote:
    """The remote named by url, else by MINDXTRAIN_REMOTE; UserError naming both where neither is."""
    url = url or os.environ.get(SETTING)
    if not url:
        raise UserError(f"no remote: set {SETTING}=<url> (a directory or s3://bucket/prefix) or pass --remote <url>")
    return remote(url)


def fill(store: Store, stage: str, key: str, label: str) -> bool:
    """A local miss tried in the remote MINDXTRAIN_REMOTE names before building: True once the
    entry is installed. A remote that cannot be read, or an entry it rejects, never fails the
    build: it says so in one line and the stage builds locally."""
    url = os.environ.get(SETTING)
    if not url:
        return False
    try:
        got = remote(url).fetch(store, stage, key, lambda: print(f"{label}: another process is installing "
                                                                  f"{key[:12]}; waiting", flush=True))
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
