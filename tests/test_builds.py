"""Whole clean builds: fast enough, bit-identical when repeated (in processes with other hash
seeds: set and dict orders must not reach an artifact), and the LoRA variant."""
from __future__ import annotations

import json

import pytest

from conftest import ALL_STAGES, build_beside, doit
from test_pipeline import artifact


@pytest.fixture(scope="module")
def built_lora(built, tmp_path_factory):
    """The built project with tiny_lora built too (hash seed 1)."""
    project, run = build_beside(built, tmp_path_factory, "tiny_lora")
    assert run.rc == 0, run.out[-3000:]
    assert run.stages_ran("tiny_lora") == ALL_STAGES - {"base", "shards"}  # shared with tiny
    assert run.seconds < 180, run.seconds
    return project


def test_clean_build_is_fast_and_bit_identical(fresh, built):
    run = doit(fresh, "manifest:tiny", env={"PYTHONHASHSEED": "2"})
    assert run.rc == 0, run.out[-3000:]
    assert run.stages_ran() == ALL_STAGES
    assert run.seconds < 180, run.seconds
    manifest = (artifact(fresh, "manifest") / "manifest.json").read_bytes()
    assert manifest == (artifact(built, "manifest") / "manifest.json").read_bytes()
    for stage in ALL_STAGES:  # no machine paths inside the hashed trees
        for path in artifact(fresh, stage).rglob("*.json*"):
            assert str(fresh) not in path.read_text(), path


def test_lora_recipe_builds_a_standard_peft_adapter(built_lora):
    import torch
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM

    warm = built_lora
    adapter = artifact(warm, "checkpoint", "tiny_lora") / "adapter"
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = PeftConfig.from_pretrained(adapter)
    assert config.peft_type == "LORA" and config.r == 8 and config.lora_alpha == 16
    base = AutoModelForCausalLM.from_pretrained(artifact(warm, "base", "tiny_lora"))
    ids = torch.tensor([[3, 4, 5, 6]])
    before = base(input_ids=ids).logits
    model = PeftModel.from_pretrained(base, adapter)  # plain PEFT loads it; training moved it
    assert not torch.allclose(model(input_ids=ids).logits, before)
    evaluation = json.loads((artifact(warm, "eval", "tiny_lora") / "eval.json").read_text())
    assert evaluation["trained"]["perplexity"] < evaluation["base"]["perplexity"]
    quant = json.loads((artifact(warm, "quantized", "tiny_lora") / "fp8" / "config.json").read_text())
    assert "fp8" in json.dumps(quant["quantization_config"]).lower()
    assert doit(warm, "verify").rc == 0


def test_eval_merges_the_adapter_into_the_base_it_scored_as_a_fresh_load_would(built_lora):
    """eval scores the base, then merges tiny_lora's adapter into that same model instead of
    loading the base again: after lm-eval has scored it, its weights must be load_trained's, bit
    for bit, so eval.json's trained scores are those of the trained model as saved."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages import eval as eval_stage
    from stages.data.kinds import chat
    from stages.engine import jsontext
    from stages.model.trained import load_trained, placement
    from stages.scoring import harness

    base, checkpoint = artifact(built_lora, "base", "tiny_lora"), artifact(built_lora, "checkpoint", "tiny_lora")
    assert eval_stage.merges_into(base, checkpoint)
    tok = AutoTokenizer.from_pretrained(base)
    lines = (artifact(built_lora, "shards", "tiny_lora") / "heldout" / "heldout.jsonl").read_text().splitlines()
    model = AutoModelForCausalLM.from_pretrained(base, **placement())
    docs = chat.heldout_docs([jsontext.loads(line) for line in lines[:8]], tok, model.config.max_position_embeddings)
    configs = harness.task_configs(chat.tasks(docs, tok.eos_token, 12, None), docs)
    harness.results(model, tok, configs, SimpleNamespace(batch_size=4))
    merged = eval_stage.trained_model(model, checkpoint, base).state_dict()
    fresh = load_trained(checkpoint, base).state_dict()
    assert merged.keys() == fresh.keys()
    assert all(torch.equal(merged[k], fresh[k]) for k in fresh)
    assert eval_stage.trained_model(None, checkpoint, base).state_dict().keys() == fresh.keys()


def test_lora_builds_are_bit_identical_under_another_hash_seed(fresh, built_lora):
    run = doit(fresh, "manifest:tiny_lora", env={"PYTHONHASHSEED": "2"})
    assert run.rc == 0, run.out[-3000:]
    manifest = artifact(fresh, "manifest", "tiny_lora") / "manifest.json"
    assert manifest.read_bytes() == (artifact(built_lora, "manifest", "tiny_lora") / "manifest.json").read_bytes()

    # and a fresh build, its output not a terminal, prints the stages' own lines only: each stage's
    # start, what it made and its end, then the summary; what Quark, lm-eval and transformers print
    # is in each stage's log beside its artifact, without colour codes or progress bar redraws
    assert len(run.out.splitlines()) <= 40 and "\x1b[" not in run.out and "\r" not in run.out, run.out
    assert "QUARK" not in run.out and "Running generate_until" not in run.out and "Loading weights" not in run.out
    built = [line.split()[1] for line in run.out.splitlines() if line.startswith("   built ")]
    assert built == [f"{stage}:tiny_lora" for stage in ("base", "plan", "shards", "checkpoint", "quantized", "eval",
                                                          "manifest")], run.out
    assert "   stats.json: 3000 rows in" in run.out and "   eval.json on 48 held-out rows: base exact match" in run.out
    logs = {stage: artifact(fresh, stage, "tiny_lora").with_suffix(".log").read_text() for stage in ALL_STAGES}
    assert "[QUARK-INFO]: Compiling" in logs["quantized"] and "QConfig(" in logs["quantized"]
    assert "Running generate_until requests: 100%" in logs["eval"] and "Loading weights: 100%" in logs["checkpoint"]
    assert "step 150/150 loss" in logs["checkpoint"]
    assert not any("\x1b[" in log or "\r" in log for log in logs.values())


# tiny's base model and the files of its shards as built before the stages moved into engine/,
# data/, train/ and model/ (c223203): moving code changes keys (module paths are part of them),
# never these bytes. Weights trained on CPU are left out: their floats depend on the CPU's
# vector instructions.
SAME_FILES = {
    "base": {"*": "cc6818b71c350876eca6dae62ff7b56c0445590102bcf93e55171758a600c21e"},  # the artifact's digest
    "shards": {"heldout/heldout.jsonl": "a8ec126b3816b05446490919ae1f732a09776ae5ce4e246a9d696c7ea3dd594d",
               "stats.json": "e024684a140bf5a6dbdc498e8ef62807cfd67ab802f0acaa81b0c6a843bc871e",
               "train/shard-00000.safetensors": "7b30d43c416ebc2c82395d37cf41c2039d61bd6c0c72a645ad367e1dd9331d3d"},
}


def test_refactors_keep_the_artifacts_bytes(built):
    from test_pipeline import pointer

    assert pointer(built, "base")["digest"] == SAME_FILES["base"]["*"]
    files = json.loads(artifact(built, "shards").with_suffix(".json").read_text())["files"]
    assert {rel: files[rel] for rel in SAME_FILES["shards"]} == SAME_FILES["shards"]
