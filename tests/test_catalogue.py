"""The recipe catalogue (recipes/*.yaml): every recipe loads, builds its task graph without
running anything, and states in a comment the GPU memory it needs, which must agree with a
quick estimate from the model's architecture (its config.json values, as published) and the
recipe's training settings."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import REPO

from stages.engine.recipe import load

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))

# config.json values of the hub models the catalogue names (the published configs)
SHAPES = {
    "Qwen/Qwen3-0.6B": dict(hidden=1024, inter=3072, layers=28, heads=16, kv=8, head_dim=128, vocab=151936, tied=True),
    "Qwen/Qwen3-1.7B": dict(hidden=2048, inter=6144, layers=28, heads=16, kv=8, head_dim=128, vocab=151936, tied=True),
    "Qwen/Qwen3-4B": dict(hidden=2560, inter=9728, layers=36, heads=32, kv=8, head_dim=128, vocab=151936, tied=True),
    "Qwen/Qwen3-8B": dict(hidden=4096, inter=12288, layers=36, heads=32, kv=8, head_dim=128, vocab=151936, tied=False),
    "Qwen/Qwen3-14B": dict(hidden=5120, inter=17408, layers=40, heads=40, kv=8, head_dim=128, vocab=151936, tied=False),
    "Qwen/Qwen3-32B": dict(hidden=5120, inter=25600, layers=64, heads=64, kv=8, head_dim=128, vocab=151936, tied=False),
    "Qwen/Qwen3-30B-A3B": dict(hidden=2048, inter=768, experts=128, layers=48, heads=32, kv=4, head_dim=128,
                               vocab=151936, tied=False),
    "openai/gpt-oss-20b": dict(hidden=2880, inter=2880, experts=32, layers=24, heads=64, kv=8, head_dim=64,
                               vocab=201088, tied=False),
}
PUBLISHED_BILLIONS = {"Qwen/Qwen3-0.6B": 0.6, "Qwen/Qwen3-1.7B": 1.7, "Qwen/Qwen3-4B": 4.0, "Qwen/Qwen3-8B": 8.2,
                      "Qwen/Qwen3-14B": 14.8, "Qwen/Qwen3-32B": 32.8, "Qwen/Qwen3-30B-A3B": 30.5,
                      "openai/gpt-oss-20b": 21.0}
GIB = 2 ** 30


def parameters(s: dict) -> int:
    attn = s["hidden"] * s["heads"] * s["head_dim"] * 2 + s["hidden"] * s["kv"] * s["head_dim"] * 2
    mlp = 3 * s["hidden"] * s["inter"] * s.get("experts", 1)
    return s["layers"] * (attn + mlp) + s["vocab"] * s["hidden"] * (1 if s["tied"] else 2)


def estimate_gib(s: dict, peft: str, micro_batch: int, length: int) -> float:
    """At the recipe's micro-batch with full activation checkpointing (the plan's safe setting;
    the probe spends what is left on speed): bf16 weights; for full training bf16 gradients and
    AdamW's two bf16 moments; each layer's checkpointed input, one layer's activations (34 bytes
    per token and hidden unit), and the logits (bf16, fp32 and its gradient). QLoRA keeps the
    decoder layers' linear weights in 4-bit NF4 (0.53 bytes a weight with its double-quantized
    scales) and the embeddings in bf16."""
    tokens = micro_batch * length
    weights = 2 * parameters(s) * (4 if peft == "none" else 1)
    if peft == "qlora":
        embeddings = s["vocab"] * s["hidden"] * (1 if s["tied"] else 2)
        weights = 0.53 * (parameters(s) - embeddings) + 2 * embeddings
    activations = tokens * s["hidden"] * (2 * s["layers"] + 34) + tokens * s["vocab"] * 10
    return (weights + activations) / GIB


def test_the_estimate_matches_a_measured_peak():
    """ours_safe in bench/results/train_speed_h100.txt: Qwen3-8B shape, LoRA, micro-batch 4 x 2048,
    full checkpointing: 32.1 GiB peak on the H100."""
    assert estimate_gib(SHAPES["Qwen/Qwen3-8B"], "lora", 4, 2048) == pytest.approx(32.1, rel=0.1)


@pytest.mark.parametrize("hub", sorted(SHAPES))
def test_shapes_give_the_published_sizes(hub):
    assert parameters(SHAPES[hub]) / 1e9 == pytest.approx(PUBLISHED_BILLIONS[hub], rel=0.05)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_each_recipe_loads_and_states_what_it_needs(path):
    recipe = load(path)
    comments = [line for line in path.read_text().splitlines() if line.startswith("#")]
    assert comments and len(comments[0]) > 10, f"{path.name}: start with a one-line description"
    if recipe.hardware.profile == "cpu":
        return
    stated = re.search(r"GPU memory: (\d+) GiB", path.read_text())
    assert stated, f"{path.name}: say 'GPU memory: N GiB' in a comment"
    if recipe.model.hub:
        shape = SHAPES[recipe.model.hub]
        assert re.fullmatch(r"[0-9a-f]{40}", recipe.model.revision)
    else:
        c = recipe.model.config
        shape = dict(hidden=c.hidden_size, inter=c.intermediate_size, layers=c.num_hidden_layers,
                     heads=c.num_attention_heads, kv=c.num_key_value_heads, head_dim=c.head_dim,
                     vocab=c.vocab_size, tied=c.tie_word_embeddings)
    t = recipe.train
    assert int(stated.group(1)) == pytest.approx(estimate_gib(shape, t.peft, t.micro_batch_size,
                                                             recipe.data.max_length), rel=0.15)
    memory = {"h100": 80, "h200": 141, "mi300x": 192}.get(recipe.hardware.profile)
    assert memory is None or int(stated.group(1)) < memory * 0.93, f"{path.name} does not fit its GPU"


def test_every_recipe_builds_its_task_graph_and_is_listed():
    run = subprocess.run([sys.executable, "-m", "doit", "list", "--all"], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    for path in RECIPES:
        for stage in ("base", "plan", "shards", "checkpoint", "quantized", "eval", "manifest"):
            assert f"{stage}:{path.stem}" in run.stdout
    listing = subprocess.run([sys.executable, "-m", "doit", "recipes"], cwd=REPO, capture_output=True,
                             text=True, timeout=300)
    assert listing.returncode == 0, listing.stderr[-2000:]
    lines = [line for line in listing.stdout.splitlines() if not line.startswith(".")]
    for path in RECIPES:
        first = path.read_text().splitlines()[0].lstrip("# ")
        assert any(line.split()[0] == path.stem and first[:40] in line for line in lines if line.split())
