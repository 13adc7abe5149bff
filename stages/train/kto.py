"""KTO: TRL's KTOTrainer on the shards' unpaired rows, each a prompt and one completion labelled
desirable or not, with train.beta. The loss pushes a desirable completion's log-probability above
the reference model's and an undesirable one's below it, each against a KL estimate made from the
batch's completions under other prompts (so a micro-batch holds more than one row); the reference
model is the base (with LoRA: the same model with its adapter switched off, as TRL does; full
weights: a frozen copy TRL makes), as for DPO. Rows go in as the text the chat template rendered
(decoded from the shards' ids, as stages/train/pairs.py does for pairs), which TRL tokenizes again;
TRL reads them in order (its sequential sampling: the KL estimate pairs neighbours in a batch)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from stages.data import ragged
from stages.data.packed import IGNORE
from stages.engine.errors import UserError
from stages.train.settings import peft_config
from stages.train.trainer import plan_args


def unpaired_ids(shards: Path) -> list[dict]:
    """Each training row as token ids: prompt_ids, completion_ids (its learned tokens), label."""
    found = []
    for path in ragged.shard_files(shards):
        t = ragged.read(path)
        for i, desirable in enumerate(ragged.beside(path, "desirable.jsonl")):
            a, b = t["ids_offsets"][i], t["ids_offsets"][i + 1]
            ids, learned = t["ids"][a:b], np.flatnonzero(t["ids_labels"][a:b] != IGNORE)
            found.append({"prompt_ids": ids[: learned[0]].tolist(),
                          "completion_ids": ids[learned[0]: learned[-1] + 1].tolist(), "label": bool(desirable)})
    return found


def dataset(shards: Path, tok):
    """The training rows as TRL's (non-conversational) unpaired preference dataset: prompt, completion, label."""
    from datasets import Dataset

    decode = lambda ids: tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return Dataset.from_list([{"prompt": decode(r["prompt_ids"]), "completion": decode(r["completion_ids"]),
                               "label": r["label"]} for r in unpaired_ids(shards)])


def make_trainer(method, model, train, tok, plan: dict, t, output_dir: Path):
    if plan["micro_batch_size"] < 2:  # TRL raises deep in its constructor; the plan's probe may pick 1
        raise UserError(f"train.method: kto estimates its KL term from the other rows of a micro-batch, and the plan's "
                        f"micro-batch is {plan['micro_batch_size']} row; raise train.micro_batch_size (on a GPU, lower "
                        f"data.max_length or use peft: lora so that two rows fit)")
    config, trainer = method.trl()
    args = config(**plan_args(plan, t, output_dir, method.logs), beta=t.beta,
                  max_length=None)  # the shards stage already applied data.max_length
    return trainer(model=model, args=args, train_dataset=train, processing_class=tok,
                   peft_config=peft_config(t, method.peft_task))
