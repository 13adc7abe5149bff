"""lm-eval's HFLM with its generate_until answered by the generation engine
(stages/inference/batching.py): every request of a group in one continuous batch, each ending
when it ends, where HFLM runs padded batches of `batch_size` through generate and every row of
a batch steps until its longest one ends. Loglikelihood and everything else stay HFLM's.

Each request is prepared as HFLM prepares it (lm-eval's normalize_gen_kwargs and
handle_stop_sequences, the context left-truncated to max_length - max_gen_toks by HFLM's own
tok_encode, the think token stripped and the text post-processed by HFLM's rules), so the
answers are HFLM's: greedy, the same strings on the CPU in fp32 (tests/test_eval.py). The
engine is made for one generate_until call and closed after it, so its KV cache never holds
memory that the loglikelihood batches need."""
from __future__ import annotations

import json

from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from stages.inference.batching import Engine, Sampling


class EngineLM(HFLM):
    def __init__(self, *args, eos_ids: set[int], **kwargs):
        super().__init__(*args, **kwargs)
        self.eos_ids = eos_ids

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = {}  # requests of the same generation kwargs decode alike
        for i, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(i)
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        answers: list[str | None] = [None] * len(requests)
        engine = Engine(self.model, self.tokenizer, self.eos_ids)
        try:
            for indices in groups.values():
                kwargs = normalize_gen_kwargs(requests[indices[0]].args[1], self.max_gen_toks)
                until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
                max_gen_toks = kwargs.pop("max_gen_toks")
                sampled = kwargs.get("do_sample", False)
                sampling = Sampling(max_gen_toks, temperature=kwargs.get("temperature", 1.0) if sampled else 0.0,
                                    top_p=kwargs.get("top_p", 1.0) if sampled else 1.0, stop=until)
                prompts = [self.tok_encode(requests[i].args[0], left_truncate_len=self.max_length - max_gen_toks)
                           for i in indices]
                for i, generated in zip(indices, engine.generate(prompts, sampling)):
                    answers[i] = self._text(generated.ids, until)
                    self.cache_hook.add_partial("generate_until", requests[i].args, answers[i])
        finally:
            engine.close()
        return answers

    def _text(self, ids: list[int], until: list[str]) -> str:
        """HFLM's answer from its new tokens: after the last think-end token where that is a
        token id, decoded, cut at the first stop string (and after a think-end string)."""
        think = self.think_end_token
        if isinstance(think, int) and think in ids:
            ids = ids[len(ids) - ids[::-1].index(think):]
        text = self.tok_decode(ids)
        if isinstance(think, int):
            text = text.lstrip()
        return postprocess_generated_text(generation=text, stop=until,
                                          think_end_token=think if isinstance(think, str) else None)
