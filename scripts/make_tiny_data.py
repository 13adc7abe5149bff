"""Write data/tiny/chat.jsonl: chat rows of small tasks whose answers can be checked.

Arithmetic, string reversal, sorting letters and counting characters; a fixed
seed makes the file reproducible: `python scripts/make_tiny_data.py` rewrites it
byte for byte.
"""
import json
import random
from pathlib import Path

ROWS = 3000
OUT = Path(__file__).resolve().parent.parent / "data" / "tiny" / "chat.jsonl"
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def word(rng):
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 8)))


def task(rng):
    kind = rng.choice(["add", "sub", "reverse", "sort", "count"])
    if kind == "add":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return f"What is {a} + {b}?", str(a + b)
    if kind == "sub":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return f"What is {a} - {b}?", str(a - b)
    w = word(rng)
    if kind == "reverse":
        return f"Reverse the string: {w}", w[::-1]
    if kind == "sort":
        return f"Sort the letters of: {w}", "".join(sorted(w))
    c = rng.choice(w)
    return f"How many times does '{c}' appear in {w}?", str(w.count(c))


def main():
    rng = random.Random(1234)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with open(OUT, "w") as f:
        for _ in range(ROWS):
            q, a = task(rng)
            row = {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
