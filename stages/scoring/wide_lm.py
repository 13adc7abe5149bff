"""lm-eval's HFLM with generation batched wide (the eval stage's model for lm-eval)."""
from __future__ import annotations

from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import normalize_gen_kwargs

# Of the device's memory beyond the weights, what a generate batch's KV cache may take; as much
# again stays for its prefill's activations (all rows' prompts in one forward: for Qwen3-8B about
# 0.7x the KV cache's bytes a token), the rest for what else the process holds.
KV_SHARE = 0.3


def kv_budget_tokens(model) -> int:
    """Tokens of KV cache a generate batch may fill: from the device's whole memory less the
    model's weights, not from the memory free now, so that the batch's width (and in bf16 which
    way a near tie breaks) does not depend on what an earlier stage of the process left cached."""
    from stages.inference.batching import kv_bytes_per_token, weight_bytes, whole_memory

    budget = int((whole_memory(model.device) - weight_bytes(model)) * KV_SHARE)
    return max(0, budget // kv_bytes_per_token(model.config))


class WideLM(HFLM):
    """lm-eval's HFLM whose generate_until runs its requests in batches as wide as the KV budget
    allows, not of the recipe's eval.batch_size, which stays the loglikelihood passes' (their
    logits span every position, a generation's only the last). A decode step costs nearly the
    same at 32 rows as at 128, so four batches of 32 took three times one batch of 128: on an
    H100, 128 GSM8K questions, 32 new tokens, the 8B shape, 1.8-1.9 s in one batch against
    4.1-4.6 s in the generation engine's continuous batch (bench/eval_speed.py,
    docs/serving.md). The answers are HFLM's: its own generate, padding and stopping, only more
    rows at a time."""

    def __init__(self, *args, kv_tokens: int | None = None, **kwargs):
        """`kv_tokens`: the KV budget in tokens (by default kv_budget_tokens's)."""
        super().__init__(*args, **kwargs)
        self.kv_tokens = kv_budget_tokens(self.model) if kv_tokens is None else kv_tokens

    def generation_batch(self, requests) -> int:
        """Rows a generate batch takes: as many of the requests as fit the KV budget at the longest
        one's context and answer (its token limit as lm-eval reads it, under any of its names),
        and never fewer than the recipe's batch size."""
        longest = max(min(self.max_length, len(self.tok_encode(r.args[0]))
                          + normalize_gen_kwargs(r.args[1], self.max_gen_toks)["max_gen_toks"]) for r in requests)
        return max(self.batch_size_per_gpu, min(len(requests), self.kv_tokens // longest))

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        narrow = self.batch_size_per_gpu
        self.batch_size_per_gpu = self.generation_batch(requests) if requests else narrow
        try:
            return super().generate_until(requests, disable_tqdm)
        finally:
            self.batch_size_per_gpu = narrow
