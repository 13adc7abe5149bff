"""The model card (doit card:<recipe>) is README.md as the Hugging Face Hub reads it, and doit
publish uploads it with the build. No Hub is reachable here, so publish is tested offline: what it
would upload (--dry-run), and its one line without a token or without a Hub; never a fake Hub."""
from __future__ import annotations

import json

import yaml
from huggingface_hub import ModelCard

from conftest import REPO, doit, free_port, snapshot
from test_receipt import forge, set_lr
from stages.view.card import card_data, render


def pointer(project, stage: str) -> dict:
    return json.loads((project / "artifacts" / "tiny" / f"{stage}.json").read_text())


def stored(project, stage: str):
    return project / "artifacts" / "store" / stage / pointer(project, stage)["key"]


def error_lines(run) -> list[str]:
    return [line for line in run.out.splitlines() if line.startswith("error:")]


def test_the_card_is_what_the_hub_reads_and_says_what_the_build_is(warm):
    run = doit(warm, "card:tiny")
    assert run.rc == 0 and run.stages_ran() == {"card"}, run.out[-2000:]
    card = ModelCard.load(stored(warm, "card") / "README.md")
    data, scores = card.data.to_dict(), json.loads((stored(warm, "eval") / "eval.json").read_text())
    assert data["library_name"] == "transformers" and data["license"] == "other"
    assert data["tags"] == ["mindxtrain", "sft", "quark-fp8"] and data["pipeline_tag"] == "text-generation"
    assert "base_model" not in data and "datasets" not in data  # built from a config, on a local file
    (index,) = data["model-index"]
    assert index["name"] == "tiny"
    assert {m["type"]: m["value"] for m in index["results"][0]["metrics"]} == {
        "exact_match": scores["trained"]["exact_match"], "perplexity": scores["trained"]["perplexity"]}
    digest = pointer(warm, "manifest")["digest"]
    assert data["mindxtrain"] == {"manifest_digest": digest}
    assert f"Manifest digest `{digest}`" in card.text and "Not anchored on a chain." in card.text
    assert f"| trained | {scores['trained']['exact_match']:.4g} |" in card.text

    # its license is the recipe's; changing it rebuilds the card alone (the receipt does not hold it)
    recipe = warm / "recipes" / "tiny.yaml"
    recipe.write_text(recipe.read_text() + "\npublish:\n  license: apache-2.0\n")
    run = doit(warm, "card:tiny")
    assert run.rc == 0 and run.stages_ran() == {"card"}, run.out[-2000:]
    assert ModelCard.load(stored(warm, "card") / "README.md").data.license == "apache-2.0"


def test_a_hub_models_card_names_its_base_datasets_adapter_and_anchor():
    recipe = yaml.safe_load((REPO / "recipes" / "qwen3_8b.yaml").read_text())
    manifest = {"recipe_name": "qwen3_8b", "recipe": recipe, "quantized": {"fp8": {}},
                "artifacts": {"checkpoint": {"files": {"adapter/adapter_config.json": "d", "metrics.jsonl": "d"}}}}
    scores = {"trained": {"exact_match": 0.5}, "heldout_rows": 500}
    data = card_data(manifest, "ab" * 32, scores, "apache-2.0").to_dict()
    assert data["base_model"] == "Qwen/Qwen3-8B" and data["datasets"] == ["HuggingFaceH4/ultrachat_200k"]
    assert data["library_name"] == "peft" and data["tags"] == ["mindxtrain", "sft", "lora", "quark-fp8"]
    anchor = {"chain_id": 31337, "registry": "0xR", "submitter": "0xS", "tx_hash": "0xT", "block_number": 5}
    text = render(manifest, "ab" * 32, scores, anchor, "apache-2.0")
    assert "Anchored on chain 31337 in registry `0xR` by `0xS`, transaction `0xT`, block 5." in text
    assert "[Qwen/Qwen3-8B](https://huggingface.co/Qwen/Qwen3-8B) at revision" in text


def test_publish_dry_run_lists_what_it_would_upload_and_sends_nothing(warm):
    assert doit(warm, "card:tiny").rc == 0
    before = snapshot(warm)
    run = doit(warm, "publish:tiny", "--repo", "me/tiny", "--dry-run", env={"HF_HUB_OFFLINE": "1"})
    assert run.rc == 0, run.out[-2000:]
    listed = {line.split(" would upload ")[1].split(" (")[0]: int(line.split(" (")[1].split()[0])
              for line in run.out.splitlines() if " would upload " in line}
    model = stored(warm, "checkpoint") / "model"
    expected = {"README.md": (stored(warm, "card") / "README.md").stat().st_size,
                "mindxtrain/manifest.json": (stored(warm, "manifest") / "manifest.json").stat().st_size}
    expected |= {p.name: p.stat().st_size for p in model.iterdir()}
    expected |= {p.name: p.stat().st_size for p in stored(warm, "base").glob("tokenizer*.json") if p.name not in expected}
    expected |= {f"quantized/fp8/{p.name}": p.stat().st_size for p in (stored(warm, "quantized") / "fp8").iterdir()}
    assert listed == expected
    assert f"publish:tiny: {len(expected)} files to me/tiny (dry run: nothing sent)" in run.out
    assert snapshot(warm) == before


def test_publish_without_a_token_or_a_hub_is_one_line_and_changes_nothing(warm, tmp_path):
    assert doit(warm, "card:tiny").rc == 0
    before = snapshot(warm)
    no_token = {"HF_TOKEN": "", "HF_HOME": str(tmp_path / "hf")}
    run = doit(warm, "publish:tiny", "--repo", "me/tiny", env=no_token)
    assert run.rc != 0 and error_lines(run) == [
        "error: publish:tiny: no Hugging Face token: set HF_TOKEN, or run `hf auth login`; nothing uploaded"], run.out
    closed = f"http://127.0.0.1:{free_port()}"  # no Hub there: nothing listens
    run = doit(warm, "publish:tiny", "--repo", "me/tiny", env={"HF_TOKEN": "hf_test", "HF_ENDPOINT": closed,
                                                                 "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"})
    (line,) = error_lines(run)
    assert run.rc != 0 and line.startswith(f"error: publish:tiny: cannot publish to me/tiny on {closed} (") \
        and line.endswith("; nothing recorded"), run.out
    run = doit(warm, "publish:tiny", env=no_token)
    assert error_lines(run) == ["error: publish:tiny: say where: --repo owner/name, or publish.repo in "
                                "recipes/tiny.yaml"], run.out
    assert snapshot(warm) == before and not (warm / "artifacts" / "tiny" / "publish.json").exists()


def test_publish_refuses_a_build_whose_receipt_does_not_verify(warm):
    assert doit(warm, "card:tiny").rc == 0
    forge(warm, set_lr)  # the manifest edited with the store's record of it: no build repairs that
    run = doit(warm, "publish:tiny", "--repo", "me/tiny", "--dry-run")
    (line,) = error_lines(run)
    assert run.rc != 0 and line.startswith("error: publish:tiny: the receipt does not verify (tiny: manifest: recipe "
                                           "train.lr is 0.004 in the receipt"), run.out
    assert "would upload" not in run.out and not (warm / "artifacts" / "store" / "publish").exists()
