"""Generation speed: doit serve's engine (stages/inference/: transformers' continuous batching,
paged KV cache, CUDA graphs) beside transformers' `generate` one request at a time (what the
server did before), on Qwen3-8B's shape in bf16 with random weights (seeded), prompts of real
text (MT-Bench's and GSM8K's questions through Qwen3's chat template and tokenizer, their own
lengths), greedy, 128 and 512 new tokens.

Measured in one process on the GPU it reports:
- the device-to-device copy bandwidth (bytes read + written per second) and the bound it sets:
  weight bytes (+ the KV bytes of the context) read per decode step over that bandwidth;
- single stream: one request at a time through the OpenAI client against the served app;
- concurrent 8, 32, 128: that many clients at once through the OpenAI client, streaming, with
  each answer's time to first token (p50, p99) and the aggregate tokens/s;
- each level --rounds times in a row: the first as a freshly started server gives it (CUDA graphs
  captured as new step shapes come), the median of the rest (`warm_tokens_per_s`) as a server
  that has run a while gives it;
- greedy equality: the engine's tokens against `generate`'s for the same prompts;
- with --serve-peer, `transformers serve --continuous-batching` (transformers' own OpenAI server
  over the same manager with its defaults), loaded from the same weights saved to disk, measured
  by the same clients.
The served app is stages/inference/app.py over stages/inference/generation.py's ServedModel, as
`doit serve` runs them, minus the manifest gate (there is no 8B build to gate here). The clients
run in processes of their own, as real clients would (in the server's process their threads
would take the interpreter's lock from the server's), spread over --client-processes (8): real clients
are separate programs (all of them in one process measured within noise of 8 on two H200s:
bench/results/generation_sampler_2026-11-28/README.md).

    python -m bench.generation_speed --out bench/results/generation_speed_h100_<date>.json
    python -m bench.generation_speed --tiny   # a CPU smoke run of the same code
"""
from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

from bench import tiny

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                tie_word_embeddings=False)


def real_questions(shared: Path, count: int) -> list[str]:
    """User questions as people wrote them: MT-Bench's first turns, then GSM8K's test questions."""
    questions = []
    mt = shared / "datasets" / "mt-bench" / "question.jsonl"
    gsm = shared / "datasets" / "gsm8k" / "test.jsonl"
    for line in mt.read_text().splitlines():
        questions.append(json.loads(line)["turns"][0])
    for line in gsm.read_text().splitlines():
        questions.append(json.loads(line)["question"])
    return questions[:count]


def tiny_questions(count: int) -> list[str]:
    return [json.loads(line)["messages"][0]["content"] for line in tiny.CHAT.read_text().splitlines()[:count]]


def copy_bandwidth(torch, device: str) -> float:
    """Bytes read plus written per second by a device-to-device copy of 4 GiB (median of 5)."""
    n = 1 << 31
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        t = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    del a, b
    return 2 * n / statistics.median(times[1:])


def make_model(shape: dict, device: str, dtype: str, tokenizer_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen3Config

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3Config(**shape, eos_token_id=eos, pad_token_id=tok.pad_token_id, bos_token_id=None, dtype=dtype)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).eval()
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id, do_sample=False)
    return model, tok


def sequential(model, prompts: list[list[int]], new_tokens: int, forced: bool = True) -> tuple[float, list[list[int]]]:
    """transformers' generate, one prompt at a time (dynamic cache, greedy): tokens/s and the tokens
    (`forced`: all new_tokens of them, an end token suppressed, as a speed measurement wants)."""
    import torch

    outs, tokens, start = [], 0, time.perf_counter()
    for ids in prompts:
        x = torch.tensor([ids], device=model.device)
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, min_new_tokens=new_tokens if forced else 0,
                                 do_sample=False)
        outs.append(out[0, len(ids):].tolist())
        tokens += len(outs[-1])
    return tokens / (time.perf_counter() - start), outs


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens two answers share from their start."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def served_prompt(tok, question: str) -> list[int]:
    """The prompt the served app makes of one user question (stages/data/render.py's rendering)."""
    from stages.data.render import render

    return tok(render(tok, [{"role": "user", "content": question}], generation_prompt=True))["input_ids"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """The served app on a free local port, in a thread."""

    def __init__(self, served, model_id: str):
        import uvicorn

        from stages.inference.app import build_app

        port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(build_app(served, model_id), host="127.0.0.1", port=port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        self.base_url, self.model_id = f"http://127.0.0.1:{port}/v1", model_id

    def close(self):
        self.server.should_exit = True
        self.thread.join()


class ServePeer:
    """`transformers serve --continuous-batching` over `model_dir`, in its own process."""

    def __init__(self, model_dir: Path, log: Path):
        port = free_port()
        self.log = log.open("w")
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "transformers.cli.transformers", "serve", str(model_dir), "--continuous-batching",
             "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.base_url, self.model_id = f"http://127.0.0.1:{port}/v1", str(model_dir)
        deadline = time.monotonic() + 600
        local = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # localhost: no proxy
        while True:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"transformers serve did not start: see {log}")
            try:
                local.open(f"http://127.0.0.1:{port}/health", timeout=1)
                return
            except OSError:
                time.sleep(0.5)

    def close(self):
        self.process.terminate()
        self.process.wait(60)
        self.log.close()


def one(client, model_id: str, question: str, new_tokens: int) -> dict:
    """One streamed greedy request: its time to first token and completion tokens."""
    messages = [{"role": "user", "content": question}]
    start, first, tokens = time.perf_counter(), None, 0
    stream = client.chat.completions.create(model=model_id, messages=messages, max_tokens=new_tokens,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return {"ttft": first if first is not None else time.perf_counter() - start, "tokens": tokens}


def client_load(base_url: str, model_id: str, questions: list[str], clients: int, new_tokens: int) -> dict:
    """`clients` OpenAI clients at once (1: the questions one after another), each streaming its
    questions' answers, in this clients' process: each request's figures, and when the first
    began and the last ended (time.monotonic, one clock for every process of the machine)."""
    import httpx2
    from openai import DefaultHttpxClient, OpenAI

    client = OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=3600,
                    http_client=DefaultHttpxClient(trust_env=False,  # localhost: no proxy
                                                   limits=httpx2.Limits(max_connections=clients + 8)))
    start = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda q: one(client, model_id, q, new_tokens), questions))
    return {"requests": results, "start": start, "end": time.monotonic()}


def ready_clients(_) -> None:
    """Imports the client side in a clients' process and holds it a moment, so that as many
    processes as there are calls start (the pool starts one per call that finds none idle)."""
    for name in ("httpx2", "openai"):
        importlib.import_module(name)
    time.sleep(1.0)


def load(pool, processes: int, base_url: str, model_id: str, questions: list[str], clients: int,
         new_tokens: int) -> dict:
    """`clients` clients at once spread over up to `processes` clients' processes, as real
    clients are separate programs (in one process every client's chunk parsing shares one
    interpreter lock). Aggregate tokens/s over the span from the first request to the last
    answer, and time to first token."""
    k = max(1, min(processes, clients))
    calls = [pool.submit(client_load, base_url, model_id, questions[i::k], clients // k + (i < clients % k), new_tokens)
             for i in range(k)]
    parts = [c.result() for c in calls]
    requests = [r for p in parts for r in p["requests"]]
    wall = max(p["end"] for p in parts) - min(p["start"] for p in parts)
    ttft = sorted(r["ttft"] for r in requests)
    tokens = sum(r["tokens"] for r in requests)
    return {"tokens_per_s": tokens / wall, "completion_tokens": tokens, "seconds": wall, "client_processes": k,
            "ttft_p50_s": statistics.median(ttft), "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))]}


def measure_server(clients_process, processes: int, server, questions: list[str], levels: list[int], new_tokens: int,
                   r: dict, rounds: int) -> None:
    """Single stream (three questions one after another) and each concurrency level into `r`, each
    `rounds` times in a row. The first round is the figure a freshly started server gives: the batch
    meets new step shapes and transformers captures a CUDA graph for each as it comes (0.1 s each on
    an H200; 22 of them, 3.5 s, in the first round of 128 at once). The later rounds, their median
    `warm_tokens_per_s`, are what a server that has run a while gives."""
    call = lambda qs, n: load(clients_process, processes, server.base_url, server.model_id, qs, n, new_tokens)

    def level(qs: list[str], n: int) -> dict:
        first, *later = [call(qs, n) for _ in range(rounds)]
        warm = [x["tokens_per_s"] for x in later]
        return {**first, "warm_rounds_tokens_per_s": warm, "warm_tokens_per_s": statistics.median(warm) if warm else None}

    single = level(questions[:3], 1)
    r["single_stream_tokens_per_s"], r["single_stream_ttft_s"] = single["tokens_per_s"], single["ttft_p50_s"]
    r["single_stream_warm_tokens_per_s"] = single["warm_tokens_per_s"]
    r["concurrent"] = {str(n): level((questions * (1 + n // len(questions)))[:n], n) for n in levels}


def run(args, result: dict, save) -> None:
    """Measures into `result`, calling save() after each measurement so a cut-off run keeps what it had."""
    import torch

    importlib.import_module("stages.inference.app")  # a serving stack that cannot import fails before the long work
    from stages.inference.generation import ServedModel

    if args.tiny:
        device, dtype, shape = "cpu", "float32", {**tiny.SHAPE, "max_position_embeddings": 1024}
        import tempfile

        tok_dir = tiny.tokenizer_dir(Path(tempfile.mkdtemp()))
        levels, lengths, count = [2, 4], [16], 8
        args.rounds = min(args.rounds, 2)
    else:
        device, dtype, shape = "cuda", "bfloat16", QWEN3_8B
        tok_dir, levels, lengths, count = args.shared / "tokenizers" / "qwen3", args.levels, args.new_tokens, 128
    result.update(gpu=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                  model="tiny" if args.tiny else "qwen3_8b_shape", dtype=dtype, torch=torch.__version__)
    import transformers

    result["transformers"] = transformers.__version__
    bandwidth = copy_bandwidth(torch, device) if device == "cuda" else None
    t = time.perf_counter()
    model, tok = make_model(shape, device, dtype, tok_dir)
    result["init_seconds"] = time.perf_counter() - t
    questions = tiny_questions(count) if args.tiny else real_questions(args.shared, count)
    prompts = [served_prompt(tok, q) for q in questions]
    lens = sorted(map(len, prompts))
    result["prompt_tokens"] = {"count": len(lens), "min": lens[0], "median": lens[len(lens) // 2], "max": lens[-1]}
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    result["weight_bytes"] = weight_bytes
    from stages.inference.batching import kv_bytes_per_token

    kv_token = kv_bytes_per_token(model.config)
    for new_tokens in lengths:
        key = str(new_tokens)
        r = result.setdefault("by_new_tokens", {}).setdefault(key, {})
        context = result["prompt_tokens"]["median"] + new_tokens // 2  # the mean context while decoding
        if bandwidth:
            r["bandwidth_bound_tokens_per_s"] = bandwidth / (weight_bytes + kv_token * context)
        if not args.serving_only:
            peer_prompts = prompts[:2 if args.tiny or new_tokens > 128 else 4]
            sequential(model, peer_prompts[:1], 8)  # warm-up
            r["peer_generate_one_at_a_time_tokens_per_s"], _ = sequential(model, peer_prompts, new_tokens)
        save()
    options = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.option)}
    compiled = device == "cuda" and not args.eager  # as doit serve runs the trained model
    result["compiled"] = compiled
    args.client_processes = result["client_processes"] = max(1, min(args.client_processes, max(levels)))
    with ProcessPoolExecutor(args.client_processes, mp_context=multiprocessing.get_context("spawn")) as clients:
        list(clients.map(ready_clients, range(args.client_processes)))
        t = time.perf_counter()
        served_model = ServedModel(model, tok, options=options, compiled=compiled)
        result["engine_options"] = options
        result["engine_init_seconds"] = time.perf_counter() - t  # with the compile and its warm-up, where compiled
        print("served model ready", flush=True)  # in a log with TORCH_LOGS=recompiles: what compiled while serving
        try:
            served = Served(served_model, "bench")
            try:
                serve_measures(args, result, save, clients, served, served_model, model, questions, prompts, levels, lengths)
            finally:
                served.close()
        finally:
            served_model.close()
        if args.serve_peer:
            del served_model
            serve_peer(args, result, save, clients, model, tok, questions, levels, lengths)


def serve_measures(args, result, save, clients, served, served_model, model, questions, prompts, levels, lengths):
    t = time.perf_counter()
    load(clients, 1, served.base_url, served.model_id, questions[:1], 1, 8)  # CUDA graphs captured
    result["first_request_seconds"] = time.perf_counter() - t
    result["kv_cache_tokens"] = served_model.kv_tokens
    for new_tokens in lengths:
        r = result["by_new_tokens"][str(new_tokens)]
        measure_server(clients, args.client_processes, served, questions, levels, new_tokens, r, args.rounds)
        if "bandwidth_bound_tokens_per_s" in r:
            r["single_stream_share_of_bound"] = r["single_stream_tokens_per_s"] / r["bandwidth_bound_tokens_per_s"]
            if r["single_stream_warm_tokens_per_s"] is not None:
                r["single_stream_warm_share_of_bound"] = r["single_stream_warm_tokens_per_s"] / r["bandwidth_bound_tokens_per_s"]
        for c in r["concurrent"].values():
            if "peer_generate_one_at_a_time_tokens_per_s" in r:
                c["x_peer_one_at_a_time"] = c["tokens_per_s"] / r["peer_generate_one_at_a_time_tokens_per_s"]
        save()
    if args.serving_only:
        return
    # greedy equality: the engine's tokens for the peer's prompts beside generate's
    from stages.inference.batching import Sampling

    new_tokens = lengths[0]
    same_prompts = prompts[:2 if args.tiny else 4]
    answers = served_model.engine.generate(same_prompts, Sampling(max_new_tokens=new_tokens))
    _, seq_out = sequential(model, same_prompts, new_tokens, forced=False)
    prefix = [common_prefix(a.ids, b) for a, b in zip(answers, seq_out)]
    result["greedy_equal"] = {"prompts": len(prefix), "identical": sum(p == new_tokens for p in prefix),
                              "common_prefix_tokens": prefix, "new_tokens": new_tokens}
    save()


def serve_peer(args, result, save, clients, model, tok, questions, levels, lengths):
    """transformers serve --continuous-batching on the same weights, saved to disk for it to load
    (our model leaves the GPU first: the peer sizes its KV cache from the memory it finds free)."""
    import shutil
    import tempfile

    import torch

    work = Path(tempfile.mkdtemp(prefix="serve_peer_"))
    try:
        model.save_pretrained(work / "model")
        tok.save_pretrained(work / "model")
        model.to("meta")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        t = time.perf_counter()
        peer = ServePeer(work / "model", args.out.with_suffix(".serve_peer.log"))
        try:
            load(clients, 1, peer.base_url, peer.model_id, questions[:1], 1, 8)
            result["peer_transformers_serve_start_seconds"] = time.perf_counter() - t
            for new_tokens in lengths:
                r = result["by_new_tokens"][str(new_tokens)]
                p = r["peer_transformers_serve"] = {}
                measure_server(clients, args.client_processes, peer, questions, levels, new_tokens, p, args.rounds)
                for n, c in r["concurrent"].items():
                    c["x_peer_transformers_serve"] = c["tokens_per_s"] / p["concurrent"][n]["tokens_per_s"]
                save()
        finally:
            peer.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a CPU smoke run on the tiny shape (measures nothing)")
    ap.add_argument("--shared", type=Path, default=SHARED,
                    help="where tokenizers/qwen3 and datasets/{mt-bench,gsm8k} are (default ../shared)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[128, 512], help="completion lengths measured")
    ap.add_argument("--levels", type=int, nargs="+", default=[8, 32, 128], help="concurrent clients measured")
    ap.add_argument("--client-processes", type=int, default=8,
                    help="processes the concurrent clients are spread over (1: every client in one process)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="times each level is measured in a row on one server: the first as a fresh server gives "
                         "it, the median of the rest as a server that has run a while (warm_tokens_per_s)")
    ap.add_argument("--serve-peer", action="store_true", help="also measure `transformers serve --continuous-batching`")
    ap.add_argument("--serving-only", action="store_true",
                    help="the served engine only (no `generate` peer, no greedy comparison): two versions of the "
                         "server side by side, one run after another on one machine")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=JSON",
                    help="a field of transformers' ContinuousBatchingConfig for the engine, e.g. use_async_batching=true")
    ap.add_argument("--eager", action="store_true",
                    help="serve with the model's forward uncompiled (on a GPU doit serve compiles it)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: each level needs at least one round")
    out = args.out or (tiny.results_path("generation_speed") if args.tiny else
                       REPO / "bench" / "results" / f"generation_speed_{time.strftime('%Y-%m-%d')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    args.out = out
    result: dict = {}

    def save():
        out.write_text(json.dumps(result, indent=1))
        print(json.dumps(result), flush=True)

    run(args, result, save)
    save()
    print(f"written {out}")


if __name__ == "__main__":
    main()
