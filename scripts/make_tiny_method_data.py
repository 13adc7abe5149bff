"""Write the tiny recipes' data for the training methods beyond SFT, from the same small
checkable tasks as data/tiny/chat.jsonl (scripts/make_tiny_data.py), with fixed seeds:
`python scripts/make_tiny_method_data.py` rewrites them byte for byte.

    data/tiny/text.jsonl        cpt: plain sentences stating task answers
    data/tiny/preference.jsonl  dpo, orpo, reward: the right answer chosen, a typical wrong one rejected
    data/tiny/prompts.jsonl     grpo: every addition of two numbers under 20, with its exact answer
    data/tiny/unpaired.jsonl    kto: each preference pair split in two, the chosen answer labelled
                                desirable and the rejected one undesirable, rows shuffled
"""
import json
import random
from pathlib import Path

from make_tiny_data import task, word

OUT = Path(__file__).resolve().parent.parent / "data" / "tiny"


def sentence(rng):
    """A statement of a task's answer in plain text."""
    kind = rng.choice(["add", "reverse", "sort"])
    if kind == "add":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return f"{a} plus {b} makes {a + b}."
    w = word(rng)
    return f"The reverse of {w} is {w[::-1]}." if kind == "reverse" else f"Sorted, {w} reads {''.join(sorted(w))}."


def wrong(rng, question, answer):
    """A typical wrong answer: the word left as it was, a number off by a little, or a refusal."""
    if rng.random() < 0.4:
        return "I am not sure."
    if question.startswith(("Reverse", "Sort")):
        given = question.split(": ", 1)[1]
        return given if given != answer else given + given[0]
    return str(int(answer) + rng.choice([-3, -2, -1, 1, 2, 3]))


def write(name, rows):
    with open(OUT / name, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main():
    rng = random.Random(2024)
    write("text.jsonl", [{"text": sentence(rng)} for _ in range(2000)])
    pairs = []
    while len(pairs) < 2000:
        q, a = task(rng)
        pairs.append({"prompt": q, "chosen": a, "rejected": wrong(rng, q, a)})
    write("preference.jsonl", pairs)
    sums = [(a, b) for a in range(20) for b in range(20)]
    rng.shuffle(sums)
    write("prompts.jsonl", [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in sums])
    # TRL's unpaired preference format; shuffled (by a generator of its own, so the files above
    # keep their bytes), since KTOTrainer reads rows in order and estimates its KL term from each
    # row's neighbours' completions: a pair's two halves side by side would share their prompt
    unpaired = [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
                for p in pairs for side in ("chosen", "rejected")]
    random.Random(40).shuffle(unpaired)
    write("unpaired.jsonl", unpaired)


if __name__ == "__main__":
    main()
