"""doit serve: the tiny recipe's model behind an OpenAI-compatible API, as a user reaches it, through
the official openai client against `doit serve:tiny` on 127.0.0.1; and the receipt gate: a
tampered byte in the served checkpoint, its mtime put back, makes serve refuse."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from conftest import NO_NETWORK, doit, free_port
from stages.engine.recipe import load


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                         http_client=openai.DefaultHttpxClient(trust_env=False), timeout=120)


class Server:
    """`doit serve:tiny` running in a project, its output in a file."""

    def __init__(self, project: Path, *args: str):
        self.port, self.log = free_port(), project / f"serve-{time.time_ns()}.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "doit", "serve:tiny", "--port", str(self.port), *args],
                                         cwd=project, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, **NO_NETWORK})
        self.client = client(self.port)
        deadline = time.time() + 300
        while True:
            assert self.proc.poll() is None, self.output()
            try:
                self.models = self.client.models.list().data
                return
            except openai.APIConnectionError:
                assert time.time() < deadline, self.output()
                time.sleep(0.5)

    def output(self) -> str:
        return self.log.read_text()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=120)


def manifest_digest(project: Path) -> str:
    return json.loads((project / "artifacts" / "tiny" / "manifest.json").read_text())["digest"]


def heldout(project: Path) -> list[dict]:
    """The eval stage's held-out rows: the conversation up to the answer, and the answer."""
    rows = [json.loads(line) for line in
            (project / "artifacts" / "tiny" / "latest" / "shards" / "heldout" / "heldout.jsonl").read_text().splitlines()]
    limit = load(project / "recipes" / "tiny.yaml").eval.limit
    return [{"messages": r["messages"][:-1], "answer": r["messages"][-1]["content"]} for r in rows[:limit]]


@pytest.fixture(scope="module")
def server(built):
    s = Server(built)
    yield s
    if s.proc.poll() is None:
        s.stop()


@pytest.fixture(scope="module")
def greedy(server, built) -> list[str]:
    """The served greedy answer to each held-out prompt, one request at a time."""
    n = load(built / "recipes" / "tiny.yaml").eval.max_new_tokens
    return [server.client.chat.completions.create(model=server.models[0].id, messages=d["messages"],
                                                  temperature=0, max_tokens=n).choices[0].message.content
            for d in heldout(built)]


def test_models_lists_the_recipe_and_its_receipt(server, built):
    assert [m.id for m in server.models] == [f"tiny-{manifest_digest(built)[:12]}"]
    assert server.client.models.retrieve(server.models[0].id).id == server.models[0].id


def test_the_console_says_where_it_serves_and_the_libraries_go_to_the_log(server, built):
    """Loading the model prints transformers' bar and warnings: they go to artifacts/tiny/serve.log,
    as a stage's library output goes to its log; the console keeps the startup line."""
    console = server.output()
    assert "Loading weights" not in console and "serve:tiny: tiny-" in console
    assert "Loading weights" in (built / "artifacts" / "tiny" / "serve.log").read_text()


def test_a_streamed_answer_is_the_same_answer(server, built):
    messages = heldout(built)[0]["messages"]
    whole = server.client.chat.completions.create(model=server.models[0].id, messages=messages, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "stop" and whole.choices[0].message.content
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    chunks = list(server.client.chat.completions.create(model=server.models[0].id, messages=messages, temperature=0,
                                                        stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_greedy_answers_are_the_eval_stages(greedy, built):
    """The served greedy answers score exactly what eval.json says the trained model scored, and
    are, one by one, what lm-eval's generation (the eval stage's) gives for the same prompts."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    from stages.data.kinds import chat
    from stages.model.trained import load_trained

    latest, recipe = built / "artifacts" / "tiny" / "latest", load(built / "recipes" / "tiny.yaml")
    docs = heldout(built)
    exact = sum(a.strip() == d["answer"] for a, d in zip(greedy, docs)) / len(docs)
    assert exact == json.loads((latest / "eval" / "eval.json").read_text())["trained"]["exact_match"]

    tok = AutoTokenizer.from_pretrained(latest / "base")
    model = load_trained(latest / "checkpoint", latest / "base")
    lm = HFLM(pretrained=model.eval(), tokenizer=tok, batch_size=recipe.eval.batch_size,
              max_length=model.config.max_position_embeddings)
    settings = {"until": [tok.eos_token], "max_gen_toks": recipe.eval.max_new_tokens, "do_sample": False}
    rows = [json.loads(line) for line in (latest / "shards" / "heldout" / "heldout.jsonl").read_text().splitlines()]
    prompts = [d["prompt"] for d in chat.heldout_docs(rows[:recipe.eval.limit], tok, model.config.max_position_embeddings)]
    expected = lm.generate_until([Instance("generate_until", {}, (p, dict(settings)), i) for i, p in enumerate(prompts)])
    assert greedy == expected


def test_max_tokens_and_stop_are_honoured(server, built, greedy):
    model, n = server.models[0].id, load(built / "recipes" / "tiny.yaml").eval.max_new_tokens
    longest = max(range(len(greedy)), key=lambda i: len(greedy[i]))
    messages, text = heldout(built)[longest]["messages"], greedy[longest]
    assert len(text) >= 3, greedy

    short = server.client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=1)
    assert short.usage.completion_tokens == 1 and short.choices[0].finish_reason == "length"
    assert text.startswith(short.choices[0].message.content)

    stop = text[len(text) // 2:]
    cut = text[:text.index(stop)]
    stopped = server.client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=n,
                                                    stop=[stop, "never appears"])
    assert stopped.choices[0].message.content == cut and stopped.choices[0].finish_reason == "stop"
    streamed = server.client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=n,
                                                     stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == cut


def post_raw(port: int, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_requests_get_openai_errors_and_serving_goes_on(server):
    model, c = server.models[0].id, server.client
    hello = [{"role": "user", "content": "What is 2 + 2?"}]
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="tiny-000000000000", messages=hello)
    assert e.value.body["code"] == "model_not_found" and model in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=model, messages=hello, max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=model, messages=[{"role": "user", "content": "1 + " * 1000}], max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded" and "1024" in e.value.body["message"]
    status, body = post_raw(server.port, b'{"model": "' + model.encode() + b'", "messages": [')
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    assert "not valid JSON" in body["error"]["message"]
    status, body = post_raw(server.port, json.dumps({"model": model, "messages": [{"role": "wizard", "content": "x"}]}).encode())
    assert status == 400 and body["error"]["param"] == "messages.0.role"
    after = c.chat.completions.create(model=model, messages=hello, temperature=0, max_tokens=4)
    assert after.choices[0].message.content is not None and server.proc.poll() is None


def test_32_concurrent_requests_are_all_answered(server, built, greedy):
    docs = heldout(built)[:32]
    n = load(built / "recipes" / "tiny.yaml").eval.max_new_tokens

    def ask(i):
        return server.client.chat.completions.create(model=server.models[0].id, messages=docs[i % len(docs)]["messages"],
                                                     temperature=0, max_tokens=n, stream=i % 2 == 1)

    def text(reply):
        if isinstance(reply, openai.Stream):
            return "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
        return reply.choices[0].message.content

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(lambda i: text(ask(i)), range(32)))
    assert answers == [greedy[i % len(docs)] for i in range(32)]


def test_quantized_model_is_served_and_sigterm_stops_it_cleanly(built):
    s = Server(built, "--quantized")
    assert [m.id for m in s.models] == [f"tiny-{manifest_digest(built)[:12]}-fp8"]
    reply = s.client.chat.completions.create(model=s.models[0].id, temperature=0, max_tokens=4,
                                             messages=[{"role": "user", "content": "What is 2 + 2?"}])
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert s.stop() == 0, s.output()
    assert "serve:tiny: stopped" in s.output()
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", s.port)):
        pass  # nothing listens there any more
    with socket.socket() as again:  # and a new server can take the port, as uvicorn would (SO_REUSEADDR)
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", s.port))
        again.listen()


def test_a_tampered_checkpoint_is_refused(warm):
    assert doit(warm, "verify:tiny").rc == 0  # the stat cache now trusts every file as it is
    ptr = json.loads((warm / "artifacts" / "tiny" / "checkpoint.json").read_text())
    weights = warm / "artifacts" / "store" / "checkpoint" / ptr["key"] / "model" / "model.safetensors"
    before = weights.stat()
    weights.chmod(0o644)
    with open(weights, "r+b") as f:
        f.seek(before.st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))  # same size, same mtime
    port = free_port()
    run = doit(warm, "serve:tiny", "--port", str(port), timeout=300)
    assert run.rc != 0
    refusal = [line for line in run.out.splitlines() if "refusing to serve" in line]
    assert len(refusal) == 1 and "checkpoint: model/model.safetensors differs" in refusal[0], run.out[-2000:]
    assert "Uvicorn running" not in run.out


def test_the_vllm_command_serves_the_checked_directories(tmp_path):
    """vLLM itself is not here (no GPU, its own environment): its command line is what is checked."""
    from stages.inference.served import Served
    from stages.inference.vllm import command

    base, adapter = tmp_path / "base", tmp_path / "checkpoint" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text('{"r": 32, "peft_type": "LORA"}')
    full = command("/opt/vllm/bin/vllm", Served("r-0123456789ab", ("checkpoint", "base"), tmp_path / "m", base),
                   "0.0.0.0", 8000)
    assert full == ["/opt/vllm/bin/vllm", "serve", str(tmp_path / "m"), "--host", "0.0.0.0", "--port", "8000",
                    "--tokenizer", str(base), "--served-model-name", "r-0123456789ab"]
    lora = command("vllm", Served("r-0123456789ab", ("checkpoint", "base"), base, base, adapter), "127.0.0.1", 9000)
    assert lora[2] == str(base) and "--enable-lora" in lora
    assert lora[lora.index("--lora-modules") + 1] == f"r-0123456789ab={adapter}"
    assert lora[lora.index("--max-lora-rank") + 1] == "32"
    assert lora[lora.index("--served-model-name") + 1] == "r-0123456789ab-base"
