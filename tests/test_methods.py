"""Training methods beyond SFT, each through TRL's own trainer, each shown doing what it exists
for by the eval stage on held-out rows, base against trained: CPT lowers the text's perplexity,
DPO widens the chosen-minus-rejected margin, KTO lifts desirable answers and sinks undesirable
ones, and the manifest records those scores."""
from __future__ import annotations

import json
import shutil

import pytest

from conftest import SHARED, doit
from stages.train.methods import METHODS
from test_pipeline import artifact

HH = SHARED / "datasets" / "hh-rlhf-harmless" / "test.jsonl.gz"


def test_every_method_a_recipe_can_name_has_its_row():
    """train.method's values (the recipe schema, which imports nothing of training) are the rows
    of the method table, in its order: a method added to one and not the other fails here, not
    halfway through a build."""
    import typing

    from stages.engine.recipe import TrainSection

    assert typing.get_args(TrainSection.model_fields["method"].annotation) == tuple(METHODS)


def built_eval(project, recipe: str) -> dict:
    """Build the recipe to its manifest; its eval.json, checked to be what the manifest records
    and to report the metrics of the recipe's method's row, for each model."""
    run = doit(project, f"manifest:{recipe}", timeout=1800)
    assert run.rc == 0, run.out[-3000:]
    evaluation = json.loads((artifact(project, "eval", recipe) / "eval.json").read_text())
    manifest = json.loads((artifact(project, "manifest", recipe) / "manifest.json").read_text())
    assert manifest["eval"]["trained"] == evaluation["trained"]
    metrics = set(METHODS[manifest["recipe"]["train"]["method"]].metrics)
    assert set(evaluation["base"]) - {"size_bytes"} == set(evaluation["trained"]) - {"size_bytes"} == metrics
    return evaluation


def test_cpt_lowers_heldout_perplexity(fresh):
    evaluation = built_eval(fresh, "tiny_cpt")
    assert evaluation["trained"]["perplexity"] < 0.8 * evaluation["base"]["perplexity"]
    assert evaluation["quantized"]["fp8"]["perplexity"] < 0.8 * evaluation["base"]["perplexity"]


def test_dpo_widens_the_preference_margin_on_heldout_pairs(fresh):
    evaluation = built_eval(fresh, "tiny_dpo")
    base, trained = evaluation["base"], evaluation["trained"]
    assert trained["margin"] > base["margin"] + 5
    assert trained["preference_accuracy"] > base["preference_accuracy"]
    steps = [json.loads(line) for line in (artifact(fresh, "checkpoint", "tiny_dpo") / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 60 and "rewards/margins" in steps[-1]  # TRL's DPO logs, kept per step
    run = doit(fresh, "report:tiny_dpo")  # pairs are kept whole, not packed: the report says so
    assert run.rc == 0, run.out[-2000:]
    html = (artifact(fresh, "report", "tiny_dpo") / "report.html").read_text()
    assert "training rows kept whole (not packed)" in html


def test_orpo_widens_the_preference_margin_on_heldout_pairs(fresh):
    evaluation = built_eval(fresh, "tiny_orpo")
    base, trained = evaluation["base"], evaluation["trained"]
    assert trained["margin"] > base["margin"] + 5
    assert trained["preference_accuracy"] > base["preference_accuracy"]


def test_reward_model_ranks_heldout_pairs_above_chance(fresh):
    evaluation = built_eval(fresh, "tiny_reward")
    base, trained = evaluation["base"], evaluation["trained"]
    assert trained["reward_accuracy"] > max(0.6, base["reward_accuracy"])  # chance is 0.5
    assert trained["reward_margin"] > 1 > abs(base["reward_margin"])
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(artifact(fresh, "checkpoint", "tiny_reward") / "model")
    assert config.architectures == ["Qwen3ForSequenceClassification"] and config.num_labels == 1


def test_kto_lifts_desirable_and_sinks_undesirable_heldout_answers(fresh):
    """KTO on unpaired rows: held out, the desirable answers' log-probability rises, the
    undesirable ones' falls (training that ignored the labels would raise both), and the mean
    gap between them widens. The shards keep each row whole with its label beside it and learn
    the completion only."""
    import numpy as np
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer

    from stages.train import kto

    evaluation = built_eval(fresh, "tiny_kto")
    base, trained = evaluation["base"], evaluation["trained"]
    assert trained["desirable_logprob"] > base["desirable_logprob"] + 2
    assert trained["undesirable_logprob"] < base["undesirable_logprob"] - 2
    assert trained["label_margin"] > base["label_margin"] + 5
    assert evaluation["heldout_rows"] == 64
    steps = [json.loads(line) for line in (artifact(fresh, "checkpoint", "tiny_kto") / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 60 and "kl" in steps[-1]  # TRL's KTO logs, kept per step

    shards = artifact(fresh, "shards", "tiny_kto")
    stats = json.loads((shards / "stats.json").read_text())
    assert stats["kind"] == "unpaired" and stats["rows_in_total"] == 4000
    t = load_file(str(shards / "train" / "shard-00000.safetensors"))
    for a, b in zip(t["ids_offsets"], t["ids_offsets"][1:]):  # loss on one span after the prompt: the completion
        learned = np.flatnonzero(t["ids_labels"][a:b] != -100)
        assert learned[0] > 0 and (np.diff(learned) == 1).all()
    # what KTOTrainer is given: every row of the data file with its own label, as the template renders it
    tok = AutoTokenizer.from_pretrained(artifact(fresh, "base", "tiny_kto"))
    given = kto.dataset(shards, tok)
    assert len(given) == stats["kept"]["train"] and 0.4 < sum(given["label"]) / len(given) < 0.6
    lines = (fresh / "data" / "tiny" / "unpaired.jsonl").read_text().splitlines()
    written = {(r["prompt"], r["completion"], r["label"]) for r in map(json.loads, lines)}
    head, tail, end = "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n", "<|im_end|>"
    for row in given:
        assert row["prompt"].startswith(head) and row["prompt"].endswith(tail) and row["completion"].endswith(end)
        assert (row["prompt"][len(head): -len(tail)], row["completion"][: -len(end)], row["label"]) in written


def test_kto_with_a_micro_batch_of_one_stops_in_one_line(fresh):
    """KTO's KL term comes from the other rows of a micro-batch: with one, a line naming
    train.micro_batch_size, not TRL's traceback, and no checkpoint stored."""
    import yaml

    recipe = yaml.safe_load((fresh / "recipes" / "tiny_kto.yaml").read_text())
    recipe["train"].update(micro_batch_size=1, grad_accum=8)
    (fresh / "recipes" / "tiny_kto.yaml").write_text(yaml.safe_dump(recipe))
    run = doit(fresh, "checkpoint:tiny_kto")
    assert run.rc != 0 and "Traceback" not in run.out
    assert "train.method: kto estimates its KL term from the other rows of a micro-batch, and the plan's " \
           "micro-batch is 1 row; raise train.micro_batch_size" in run.out
    assert not list((fresh / "artifacts" / "store").glob("checkpoint/*"))


@pytest.mark.skipif(not HH.is_file(), reason="../shared/datasets/hh-rlhf-harmless is not on this machine")
def test_dpo_on_real_hh_rlhf_pairs(fresh):
    """The HH transcript format trained on, not only parsed: the held-out margin widens."""
    import yaml

    (fresh / "data" / "real").mkdir()
    shutil.copy(HH, fresh / "data" / "real" / "hh.jsonl.gz")
    evaluation = built_eval(fresh, "hh_dpo")
    assert evaluation["heldout_rows"] >= 32
    assert evaluation["trained"]["margin"] > evaluation["base"]["margin"]
    recipe = yaml.safe_load((fresh / "recipes" / "hh_dpo.yaml").read_text())
    assert recipe["data"]["sources"] == [{"path": "data/real/hh.jsonl.gz", "format": "preference"}]


def test_rewards_check_answers_and_fail_in_one_line():
    from stages.engine.errors import UserError
    from stages.train.verifiers import reward_function

    exact, gsm8k = reward_function("exact_answer"), reward_function("gsm8k")
    assert exact(" 65 ", "65") == 1.0 and exact("56", "65") == 0.0
    assert gsm8k("so she pays 1,200 dollars\n#### 1200", "She pays 1000 + 200\n#### 1,200") == 1.0
    assert gsm8k("the answer is 18", "... #### 18") == 1.0 and gsm8k("#### 17", "#### 18") == 0.0
    with pytest.raises(UserError, match=r"^train.reward: gsm8k raised ValueError \(the reference has no '####'"):
        gsm8k("12", "12")
    with pytest.raises(UserError, match=r"^train.reward: 'nope' is not a reward; use one of exact_answer, gsm8k$"):
        reward_function("nope")


def test_grpo_raises_the_heldout_reward(warm):
    """GRPO from tiny's SFT model (a reward needs a model that is sometimes right): the mean
    exact-answer reward of greedy answers to held-out additions goes up."""
    project = warm
    evaluation = built_eval(project, "tiny_grpo")
    assert evaluation["trained"]["reward"] > evaluation["base"]["reward"]
    steps = [json.loads(line) for line in (artifact(project, "checkpoint", "tiny_grpo") / "metrics.jsonl").read_text().splitlines()]
    assert "reward" in steps[-1]


def test_gspo_raises_the_heldout_reward(warm):
    """GSPO (GRPO's trainer with one importance ratio per completion, as TRL documents it) from
    tiny's SFT model: the mean exact-answer reward of greedy answers to held-out additions goes up,
    and TRL samples one rollout for every 4 steps (the reward is logged on those steps only)."""
    project = warm
    evaluation = built_eval(project, "tiny_gspo")
    assert evaluation["trained"]["reward"] > evaluation["base"]["reward"]
    steps = [json.loads(line) for line in (artifact(project, "checkpoint", "tiny_gspo") / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "reward" in s] == list(range(1, len(steps) + 1, 4)) and len(steps) == 60


def test_gspo_sets_trls_documented_settings(tmp_path):
    """What stages/train/gspo.py gives GRPOConfig: sequence-level ratios, the per-sequence loss, no
    KL term, the GSPO paper's clip, and a rollout for 4 optimizer steps whatever the plan's grad_accum."""
    from trl import GRPOConfig

    from stages.train import gspo

    config = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=16,
                        gradient_accumulation_steps=2, num_generations=8, **gspo.settings({"grad_accum": 2}))
    assert (config.importance_sampling_level, config.loss_type, config.beta) == ("sequence", "grpo", 0.0)
    assert (config.epsilon, config.epsilon_high) == (3e-4, 4e-4)
    assert config.steps_per_generation == 8 and config.generation_batch_size == 16 * 8


def test_a_reward_that_raises_stops_grpo_in_one_line(warm):
    """gsm8k's reward on references without '####' raises: one line naming train.reward, store unchanged."""
    import yaml

    from conftest import snapshot

    project = warm
    recipe = yaml.safe_load((project / "recipes" / "tiny_grpo.yaml").read_text())
    recipe["train"]["reward"] = "gsm8k"
    (project / "recipes" / "tiny_grpo.yaml").write_text(yaml.safe_dump(recipe))
    doit(project, "shards:tiny_grpo", "plan:tiny_grpo")
    before = snapshot(project)
    run = doit(project, "checkpoint:tiny_grpo")
    assert run.rc != 0
    assert "train.reward: gsm8k raised ValueError (the reference has no '####' answer line" in run.out
    assert "Traceback" not in run.out
    assert {k for k in snapshot(project) if "/checkpoint/" in k or k.startswith("tiny_grpo/checkpoint")} == \
        {k for k in before if "/checkpoint/" in k or k.startswith("tiny_grpo/checkpoint")}


def test_qlora_on_the_cpu_stops_in_one_line(warm):
    """QLoRA's 4-bit base needs bitsandbytes on a GPU: the plan says so in one line, nothing stored."""
    import yaml

    from conftest import snapshot

    recipe = yaml.safe_load((warm / "recipes" / "tiny_lora.yaml").read_text())
    recipe["train"]["peft"] = "qlora"
    (warm / "recipes" / "tiny_qlora.yaml").write_text(yaml.safe_dump(recipe))
    before = snapshot(warm)
    run = doit(warm, "checkpoint:tiny_qlora")
    assert run.rc != 0
    at = (warm / "recipes" / "tiny_qlora.yaml").read_text().splitlines().index("  peft: qlora") + 1
    assert f"error: recipes/tiny_qlora.yaml:{at}: train.peft: qlora loads the base in 4-bit through bitsandbytes, " \
           "which needs a GPU; hardware.profile is cpu: use peft: lora on this machine" in run.out, run.out
    assert "Traceback" not in run.out
    assert {k for k in snapshot(warm) if "/plan/" in k or "/checkpoint/" in k} == \
        {k for k in before if "/plan/" in k or "/checkpoint/" in k}


def test_moe_lora_trains_the_experts(fresh):
    """LoRA on a Qwen3-MoE's fused expert weights (PEFT target_parameters): the expert adapters
    get gradients, end up changed from their zero start, and move the merged experts."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    evaluation = built_eval(fresh, "tiny_moe")
    assert evaluation["trained"]["perplexity"] < evaluation["base"]["perplexity"]
    ckpt, base_dir = artifact(fresh, "checkpoint", "tiny_moe"), artifact(fresh, "base", "tiny_moe")
    adapter = load_file(str(ckpt / "adapter" / "adapter_model.safetensors"))
    experts_b = {k: v for k, v in adapter.items() if ".mlp.experts" in k and "lora_B" in k}
    assert len(experts_b) == 4 and all(v.abs().sum() > 0 for v in experts_b.values())  # 2 layers x gate_up, down

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), ckpt / "adapter", is_trainable=True)
    ids = torch.randint(3, 90, (2, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if ".mlp.experts" in n and "lora_" in n}
    assert len(grads) == 8 and all(g is not None and g.abs().sum() > 0 for g in grads.values())

    base = AutoModelForCausalLM.from_pretrained(base_dir).state_dict()
    merged = model.merge_and_unload().state_dict()
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        assert not torch.equal(merged[name], base[name])


def test_pairs_split_at_the_answer_where_the_sides_part():
    """A multi-turn prompt's earlier assistant turn is learned on both sides: the answers start
    at the learned span where chosen and rejected part (both begin with token 7 here), and end
    at each side's last learned token."""
    import numpy as np

    from stages.train.pairs import split

    I = -100
    chosen = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9])
    chosen_labels = np.array([I, I, I, 4, 5, I, 7, 8, I])
    rejected = np.array([1, 2, 3, 4, 5, 6, 7, 10, 11, 9])
    rejected_labels = np.array([I, I, I, 4, 5, I, 7, 10, 11, I])
    assert split(chosen, chosen_labels, rejected, rejected_labels) == (6, 8, 9)
