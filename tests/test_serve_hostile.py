"""doit serve under hostile clients (issue 36): each attack that used to cost seconds of CPU,
gigabytes of memory or a 500 is refused with an OpenAI-shaped 4xx while 200 ordinary requests
are answered beside it, /health answers within a second throughout, and the server's memory
stays bounded. A client that leaves frees the model at once; a generation past the time limit
is cut short; past the in-flight limit a request is 429 at once."""
from __future__ import annotations

import http.client
import json
import select
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2
import openai
import pytest

from test_serve import Server, client, heldout

RSS_BOUND = 1 << 30  # the server's peak (VmHWM), model loaded, through the attacks: under 1 GiB (0.45 GiB idle)
HEALTH_BOUND_S = 1.0
PAD = [[]] * 230_000  # about 0.9 MB of JSON: under tiny's body cap (1 MiB and the prompt's)
LONG = [{"role": "user", "content": "1 2 3 4 5 6 7 8 9 " * 20}]  # tiny answers this to its last token
ERROR_KEYS = {"message", "type", "param", "code"}


def stop_server(s: Server) -> None:
    if s.proc.poll() is None:
        try:
            s.stop()
        except Exception:
            s.proc.kill()


@pytest.fixture(scope="module")
def server(built):
    s = Server(built)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def limited(built):
    """A second server whose generations may hold the model a quarter of a second."""
    s = Server(built, "--time-limit", "0.25")
    yield s
    stop_server(s)


def peak_rss(pid: int) -> int:
    """The most resident memory the process, and each process under it, has had (VmHWM), in bytes."""
    procs = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            fields = dict(line.split(":", 1) for line in (d / "status").read_text().splitlines())
        except (OSError, ValueError):
            continue
        procs[int(d.name)] = int(fields["PPid"]), int(fields.get("VmHWM", "0 kB").split()[0]) * 1024
    tree, total = [pid], 0
    while tree:
        p = tree.pop()
        total += procs[p][1]
        tree += [c for c, (parent, _) in procs.items() if parent == p]
    return total


WATCH = """
import json, sys, threading, time
import httpx2
slowest, failures, done, started = 0.0, [], threading.Event(), False
threading.Thread(target=lambda: (sys.stdin.readline(), done.set()), daemon=True).start()
with httpx2.Client(trust_env=False, timeout=10) as c:
    while not done.is_set():  # until the test writes a line
        start = time.monotonic()
        try:
            ok = c.get(f"http://127.0.0.1:{sys.argv[1]}/health").json() == {"status": "ok"}
        except httpx2.HTTPError as e:
            ok = False
            failures.append(repr(e))
        slowest = max(slowest, time.monotonic() - start if ok else float("inf"))
        if not started:
            print("polling", flush=True)
            started = True
        time.sleep(0.05)
print(json.dumps({"slowest": slowest, "failures": failures[:3]}))
"""


class Watch:
    """Polls /health from a process of its own (the test's 200 client threads would otherwise hold
    a poller in this process off the GIL for a second and more on two cores): the slowest answer,
    and any failure."""

    def __init__(self, port: int):
        self.proc = subprocess.Popen([sys.executable, "-c", WATCH, str(port)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline() == "polling\n"  # the load starts once the watch has

    def stop(self):
        out, _ = self.proc.communicate("stop\n", timeout=60)
        found = json.loads(out)
        self.health_s, self.failures = found["slowest"], found["failures"]


def refused(call) -> tuple[int, dict]:
    """Status and JSON body of an openai call expected to fail with an HTTP error."""
    try:
        call()
    except openai.APIStatusError as e:
        return e.status_code, e.response.json()
    raise AssertionError("answered, not refused")


def wrong(call, status: int, code: str | None, param: str | None) -> str | None:
    """What is wrong with an attack's answer; None when it is the OpenAI-shaped refusal expected."""
    try:
        got, body = call()
    except Exception as e:
        return f"no answer: {e!r}"[:300]
    error = body.get("error", {})
    if (got, set(error), error.get("code"), error.get("param")) != (status, ERROR_KEYS, code, param):
        return f"{got} {json.dumps(body)[:300]}"
    return None


def over_socket(port: int, request_head: bytes, chunks=(), timeout: float = 10) -> tuple[int, dict, int]:
    """Sends a request head, then body chunks until the server answers; the status, the JSON
    body, and how many body bytes went before the answer came."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request_head)
        sent = 0
        for chunk in chunks:
            if select.select([sock], [], [], 0)[0]:
                break
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):  # answered and closed between the look and the send
                break
            sent += len(chunk)
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, json.loads(response.read()), sent


def head(port: int, extra: str, path: str = "/v1/chat/completions", media: str = "application/json") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: {media}\r\n{extra}\r\n").encode()


def attacks(s: Server) -> dict:
    """Each attack: a call giving (status, body), and the status, code and param it must get."""
    model, port = s.models[0].id, s.port
    c = client(port).with_options(timeout=30)
    hi = [{"role": "user", "content": "What is 2 + 2?"}]

    def chat(**kw):
        return refused(lambda: c.chat.completions.create(model=model, **{"messages": hi, "max_tokens": 4, **kw}))

    def chunked():
        chunk = b"%x\r\n%s\r\n" % (65536, b"x" * 65536)
        status, body, sent = over_socket(port, head(port, "Transfer-Encoding: chunked\r\n"), [chunk] * 320)
        assert sent < 320 * len(chunk), "the server read a 20 MiB body whole before refusing it"
        return status, body

    def stated():
        return over_socket(port, head(port, "Content-Length: 10000000000\r\n"))[:2]

    def elsewhere():  # not counted in flight, so bounded far lower: a megabyte (under the chat cap) is 413
        chunk = b"%x\r\n%s\r\n" % (65536, b"x" * 65536)
        return over_socket(port, head(port, "Transfer-Encoding: chunked\r\n", "/v1/chat/completion"), [chunk] * 16)[:2]

    def raw(body: bytes, media: str = "application/json"):
        return lambda: over_socket(port, head(port, f"Content-Length: {len(body)}\r\n", media=media), [body])[:2]

    nested = raw(b'{"model": "m", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    hi_json = json.dumps(hi).encode()

    def say(content):
        return lambda: chat(messages=[{"role": "user", "content": content}])

    too_large = 413, "request_too_large", None

    return {
        "5 MB prompt": (say("x" * 5_000_000), *too_large),
        "5 MB prompt again": (say("y" * 5_000_000), *too_large),
        "5 MB prompt thrice": (say("z" * 5_000_000), *too_large),
        "200,000-character prompt": (say("1 + " * 50_000), 400, "context_length_exceeded", "messages"),
        "1,000 stops of 1,000 characters": (lambda: chat(stop=["x" * 1000] * 1000), 400, None, "stop"),
        "10,000 stops of 1,000 characters": (lambda: chat(stop=["x" * 1000] * 10_000), *too_large),
        "5 stops": (lambda: chat(stop=["a", "b", "c", "d", "e"]), 400, None, "stop"),
        "seed 2**80": (lambda: chat(seed=2**80), 400, None, "seed"),
        "top_p 0": (lambda: chat(top_p=0), 400, None, "top_p"),  # the engine's greedy setting, not a client's
        "top_p 2": (lambda: chat(top_p=2), 400, None, "top_p"),
        "max_tokens 2**80": (lambda: chat(max_tokens=2**80), 400, None, "max_tokens"),
        "max_completion_tokens 2**63": (lambda: chat(max_completion_tokens=2**63), 400, None,
                                        "max_completion_tokens"),
        "3,000 messages": (lambda: chat(messages=hi * 3000), 400, None, "messages"),
        "1,000 content parts": (say([{"type": "text", "text": "a"}] * 1000), 400, None, "messages.0.content"),
        "a chunked 20 MiB body": (chunked, *too_large),
        "a stated 10 GB body, never sent": (stated, *too_large),
        "a chunked megabyte to a mistyped path": (elsewhere, *too_large),
        "JSON nested 100,000 deep": (nested, 400, None, None),
        # JSON that is not text: a lone UTF-16 surrogate (was a 500 in plain text, from the tokenizer, or
        # from rendering the 404 that names the model)
        "a lone surrogate in the content": (raw(b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}'
                                                % model.encode()),
                                            400, None, None),
        "a lone surrogate as the model": (raw(b'{"model": "\\udfff", "messages": ' + hi_json + b"}"), 400, None, None),
        # what any web page can post to localhost without a CORS preflight
        "a text/plain post": (raw(b'{"model": "%s", "messages": %s}' % (model.encode(), hi_json), "text/plain"),
                              400, None, None),
    }


def leave_mid_generation(port: int, model: str, stream: bool) -> None:
    """A request for a long answer whose client goes away a quarter of a second later."""
    body = json.dumps({"model": model, "messages": LONG, "temperature": 2, "seed": 0, "stream": stream}).encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head(port, f"Content-Length: {len(body)}\r\n") + body)
        time.sleep(0.25)


def test_clients_that_leave_free_the_model_at_once(server):
    """Four clients ask for a long answer each (the rest of the context), non-streamed and then
    streamed, and go away a quarter of a second later: the next request is answered in less than
    half the time one such answer takes, not after the abandoned generations would have ended."""
    model, c = server.models[0].id, server.client
    for _ in range(3):  # sampled: an end token can come early (the server does not seed requests)
        start = time.monotonic()
        whole = c.chat.completions.create(model=model, messages=LONG, temperature=2, seed=0)
        alone_s = time.monotonic() - start
        if whole.usage.total_tokens == 1024:
            break
    assert whole.usage.total_tokens == 1024, whole.usage  # it runs to the end of the context
    for stream in (False, True):
        with ThreadPoolExecutor(4) as leavers:
            for _ in range(4):
                leavers.submit(leave_mid_generation, server.port, model, stream)
        start = time.monotonic()
        after = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is 2 + 2?"}],
                                          temperature=0, max_tokens=4)
        waited = time.monotonic() - start
        print(f"after four {'streaming ' * stream}clients left: answered in {waited:.2f} s "
              f"(one abandoned answer takes {alone_s:.2f} s)")
        assert after.choices[0].message.content is not None
        assert waited < alone_s / 2, f"waited {waited:.2f} s; one abandoned answer takes {alone_s:.2f} s"


def test_past_the_in_flight_limit_a_request_is_429_at_once(server):
    """Requests that hold a slot without finishing (a body promised, never sent) fill the limit;
    one more is 429 in OpenAI's shape at once, and when they go the server serves again."""
    from stages.inference.app import MAX_IN_FLIGHT

    model, port = server.models[0].id, server.port
    holders = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_IN_FLIGHT)]
    try:
        for sock in holders:
            sock.sendall(head(port, "Content-Length: 100\r\n"))
        deadline = time.monotonic() + 30  # the server takes in every holder's headers (seconds on a busy 2-core
        while True:  # machine: a fixed second was not always enough under CI); until then a request is answered
            try:
                status, body = refused(lambda: client(port).with_options(timeout=10).chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4))
                break
            except AssertionError:
                assert time.monotonic() < deadline, f"{MAX_IN_FLIGHT} held requests never filled the limit"
                time.sleep(0.5)
        assert status == 429 and set(body["error"]) == ERROR_KEYS and body["error"]["code"] == "rate_limit_exceeded"
        assert httpx2.get(f"http://127.0.0.1:{port}/health", trust_env=False, timeout=1).status_code == 200
    finally:
        for sock in holders:
            sock.close()
    time.sleep(1)
    reply = server.client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_attacks_under_load_are_refused_while_serving_goes_on(server, built):
    """Each attack at once, a second into 200 ordinary concurrent requests (one in five padded near
    the body cap): every attack gets its OpenAI-shaped 4xx, every ordinary request the answer it gets
    alone, /health answers within HEALTH_BOUND_S throughout and the server's peak RSS stays under
    RSS_BOUND."""
    model, normal = server.models[0].id, client(server.port)
    prompts = [d["messages"] for d in heldout(built)[:8]]

    def ask(i: int, padded: bool = False):
        # padded: the body near its cap with a field the server ignores, which json.loads held 29 times over
        # for the whole generation (40 at once took the server past RSS_BOUND)
        reply = normal.chat.completions.create(model=model, messages=prompts[i % 8], temperature=0, max_tokens=4,
                                               stream=i % 4 == 3, extra_body={"padding": PAD} if padded else None)
        if isinstance(reply, openai.Stream):
            return "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
        return reply.choices[0].message.content

    def answer(i: int):
        try:
            return ask(i, padded=i % 5 == 4)
        except openai.OpenAIError as e:
            return repr(e)

    alone = [ask(i) for i in range(8)]  # the answers each prompt gets with the server to itself
    watch = Watch(server.port)
    hostile = attacks(server)
    with ThreadPoolExecutor(200) as load, ThreadPoolExecutor(len(hostile) + 2) as attackers:
        answers = [load.submit(answer, i) for i in range(200)]
        time.sleep(1)  # the queue is full of ordinary requests when the attacks come
        problems = {name: attackers.submit(wrong, *attack) for name, attack in hostile.items()}
        for stream in (False, True):
            attackers.submit(leave_mid_generation, server.port, model, stream)
        answers = [a.result() for a in answers]
        problems = {name: p.result() for name, p in problems.items() if p.result()}
    watch.stop()
    rss = peak_rss(server.proc.pid)
    print(f"under load: peak RSS {rss / 2**20:.0f} MiB, slowest /health {watch.health_s * 1000:.0f} ms")

    assert not problems, "\n".join(f"{name}: {p}" for name, p in problems.items())
    missed = [a for i, a in enumerate(answers) if a != alone[i % 8]]
    assert not missed, f"{len(missed)} of 200 ordinary requests answered otherwise than alone, e.g. {missed[0]}"
    assert watch.health_s < HEALTH_BOUND_S, watch.failures[:3]
    assert rss < RSS_BOUND, f"peak RSS {rss / 2**20:.0f} MiB"
    after = normal.chat.completions.create(model=model, messages=prompts[0], temperature=0, max_tokens=4)
    assert after.choices[0].message.content == alone[0] and server.proc.poll() is None


def test_an_empty_stop_string_stops_nothing(server):
    """stop: "" ended every answer at once, where stop: [""] was left out; both are no stop now."""
    model, c = server.models[0].id, server.client
    hi = [{"role": "user", "content": "What is 2 + 2?"}]
    plain, *empty = [c.chat.completions.create(model=model, messages=hi, temperature=0, max_tokens=8, **stop)
                     for stop in ({}, {"stop": ""}, {"stop": [""]})]
    assert plain.choices[0].message.content
    assert all(e.choices[0].message.content == plain.choices[0].message.content for e in empty)


def test_a_generation_past_the_time_limit_is_cut_short(limited):
    """With --time-limit 0.25, a long answer (the rest of the context: over a second on tiny) ends
    near the limit, streamed or not, as one out of tokens does: finish_reason "length", with the
    text generated so far."""
    model, c = limited.models[0].id, limited.client
    assert "0.25 s a generation" in limited.output()
    for stream in (False, True):
        for _ in range(3):  # sampled: an end token can come early (the server does not seed requests); then again
            start = time.monotonic()
            usage_asked = {"stream_options": {"include_usage": True}} if stream else {}
            reply = c.chat.completions.create(model=model, messages=LONG, temperature=2, seed=0, stream=stream,
                                              **usage_asked)
            if stream:
                chunks = list(reply)
                text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
                finish, usage = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1], chunks[-1].usage
            else:
                text, finish, usage = reply.choices[0].message.content, reply.choices[0].finish_reason, reply.usage
            if finish != "stop":
                break
        assert finish == "length" and text and 0 < usage.completion_tokens < 1024 - usage.prompt_tokens, usage
        assert time.monotonic() - start < 2.5
