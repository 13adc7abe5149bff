"""The shards stage: best-fit-decreasing packing, documents that never see each other inside
a packed sequence, a stable held-out split, and shards for every training method."""
from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from conftest import SHARED, doit
from stages import shards

DATASETS = SHARED / "datasets"

def test_best_fit_decreasing_packing():
    bins = shards.pack([5, 4, 3, 3, 2, 1], capacity=8)
    assert bins == [[0, 2], [1, 3, 5], [4]]
    lengths = [7, 250, 3, 128, 128, 90, 40, 166, 12, 1, 256]
    bins = shards.pack(lengths, capacity=256)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 256 for b in bins)
    assert len(bins) == -(-sum(lengths) // 256)  # as few bins as the total allows, here


def test_packed_documents_do_not_attend_to_each_other(tmp_path):
    """Two documents in one row, position ids restarting, no attention mask: each gets the logits
    it gets alone. This is what training relies on when it feeds packed shards."""
    import torch
    from transformers import AutoModelForCausalLM

    from stages.base import build_from_config
    from stages.recipe import TinyConfig

    build_from_config(TinyConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8), tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    model.config.use_cache = False
    a, b = torch.randint(3, 90, (1, 11)), torch.randint(3, 90, (1, 7))
    with torch.no_grad():
        alone_a, alone_b = model(input_ids=a).logits, model(input_ids=b).logits
        packed = model(input_ids=torch.cat([a, b], 1),
                       position_ids=torch.cat([torch.arange(11), torch.arange(7)])[None]).logits
    torch.testing.assert_close(packed[:, :11], alone_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:, 11:], alone_b, rtol=1e-5, atol=1e-5)


def test_heldout_split_depends_on_the_row_alone():
    rows = [f"user:what is {i} + 1?\nassistant:{i + 1}" for i in range(2000)]
    split = [shards.is_heldout(r, 0.1, 0) for r in rows]
    assert 150 < sum(split) < 250
    assert [shards.is_heldout(r, 0.1, 0) for r in reversed(rows)] == split[::-1]


def shards_for(project: Path, name: str, method: str, sources: list[str], **data) -> tuple[dict, Path]:
    """Build shards:<name> for a copy of tiny with another method and sources; (stats, train dir)."""
    import yaml

    recipe = yaml.safe_load((project / "recipes" / "tiny.yaml").read_text())
    recipe["train"]["method"] = method
    recipe["data"].update({"sources": [{"path": s} for s in sources], "max_length": 1024, **data})
    (project / "recipes" / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
    run = doit(project, f"shards:{name}")
    assert run.rc == 0, run.out[-3000:]
    key = json.loads((project / "artifacts" / name / "shards.json").read_text())["key"]
    obj = project / "artifacts" / "store" / "shards" / key
    stats = json.loads((obj / "stats.json").read_text())
    assert stats["rows_in_total"] == stats["kept"]["train"] + stats["kept"]["heldout"] + sum(stats["dropped"].values())
    return stats, obj / "train"


@pytest.mark.skipif(not DATASETS.is_dir(), reason="../shared/datasets is not on this machine")
def test_preference_and_prompt_shards_from_real_data(fresh):
    from safetensors.numpy import load_file

    (fresh / "data" / "real").mkdir()
    shutil.copy(DATASETS / "hh-rlhf-harmless" / "test.jsonl.gz", fresh / "data" / "real" / "hh.jsonl.gz")
    shutil.copy(DATASETS / "gsm8k" / "test.jsonl", fresh / "data" / "real" / "gsm8k.jsonl")

    stats, train = shards_for(fresh, "hh_dpo", "dpo", ["data/real/hh.jsonl.gz"], on_error="skip")
    assert stats["kind"] == "preference" and stats["kept"]["train"] > 1000
    pairs = load_file(str(train / "shard-00000.safetensors"))
    for side in ("ids", "rejected_ids"):
        offsets = pairs[f"{side}_offsets"]
        assert offsets[-1] == len(pairs[side]) == len(pairs[f"{side}_labels"])
        first = pairs[f"{side}_labels"][offsets[0]: offsets[1]]
        assert first[0] == -100 and (first != -100).any()  # the prompt has no loss, the answer has

    stats, train = shards_for(fresh, "gsm8k_grpo", "grpo", ["data/real/gsm8k.jsonl"])
    assert stats["kind"] == "prompt" and stats["kept"]["train"] + stats["kept"]["heldout"] > 1200
    prompts = load_file(str(train / "shard-00000.safetensors"))
    references = (train / "shard-00000.references.jsonl").read_text().splitlines()
    assert len(prompts["ids_offsets"]) == len(references) + 1 == stats["kept"]["train"] + 1
    assert json.loads(references[0]).split("####")[-1].strip().lstrip("-").replace(",", "").isdigit()


def test_continued_pretraining_shards_learn_every_token(fresh):
    from safetensors.numpy import load_file

    texts = [{"text": f"Line {i}: the quick brown fox number {i} jumps over {i * 7} lazy dogs."} for i in range(300)]
    (fresh / "data" / "text.jsonl").write_text("".join(json.dumps(t) + "\n" for t in texts))
    stats, train = shards_for(fresh, "text_cpt", "cpt", ["data/text.jsonl"], max_length=256,
                              dedupe={"near_threshold": None})
    assert stats["kind"] == "text" and stats["dropped"] == {}
    shard = load_file(str(train / "shard-00000.safetensors"))
    real = shard["labels"] != -100
    assert stats["loss_tokens"] == stats["tokens"] == int(real.sum())


@pytest.mark.skipif(not DATASETS.is_dir(), reason="../shared/datasets is not on this machine")
def test_packing_real_chat_data_is_over_98_percent_full(fresh):
    shutil.copy(DATASETS / "gsm8k" / "train.jsonl", fresh / "data" / "gsm8k.jsonl")
    stats, _ = shards_for(fresh, "gsm8k_sft", "sft", ["data/gsm8k.jsonl"], max_length=4096)
    assert stats["kept"]["train"] > 7000
    assert stats["packing_efficiency"] > 0.98, stats
