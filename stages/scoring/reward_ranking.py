"""A reward model's ranking of held-out pairs: how often it scores the chosen answer above the
rejected one (chance is 0.5), and the mean score margin. lm-eval scores language models only,
so a sequence-classification model is run here directly, one pair at a time."""
from __future__ import annotations

from pathlib import Path

from stages.data.render import render


def load(checkpoint: Path | None, base: Path):
    """The trained reward model; with checkpoint None, the base with a new, seeded scoring head
    (what training starts from)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    if checkpoint is not None and (checkpoint / "model").is_dir():
        return AutoModelForSequenceClassification.from_pretrained(checkpoint / "model")
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
    if checkpoint is None:
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(model, checkpoint / "adapter").merge_and_unload()


def score(model, tok, rows: list[dict]) -> dict:
    """Each pair scored as training saw it: prompt and answer to its end of turn (the score is
    read at the last token, so the template's trailing whitespace is left off)."""
    import torch

    model.eval()
    wins, margins = [], []
    with torch.no_grad():
        for r in rows:
            c, j = (model(**tok(render(tok, r["prompt"] + r[side]).rstrip(), return_tensors="pt",
                                add_special_tokens=False)).logits[0, 0].item() for side in ("chosen", "rejected"))
            wins.append(float(c > j))
            margins.append(c - j)
    return {"reward_accuracy": sum(wins) / len(wins), "reward_margin": sum(margins) / len(margins)}
