"""The generation engine: generations on a loaded model go through one continuous batch,
transformers' ContinuousBatchingManager (a paged KV cache of a stated token budget; requests join
and leave the batch between decode steps; on CUDA its decode step replayed as a CUDA graph). It is
transformers' engine, configured here, not one written here; its attention
(stages/inference/attention.py) reads each request's own keys on a GPU (a Triton kernel,
stages/inference/varlen.py), and is transformers' SDPA without the copies of keys and values per
query head on the CPU.

One batch holds greedy and sampled requests side by side: every request states its temperature
and top_p, and a greedy one (temperature 0) is sampled with top_p 0, which keeps the highest
score alone (under an exact tie, the same one of the tied every time). A top-k processor, whose
only use was top_k 1 for greedy requests, would sort the vocabulary of every request a second
time at every step.
What a request cannot have of its own is a random generator: sampled requests share the batch's,
so a seed makes no sampled answer repeatable (greedy ones are, and equal the sequential path's).

Stop strings, deadlines and cancellation are the caller's side of the batch: `stream` (and
`generate`, for stop strings) watches the text as it grows and cancels the request in the manager,
which frees its KV pages at the next step.
"""
from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field

PAGE_TOKENS = 256  # tokens a KV page holds (transformers' default page size)
CUDA_KV_SHARE = 0.6  # of the GPU memory free after loading: the rest is the batch's activations and logits
CPU_KV_SHARE = 0.1  # of the RAM available: the CPU is a fallback, its batches are small
MAX_BATCH_TOKENS = {"cuda": 2048, "cpu": 256}  # tokens one step computes: prefill chunks, or decodes of many requests
POLL_S = 0.1  # how often a waiting caller checks its deadline and that the batch's thread still runs
KV_CONTEXTS = 64  # the cache never holds more than this many whole contexts: beyond, memory buys nothing
# Without flash attention (not on the lent GPUs) a decode step runs SDPA over the batch's KV read out of
# the pages, padded up to a multiple of this many tokens so that a CUDA graph replays it. transformers'
# preset, 16384, made every step of a short chat attend over 16k tokens: on an H200 (8B shape, 128 new
# tokens, one run each) 1024 took one stream from 23 to 58 tokens/s and 8 at once from 173 to 326, 32 from
# 555 to 685, for 9% less at 128 at once (1000 -> 914); 256 captured so many graphs that 32 and 128 fell.
KV_PADDING_TOKENS = 1024


@dataclass
class Sampling:
    """One request's decoding: temperature 0 is greedy."""
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    deadline: float = math.inf  # time.monotonic() after which the request ends (once it has a token) as if out of tokens


@dataclass
class Generated:
    ids: list[int]  # the new tokens, up to where the request ended (at or a little past a stop string)
    finish: str  # "stop" (end of turn or a stop string) or "length" (max_new_tokens or the deadline)
    text: str  # the new tokens' text, cut before a stop string


def kv_bytes_per_token(config) -> int:
    """Bytes one token of context takes in the KV cache: keys and values of every layer."""
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * 2  # bf16/fp16 cache: 2 bytes an element


def whole_memory(device) -> int:
    """Bytes of the device's whole memory (a GPU's, or the machine's RAM on the CPU): what sizes
    that must not follow the memory free at the time are taken from (eval's generate batches,
    whether GRPO's rollouts merge), so the same recipe on the same card decides the same."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    import psutil

    return psutil.virtual_memory().total


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_budget_tokens(model) -> int:
    """The KV cache's size in tokens, whole pages: a share of the memory free once the model is loaded."""
    import torch

    if model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        share = free * CUDA_KV_SHARE
    else:
        import psutil

        share = psutil.virtual_memory().available * CPU_KV_SHARE
    tokens = min(int(share // kv_bytes_per_token(model.config)),
                 KV_CONTEXTS * model.config.get_text_config().max_position_embeddings)
    return max(PAGE_TOKENS, tokens // PAGE_TOKENS * PAGE_TOKENS)


def end_ids(model, tok) -> set[int]:
    """The tokens that end an answer: the model's generation config's and the tokenizer's end."""
    eos = model.generation_config.eos_token_id
    return (set(eos if isinstance(eos, list) else [eos]) | {tok.eos_token_id}) - {None}


def cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """The text up to the first stop string (which OpenAI's API leaves out), and whether one occurred."""
    at = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text[:at], True) if at >= 0 else (text, False)


class Engine:
    """A running continuous batch over `model` (eval mode, loaded on its device). `stream` runs
    one request for an asyncio caller; `generate` runs many and returns when all are done. `options` are further fields
    of transformers' ContinuousBatchingConfig (bench/generation_speed.py tries them). Its compile
    levels above 0 fail with per-request settings (torch 2.11, transformers 5.23: inductor cannot
    generate the top-p sampler's cumsum), so a serving engine's step runs as a CUDA graph of eager
    kernels; an engine with one `sampling` for all (GRPO's rollouts) compiles at level 1."""

    def __init__(self, model, tok, eos_ids: set[int], kv_tokens: int | None = None, options: dict | None = None,
                 sampling: tuple[float, float] | None = None):
        """`sampling` (temperature, top_p) fixes one decoding for every request, as a batch of
        rollouts has: then the batch runs no per-request logits processors, and none at all where
        the settings are the no-op ones (temperature 1, top_p 1: plain sampling from the softmax),
        which spares each step the vocabulary sorts of top-k and top-p."""
        from transformers import ContinuousBatchingConfig, GenerationConfig

        from stages.inference import attention

        attention.install()
        self.tok, self.eos_ids, self.fixed = tok, set(eos_ids), sampling is not None
        self.kv_tokens = kv_tokens or kv_budget_tokens(model)
        device = model.device.type
        ends = dict(eos_token_id=sorted(self.eos_ids), pad_token_id=tok.pad_token_id)
        if sampling is not None:
            temperature, top_p = sampling
            config = GenerationConfig(do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
                                      top_p=top_p, top_k=None, **ends)
        else:
            # The manager makes a logits processor only for a setting that differs from the no-op default,
            # and then takes each request's own value: these defaults are placeholders every request overrides.
            config = GenerationConfig(do_sample=True, temperature=0.5, top_p=0.5, top_k=None, **ends)
        # On CUDA the decode step is a CUDA graph. Async batching (the next batch prepared while one
        # runs) is off: it copies SDPA's mask, sized by the whole KV cache (about 2 GB on an H200), from
        # the host at every step, 2-4x slower at 1-128 requests; with a 16-64k token cache it was on
        # par, not a gain (bench/results/generation_cold_warm_2026-11-28/README.md).
        cuda = device == "cuda"
        step = MAX_BATCH_TOKENS["cuda" if cuda else "cpu"]
        batching = ContinuousBatchingConfig(**{
            "page_size": PAGE_TOKENS, "num_blocks": self.kv_tokens // PAGE_TOKENS, "per_request_processors": not self.fixed,
            "max_batch_tokens": step, "use_cuda_graph": cuda,
            "kv_padding_interval_size": KV_PADDING_TOKENS, "use_async_batching": False, **(options or {})})
        self.max_batch_tokens = batching.max_batch_tokens or step  # options may leave it to transformers
        self.manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=batching)
        self.manager.start()
        self.waiting: dict[str, queue.Queue] = {}
        self.lock, self.count, self.running = threading.Lock(), 0, True
        self.router = threading.Thread(target=self._route, daemon=True, name="generation-router")
        self.router.start()

    def close(self) -> None:
        self.running = False
        self.manager.stop(block=True)
        self.router.join()

    def _route(self) -> None:
        """Hands each output the manager produces to the caller waiting for its request. A hand-off
        that fails (a caller whose event loop has closed) is that caller's loss alone: the router
        goes on for the others. Once the batch's thread has died it idles (the manager then answers
        at once, and the callers see the death themselves)."""
        while self.running:
            out = self.manager.get_result(timeout=POLL_S)
            if out is None:
                if not self.manager.is_running():
                    time.sleep(POLL_S)
                continue
            with self.lock:
                waiting = self.waiting.get(out.request_id)
            if waiting is not None:
                try:
                    waiting.put(out)
                except Exception:  # noqa: BLE001 - one caller's failure must not stop every other's outputs
                    logging.getLogger(__name__).exception("handing %s its output failed", out.request_id)

    def alive(self) -> bool:
        """Whether requests can still end: the batch's thread and the router both run."""
        return self.manager.is_running() and self.router.is_alive()

    def _submit(self, ids: list[int], s: Sampling, streaming: bool, into=None) -> tuple[str, queue.Queue | Reading]:
        """Queue a request; its outputs go to a queue of its own, or to `into` (anything with a
        `put`: a queue shared by many requests, or one request's Reading)."""
        if len(ids) + s.max_new_tokens > self.kv_tokens:
            raise ValueError(f"{len(ids)} prompt and {s.max_new_tokens} new tokens are more than the "
                             f"{self.kv_tokens} tokens of KV cache this engine holds")
        with self.lock:
            self.count += 1
            rid, waiting = f"r{self.count}", into or queue.Queue()
            self.waiting[rid] = waiting
        greedy = s.temperature <= 0
        own = {} if self.fixed else dict(temperature=1.0 if greedy else float(s.temperature),
                                         top_p=0.0 if greedy else float(s.top_p))
        taken = self.manager.add_request(list(ids), request_id=rid, max_new_tokens=s.max_new_tokens, streaming=streaming,
                                         **own)
        if taken is None:  # the manager refuses requests once its thread has stopped
            self._finish(rid, cancel=False)
            raise RuntimeError("the generation engine has stopped (its log says why)")
        return rid, waiting

    def _next(self, waiting: queue.Queue):
        """The request's next output, None after POLL_S without one; an error once the batch's thread
        has died (its requests would never end)."""
        try:
            return waiting.get(timeout=POLL_S)
        except queue.Empty:
            if not self.alive():
                raise RuntimeError("the generation engine has stopped (its log says why)") from None
            return None

    def _finish(self, rid: str, cancel: bool) -> None:
        if cancel:
            self.manager.cancel_request(rid)
        with self.lock:
            self.waiting.pop(rid, None)

    async def stream(self, ids: list[int], s: Sampling, texts: bool = True):
        """Yields the text of the answer so far each time it grows, then the Generated answer;
        with `texts` off (a caller that wants the answer only), the answer alone. The request's
        outputs wake the event loop, not a thread of its own (a thread per request, woken at every
        token, held the GIL the batch's own thread needs), and a wake-up reads the newest tokens,
        however many steps came since. Past the deadline the answer so far ends it; closing the
        generator (its client went away) frees the request's pages at the next step."""
        loop, woken = asyncio.get_running_loop(), asyncio.Event()
        reading = Reading(self, s, texts, lambda: loop.call_soon_threadsafe(woken.set))
        rid = self._submit(ids, s, streaming=True, into=reading)[0]
        try:
            while True:
                if reading.late():
                    yield reading.cut()
                    return
                # a timer, not asyncio.wait_for: Python 3.11's wait_for swallows a cancellation that
                # comes as the wait ends, which left a request decoding for a client gone
                timer = loop.call_later(POLL_S, woken.set)
                try:
                    await woken.wait()
                finally:
                    timer.cancel()
                woken.clear()
                piece = reading.next()
                if piece is not None:
                    yield piece
                    if isinstance(piece, Generated):
                        return
        finally:
            self._finish(rid, cancel=not reading.done)

    def _answer(self, new: list[int], text: str, stopped: bool, s: Sampling) -> Generated:
        """A finished request ended at a stop string, at the end of its turn (an end token, which
        the manager may or may not keep in its tokens), or out of tokens."""
        ended = bool(new) and (new[-1] in self.eos_ids or len(new) < s.max_new_tokens)
        return Generated(new, "stop" if stopped or ended else "length", text)

    def generate(self, prompts: list[list[int]], s: Sampling) -> list[Generated]:
        """Every prompt's answer, all in the batch at once (the batch admits what its KV cache holds
        and the rest as pages free). With stop strings the requests stream into one queue, and one
        whose newest tokens hold a stop string leaves the batch then (a few-shot task's answer
        ends where the model starts the next question, long before its token limit); the others
        are decoded once, when they end."""
        outputs: queue.Queue = queue.Queue()
        order, answers = {}, {}
        try:
            for i, ids in enumerate(prompts):
                order[self._submit(ids, s, streaming=bool(s.stop), into=outputs)[0]] = i
            while len(answers) < len(prompts):
                out = self._next(outputs)
                if out is None or order[out.request_id] in answers:  # (queued before its request left)
                    continue
                if out.error:
                    raise RuntimeError(f"generation failed: {out.error}")
                new = list(out.generated_tokens)
                if out.is_finished() or self._stopped(new, s.stop):
                    text, stopped = cut_at_stop(self.tok.decode(new, skip_special_tokens=True), s.stop)
                    answers[order[out.request_id]] = self._answer(new, text, stopped, s)
                    self._finish(out.request_id, cancel=not out.is_finished())
        finally:  # what has not answered (a refused or failed request stops the rest) leaves the batch
            for rid, i in order.items():
                if i not in answers:
                    self._finish(rid, cancel=True)
        return [answers[i] for i in range(len(prompts))]

    def _stopped(self, new: list[int], stop: list[str]) -> bool:
        """Whether the newest tokens hold a stop string: only they are decoded (a token is a
        character or more, or a piece of one), so a step costs the same however long the answer."""
        if not stop:
            return False
        tail = self.tok.decode(new[-4 * max(map(len, stop)) - 8:], skip_special_tokens=True)
        return any(x in tail for x in stop)


class Reading:
    """One request as its caller reads it. The engine's router thread `put`s each output here;
    outputs carry every token so far, so only the newest is kept, and the caller is woken
    (`wake`) once until it reads: at every step when it wants the text as it grows (or has stop
    strings to watch for), else only for the end. `next` turns the newest output into what the
    caller sees: the text so far, the Generated answer, or None (nothing new)."""

    def __init__(self, engine: Engine, s: Sampling, texts: bool, wake):
        self.engine, self.s, self.texts, self.wake = engine, s, texts, wake
        self.every = texts or bool(s.stop)
        self.text = Detokenizer(engine.tok)
        self.lock, self.out, self.woken = threading.Lock(), None, False
        self.new: list[int] = []
        self.done = False

    def put(self, out) -> None:
        with self.lock:
            self.out = out
            wake = not self.woken and (self.every or out.is_finished() or bool(out.error))
            self.woken = self.woken or wake
        if wake:
            self.wake()

    def late(self) -> bool:
        """Past the deadline with a token: a request still gets its first token, an answer however short."""
        return bool(self.new) and time.monotonic() >= self.s.deadline

    def next(self):
        with self.lock:
            out, self.out, self.woken = self.out, None, False
        if out is None:
            if not self.engine.alive():
                raise RuntimeError("the generation engine has stopped (its log says why)")
            return None
        if out.error:
            raise RuntimeError(f"generation failed: {out.error}")
        self.new = out.generated_tokens
        if out.is_finished():
            self.done = True
            text, stopped = cut_at_stop(self.engine.tok.decode(self.new, skip_special_tokens=True), self.s.stop)
            return self.engine._answer(list(self.new), text, stopped, self.s)
        if not self.every:
            return None
        text, stopped = cut_at_stop(self.text(self.new), self.s.stop)
        if stopped:
            return self.engine._answer(list(self.new), text, stopped, self.s)
        return text if self.texts else None

    def cut(self) -> Generated:
        """The answer so far, for a request past its deadline."""
        text = self.engine.tok.decode(self.new, skip_special_tokens=True)
        return Generated(list(self.new), "length", cut_at_stop(text, self.s.stop)[0])


class Detokenizer:
    """The text of a request's tokens as they grow, extended a token at a time by tokenizers'
    DecodeStream where the tokenizer is a fast one that decodes without clean-up (the text is then
    the whole decode's): decoding the whole answer at every step cost 44 us for 128 of Qwen3's
    tokens and 176 us for 512 (this machine's CPU), per request per step on the thread the batch
    shares, against 2 us a token. Other tokenizers decode the whole answer each time."""

    def __init__(self, tok):
        backend = getattr(tok, "backend_tokenizer", None)
        self.tok = tok
        self.backend = None if getattr(tok, "clean_up_tokenization_spaces", False) else backend
        if self.backend is not None:
            from tokenizers.decoders import DecodeStream

            self.stream = DecodeStream(skip_special_tokens=True)
        self.fed, self.text = 0, ""

    def __call__(self, ids: list[int]) -> str:
        """The text of `ids`, which extend the ids of the previous call; a character whose bytes
        are not all there yet waits (the whole decode shows it as U+FFFD meanwhile)."""
        if self.backend is not None:
            try:
                for token in ids[self.fed:]:
                    piece = self.stream.step(self.backend, token)
                    if piece:
                        self.text += piece
                    self.fed += 1
                return self.text
            except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception ("Invalid prefix encountered")
                # a byte-fallback decoder turned earlier bytes into U+FFFD after the fact: what was
                # decoded is no longer a prefix, so this request decodes whole from here on
                self.backend = None
        return self.tok.decode(ids, skip_special_tokens=True)
