"""Verifiers: GRPO's verifiable rewards, by the name a recipe gives in train.reward: each scores
one completion against the row's reference answer, 1.0 right or 0.0 wrong. GRPO trains on them
and the eval stage measures held-out prompts with the same function (the prompt kind's tasks)."""
from __future__ import annotations

import re

from stages.engine.errors import UserError

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def exact_answer(completion: str, reference: str) -> float:
    """The whole answer, as the tiny tasks give it: the completion stripped equals the reference."""
    return float(completion.strip() == reference.strip())


def number(text: str) -> str | None:
    found = NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def gsm8k(completion: str, reference: str) -> float:
    """GSM8K: the number after '####' in the reference, against the completion's number after
    '####' (or its last number, for a model that does not write the marker)."""
    if "####" not in reference:
        raise ValueError(f"the reference has no '####' answer line: {reference[-60:]!r}")
    want = number(reference.split("####")[-1])
    got = number(completion.split("####")[-1]) if "####" in completion else number(completion)
    return float(got is not None and want is not None and float(got) == float(want))


REWARDS = {"exact_answer": exact_answer, "gsm8k": gsm8k}


def reward_function(name: str):
    """The named reward, checked: an unknown name, or a reward that raises on a row, is a
    one-line error naming train.reward and the row, not a traceback from inside the trainer."""
    if name not in REWARDS:
        raise UserError(f"train.reward: {name!r} is not a reward; use one of {', '.join(REWARDS)}")
    fn = REWARDS[name]

    def score(completion: str, reference: str) -> float:
        try:
            return fn(completion, reference)
        except Exception as e:  # any failure of a reward is the recipe's problem to fix
            raise UserError(f"train.reward: {name} raised {type(e).__name__} ({e}) on the completion "
                            f"{completion[:60]!r}; use a reward that fits the data's answers") from None

    return score
