"""GRPO: TRL's GRPOTrainer on the shards' prompts, rewarded by the verifiable reward the recipe
names (train.reward, stages/train/verifiers.py) against each prompt's reference answer:
train.num_generations sampled completions per prompt of up to train.max_completion_length
tokens, each scored against the others of its group."""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from pathlib import Path

from stages.train.pairs import prompt_texts
from stages.train.verifiers import reward_function
from stages.train.settings import peft_config
from stages.train.trainer import plan_args


def dataset(shards: Path, tok):
    return prompt_texts(shards, tok)


def reward_for_trainer(name: str):
    """The named reward as TRL calls a reward function: a batch of completions, with the
    dataset's other columns (the reference answers) as keyword arguments."""
    score = reward_function(name)

    def reward(prompts, completions, reference, **_):
        return [score(c, r) for c, r in zip(completions, reference)]

    reward.__name__ = name  # TRL logs each reward under its function's name
    return reward


def make_trainer(method, model, train, tok, plan: dict, t, output_dir: Path, engine: bool | None = None, **settings):
    """GRPOTrainer as the row, plan and recipe say; `settings` are further GRPOConfig fields, for a
    method that is GRPO with other settings of TRL's (stages/train/gspo.py). Its rollouts go
    through the generation engine where that is faster (`engine` None: engine_here(plan))."""
    config, grpo_trainer = method.trl()
    args = config(**plan_args(plan, t, output_dir, method.logs), num_generations=t.num_generations,
                  max_completion_length=t.max_completion_length, **settings)
    rollouts, engine = None, engine_here(plan) if engine is None else engine
    if engine or plan.get("compile"):
        longest = max(map(len, tok(text=list(train["prompt"]))["input_ids"])) + t.max_completion_length
    if engine:
        rollouts = EngineRollouts(tok, plan, rollout_kv_tokens(args.generation_batch_size, longest))
    trainer = grpo_trainer(model=model, reward_funcs=reward_for_trainer(t.reward), args=args, train_dataset=train,
                           processing_class=tok, peft_config=peft_config(t, method.peft_task), rollout_func=rollouts)
    if plan.get("compile"):
        trainer.add_callback(compiling_ahead(trainer, longest))
    if rollouts is not None:
        trainer.add_callback(rollouts.closer())
    generate_eagerly(trainer.model, plan)
    return trainer


def engine_here(plan: dict) -> bool:
    """One CUDA process: the engine's continuous batch (CUDA graphs) against generate's padded
    batch run eagerly. On the CPU the engine was slower than generate (docs/serving.md), and under
    FSDP each process would batch its own requests while their forwards must gather together."""
    return plan["device"] == "cuda" and plan["processes"] == 1


def compile_ahead(model, batch: int, longest: int, context=nullcontext) -> None:
    """Run the compiled layers' forward and backward on every kind of batch training will give them,
    before training, so that no step compiles mid-training. A GRPO batch's length (longest prompt
    plus longest completion) changes every step, and a batch with padding (a completion that ended
    early) makes transformers build another attention mask. Dynamo traces a graph for each kind at
    its first batch, and a graph dynamic in the length at its second length; each twice, as the
    first layer's input needs no gradient and the others' do: 8 graphs for the 8B shape on an H100
    (about 100 s up front), which otherwise compiled on whichever step first met a kind (a 34 s
    step). 8 is also dynamo's default limit of graphs for the layers' code: a kind met after it
    (forwards without gradients, as GSPO's old log-probabilities or the engine's, or a batch
    within flex attention's first 128-token block) runs the layers uncompiled, compiling nothing.
    The random state is put back, so training draws what it would have drawn, and the gradients
    are dropped; `context` is what the trainer's forwards run in (its autocast)."""
    import torch

    training = model.training
    device = next(model.parameters()).device
    model.train()
    with torch.random.fork_rng():
        for length, padded in ((longest, False), (longest - 1, True), (longest - 1, False), (longest, True)):
            ids = torch.ones(batch, length, dtype=torch.long, device=device)
            mask = torch.ones_like(ids)
            if padded:
                mask[0, length // 2:] = 0  # a completion that ended early, padded on the right as TRL pads
            with context():
                logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits
            logits.float().sum().backward()
    model.zero_grad(set_to_none=True)
    model.train(training)


def compiling_ahead(trainer, longest: int):
    """compile_ahead at the start of training, at the trainer's micro-batch, in its autocast."""
    from transformers import TrainerCallback

    class CompileAhead(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            compile_ahead(trainer.model, args.per_device_train_batch_size, longest, trainer.accelerator.autocast)
    return CompileAhead()


def rollout_kv_tokens(completions: int, longest: int) -> int:
    """The KV cache a rollout needs: every completion at its longest (prompt and answer), each in
    whole pages of its own, as transformers' paged cache gives a request ceil(length / page) pages.
    A budget rounded up only in total left requests starved of pages and reset mid-rollout (8B
    shape on an H100)."""
    from stages.inference.batching import PAGE_TOKENS

    return completions * -(-longest // PAGE_TOKENS) * PAGE_TOKENS


class EngineRollouts:
    """TRL's rollout_func: each process's prompts (already one per completion, TRL repeats each
    prompt num_generations times) sampled through stages/inference/batching.py's engine at the
    trainer's temperature and top_p, all at once; the completions keep their end token (the
    engine's batch keeps it), as TRL's own generate path does. The engine starts at the first
    rollout and holds `kv_tokens` of KV cache (every completion of a rollout at its longest),
    then lives until training ends. While it samples, the adapter is merged into the base in
    place (merged()), so its CUDA graphs read the merged weights, and training's steps in between
    update the adapter that the next rollout's merge reads. On CUDA the batch's step is compiled (transformers' compile
    level 1) around the model's layers, which then run uncompiled inside it: one sampling setting
    for the whole batch leaves no top-p cumsum, the op inductor fails on (batching.py). 8B shape,
    plain sampling on an H200: 8 at once 469-502 tokens/s with per-request settings, 547-585 with
    one, 709-744 compiled; one stream 65 -> 77 -> 108 (two runs each,
    bench/results/generation_engine_variants_h200_2026-11-26.json)."""

    def __init__(self, tok, plan: dict, kv_tokens: int):
        self.tok, self.plan, self.kv_tokens, self.engine = tok, plan, kv_tokens, None
        self.base_copy = None  # [(parameter, its copy)]: set at the first rollout, [] where not merged

    def __call__(self, prompts: list[str], trainer) -> dict:
        from stages.inference.batching import Engine, Sampling

        if trainer.top_k or trainer.min_p or trainer.repetition_penalty != 1.0:
            raise ValueError("the generation engine samples with temperature and top_p only")
        sampling = (trainer.temperature, trainer.top_p)
        ids = self.tok(text=prompts)["input_ids"]  # as TRL tokenizes text prompts
        model, compiled = trainer.model, self.plan["device"] == "cuda"  # the adapter-wrapped model it trains
        training = model.training
        model.eval()  # no adapter dropout while sampling
        if self.base_copy is None:  # before the engine takes its KV cache
            self.base_copy = base_copy(model)
        try:
            with sdpa(model, self.plan, eager=not compiled), adapter_input_casting(model), \
                    merged(model, self.base_copy):
                if self.engine is None:
                    self.engine = Engine(model, self.tok, set(trainer.eos_token_ids), self.kv_tokens,
                                         {"default_compile_level": 1} if compiled else {}, sampling=sampling)
                answers = self.engine.generate(ids, Sampling(trainer.max_completion_length, *sampling))
        finally:
            model.train(training)
        return {"prompt_ids": ids, "completion_ids": [a.ids for a in answers], "logprobs": None}

    def closer(self):
        from transformers import TrainerCallback

        rollouts = self

        class CloseEngine(TrainerCallback):
            def on_train_end(self, args, state, control, **kwargs):
                if rollouts.engine is not None:
                    rollouts.engine.close()
                    rollouts.engine = None
                rollouts.base_copy = None  # 12.9 GiB for the 8B shape
        return CloseEngine()


# the model and the base's copy together may take this share of the device's whole memory (not of the
# memory free, so the same recipe on the same card always decides the same: merged rollouts sample
# other tokens than unmerged ones); the rest is training's activations, the optimizer's state and the
# engine's KV cache. The 8B shape on an H100: 16.4 + 12.9 GiB of 79; a 14B's would not fit there.
BASE_COPY_SHARE = 0.5


def base_copy(model) -> list:
    """A copy of the base weights (and biases) the adapter merges into, so that merged() can put
    them back bit for bit: merging and unmerging would leave the frozen base a rounding off after
    every rollout. Empty, and rollouts sample through the adapter's side matmuls, where merging is
    not exact or not in place, or the copy does not fit:
    - an adapter other than plain LoRA on a linear layer: a quantized base, experts' parameters, a
      LoRA variant (DoRA and the like: PEFT's merge replaces their weight tensors, which the
      engine's CUDA graphs would no longer read) or a LoRA bias;
    - a base weight tied to another (a tied LM head: merging into it would move the embeddings);
    - the model and its copy over BASE_COPY_SHARE of the device's memory."""
    import torch
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    if not layers or any(type(m) is not LoraLinear or m.lora_variant or any(m.lora_bias.values()) for m in layers):
        return []
    params = [p for m in layers for p in (m.get_base_layer().weight, m.get_base_layer().bias) if p is not None]
    if any(type(p) is not torch.nn.Parameter or not p.is_floating_point() for p in params):
        return []
    names = [id(p) for _, p in model.named_parameters(remove_duplicate=False)]
    if any(names.count(id(p)) > 1 for p in params):
        return []
    from stages.inference.batching import weight_bytes, whole_memory

    copy_bytes = sum(p.numel() * p.element_size() for p in params)
    if weight_bytes(model) + copy_bytes > whole_memory(params[0].device) * BASE_COPY_SHARE:
        return []
    return [(p, p.detach().clone()) for p in params]


@contextmanager
def merged(model, copy: list):
    """The adapter merged into the base while the engine samples (PEFT's merge_adapter, in place),
    the base put back from its copy after, also where the merge or the sampling fails partway.
    Sampled through LoRA's side matmuls, the 8B shape's decode step ran at 41 steps a second
    against the plain model's 89-93 (H200, docs/performance.md); TRL merges the same way before
    it hands a model's weights to vLLM. The trainer's logprobs are its own forward's, through
    the adapter, as before."""
    import torch

    if not copy:
        yield
        return
    try:
        model.merge_adapter()
        if copy[0][0].is_cuda:
            torch.cuda.synchronize()  # the engine's thread runs its forwards on a stream of its own
        yield
    finally:
        model.unmerge_adapter()  # each layer as far as it was merged: clears PEFT's record of it
        with torch.no_grad():
            for p, saved in copy:
                p.copy_(saved)


@contextmanager
def adapter_input_casting(model):
    """PEFT's cast of each adapter's input to the adapter's dtype, on while the engine runs: training
    turns it off under autocast (settings.training_context), and the engine's thread has no autocast."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m.cast_input_dtype_enabled for m in layers]
    for m in layers:
        m.cast_input_dtype_enabled = True
    try:
        yield
    finally:
        for m, was in zip(layers, before):
            m.cast_input_dtype_enabled = was


def generate_eagerly(model, plan: dict) -> None:
    """The plan's decisions are measured on training steps. Sampling runs the same model a token
    at a time, where the compiled layers fail (flex attention: inductor finds no kernel for the
    decode shapes, lent H100), so the model's generate runs its layers eagerly with SDPA, under
    the autocast training runs in (training_context leaves LoRA's inputs in bf16 for it)."""
    import torch

    generate = model.generate
    autocast = (lambda: torch.autocast(plan["device"], dtype=torch.bfloat16)) if plan["dtype"] == "bfloat16" else nullcontext

    def eager_generate(*args, **kwargs):
        with sdpa(model, plan, eager=True), autocast():
            return generate(*args, **kwargs)

    model.generate = eager_generate


@contextmanager
def sdpa(model, plan: dict, eager: bool):
    """The model's attention as SDPA while sampling (the plan's again after); `eager`: its
    compiled layers run uncompiled."""
    import torch

    model.set_attn_implementation("sdpa")
    try:
        with torch.compiler.set_stance("force_eager") if eager else nullcontext():
            yield
    finally:
        model.set_attn_implementation(plan["attn_implementation"])
