"""The served model on the transformers backend: loaded once, prompted the way the eval stage
prompts (the model's own chat template through stages/data/render.py, the tokenizer's default
special tokens), and decoded by the generation engine (stages/inference/batching.py):
concurrent requests share its continuous batch, joining and leaving between decode steps. A
generation ends early when its caller stops waiting (its client went away: its KV pages are
freed at the next step) or when its time limit passes (it then ends as one out of tokens does,
finish_reason "length"). The KV budget bounds prompt plus completion of one request."""
from __future__ import annotations

import gc
import math
import os
import time
from contextlib import aclosing
from dataclasses import dataclass, field

from stages.data.render import prompt_ids
from stages.inference.batching import Engine, Generated, Sampling, end_ids
from stages.inference.served import Served
from stages.model.trained import load_trained, on_cuda, placement


@dataclass
class Settings:
    """One request's decoding settings, already validated."""
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    time_limit: float = math.inf  # seconds from the request's start to its last token

    def sampling(self) -> Sampling:
        return Sampling(self.max_new_tokens, self.temperature, self.top_p, self.stop,
                        time.monotonic() + self.time_limit)


def compiles(s: Served) -> bool:
    """Whether `load` compiles the served model: the trained model on a CUDA GPU. Not a quantized
    export, which runs its quantizer's own modules (on a GPU vLLM serves it), nor on the CPU."""
    return s.checkpoint is not None and on_cuda()


def load(s: Served, compiled: bool) -> "ServedModel":
    """What a manifest serves, loaded as eval loads it (an adapter merged into the base);
    `compiled`: the caller's choice where `compiles(s)`."""
    os.environ.setdefault("QUARK_DISABLE_COMPILE", "1")  # a Quark export loads as eval loads it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(s.tokenizer)
    if s.checkpoint is not None:
        return ServedModel(load_trained(s.checkpoint, s.tokenizer), tok, compiled=compiled)
    return ServedModel(AutoModelForCausalLM.from_pretrained(s.weights, **placement()), tok)


class ServedModel:
    """A loaded model and tokenizer behind the generation engine. `compiled`: the model's forward
    goes through torch.compile (dynamic shapes; the engine's attention stays outside it, so every
    layer shares one compiled variant), compiled before the server answers by a warm-up. On an
    H100 it made the batch 1.2-1.5x faster at 1 to 128 requests at once (docs/serving.md); on a
    CPU it is left off, where the compile costs more than it gives. A model that does not compile
    is served uncompiled: `compile_failure` says why."""

    def __init__(self, model, tok, kv_tokens: int | None = None, options: dict | None = None,
                 compiled: bool = False):
        self.model, self.tok, self.compile_failure = model.eval(), tok, None
        if compiled:
            import torch

            self.model.forward = torch.compile(self.model.forward, dynamic=True)
        def engine(kv: int | None) -> Engine:
            return Engine(self.model, self.tok, end_ids(self.model, tok), kv, options)

        self.engine = engine(kv_tokens)
        self.kv_tokens = self.engine.kv_tokens
        self.context_length = min(self.model.config.max_position_embeddings, self.kv_tokens)
        if compiled:
            try:
                self.warm_up()
            except Exception as e:  # noqa: BLE001 - any failure to compile leaves the model as it was loaded
                self.compile_failure = " ".join(f"{type(e).__name__}: {e}".split())[:300]  # one line
                self.engine.close()
                self.engine = None  # its KV cache freed before the next is sized as large
                vars(self.model).pop("forward")  # the class's forward again
                torch.compiler.reset()
                gc.collect()
                torch.cuda.empty_cache()
                self.engine = engine(self.kv_tokens)

    def warm_up(self) -> None:
        """Compile every kind of step the batch takes before a client waits on one. Dynamo compiles
        anew for one request or several, for keys and values to read from the cache or none yet,
        and for a prefill chunk that fills the step or not: eight kinds, as many as its limit
        allows (past it a frame runs uncompiled). On an H200, a kind first met while serving held
        32 or 128 clients for 5-7 s. One request; eight; long prompts, prefilled in chunks
        (together enough for two and a half steps, each as long as the context allows); then eight
        beside other such prompts, decoding across their chunks. A kind missed here (a KV cache
        too small to hold them at once) compiles when it first comes."""
        short = self.prompt_ids([{"role": "user", "content": "Say hello."}])
        fill = self.engine.max_batch_tokens * 5 // 2
        length = max(len(short), min(fill, self.context_length - 16))
        long = (short * (length // len(short) + 1))[:length]
        longs = [long[i:] + long[:i] for i in range(-(-fill // length))]  # rotated: no prefix in common to reuse
        for prompts in ([short], [short] * 8, longs, [short] * 8 + [x[::-1] for x in longs]):
            self.engine.generate(prompts, Sampling(8))

    def close(self) -> None:
        self.engine.close()

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return prompt_ids(self.tok, messages)

    async def complete(self, ids: list[int], s: Settings) -> Generated:
        """The answer, whole; cancelling the call (its client went away) ends the generation."""
        async with aclosing(self.engine.stream(ids, s.sampling(), texts=False)) as pieces:
            async for piece in pieces:
                return piece
        raise AssertionError("the engine ends every request with its answer")

    async def stream(self, ids: list[int], s: Settings):
        """Yields pieces of text as they are decoded, then the Generated answer (its text the pieces joined).
        A piece that could be the start of a stop string is held back until it is known not to be.
        Closing it (its client went away) ends the generation."""
        sent, hold = 0, max((len(x) for x in s.stop), default=1) - 1
        async with aclosing(self.engine.stream(ids, s.sampling())) as pieces:
            async for piece in pieces:
                if isinstance(piece, Generated):
                    if len(piece.text) > sent:
                        yield piece.text[sent:]
                    yield piece
                    return
                safe = len(piece.rstrip("\ufffd")) - hold  # a character whose bytes are not all decoded yet waits
                if safe > sent:
                    yield piece[sent:safe]
                    sent = safe
