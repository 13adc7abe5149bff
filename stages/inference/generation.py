"""The served model on the transformers backend: loaded once, prompted the way the eval stage
prompts (the model's own chat template through stages/data/render.py, the tokenizer's default
special tokens), and decoded by transformers' generate (greedy when temperature is 0, its
sampler otherwise; stop strings through its StopStringCriteria; TextIteratorStreamer for
streaming). One generation runs at a time: concurrent requests queue for the model, so each
answer is the one it would get alone. A generation ends early when its cancel event is set (its
client went away; one still queued then never starts) or when it has held the model for its
time limit (it then ends as one out of tokens does, finish_reason "length")."""
from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass, field

from stages.data.render import render
from stages.model.trained import load_trained, placement
from stages.inference.served import Served


@dataclass
class Settings:
    """One request's decoding settings, already validated."""
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    time_limit: float = math.inf  # seconds the generation may hold the model


@dataclass
class Answer:
    text: str
    finish_reason: str  # "stop" (end of turn or a stop string) or "length"
    completion_tokens: int


def cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """The text up to the first stop string (which OpenAI's API leaves out), and whether one occurred."""
    at = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text[:at], True) if at >= 0 else (text, False)


def halting(cancel: threading.Event | None, deadline: float):
    """A stopping criterion that ends a generation once its client has gone away (cancel is set)
    or time.monotonic() reaches its deadline."""
    import torch
    from transformers import StoppingCriteria

    class Halting(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            halt = (cancel is not None and cancel.is_set()) or time.monotonic() >= deadline
            return torch.full((input_ids.shape[0],), halt, dtype=torch.bool)

    return Halting()


class ServedModel:
    def __init__(self, s: Served):
        os.environ.setdefault("QUARK_DISABLE_COMPILE", "1")  # a Quark export loads as eval loads it
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(s.tokenizer)
        if s.checkpoint is not None:  # loaded as eval loads it (an adapter merged into the base)
            self.model = load_trained(s.checkpoint, s.tokenizer)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(s.weights, **placement())
        self.model.eval()
        self.context_length = self.model.config.max_position_embeddings
        self.lock = threading.Lock()

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.tok(render(self.tok, messages, generation_prompt=True))["input_ids"]

    def _generate(self, ids: list[int], s: Settings, streamer=None, cancel: threading.Event | None = None):
        """transformers' generate on one prompt, the model held for the whole call; the new token ids,
        and whether the time limit cut them short."""
        from transformers import StoppingCriteriaList

        torch = self.torch
        sampling = {"do_sample": True, "temperature": s.temperature, "top_p": s.top_p} if s.temperature > 0 \
            else {"do_sample": False}
        extra = {"stop_strings": s.stop, "tokenizer": self.tok} if s.stop else {}
        input_ids = torch.tensor([ids], device=self.model.device)
        with self.lock, torch.no_grad():
            if cancel is not None and cancel.is_set():  # its client left while it waited
                return [], False
            deadline = time.monotonic() + s.time_limit
            halt = StoppingCriteriaList([halting(cancel, deadline)])
            if s.seed is not None:
                torch.manual_seed(s.seed)
            out = self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                      max_new_tokens=s.max_new_tokens, pad_token_id=self.tok.pad_token_id,
                                      streamer=streamer, stopping_criteria=halt, **sampling, **extra)
        return out[0, len(ids):].tolist(), time.monotonic() >= deadline

    def _answer(self, new_ids: list[int], late: bool, text: str, s: Settings) -> Answer:
        text, stopped = cut_at_stop(text, s.stop)
        ended = bool(new_ids) and new_ids[-1] in self._eos_ids()
        finish = "stop" if stopped or ended or (len(new_ids) < s.max_new_tokens and not late) else "length"
        return Answer(text, finish, len(new_ids))

    def _eos_ids(self) -> set[int]:
        eos = self.model.generation_config.eos_token_id
        return set(eos if isinstance(eos, list) else [eos]) | {self.tok.eos_token_id}

    def complete(self, ids: list[int], s: Settings, cancel: threading.Event | None = None) -> Answer:
        new, late = self._generate(ids, s, cancel=cancel)
        return self._answer(new, late, self.tok.decode(new, skip_special_tokens=True), s)

    def stream(self, ids: list[int], s: Settings, cancel: threading.Event):
        """Yields pieces of text as they are decoded, then the Answer (its text the pieces joined).
        A piece that could be the start of a stop string is held back until it is known not to be."""
        from transformers import TextIteratorStreamer

        streamer = TextIteratorStreamer(self.tok, skip_prompt=True, skip_special_tokens=True)
        result: dict = {}

        def work():
            try:
                result["ids"], result["late"] = self._generate(ids, s, streamer, cancel)
            except BaseException as e:  # re-raised on the streaming side
                result["error"] = e
            finally:  # generate ends the stream itself, but not one that failed or never started
                streamer.end()

        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        text, sent, hold = "", 0, max((len(x) for x in s.stop), default=1) - 1
        for piece in streamer:
            text += piece
            cut, stopped = cut_at_stop(text, s.stop)
            safe = len(cut) if stopped else max(sent, len(text) - hold)
            if safe > sent:
                yield text[sent:safe]
                sent = safe
        thread.join()
        if "error" in result:
            raise result["error"]
        answer = self._answer(result["ids"], result["late"], text, s)
        if len(answer.text) > sent:
            yield answer.text[sent:]
        yield answer
