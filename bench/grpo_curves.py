"""GRPO's first steps beside TRL's: loss and reward per step, on a model that earns reward.

bench/methods_speed.py measures speed on a random 8B shape, where neither side ever earns a
reward (random weights never write a GSM8K answer), so its loss and reward curves are 0 on both
sides. This runs the same comparison on tiny's SFT model (`doit checkpoint:tiny`), which answers
additions under 20 part of the time, on the CPU:

  ours  stages/train/grpo.make_trainer with the generation engine's rollouts forced on (engine=True:
        the rollout path a CUDA GPU takes, the adapter merged into the base while sampling; the
        CPU's own default is TRL's generate)
  trl   TRL's GRPOTrainer (bench/methods_speed.trl_trainer) with ours' optimizer settings: learning
        rate, cosine schedule, warm-up, weight decay, and fp32 (GRPOConfig's default is bf16)

Both: data/tiny/prompts.jsonl as chat, LoRA r16 alpha 32 on every linear layer, 8 completions of up to 6
tokens per prompt, 16 completions (2 prompts) per step, reward exact_answer, the same seed. The two sample
different tokens (different samplers), so the curves are compared in size and trend, not step by
step.

    python -m bench.grpo_curves [out_dir] [--model DIR] [--steps N]
"""
from __future__ import annotations

import argparse
import json
import tempfile
from datetime import date
from pathlib import Path

from bench.methods_speed import NUM_GENERATIONS, grpo_dataset, rows, train_section, trl_trainer

REPO = Path(__file__).resolve().parent.parent
COMPLETION, LR, BATCH = 6, 2e-3, 16


def curve(trainer) -> list[dict]:
    return [{"step": x["step"], "loss": x["loss"], "reward": x["rewards/exact_answer/mean"]}
            for x in trainer.state.log_history if "rewards/exact_answer/mean" in x]


def run(who: str, model_dir: Path, steps: int, work: Path) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    train = grpo_dataset(tok, rows(REPO / "data" / "tiny" / "prompts.jsonl", BATCH // NUM_GENERATIONS * steps))
    t = train_section("grpo", steps, "exact_answer").model_copy(
        update={"lr": LR, "micro_batch_size": BATCH, "max_completion_length": COMPLETION})
    if who == "trl":  # ours' optimizer settings (trainer.plan_args), in fp32 as ours
        trainer = trl_trainer("grpo", model, train, tok, steps, work, "cpu", "exact_answer", learning_rate=t.lr,
                              per_device_train_batch_size=BATCH, max_completion_length=COMPLETION,
                              lr_scheduler_type="cosine", warmup_steps=t.warmup_steps, weight_decay=t.weight_decay)
    else:
        from stages.train import grpo
        from stages.train.methods import METHODS

        plan = {"device": "cpu", "dtype": "float32", "processes": 1, "micro_batch_size": BATCH,
                "grad_accum": 1, "attn_implementation": "sdpa", "compile": False}
        trainer = grpo.make_trainer(METHODS["grpo"], model, train, tok, plan, t, work, engine=True)
    trainer.train()
    return curve(trainer)


def plot(curves: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for who, points in curves.items():
        for ax, key in zip(axes, ("loss", "reward")):
            ax.plot([p["step"] for p in points], [p[key] for p in points], label=who)
            ax.set_title(key)
            ax.set_xlabel("step")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", nargs="?", type=Path, default=REPO / "bench" / "results" / f"grpo_curves_tiny_{date.today()}")
    p.add_argument("--model", type=Path, default=REPO / "artifacts" / "tiny" / "latest" / "checkpoint" / "model")
    p.add_argument("--steps", type=int, default=100)
    a = p.parse_args()
    if not (a.model / "config.json").is_file():
        raise SystemExit(f"{a.model}: no model there; build tiny's SFT model first (doit checkpoint:tiny)")
    a.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        curves = {who: run(who, a.model, a.steps, Path(work) / who) for who in ("ours", "trl")}
    (a.out / "curves.json").write_text(json.dumps(curves, indent=1) + "\n")
    plot(curves, a.out / "curves.png")
    print(f"{'step':>4} {'loss ours':>10} {'loss trl':>10} {'reward ours':>12} {'reward trl':>11}")
    for o, t in zip(curves["ours"], curves["trl"]):
        print(f"{o['step']:>4} {o['loss']:>10.4f} {t['loss']:>10.4f} {o['reward']:>12.3f} {t['reward']:>11.3f}")
    for who, points in curves.items():
        half = len(points) // 2
        first, last = (sum(p["reward"] for p in part) / len(part) for part in (points[:half], points[half:]))
        print(f"{who}: mean reward {first:.3f} over the first {half} steps, {last:.3f} over the rest")


if __name__ == "__main__":
    main()
