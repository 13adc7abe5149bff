"""A model card as the Hugging Face Hub reads one: README.md with YAML front matter (base_model,
datasets, library_name, license, tags, and a model-index holding the eval stage's scores, through
huggingface_hub's ModelCardData and EvalResult) and a body for people: what was trained, from
what, how it scored, the receipt's digest to verify, and its anchor where there is one. Built
only from the manifest, eval.json and anchor.json, so the same build gives the same bytes."""
from __future__ import annotations

# eval.json metric -> the Hub's metric type id and a readable name (https://hf.co/metrics)
METRICS = {"exact_match": ("exact_match", "exact match, greedy"), "perplexity": ("perplexity", "perplexity per token"),
           "preference_accuracy": ("accuracy", "preference accuracy"), "reward": ("reward", "mean reward"),
           "margin": ("margin", "chosen - rejected log-probability margin")}


def card_data(manifest: dict, digest: str, scores: dict, license: str | None):
    """The card's front matter: what the Hub indexes the model by."""
    from huggingface_hub import EvalResult, ModelCardData

    recipe, name = manifest["recipe"], manifest["recipe_name"]
    train = recipe["train"]
    hub = recipe["model"].get("hub")
    datasets = sorted({s["hub"] for s in recipe["data"]["sources"] if s.get("hub")})
    adapter = any(rel.startswith("adapter/") for rel in manifest["artifacts"]["checkpoint"]["files"])
    schemes = sorted(manifest.get("quantized") or {})
    results = [EvalResult(task_type="text-generation", dataset_type="heldout", dataset_name=f"{name} held-out rows",
                          dataset_split="heldout", metric_type=METRICS[m][0], metric_name=METRICS[m][1],
                          metric_value=value)
               for m, value in sorted((scores.get("trained") or {}).items()) if m in METRICS]
    return ModelCardData(
        base_model=hub, datasets=datasets or None, library_name="peft" if adapter else "transformers",
        license=license or "other", model_name=name, eval_results=results or None, pipeline_tag="text-generation",
        tags=["mindxtrain", train["method"], *(["lora"] if train["peft"] != "none" else []),
              *([train["peft"]] if train["peft"] == "qlora" else []), *(f"quark-{s}" for s in schemes)],
        mindxtrain={"manifest_digest": digest},
    )


def fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def body(manifest: dict, digest: str, scores: dict, anchor: dict | None) -> str:
    """The card's text: what the model is, how it was made and scored, and how to check it."""
    recipe, name = manifest["recipe"], manifest["recipe_name"]
    train, model = recipe["train"], recipe["model"]
    base = (f"[{model['hub']}](https://huggingface.co/{model['hub']}) at revision `{model['revision']}`"
            if model.get("hub") else f"`{model['path']}`" if model.get("path") else "a model built from its config "
            "(random weights, for testing the pipeline)")
    sources = [f"[{s['hub']}](https://huggingface.co/datasets/{s['hub']}) `{s.get('split', 'train')}` at "
               f"`{s['revision']}`" if s.get("hub") else f"`{s['path']}`" for s in recipe["data"]["sources"]]
    models = [(m, scores[m]) for m in ("base", "trained") if m in scores]
    models += [(f"quantized {s}", q) for s, q in sorted((scores.get("quantized") or {}).items())]
    metrics = sorted({k for _, s in models for k in s})
    lines = [
        f"# {name}", "",
        f"Fine-tuned from {base} by mindxtrain (`doit manifest:{name}`): "
        f"{train['method']}, {'full weights' if train['peft'] == 'none' else train['peft'] + ' adapter'}, "
        f"learning rate {train['lr']}, {train['max_steps']} steps of {train['micro_batch_size'] * train['grad_accum']} "
        f"sequences of up to {recipe['data']['max_length']} tokens.", "",
        "## Data", "", *(f"- {s}" for s in sources), "",
        "## Evaluation", "",
        f"On {scores.get('heldout_rows', 'the')} held-out rows of the training data:", "",
        "| model | " + " | ".join(metrics) + " |", "|---" * (len(metrics) + 1) + "|",
        *(f"| {m} | " + " | ".join(fmt(s.get(k, "-")) for k in metrics) + " |" for m, s in models), "",
        "## Receipt", "",
        f"Manifest digest `{digest}` (BLAKE3 of `manifest.json`, which names every file of every artifact, the "
        f"recipe, the code and the library versions). Check it with `doit verify:{name}`.",
    ]
    if anchor:
        lines += ["", f"Anchored on chain {anchor['chain_id']} in registry `{anchor['registry']}` by "
                      f"`{anchor['submitter']}`, transaction `{anchor['tx_hash']}`, block {anchor['block_number']}."]
    else:
        lines += ["", "Not anchored on a chain."]
    return "\n".join(lines) + "\n"


def render(manifest: dict, digest: str, scores: dict, anchor: dict | None, license: str | None) -> str:
    """README.md's text: the front matter, then the body."""
    from huggingface_hub import ModelCard

    data = card_data(manifest, digest, scores, license)
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body(manifest, digest, scores, anchor)}"))
