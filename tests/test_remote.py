"""The remote cache as a team uses it: push a built recipe to a directory or an S3 bucket (moto's
server on 127.0.0.1), pull it into a fresh clone, and a build there runs nothing and verifies; a
corrupted blob is rejected and not installed; a push killed halfway leaves the remote readable and
the next push completes it; two pushes at once are safe; a build with MINDXTRAIN_REMOTE set fetches
what the remote has and builds only the rest."""
from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import s3fs

from conftest import ALL_STAGES, NO_NETWORK, doit, snapshot


def s3_env(endpoint: str) -> dict:
    """What a doit process needs to reach the bucket: the endpoint, test credentials, and no proxy
    for 127.0.0.1 (every other host still goes to NO_NETWORK's dead proxy)."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}


@pytest.fixture
def bucket(moto_url, request, monkeypatch):
    """A new empty bucket on the moto server, and s3fs pointed at it for looking inside."""
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.setenv(name, "127.0.0.1")
    fs = s3fs.S3FileSystem(endpoint_url=moto_url, key="testing", secret="testing", skip_instance_cache=True)
    name = request.node.name.replace("_", "-")[:40].strip("-").lower()
    fs.mkdir(name)
    return fs, name


def remote_files(fs, root: str) -> list[str]:
    return sorted(p[len(root) + 1:] for p in fs.find(root))


def pointers(project) -> dict:
    return {s: json.loads((project / "artifacts" / "tiny" / f"{s}.json").read_text()) for s in ALL_STAGES}


def pulled_and_verified(source, fresh, *args, env=None):
    """Pull into a fresh clone; the build then runs nothing and verify passes on every byte."""
    run = doit(fresh, "pull:tiny", *args, env=env)
    assert run.rc == 0 and "Traceback" not in run.out, run.out[-3000:]
    said = [line for line in run.out.splitlines() if line.split(":")[0] in ALL_STAGES]  # each entry once, as it is
    assert sorted(line.split(":")[0] for line in said) == sorted(ALL_STAGES), run.out
    assert all(line.endswith(" pulled") for line in said), run.out
    assert f"pull:tiny: the recipe's build is in the store ({len(ALL_STAGES)} of {len(ALL_STAGES)} entries pulled" in run.out
    assert pointers(fresh) == pointers(source)
    assert doit(fresh, "manifest:tiny").ran == []
    check = doit(fresh, "verify:tiny", "--full")
    assert check.rc == 0 and "intact" in check.out, check.out[-2000:]


def test_push_and_pull_through_a_directory(warm, fresh, tmp_path):
    remote = tmp_path / "remote"
    run = doit(warm, "push:tiny", "--remote", str(remote))
    assert run.rc == 0 and "pushed" in run.out, run.out[-3000:]
    assert {p.parent.name for p in (remote / "ac").glob("*/*.json")} == ALL_STAGES
    assert not list(remote.rglob("*.tmp-*"))
    before = {str(p): p.stat().st_mtime_ns for p in remote.rglob("*") if p.is_file()}
    again = doit(warm, "push:tiny", "--remote", str(remote))  # what is there is neither sent nor rewritten
    assert again.rc == 0 and "pushed" not in again.out
    assert {str(p): p.stat().st_mtime_ns for p in remote.rglob("*") if p.is_file()} == before
    pulled_and_verified(warm, fresh, "--remote", str(remote))


def test_push_and_pull_through_s3(warm, fresh, bucket, moto_url):
    fs, name = bucket
    env = {**s3_env(moto_url), "MINDXTRAIN_REMOTE": f"s3://{name}/team"}
    run = doit(warm, "push:tiny", env=env)
    assert run.rc == 0 and "pushed" in run.out, run.out[-3000:]
    files = remote_files(fs, f"{name}/team")
    assert {f.split("/")[1] for f in files if f.startswith("ac/")} == ALL_STAGES
    assert all(f.startswith(("ac/", "cas/")) and ".tmp-" not in f for f in files)
    pulled_and_verified(warm, fresh, env=env)


def test_a_corrupted_blob_is_rejected_and_not_installed(warm, fresh, tmp_path):
    remote = tmp_path / "remote"
    assert doit(warm, "push:tiny", "--remote", str(remote)).rc == 0
    key = pointers(warm)["plan"]["key"]
    entry = json.loads((remote / "ac" / "plan" / f"{key}.json").read_text())
    digest = entry["sidecar"]["files"]["plan.json"]
    blob = remote / "cas" / digest[:2] / digest
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 1  # one bit, same size
    blob.write_bytes(bytes(data))

    run = doit(fresh, "pull:tiny", "--remote", str(remote))
    assert run.rc != 0 and "Traceback" not in run.out, run.out[-3000:]
    assert f"ac/plan/{key}.json: plan.json differs in the remote" in run.out
    objects = fresh / "artifacts" / "store"
    assert not (objects / "plan" / key).exists() and not (objects / "plan" / f"{key}.json").exists()
    assert not list(objects.glob("*/.tmp-*"))
    assert (objects / "base" / pointers(warm)["base"]["key"]).is_dir()  # the intact entry before it is in

    # a build reading the remote rejects it too, says so, and builds the plan here instead
    build = doit(fresh, "plan:tiny", env={"MINDXTRAIN_REMOTE": str(remote)})
    assert build.rc == 0, build.out[-3000:]
    assert "plan:tiny: remote entry rejected" in build.out and build.stages_ran() == {"plan"}
    built_here = json.loads((fresh / "artifacts" / "tiny" / "plan.json").read_text())
    assert built_here == pointers(warm)["plan"]  # the same key, and the same bytes


class HoldAfterFirstBlob(ThreadingHTTPServer):
    """A pass-through to the S3 server that, once the first blob upload (a PUT under cas/) has been
    stored, tells the test and holds its reply, so the pusher is killed with exactly one blob sent."""

    def __init__(self, upstream_port: int):
        super().__init__(("127.0.0.1", 0), Forward)
        self.upstream_port = upstream_port
        self.first_blob, self.release = threading.Event(), threading.Event()


class Forward(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while size := int(self.rfile.readline().split(b";")[0], 16):
                out += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
            return out
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def forward(self):
        body = self.body()
        skip = {"transfer-encoding", "connection", "expect", "content-length", "keep-alive"}
        headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
        upstream = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=60)
        upstream.request(self.command, self.path, body=body, headers={**headers, "Content-Length": str(len(body))})
        reply = upstream.getresponse()
        data = reply.read()
        if self.command == "PUT" and "/cas/" in self.path and reply.status == 200 and not self.server.first_blob.is_set():
            self.server.first_blob.set()
            self.server.release.wait(120)
            self.close_connection = True
            return
        self.send_response(reply.status)
        for k, v in reply.getheaders():
            if k.lower() not in skip:
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = forward


def test_a_push_killed_halfway_leaves_the_remote_readable_and_the_next_push_completes_it(warm, fresh, bucket,
                                                                                      moto_url):
    fs, name = bucket
    url = f"s3://{name}/team"
    proxy = HoldAfterFirstBlob(int(moto_url.rsplit(":", 1)[1]))
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    env = {**os.environ, **NO_NETWORK, **s3_env(f"http://127.0.0.1:{proxy.server_address[1]}")}
    push = subprocess.Popen([sys.executable, "-m", "doit", "push:tiny", "--remote", url], cwd=warm, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while not proxy.first_blob.wait(1):
            assert push.poll() is None, push.communicate()[0][-3000:]
        os.kill(push.pid, signal.SIGKILL)
        push.wait(60)
    finally:
        proxy.release.set()
        proxy.shutdown()
    assert push.returncode == -signal.SIGKILL
    files = remote_files(fs, f"{name}/team")
    assert len(files) == 1 and files[0].startswith("cas/")  # one blob, no entry

    before = snapshot(fresh) if (fresh / "artifacts").exists() else {}
    env = s3_env(moto_url)
    run = doit(fresh, "pull:tiny", "--remote", url, env=env)  # the remote reads as not having the build
    assert run.rc != 0 and "Traceback" not in run.out and f"base ({pointers(warm)['base']['key'][:12]}) is not " \
        f"in the remote" in run.out, run.out[-3000:]
    assert snapshot(fresh) == before

    again = doit(warm, "push:tiny", "--remote", url, env=env)
    assert again.rc == 0, again.out[-3000:]
    pushed = sum(int(line.split("pushed ")[1].split()[0]) for line in again.out.splitlines() if " pushed " in line)
    blobs = [f for f in remote_files(fs, f"{name}/team") if f.startswith("cas/")]
    assert pushed == len(blobs) - 1  # the blob sent before the kill was not sent again
    pulled_and_verified(warm, fresh, "--remote", url, env=env)


def test_two_pushes_of_the_same_build_at_once(warm, fresh, tmp_path):
    remote = tmp_path / "remote"
    env = {**os.environ, **NO_NETWORK}
    pushes = [subprocess.Popen([sys.executable, "-m", "doit", "push:tiny", "--remote", str(remote)], cwd=warm,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in pushes]
    assert [p.returncode for p in pushes] == [0, 0], outs
    assert not any("Traceback" in out for out in outs)
    assert not list(remote.rglob("*.tmp-*"))
    pulled_and_verified(warm, fresh, "--remote", str(remote))


def test_a_build_fetches_what_the_remote_has_and_builds_the_rest(warm, fresh, tmp_path):
    remote = tmp_path / "remote"
    assert doit(warm, "push:tiny", "--remote", str(remote)).rc == 0
    env = {"MINDXTRAIN_REMOTE": str(remote)}
    recipe = fresh / "recipes" / "tiny.yaml"
    recipe.write_text(recipe.read_text().replace("limit: 48", "limit: 24"))  # only eval (and the manifest) differ

    status = doit(fresh, "status:tiny", env=env)
    assert f"base       missing from the store, present in the remote {remote}" in status.out, status.out
    run = doit(fresh, "manifest:tiny", env=env)
    assert run.rc == 0, run.out[-3000:]
    assert run.stages_ran() == {"eval", "manifest"}
    for stage in ("base", "plan", "shards", "checkpoint", "quantized"):
        assert f"{stage}:tiny: fetched {pointers(warm)[stage]['key'][:12]} from the remote" in run.out
    check = doit(fresh, "verify:tiny", "--full")
    assert check.rc == 0 and "intact" in check.out, check.out[-2000:]
