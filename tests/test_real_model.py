"""A real model directory, as users bring one: Qwen3's real tokenizer and chat template
(../shared/tokenizers/qwen3) beside a small Qwen3 with Qwen3's vocabulary size (151,936), named
by model.path, goes through the whole pipeline as the tiny default does. And a hub model that
cannot be fetched (no network here) fails in one line naming the recipe, the id and what to do."""
from __future__ import annotations

import json

import pytest
import yaml

from conftest import ALL_STAGES, SHARED, doit
from test_pipeline import artifact, one_error_line

QWEN3 = SHARED / "tokenizers" / "qwen3"


def small_qwen3_dir(dest):
    """A Qwen3 model directory as save_pretrained writes one: config, safetensors, generation
    config, and Qwen3's tokenizer files."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(QWEN3)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id))
    model.generation_config = GenerationConfig(eos_token_id=model.config.eos_token_id,
                                               pad_token_id=tok.pad_token_id, do_sample=False)
    model.save_pretrained(dest)
    tok.save_pretrained(dest)


@pytest.mark.skipif(not QWEN3.is_dir(), reason="../shared/tokenizers/qwen3 is not on this machine")
def test_a_real_model_directory_runs_the_whole_pipeline(fresh):
    small_qwen3_dir(fresh / "models" / "qwen3-small")
    recipe = yaml.safe_load((fresh / "recipes" / "tiny.yaml").read_text())
    recipe["model"] = {"path": "models/qwen3-small"}
    recipe["data"]["max_length"] = 128
    recipe["train"].update(max_steps=6, micro_batch_size=2, save_steps=3, warmup_steps=0)
    recipe["eval"] = {"limit": 6, "max_new_tokens": 4, "batch_size": 6}
    recipe["quantize"]["calibration_sequences"] = 2
    (fresh / "recipes" / "real.yaml").write_text(yaml.safe_dump(recipe))
    run = doit(fresh, "manifest:real")
    assert run.rc == 0, run.out[-4000:]
    assert run.stages_ran("real") == ALL_STAGES
    base = artifact(fresh, "base", "real")
    assert (base / "tokenizer.json").read_bytes() == (QWEN3 / "tokenizer.json").read_bytes()
    assert json.loads((base / "config.json").read_text())["vocab_size"] == 151936
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer

    shard = load_file(str(artifact(fresh, "shards", "real") / "train" / "shard-00000.safetensors"))
    tok = AutoTokenizer.from_pretrained(QWEN3)
    text = tok.decode(shard["input_ids"][0][shard["documents"][0][1]: shard["documents"][0][1] + shard["documents"][0][2]])
    assert text.startswith("<|im_start|>user\n") and "<|im_start|>assistant\n" in text  # Qwen3's own template
    assert max(shard["input_ids"].ravel()) > 1000  # Qwen3's ids, not a small tokenizer's
    evaluation = json.loads((artifact(fresh, "eval", "real") / "eval.json").read_text())
    assert {"base", "trained", "quantized"} <= set(evaluation)
    assert doit(fresh, "verify:real").rc == 0


def test_a_hub_model_that_cannot_be_fetched_fails_in_one_line(warm):
    recipe = yaml.safe_load((warm / "recipes" / "tiny.yaml").read_text())
    recipe["model"] = {"hub": "Qwen/Qwen3-8B", "revision": "b968826d9c46dd6066d109eabc6255188de91218"}
    (warm / "recipes" / "hubbed.yaml").write_text(yaml.safe_dump(recipe))
    line = one_error_line(doit(warm, "base:hubbed", env={"HF_HUB_OFFLINE": "1"}))
    assert line.startswith("error: recipes/hubbed.yaml: model.hub Qwen/Qwen3-8B@b968826d9c46dd6066d109eabc6255188de91218 "
                           "cannot be fetched (")
    assert line.endswith("or download it once and point model.path at that directory")


def test_a_model_directory_saved_in_shards_trains(warm):
    """Models over save_pretrained's shard size (every hub model of a few GB, a 32B shape built
    here) come as model-0000N-of-0000M.safetensors with model.safetensors.index.json: the
    checkpoint stage reads the index too (it once linked the shards alone, and loading failed)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = artifact(warm, "base", "tiny")
    sharded = warm / "models" / "tiny-sharded"
    AutoModelForCausalLM.from_pretrained(base).save_pretrained(sharded, max_shard_size="200KB")
    AutoTokenizer.from_pretrained(base).save_pretrained(sharded)
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 1
    recipe = yaml.safe_load((warm / "recipes" / "tiny.yaml").read_text())
    recipe["model"] = {"path": "models/tiny-sharded"}
    recipe["train"].update(max_steps=2, save_steps=2)
    (warm / "recipes" / "sharded.yaml").write_text(yaml.safe_dump(recipe))
    run = doit(warm, "checkpoint:sharded")
    assert run.rc == 0, run.out[-3000:]
    assert (artifact(warm, "checkpoint", "sharded") / "model" / "config.json").is_file()


def test_a_config_built_base_is_keyed_by_the_device_that_made_it(warm):
    """Random weights made on a GPU differ from the CPU's (stages/model/tiny.py): the base's key
    names the device, so a GPU machine never takes a CPU-made base from a shared cache for its own."""
    key = json.loads((warm / "artifacts" / "tiny" / "base.json").read_text())["key"]
    inputs = json.loads((warm / "artifacts" / "store" / "base" / f"{key}.json").read_text())["inputs"]
    assert inputs["extra"]["device"] == "cpu"
