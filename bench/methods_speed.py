"""DPO and GRPO throughput on one GPU, one run: TRL's trainers with TRL's defaults beside the
same trainers as the checkpoint stage builds them (stages/train/dpo.py and grpo.py: plan_args,
and the plan probe's decisions applied to the model, the probe run here on the method's shape).

Workload: a Qwen3-8B-shaped model (random init, seed 0), LoRA r16 alpha 32 on every linear
layer, bf16, Qwen3's real tokenizer, GSM8K train rows (real text) as chat:

  DPO   prompt = the question, chosen = its worked answer, rejected = the next row's answer;
        8 pairs per optimizer step (DPOConfig's per-device default), max_length 1024
        (DPOConfig's default), sigmoid loss, beta 0.1, the reference = the adapter switched off.
  GRPO  prompt = the question; 8 completions sampled per prompt, up to 256 new tokens each,
        8 completions per optimizer step (GRPOConfig's defaults but the completion length,
        512, halved to keep the run short), reward = stages/train/verifiers.gsm8k.

  trl   the TRL config's defaults: padded batches of 8, gradient checkpointing on, sdpa
  ours  the checkpoint stage's trainer with the probe's decisions (attention, checkpointing,
        micro-batch x accumulation = 8, compile, fused loss)

Measured: optimizer steps after WARMUP (compilation and the first generations untimed);
tokens/s counts the non-pad tokens the model trains on (DPO: chosen and rejected rows with
their prompts; GRPO: prompts and completions); samples/s: pairs (DPO) or completions (GRPO).
GRPO's generation is timed on its own (TRL's: the model's generate; ours on CUDA: the rollouts
through the generation engine, stages/train/grpo.EngineRollouts; tokens generated per second),
and the training part is the step time less it. Peak memory is torch's max allocated. Each
configuration runs in a fresh process, as bench/train_speed.py's do.

    python -m bench.methods_speed [out.json] [--tokenizer DIR] [--data FILE] [--tiny]

--tiny: the tiny recipe's model on the CPU in fp32 with its character tokenizer, data/tiny's
prompts (GSM8K's fields) and the exact_answer reward (the gsm8k reward needs '####' answers),
ours with bench/tiny.probe's decisions (the CUDA-only probe's search on the CPU, five seconds),
3 steps, DPO's probe at 256 tokens, GRPO's prompts probed at 64 and completions of 16 tokens
(a smoke test, not a measurement).
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import tiny
from bench.autotune_probe import SHAPES, one_gpu, recipe_probe_budget

one_gpu()

REPO = Path(__file__).resolve().parent.parent

GLOBAL_BATCH = 8
DPO_MAX_LENGTH, GRPO_PROMPT_LENGTH, GRPO_COMPLETION = 1024, 512, 256
NUM_GENERATIONS = 8
PROBE_BUDGET = recipe_probe_budget()
CONFIGS = ("dpo_ours", "dpo_trl", "grpo_ours", "grpo_trl")


def use_tiny() -> None:
    """--tiny's shorter sequences (the docstring says what it runs), set in every process."""
    global DPO_MAX_LENGTH, GRPO_PROMPT_LENGTH, GRPO_COMPLETION
    DPO_MAX_LENGTH, GRPO_PROMPT_LENGTH, GRPO_COMPLETION = 256, 64, 16


def rows(path: Path, n: int) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()[:n]]


def chat_prompt(tok, question: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                   add_generation_prompt=True)


def dpo_dataset(tok, data: list[dict]):
    from datasets import Dataset

    end = tok.eos_token
    return Dataset.from_list([{"prompt": chat_prompt(tok, r["question"]), "chosen": r["answer"] + end,
                               "rejected": data[(i + 1) % len(data)]["answer"] + end} for i, r in enumerate(data)])


def grpo_dataset(tok, data: list[dict]):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": chat_prompt(tok, r["question"]), "reference": r["answer"]} for r in data])


def train_section(method: str, steps: int, reward: str = "gsm8k"):
    from stages.engine.recipe import TrainSection

    return TrainSection(method=method, peft="lora", lora={"r": 16, "alpha": 32, "target_modules": "all-linear"},
                        lr=1e-5, max_steps=steps, micro_batch_size=GLOBAL_BATCH, save_steps=10**6, beta=0.1,
                        reward=reward, num_generations=NUM_GENERATIONS, max_completion_length=GRPO_COMPLETION)


def new_model(shape: dict, device: str, attn: str = "sdpa"):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**shape), dtype=dtype, attn_implementation=attn)
    model.config.use_cache = False  # as trainable_model leaves it (generation turns the cache on itself)
    return model


class Clock:
    """Per optimizer step: wall time, tokens the model trained on, generation time and tokens."""

    def __init__(self, device: str, pad_id: int):
        self.device, self.pad_id = device, pad_id
        self.steps, self.tokens, self.generate_seconds, self.generated = [], [0], [0.0], [0]

    def sync(self):
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def callback(self):
        from transformers import TrainerCallback

        clock = self

        class Meter(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                clock.sync()
                clock.start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                clock.sync()
                clock.steps.append(time.perf_counter() - clock.start)
                clock.tokens.append(0)
                clock.generate_seconds.append(0.0)
                clock.generated.append(0)

        return Meter()

    def time_generation(self, trainer):
        """The trainer's sampling, timed: the engine's rollouts (trainer.rollout_func) where the
        checkpoint stage gives it them, else the model's generate; new tokens that are not padding."""
        if trainer.rollout_func is not None:
            rollout = trainer.rollout_func

            def timed_rollout(prompts, tr):
                out = self.timed(rollout, prompts, tr)
                self.generated[-1] += sum(map(len, out["completion_ids"]))
                return out
            trainer.rollout_func = timed_rollout
            return
        model = trainer.model
        generate = model.generate

        def timed(*args, **kwargs):
            prompt = kwargs.get("input_ids", args[0] if args else None)
            out = self.timed(generate, *args, **kwargs)
            self.generated[-1] += int((out[:, prompt.shape[1]:] != self.pad_id).sum())
            return out
        model.generate = timed

    def timed(self, fn, *args, **kwargs):
        self.sync()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        self.sync()
        self.generate_seconds[-1] += time.perf_counter() - start
        return out


def count_tokens(trainer, clock: Clock) -> None:
    """Count the real tokens of each micro-batch as its loss is computed (the data loader reads
    one batch ahead, so counting in the collator would credit a step with the next one's):
    DPO's attention mask over chosen and rejected rows, GRPO's prompt and completion masks."""
    compute_loss = trainer.compute_loss

    def counted(model, inputs, *args, **kwargs):
        masks = [inputs["attention_mask"]] if "attention_mask" in inputs else [inputs["prompt_mask"], inputs["completion_mask"]]
        clock.tokens[-1] += int(sum(m.sum() for m in masks))
        return compute_loss(model, inputs, *args, **kwargs)
    trainer.compute_loss = counted


def summary(name: str, clock: Clock, warmup: int, per_step: int, device: str) -> dict:
    import torch

    timed = slice(warmup, len(clock.steps))
    seconds = sum(clock.steps[timed])
    result = {"steps_timed": len(clock.steps[timed]), "step_seconds": round(seconds / len(clock.steps[timed]), 3),
              "step_seconds_each": [round(s, 3) for s in clock.steps[timed]],  # a recompile in one shows here
              "tokens_per_s": round(sum(clock.tokens[timed]) / seconds, 1),
              "samples_per_s": round(per_step * len(clock.steps[timed]) / seconds, 3)}
    generating = sum(clock.generate_seconds[timed])
    if generating:
        result.update(generate_seconds_per_step=round(generating / len(clock.steps[timed]), 3),
                      generate_tokens_per_s=round(sum(clock.generated[timed]) / generating, 1),
                      train_seconds_per_step=round((seconds - generating) / len(clock.steps[timed]), 3))
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else tiny.peak_bytes()  # --tiny: the process's RSS
    result["peak_gib"] = round(peak / 2**30, 1)
    logging.info("%s: %s", name, result)
    return result


def trl_trainer(method: str, model, dataset, tok, steps: int, work: Path, device: str, reward: str, **grpo):
    """TRL's trainer with its defaults; `grpo`: GRPOConfig fields set otherwise (bench/grpo_curves.py
    gives it ours' learning rate and schedule)."""
    from peft import LoraConfig

    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    common = dict(output_dir=str(work), max_steps=steps, logging_steps=1, report_to="none", save_strategy="no",
                  seed=0, data_seed=0, dataloader_num_workers=0, bf16=device == "cuda", use_cpu=device == "cpu")
    if method == "dpo":
        from trl import DPOConfig, DPOTrainer

        return DPOTrainer(model=model, args=DPOConfig(**common, beta=0.1), train_dataset=dataset,
                          processing_class=tok, peft_config=lora)
    from trl import GRPOConfig, GRPOTrainer

    from stages.train.grpo import reward_for_trainer

    args = GRPOConfig(**{**common, "num_generations": NUM_GENERATIONS, "max_completion_length": GRPO_COMPLETION, **grpo})
    return GRPOTrainer(model=model, reward_funcs=reward_for_trainer(reward), args=args, train_dataset=dataset,
                       processing_class=tok, peft_config=lora)


def probe(method: str, shape: dict, work: Path, budget: float, on_cpu: bool = False) -> dict:
    """The plan stage's probe for this method's recipe (same shapes the plan would give it);
    on_cpu: bench/tiny.probe, its search on the CPU."""
    from transformers import Qwen3Config

    from stages.engine.recipe import Recipe
    from stages.train import autotune

    config_dir = work / "config"
    Qwen3Config(**shape).save_pretrained(config_dir)
    length = DPO_MAX_LENGTH if method == "dpo" else GRPO_PROMPT_LENGTH
    t = train_section(method, 1).model_dump()
    recipe = Recipe.model_validate({"model": {"path": "unused"}, "data": {"sources": [{"path": "unused.jsonl"}],
                                    "max_length": length}, "train": t, "hardware": {"profile": "h100"},
                                    "autotune": {"budget_seconds": budget}})
    start = time.perf_counter()
    found = (tiny.probe if on_cpu else autotune.probe)(config_dir, recipe, logging.getLogger("probe"), GLOBAL_BATCH)
    return {"decisions": found["decisions"], "probe_seconds": round(time.perf_counter() - start, 1)}


def run_one(name: str, a) -> dict:
    import torch
    from transformers import AutoTokenizer

    from stages.model import numerics
    from stages.train import settings

    method, who = name.split("_")
    device = "cpu" if a.tiny else "cuda"
    shape = tiny.SHAPE if a.tiny else SHAPES["qwen3-8b"]
    reward = "exact_answer" if a.tiny else "gsm8k"
    steps, warmup = (3, 1) if a.tiny else ((20, 5) if method == "dpo" else (7, 2))
    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    data = rows(a.data, GLOBAL_BATCH * steps)
    dataset = dpo_dataset(tok, data) if method == "dpo" else grpo_dataset(tok, data)
    work = Path(a.work) / name
    if who == "trl":
        trainer = trl_trainer(method, new_model(shape, device), dataset, tok, steps, work, device, reward)
        found = None
    else:
        from stages.train import dpo, grpo
        from stages.train.methods import METHODS

        found = probe(method, shape, Path(a.work) / f"{name}_probe", tiny.BUDGET if a.tiny else a.probe_budget,
                      on_cpu=a.tiny)
        decisions = found["decisions"]
        plan = {**decisions, "device": device, "dtype": "bfloat16" if device == "cuda" else "float32", "processes": 1,
                "grad_accum": GLOBAL_BATCH // decisions["micro_batch_size"]}
        numerics.training_mode()
        model = new_model(shape, device)
        settings.apply_settings(model, plan)
        module = dpo if method == "dpo" else grpo
        trainer = module.make_trainer(METHODS[method], model, dataset, tok, plan, train_section(method, steps, reward), work)
    clock = Clock(device, tok.pad_token_id)
    trainer.add_callback(clock.callback())
    count_tokens(trainer, clock)
    if method == "grpo":
        clock.time_generation(trainer)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    if who == "ours":
        with settings.training_context(trainer, plan):
            trainer.train()
    else:
        trainer.train()
    per_step = GLOBAL_BATCH
    result = summary(name, clock, warmup, per_step, device)
    if found:
        result["found"] = found
    del trainer
    gc.collect()
    return result


def table(results: dict) -> None:
    print(f"\n8B-shaped LoRA r16 on GSM8K rows, {GLOBAL_BATCH} samples per optimizer step")
    print(f"{'':10} {'samples/s':>10} {'tokens/s':>9} {'peak GiB':>9} {'gen tok/s':>10} {'vs TRL':>7}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:10} failed: {r['error']}")
            continue
        trl = results.get(name.split("_")[0] + "_trl", {})
        ratio = f"{r['samples_per_s'] / trl['samples_per_s']:.2f}x" if "samples_per_s" in trl else ""
        print(f"{name:10} {r['samples_per_s']:>10.3f} {r['tokens_per_s']:>9.0f} {r.get('peak_gib', 0):>9.1f} "
              f"{r.get('generate_tokens_per_s', 0):>10.0f} {ratio:>7}")
    for name in ("dpo_ours", "grpo_ours"):
        if "found" in results.get(name, {}):
            print(f"{name} decisions: {results[name]['found']}")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    p = argparse.ArgumentParser()
    p.add_argument("out", nargs="?", type=Path, help="default bench/results/methods_speed.json")
    p.add_argument("--tokenizer", default=str(REPO.parent / "shared" / "tokenizers" / "qwen3"))
    p.add_argument("--data", type=Path, default=REPO.parent / "shared" / "datasets" / "gsm8k" / "train.jsonl")
    p.add_argument("--probe-budget", type=float, default=PROBE_BUDGET)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS), help="which to run (default all)")
    p.add_argument("--work", default=None, help="a run cut short goes on where it stopped: --work DIR again")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: one configuration
    a = p.parse_args()
    if a.tiny:
        use_tiny()
    if a.one:
        try:
            result = run_one(a.one, a)
        except Exception as e:  # an OOM or a failing setting is a result of the bench, recorded
            logging.exception("%s failed", a.one)
            result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
        (Path(a.work) / f"{a.one}.json").write_text(json.dumps(result))
        return
    a.work = a.work or tempfile.mkdtemp()
    logging.info("work directory %s", a.work)
    if a.tiny:
        a.tokenizer, a.data = str(tiny.tokenizer_dir(Path(a.work))), tiny.PROMPTS
    a.out = a.out or (tiny.results_path("methods_speed.json") if a.tiny else
                      REPO / "bench" / "results" / "methods_speed.json")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in a.configs:
        done = Path(a.work) / f"{name}.json"
        if not done.exists():
            subprocess.run([sys.executable, "-m", "bench.methods_speed", "--one", name, "--work", a.work, "--tokenizer", a.tokenizer,
                            "--data", str(a.data), "--probe-budget", str(a.probe_budget)] + (["--tiny"] if a.tiny else []),
                           check=True)
        results[name] = json.loads(done.read_text())
        a.out.write_text(json.dumps({"tiny": a.tiny, "global_batch": GLOBAL_BATCH, "results": results}, indent=1) + "\n")
    table(results)


if __name__ == "__main__":
    main()
