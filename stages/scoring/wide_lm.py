"""lm-eval's HFLM with generation batched wide (the eval stage's model for lm-eval)."""
from __future__ import annotations

from lm_eval.models.huggingface import HFLM


class WideLM(HFLM):
    """lm-eval's HFLM whose generate_until runs its requests in batches as wide as the KV cache
    allows (a share of the memory free, as the generation engine sizes its cache), not of the
    recipe's eval.batch_size, which stays the loglikelihood passes' (their logits span every
    position, a generation's only the last). A decode step costs nearly the same at 32 rows as at
    128, so four batches of 32 took four times one batch of 128: on an H100, 128 GSM8K questions,
    32 new tokens, the 8B shape, 1.8-1.9 s in one batch against 4.1-4.6 s in the generation
    engine's continuous batch (bench/eval_speed.py, docs/serving.md). The answers are HFLM's:
    its own generate, padding and stopping, only more rows at a time."""

    def __init__(self, *args, kv_tokens: int | None = None, **kwargs):
        """`kv_tokens`: the KV cache's budget in tokens (by default stages/inference/batching's)."""
        super().__init__(*args, **kwargs)
        if kv_tokens is None:
            from stages.inference.batching import kv_budget_tokens

            kv_tokens = kv_budget_tokens(self.model)
        self.kv_tokens = kv_tokens

    def generation_batch(self, requests) -> int:
        """Rows a generate batch takes: as many of the requests as fit the KV budget at the longest
        one's context and answer, and never fewer than the recipe's batch size."""
        longest = max(min(self.max_length, len(self.tok_encode(r.args[0]))
                          + int(r.args[1].get("max_gen_toks", self.max_gen_toks))) for r in requests)
        return max(self.batch_size_per_gpu, min(len(requests), self.kv_tokens // longest))

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        narrow = self.batch_size_per_gpu
        self.batch_size_per_gpu = self.generation_batch(requests) if requests else narrow
        try:
            return super().generate_until(requests, disable_tqdm)
        finally:
            self.batch_size_per_gpu = narrow
