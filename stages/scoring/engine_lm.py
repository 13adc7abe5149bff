"""lm-eval's HFLM with its greedy generate_until answered by the generation engine
(stages/inference/batching.py): every request of a group in one continuous batch, each ending
when it ends, where HFLM runs padded batches of `batch_size` through generate and every row of
a batch steps until its longest one ends. Loglikelihood and everything else stay HFLM's.

Each request is prepared as HFLM prepares it (lm-eval's normalize_gen_kwargs and
handle_stop_sequences, the context left-truncated to max_length - max_gen_toks by HFLM's own
tok_encode, the text cut at the first stop string by lm-eval's postprocess), so the answers are
HFLM's: the same strings in fp32 on the CPU (tests/test_eval_engine.py). What the engine does not
do as HFLM does goes to HFLM's own generate_until: sampled requests (the batch's random stream
cannot be seeded per request), generation settings beyond greedy's, and think tokens. The
engine is made for one generate_until call and closed after it, so its KV cache never holds
memory that the loglikelihood batches need. A request leaves the batch at its end-of-text, its
length or its first stop string (a few-shot task's "Question:"), and lm-eval's postprocess cuts
the text there, as HFLM's stopping criteria and postprocess do."""
from __future__ import annotations

import json

from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from stages.inference.batching import Engine, Sampling

GREEDY_KEYS = {"do_sample", "temperature", "until", "max_gen_toks"}  # normalized kwargs the engine takes


class EngineLM(HFLM):
    def __init__(self, *args, eos_ids: set[int], options: dict | None = None, **kwargs):
        """`options`: the engine's (stages/inference/batching.Engine), for bench/eval_speed.py to try."""
        super().__init__(*args, **kwargs)
        self.eos_ids, self.options = eos_ids, options

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = {}  # requests of the same generation kwargs decode alike
        for i, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(i)
        answers: list[str | None] = [None] * len(requests)
        elsewhere = []  # what HFLM answers itself
        engine = None
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        # as HFLM's own bar does, this one leaves the generation's time in the stage's log
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="Running generate_until requests in the engine")
        try:
            for indices in groups.values():
                kwargs = normalize_gen_kwargs(requests[indices[0]].args[1], self.max_gen_toks)
                if kwargs.get("do_sample") or set(kwargs) - GREEDY_KEYS or self.think_end_token is not None:
                    elsewhere += indices
                    continue
                until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
                max_gen_toks = kwargs.pop("max_gen_toks")
                assert self.max_length > max_gen_toks, (
                    f"requested max tokens to generate ({max_gen_toks}) must be less than the model's maximum "
                    f"sequence length ({self.max_length})")
                prompts = [self.tok_encode(requests[i].args[0], left_truncate_len=self.max_length - max_gen_toks)
                           for i in indices]
                engine = engine or Engine(self.model, self.tokenizer, self.eos_ids, options=self.options)
                for i, generated in zip(indices, engine.generate(prompts, Sampling(max_gen_toks, stop=until))):
                    answers[i] = postprocess_generated_text(generation=self.tok_decode(generated.ids), stop=until,
                                                            think_end_token=None)
                    self.cache_hook.add_partial("generate_until", requests[i].args, answers[i])
                bar.update(len(indices))
        finally:
            bar.close()
            if engine is not None:
                engine.close()
        if elsewhere:
            for i, answer in zip(elsewhere, super().generate_until([requests[i] for i in elsewhere], disable_tqdm)):
                answers[i] = answer
        return answers
