"""The generation engine (stages/inference/batching.py) on a small random Qwen3 in fp32 on the CPU:
greedy answers equal transformers' generate one at a time, concurrent requests share decode
steps, a stop string, a cancel and a deadline end a request, and a request past the KV cache
is refused before it is queued."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest

from stages.inference.batching import Engine, Sampling


@pytest.fixture(scope="module")
def engine(model_and_tok):
    model, tok = model_and_tok
    e = Engine(model, tok, {tok.eos_token_id}, kv_tokens=4096)
    yield e
    e.close()


PROMPTS = ["What is 12 + 30?", "Name a colour.", "Say hello " * 5, "x"]


def sequential(model, tok, text: str, n: int) -> list[int]:
    import torch

    ids = torch.tensor([tok(text)["input_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


@contextmanager
def serving(served):
    """The app over `served` on a free local port, run by uvicorn in a thread: its base URL."""
    import uvicorn

    from conftest import free_port
    from stages.inference.app import build_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(served, "tiny-test"), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        yield port
    finally:
        server.should_exit = True
        thread.join()


def test_greedy_answers_equal_generate_one_at_a_time(engine, model_and_tok):
    model, tok = model_and_tok
    answers = engine.generate([tok(p)["input_ids"] for p in PROMPTS], Sampling(max_new_tokens=24))
    assert [a.ids for a in answers] == [sequential(model, tok, p, 24) for p in PROMPTS]
    assert [a.finish for a in answers] == ["stop" if a.ids[-1] == tok.eos_token_id else "length" for a in answers]


def test_greedy_requests_beside_sampled_ones_answer_as_generate(engine, model_and_tok):
    """Each request brings its own sampling: greedy ones (top_p 0 keeps the highest score alone)
    sharing steps with sampled ones still answer exactly as `generate` one at a time."""
    import asyncio

    model, tok = model_and_tok

    async def answer(text: str, s: Sampling):
        async for piece in engine.stream(tok(text)["input_ids"], s, texts=False):
            return piece

    async def together():
        return await asyncio.gather(*[answer(p, s) for p in PROMPTS
                                      for s in (Sampling(24), Sampling(24, temperature=1.0, top_p=0.9))])

    answers = asyncio.run(together())
    assert [a.ids for a in answers[::2]] == [sequential(model, tok, p, 24) for p in PROMPTS]
    assert all(a.ids for a in answers[1::2])


def test_a_greedy_request_picks_the_same_of_two_tied_tokens_every_time(model_and_tok):
    """Two tokens with the same output row always tie. Greedy requests keep one token, the same
    one in every request and every run (with top_k 1, both tied tokens passed and the sampler
    drew between them)."""
    import copy

    import torch

    model, tok = model_and_tok
    tied = copy.deepcopy(model)
    ids = tok("x")["input_ids"]
    first = sequential(model, tok, "x", 1)[0]
    other = next(t for t in range(tied.config.vocab_size)
                 if t != first and t not in (tok.eos_token_id, tok.pad_token_id))
    with torch.no_grad():
        head = tied.get_output_embeddings().weight
        head[other] = head[first]
    e = Engine(tied, tok, {tok.eos_token_id}, kv_tokens=4096)
    try:
        runs = [e.generate([ids] * 8, Sampling(max_new_tokens=6)) for _ in range(2)]
    finally:
        e.close()
    answers = [a.ids for run in runs for a in run]
    assert answers[0][0] in (first, other)
    assert all(a == answers[0] for a in answers), answers


def test_the_batch_attends_with_query_heads_grouped_not_keys_copied(model_and_tok, monkeypatch):
    """The engine's attention (stages/inference/attention.py) runs for every layer of every step
    of the batch, and its answers are generate's one at a time (above, and here with its calls
    counted): grouping the query heads that share a key/value head is the same attention."""
    from stages.inference import attention

    model, tok = model_and_tok
    rows, copied = [], []
    grouped, transformers_sdpa = attention.batch_sdpa, attention.sdpa_attention_forward
    monkeypatch.setattr(attention, "batch_sdpa", lambda *a, **k: rows.append(a[1].shape[2]) or grouped(*a, **k))
    monkeypatch.setattr(attention, "sdpa_attention_forward",  # transformers' own, which repeats keys and values
                        lambda *a, **k: copied.append(k.get("cache")) or transformers_sdpa(*a, **k))
    e = Engine(model, tok, {tok.eos_token_id}, kv_tokens=4096)
    try:
        answers = e.generate([tok(p)["input_ids"] for p in PROMPTS], Sampling(max_new_tokens=12))
    finally:
        e.close()
    assert [a.ids for a in answers] == [sequential(model, tok, p, 12) for p in PROMPTS]
    assert len(rows) >= 12 * model.config.num_hidden_layers and max(rows) > 1  # decode steps and a prefill
    assert not [c for c in copied if c is not None]  # no step of the batch fell back to transformers' function


OWN_KEYS = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, MistralConfig, Qwen3Config
from stages.inference import attention, varlen
from stages.inference.batching import Engine, Sampling
from stages.model.tiny import char_tokenizer

def kernel_against_the_mask(qlens, klens, heads, kv_heads, dim, padding):
    # the layouts the model hands over: queries [1, tokens, heads, dim] seen as [1, heads, tokens, dim];
    # keys and values read out of the cache as [keys, kv_heads, dim] seen as [1, kv_heads, keys, dim]
    tokens, keys = sum(qlens) + padding, sum(klens) + 5
    q = torch.randn(1, tokens, heads, dim).transpose(1, 2)
    k, v = (torch.randn(keys, kv_heads, dim).transpose(0, 1).unsqueeze(0) for _ in range(2))
    mask = torch.full((1, 1, tokens, keys), float("-inf"))
    qs = ks = 0
    for ql, kl in zip(qlens, klens):  # block-diagonal, causal at the bottom right: transformers' batch mask
        for t in range(ql):
            mask[0, 0, qs + t, ks:ks + kl - ql + t + 1] = 0
        qs, ks = qs + ql, ks + kl
    cu = lambda n: torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()] + [sum(n)] * padding, dtype=torch.int32)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=dim ** -0.5, enable_gqa=True).transpose(1, 2)
    got = varlen.attention(q, k, v, cu(qlens), cu(klens), dim ** -0.5)
    real = sum(qlens)
    return float((got[:, :real] - want[:, :real]).abs().max()), float(got[:, real:].abs().sum())

torch.manual_seed(0)
kernel = [kernel_against_the_mask(*case) for case in [
    ([1, 1, 1], [5, 9, 3], 4, 2, 16, 0),                      # decodes
    ([1] * 5 + [40], [30, 40, 50, 60, 70, 90], 8, 2, 16, 3),  # decodes beside a chunk with history, padded
    ([70], [70], 4, 4, 32, 0),                                # a first chunk, no grouping
    ([3, 1], [100, 8], 4, 1, 128, 0),                         # one key/value head for all
    ([20, 1], [20, 5], 6, 2, 24, 0),                          # a head dimension not a power of two
    ([1, 1, 40], [50, 9, 100], 8, 1, 24, 0),                  # 8 query heads a key/value head
    ([530], [530], 8, 1, 16, 0),                              # past 512 tokens: 64 rows a program
    ([1] * 3 + [520, 2], [9, 30, 4, 600, 12], 4, 2, 16, 40)]] # a program's tokens from several requests, padded
tok = char_tokenizer()
config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=512, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id)
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
prompts = [tok(p)["input_ids"] for p in sys.argv[2:]]
own, masked = varlen.attention, attention.sdpa_attention_forward

def in_the_batch(model, calls, fallbacks):
    # the engine's answers, each kernel call's query tokens and each masked SDPA call counted
    varlen.attention = lambda *a, **k: calls.append(a[0].shape[2]) or own(*a, **k)
    attention.sdpa_attention_forward = lambda *a, **k: fallbacks.append(1) or masked(*a, **k)
    engine = Engine(model, tok, {tok.eos_token_id}, kv_tokens=4096)
    try:
        return [a.ids for a in engine.generate(prompts, Sampling(12))]
    finally:
        engine.close()
        varlen.attention, attention.sdpa_attention_forward = own, masked

calls, fallbacks = [], []
batched = in_the_batch(model, calls, fallbacks)

def one_at_a_time(model):
    answers = []
    for ids in prompts:
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        answers.append(out[0, x.shape[1]:].tolist())
    return answers

# a sliding window (Mistral's layers pass it as a keyword) is not the kernel's: the masked SDPA keeps it
windowed = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=8,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
windowed = AutoModelForCausalLM.from_config(windowed, dtype=torch.float32, attn_implementation="sdpa").eval()
window_calls = []
window_batched = in_the_batch(windowed, window_calls, [])
print(json.dumps({"kernel": kernel, "batched": batched, "alone": one_at_a_time(model), "calls": calls,
                  "fallbacks": len(fallbacks), "window_calls": len(window_calls), "window_batched": window_batched,
                  "window_alone": one_at_a_time(windowed)}))
"""


def test_on_a_gpu_each_request_attends_to_its_own_keys():
    """On a GPU the batch's attention is stages/inference/varlen.py's Triton kernel: each request's
    queries over its own keys. Run here by Triton's interpreter on the CPU (TRITON_INTERPRET=1,
    which makes varlen.available take CPU tensors): the kernel equals SDPA under transformers'
    batch mask (decodes, chunks with and without history, padding rows left 0, 1 to 8 query heads a
    key/value head, a head dimension of 24, a step past 512 tokens, where a program takes several
    tokens, from one request or several), and the engine with it answers as generate does one
    prompt at a time, the kernel called for every layer of every step and the masked SDPA never. A
    model with a sliding window keeps the masked SDPA, and its answers."""
    import json
    import os
    import subprocess
    import sys

    from conftest import NO_NETWORK, REPO

    pytest.importorskip("triton")  # the test extra installs it (the GPU's torch ships it)
    p = subprocess.run([sys.executable, "-c", OWN_KEYS, str(REPO), *PROMPTS], capture_output=True, text=True,
                       timeout=900, env={**os.environ, **NO_NETWORK, "TRITON_INTERPRET": "1"})
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    for difference, padding in r["kernel"]:
        assert difference < 1e-5 and padding == 0, r["kernel"]
    assert r["batched"] == r["alone"]
    assert len(r["calls"]) >= 12 * 2 and max(r["calls"]) > 1 and r["fallbacks"] == 0
    assert r["window_calls"] == 0 and r["window_batched"] == r["window_alone"]  # prompts longer than the window


COMPILED = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from transformers import AutoModelForCausalLM, Qwen3Config
from stages.inference.batching import Sampling
from stages.inference.generation import ServedModel
from stages.model.tiny import char_tokenizer
tok = char_tokenizer()
torch.manual_seed(0)
config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=12, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=512, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id)
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
prompts = [tok(p)["input_ids"] for p in sys.argv[2:]]
answers = {}
for compiled in (False, True):
    served = ServedModel(model, tok, kv_tokens=4096, compiled=compiled)
    print("warmed up", file=sys.stderr, flush=True)
    answers[compiled] = [a.ids for a in served.engine.generate(prompts, Sampling(16))]
    served.close()
print(json.dumps([answers[False], answers[True]]))
"""


def test_the_served_model_compiles_once_for_all_its_layers():
    """doit serve compiles the model's forward on a GPU. Before the engine had its own attention,
    dynamo compiled transformers' attention once per layer (guarded on its layer_idx) and past its
    limit of 8 ran the rest eager (an H100, 36 layers: docs/serving.md). 12 layers here, on the
    CPU: no guard on a layer; no frame compiled more than five times, under dynamo's limit of 8
    (its shape classes: one request or several, keys and values to read from the cache or none
    yet, a prefill chunk that fills the step or not), all in the warm-up; and the answers the
    uncompiled engine gives."""
    import json
    import os
    import re
    import subprocess
    import sys

    from conftest import NO_NETWORK, REPO

    p = subprocess.run([sys.executable, "-c", COMPILED, str(REPO), *PROMPTS], capture_output=True, text=True,
                       timeout=900, env={**os.environ, **NO_NETWORK, "TORCH_LOGS": "recompiles"})
    assert p.returncode == 0, p.stderr[-4000:]
    eager, compiled = json.loads(p.stdout.strip().splitlines()[-1])
    assert compiled == eager
    assert "layer_idx" not in p.stderr, p.stderr[-4000:]
    recompiled = [int(n) for n in re.findall(r"\[\d+/(\d+)\] \[__recompiles\] Recompiling function", p.stderr)]
    assert max(recompiled, default=0) <= 4, p.stderr[-4000:]
    served = p.stderr.rsplit("warmed up", 1)[1]
    assert "Recompiling" not in served, served[-4000:]  # requests after the warm-up compile nothing


def test_a_model_that_does_not_compile_is_served_uncompiled(model_and_tok, monkeypatch):
    """A model dynamo cannot compile is not refused: the warm-up's failure is kept for the console
    and the model answers uncompiled, as generate does. The failure is a real one: torch.compile
    with a backend that raises."""
    import functools

    import torch

    from stages.inference.generation import ServedModel

    def refuses(graph, example_inputs):
        raise NotImplementedError("this backend compiles nothing")
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=refuses))
    model, tok = model_and_tok
    served = ServedModel(model, tok, kv_tokens=4096, compiled=True)
    try:
        assert "this backend compiles nothing" in served.compile_failure
        assert "forward" not in vars(model)
        answers = served.engine.generate([tok(p)["input_ids"] for p in PROMPTS], Sampling(max_new_tokens=12))
        assert [a.ids for a in answers] == [sequential(model, tok, p, 12) for p in PROMPTS]
    finally:
        served.close()


def test_asyncio_streams_share_steps_and_a_closed_one_leaves_the_batch(engine, model_and_tok, monkeypatch):
    """The server's path (Engine.stream, on the event loop): concurrent streams are decoded
    together, each one's text grows to the answer `generate` gives, and a stream closed after its
    first piece (its client went away) is cancelled in the batch and forgotten."""
    import asyncio

    _, tok = model_and_tok
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    whole = engine.generate(prompts, Sampling(max_new_tokens=24))
    cancelled, cancel = [], engine.manager.cancel_request
    monkeypatch.setattr(engine.manager, "cancel_request", lambda rid: (cancelled.append(rid), cancel(rid)))

    async def read(ids):
        pieces, first = [], None
        async for piece in engine.stream(ids, Sampling(max_new_tokens=24)):
            first = first or time.monotonic()
            pieces.append(piece)
        return first, time.monotonic(), pieces

    async def leave(ids):
        pieces = engine.stream(ids, Sampling(max_new_tokens=400))
        first = await anext(pieces)
        await pieces.aclose()
        return first

    async def together():
        return await asyncio.gather(*(read(ids) for ids in prompts), leave(prompts[0]))

    *streams, left = asyncio.run(together())
    assert [s[2][-1].ids for s in streams] == [w.ids for w in whole]
    for _, _, pieces in streams:
        texts = pieces[:-1] + [pieces[-1].text]
        assert all(isinstance(t, str) and b.startswith(t) for t, b in zip(texts, texts[1:]))
    assert max(s[0] for s in streams) < min(s[1] for s in streams)
    assert isinstance(left, str) and len(cancelled) == 1 and not engine.waiting


def test_a_request_cancelled_as_an_output_wakes_it_leaves_the_batch(model_and_tok, monkeypatch):
    """A non-streamed request with stop strings to watch (woken at every step), cancelled 0 to 7
    turns of the event loop after an output woke it: each time the task ends cancelled and the
    request is cancelled in the batch (Python 3.11's asyncio.wait_for swallowed a cancellation that
    came as its wait ended, which at 0 turns left the request decoding for a client gone). The
    engine's end token is one the answer never holds, so no answer ends before its cancel."""
    import asyncio

    model, tok = model_and_tok
    ids = tok(PROMPTS[0])["input_ids"]
    engine = Engine(model, tok, {tok.pad_token_id}, kv_tokens=4096)
    cancelled, cancel = [], engine.manager.cancel_request
    monkeypatch.setattr(engine.manager, "cancel_request", lambda rid: (cancelled.append(rid), cancel(rid)))

    async def trial(turns: int):
        async def answer():
            async for piece in engine.stream(ids, Sampling(max_new_tokens=3000, stop=["never said"]), texts=False):
                return piece
        task = asyncio.ensure_future(answer())
        while not engine.waiting:
            await asyncio.sleep(0.001)
        (rid, reading), = engine.waiting.items()
        seen, put = [], reading.put
        reading.put = lambda out: (seen.append(out), put(out))  # what the router hands over, seen
        while not seen:
            await asyncio.sleep(0.001)
        loop = asyncio.get_running_loop()

        def cancel_after(n: int):
            if n:
                loop.call_soon(cancel_after, n - 1)
            else:
                task.cancel()
        reading.put(seen[-1])  # an output wakes it, as from the router
        loop.call_soon(cancel_after, turns)
        await asyncio.sleep(0.3)
        ended = task.cancelled()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return ended, rid in cancelled and rid not in engine.waiting

    try:
        assert [asyncio.run(trial(turns)) for turns in range(8)] == [(True, True)] * 8
    finally:
        engine.close()


def test_a_caller_whose_hand_off_fails_leaves_the_router_serving_the_others(engine, model_and_tok):
    """A request whose waiting caller cannot take its output (its event loop closed as the output
    came) costs that request alone: the router thread goes on and the next requests end."""
    _, tok = model_and_tok
    ids = tok(PROMPTS[1])["input_ids"]

    class Gone:
        def put(self, out):
            raise RuntimeError("Event loop is closed")

    rid = engine._submit(ids, Sampling(max_new_tokens=8), streaming=True, into=Gone())[0]
    time.sleep(1)  # its outputs come and fail to be handed over
    engine._finish(rid, cancel=True)
    assert engine.router.is_alive()
    assert engine.generate([ids], Sampling(max_new_tokens=8))[0].ids


def test_a_stop_string_and_a_deadline_end_a_request(engine, model_and_tok):
    import asyncio

    _, tok = model_and_tok
    ids = tok(PROMPTS[0])["input_ids"]
    whole = engine.generate([ids], Sampling(max_new_tokens=40))[0]
    stop = whole.text[5:7]
    cut = engine.generate([ids], Sampling(max_new_tokens=40, stop=[stop]))[0]
    assert cut.finish == "stop" and cut.text == whole.text[:whole.text.find(stop)]

    async def answers(s: Sampling, texts: bool):
        return [piece async for piece in engine.stream(ids, s, texts)]

    streamed = asyncio.run(answers(Sampling(max_new_tokens=40, stop=[stop]), True))
    assert streamed[-1].text == cut.text and all(isinstance(x, str) for x in streamed[:-1])
    alone = asyncio.run(answers(Sampling(max_new_tokens=40), False))  # the answer only
    assert len(alone) == 1 and alone[0].ids == whole.ids
    late = asyncio.run(answers(Sampling(max_new_tokens=400, deadline=time.monotonic()), True))[-1]
    assert late.finish == "length" and 0 < len(late.ids) < 400 and not engine.waiting


def test_a_batch_with_stop_strings_lets_each_request_leave_at_its_first_stop(engine, model_and_tok):
    """generate with stop strings: each answer is the whole answer cut at its first stop string,
    as before; the request that reaches one leaves the batch there instead of decoding on to its
    token limit, and one that never does is decoded whole."""
    from stages.inference.batching import cut_at_stop

    _, tok = model_and_tok
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    whole = engine.generate(prompts, Sampling(max_new_tokens=40))
    stop = whole[0].text[5:7]
    cut = engine.generate(prompts, Sampling(max_new_tokens=40, stop=[stop]))
    assert [c.text for c in cut] == [cut_at_stop(w.text, [stop])[0] for w in whole]
    assert cut[0].finish == "stop" and len(cut[0].ids) < len(whole[0].ids)
    assert cut[0].ids == whole[0].ids[:len(cut[0].ids)]
    for c, w in zip(cut, whole):
        if stop not in w.text:
            assert c.ids == w.ids and c.finish == w.finish


def test_a_request_past_the_kv_cache_is_refused(engine, model_and_tok):
    _, tok = model_and_tok
    with pytest.raises(ValueError, match="4096 tokens of KV cache"):
        engine.generate([tok("hi")["input_ids"]], Sampling(max_new_tokens=5000))
    assert engine.generate([tok("hi")["input_ids"]], Sampling(max_new_tokens=4))[0].ids  # and it goes on


def test_the_api_refuses_a_request_past_a_kv_budget_smaller_than_the_context(model_and_tok):
    """A GPU with little memory left gives a KV cache smaller than the model's positions: the API's
    context is then the KV budget, and a request over it gets a 400 before any generation."""
    from fastapi.testclient import TestClient

    from stages.inference.app import build_app
    from stages.inference.generation import ServedModel

    model, tok = model_and_tok
    served = ServedModel(model, tok, kv_tokens=64)
    try:
        assert served.context_length == 64 < model.config.max_position_embeddings
        client = TestClient(build_app(served, "tiny-test"))
        ask = lambda n: client.post("/v1/chat/completions", json={  # noqa: E731
            "model": "tiny-test", "messages": [{"role": "user", "content": "What is 12 + 30?"}], "max_tokens": n,
            "temperature": 0})
        refused = ask(60)
        assert refused.status_code == 400 and "maximum context length is 64 tokens" in refused.json()["error"]["message"]
        answered = ask(4)
        assert answered.status_code == 200 and answered.json()["usage"]["completion_tokens"] <= 4
    finally:
        served.close()


def test_more_requests_than_the_default_thread_pool_share_the_batch(model_and_tok):
    """Non-streamed requests wait on the event loop, not a worker thread each (anyio's default
    pool of 40 capped the batch at 40 when they did): 48 requests at once must all be generating."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx2

    from stages.inference.generation import ServedModel

    model, tok = model_and_tok
    served = ServedModel(model, tok, kv_tokens=48 * 512)
    complete, lock, now, most = served.complete, threading.Lock(), [0], [0]

    async def counted(*args, **kwargs):  # how many generations are running at once
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        try:
            return await complete(*args, **kwargs)
        finally:
            with lock:
                now[0] -= 1
    served.complete = counted
    try:
        with serving(served) as port:
            client = httpx2.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=300,
                                   limits=httpx2.Limits(max_connections=64))
            ask = lambda i: client.post("/v1/chat/completions", json={  # noqa: E731
                "model": "tiny-test", "messages": [{"role": "user", "content": f"Count to {i}."}], "max_tokens": 400,
                "temperature": 0}).status_code
            with ThreadPoolExecutor(48) as pool:
                assert set(pool.map(ask, range(48))) == {200}
        assert most[0] > 40, most[0]
    finally:
        served.close()


def test_a_client_that_goes_away_leaves_the_batch(model_and_tok, monkeypatch):
    """A client that asks for a long answer, streamed or not, and closes its connection once its
    request is in the batch: the request is cancelled there and forgotten, and the server goes on
    answering. (The answer must outlast noticing the client left, however loaded the machine: the
    model's own end token is swapped for one its greedy answer never holds, so it runs to the end
    of the context.)"""
    import asyncio
    import copy
    import json
    import socket

    import httpx2

    from stages.inference.generation import ServedModel, Settings

    model, tok = model_and_tok
    never = copy.deepcopy(tok)
    never.eos_token = never.pad_token
    monkeypatch.setattr(model.generation_config, "eos_token_id", never.eos_token_id)
    served = ServedModel(model, never, kv_tokens=4 * 512)
    cancelled, cancel = [], served.engine.manager.cancel_request
    monkeypatch.setattr(served.engine.manager, "cancel_request", lambda rid: (cancelled.append(rid), cancel(rid)))
    try:
        ids = served.prompt_ids([{"role": "user", "content": "Count."}])
        whole = asyncio.run(served.complete(ids, Settings(max_new_tokens=served.context_length - len(ids), temperature=0)))
        assert whole.finish == "length"  # it would run to the end of the context
        with serving(served) as port:
            for stream in (False, True):
                body = json.dumps({"model": "tiny-test", "messages": [{"role": "user", "content": "Count."}],
                                   "temperature": 0, "stream": stream}).encode()
                with socket.create_connection(("127.0.0.1", port)) as sock:
                    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                    deadline = time.monotonic() + 30
                    while not served.engine.waiting and time.monotonic() < deadline:
                        time.sleep(0.01)
                    assert served.engine.waiting, "the request never reached the batch"
                deadline = time.monotonic() + 30
                while (len(cancelled) < 1 + stream or served.engine.waiting) and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert len(cancelled) == 1 + stream and not served.engine.waiting, (stream, cancelled)
            answer = httpx2.post(f"http://127.0.0.1:{port}/v1/chat/completions", trust_env=False, json={
                "model": "tiny-test", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 4})
            assert answer.status_code == 200
    finally:
        served.close()


@pytest.mark.parametrize("which", ["char", "qwen3"])
def test_the_text_as_it_grows_is_the_whole_decode(which, model_and_tok):
    """Detokenizer extends the text a token at a time; after every token it is what decoding all
    the tokens gives, or, while a character still misses bytes (the whole decode shows U+FFFD), a
    start of it that holds back that token: on the tiny model's tokenizer, and on Qwen3's over text
    in several scripts, where emoji and CJK characters span tokens."""
    from pathlib import Path

    from stages.inference.batching import Detokenizer

    if which == "char":
        tok = model_and_tok[1]
    else:
        qwen3 = Path(__file__).resolve().parents[2] / "shared" / "tokenizers" / "qwen3"
        if not qwen3.is_dir():
            pytest.skip("../shared/tokenizers/qwen3 is not on this machine")
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(qwen3)
    text = "Grüße, 世界! Ünïcödé 🤖🧠 — «quotes» ½ x² naïve café 日本語のテキスト\n\tend. " * 3
    ids = tok(text, add_special_tokens=False)["input_ids"]
    grow = Detokenizer(tok)
    assert grow.backend is not None  # both are fast tokenizers: the incremental path is the one tested
    withheld = 0
    for k in range(1, len(ids) + 1):
        whole, grown = tok.decode(ids[:k], skip_special_tokens=True), grow(ids[:k])
        if whole.endswith("\ufffd"):
            withheld += 1
            assert whole.startswith(grown) and len(grown) >= len(tok.decode(ids[:k - 1], skip_special_tokens=True)
                                                                  .rstrip("\ufffd")) - 1
        else:
            assert grown == whole
    assert grow(ids) == tok.decode(ids, skip_special_tokens=True)
    assert which == "char" or withheld  # some character did span tokens


def test_the_growing_text_falls_back_to_whole_decodes_where_a_byte_fallback_decoder_refuses():
    """A Llama-style tokenizer (byte-fallback tokens, its decoder turns invalid bytes into U+FFFD
    after the fact): tokenizers' DecodeStream raises on ids a sampled answer can hold; the text
    then comes from decoding all the ids, as before, instead of the error ending the answer."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from stages.inference.batching import Detokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for word in ["\u2581", "\u2581a", "a", "\u2581hello"]:
        vocab[word] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")
    ids = [vocab["<0x20>"], vocab["<0x96>"], vocab["<0xC2>"], vocab["\u2581"], vocab["<0xE4>"], vocab["\u2581hello"]]
    grow = Detokenizer(tok)
    texts = [grow(ids[:k]) for k in range(1, len(ids) + 1)]
    assert grow.backend is None  # DecodeStream refused on the way, so the whole decode took over
    assert texts[-1] == tok.decode(ids, skip_special_tokens=True)
