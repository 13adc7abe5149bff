"""The served model on the transformers backend: loaded once, prompted the way the eval stage
prompts (the model's own chat template through stages/data/render.py, the tokenizer's default
special tokens), and decoded by the generation engine (stages/inference/batching.py):
concurrent requests share its continuous batch, joining and leaving between decode steps. A
generation ends early when its caller stops waiting (its client went away: its KV pages are
freed at the next step) or when its time limit passes (it then ends as one out of tokens does,
finish_reason "length"). The KV budget bounds prompt plus completion of one request."""
from __future__ import annotations

import math
import os
import time
from contextlib import aclosing
from dataclasses import dataclass, field

from stages.data.render import render
from stages.inference.batching import Engine, Generated, Sampling, end_ids
from stages.inference.served import Served
from stages.model.trained import load_trained, placement


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


def load(s: Served) -> "ServedModel":
    """What a manifest serves, loaded as eval loads it (an adapter merged into the base)."""
    os.environ.setdefault("QUARK_DISABLE_COMPILE", "1")  # a Quark export loads as eval loads it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(s.tokenizer)
    if s.checkpoint is not None:
        return ServedModel(load_trained(s.checkpoint, s.tokenizer), tok)
    return ServedModel(AutoModelForCausalLM.from_pretrained(s.weights, **placement()), tok)


class ServedModel:
    """A loaded model and tokenizer behind the generation engine."""

    def __init__(self, model, tok, kv_tokens: int | None = None, options: dict | None = None):
        self.model, self.tok = model.eval(), tok
        self.engine = Engine(self.model, self.tok, end_ids(self.model, tok), kv_tokens, options)
        self.kv_tokens = self.engine.kv_tokens
        self.context_length = min(self.model.config.max_position_embeddings, self.kv_tokens)

    def close(self) -> None:
        self.engine.close()

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.tok(render(self.tok, messages, generation_prompt=True))["input_ids"]

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
