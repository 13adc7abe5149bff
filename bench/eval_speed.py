"""The eval stage's generation, side by side on one model in one run: lm-eval's HFLM
(generate over padded batches of eval.batch_size) against stages/scoring/wide_lm.WideLM (the same
generate in batches as wide as the KV budget allows, as the eval stage runs it), alternating,
after one untimed call of each on a few of the requests.

Requests are the chat kind's exact-match task (stages/data/kinds/chat.py): real questions
(GSM8K's test split) rendered through the model's chat template, greedy, until the end-of-turn
string, at most --max-new-tokens (recipes/qwen3_8b_shape.yaml: 128 rows, 32 tokens, batch 32).
The model is a Qwen3 shape with random weights in bf16 on the GPU: its answers never end early,
so every request runs its whole budget. Reported: seconds per side and run, HFLM over the wide
batch (min and median over --repeat), and how many answers are the same string (bf16: the two
batch differently, so near-ties may break differently).

    python -m bench.eval_speed [--shape qwen3-8b | --model DIR] [--limit 128] [--max-new-tokens 32] [--repeat 3] [--out FILE]

--tiny: the tiny model and its character tokenizer on the CPU, data/tiny's questions (a smoke
test of this script, not a measurement).
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

from bench import tiny
from bench.autotune_probe import SHAPES

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"


def load_model(shape: dict, device: str, tok):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(**shape, max_position_embeddings=40960, tie_word_embeddings=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def requests(tok, rows: Path, limit: int, max_new_tokens: int) -> list:
    """The chat kind's generate_until requests for the first `limit` questions."""
    from lm_eval.api.instance import Instance

    from stages.data.render import render

    with open(rows, encoding="utf-8") as f:
        questions = [json.loads(line)["question"] for line, _ in zip(f, range(limit))]
    kwargs = {"until": [tok.eos_token], "max_gen_toks": max_new_tokens, "do_sample": False}
    return [Instance("generate_until", doc={}, idx=i, arguments=(render(tok, [{"role": "user", "content": q}],
                                                                        generation_prompt=True), kwargs))
            for i, q in enumerate(questions)]


def timed(lm, reqs) -> tuple[float, list[str]]:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    answers = lm.generate_until(reqs, disable_tqdm=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, answers


def main() -> None:
    ap = argparse.ArgumentParser(description="eval's generation: lm-eval's HFLM against its wide batches")
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--tokenizer", type=Path, default=SHARED / "tokenizers" / "qwen3")
    ap.add_argument("--rows", type=Path, default=SHARED / "datasets" / "gsm8k" / "test.jsonl")
    ap.add_argument("--limit", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--model", type=Path, help="a saved model directory instead of --shape (a Quark export from "
                                                "the quantized stage: its tokenizer is read from there too)")
    a = ap.parse_args()
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    from stages.scoring.wide_lm import WideLM

    device = "cpu" if a.tiny else "cuda"
    if a.tiny:
        from stages.model.tiny import char_tokenizer

        tok, shape, a.rows, a.limit, a.max_new_tokens, a.repeat = char_tokenizer(), tiny.SHAPE, tiny.PROMPTS, 12, 8, 2
    else:
        tok, shape = AutoTokenizer.from_pretrained(a.tokenizer), SHAPES[a.shape]
    if a.model:
        from transformers import AutoModelForCausalLM

        from stages.model.trained import placement

        tok = AutoTokenizer.from_pretrained(a.model)
        model = AutoModelForCausalLM.from_pretrained(a.model, **placement()).eval()
    else:
        model = load_model(shape, device, tok)
    reqs = requests(tok, a.rows, a.limit, a.max_new_tokens)
    args = dict(pretrained=model, tokenizer=tok, batch_size=a.batch_size, max_length=model.config.max_position_embeddings)
    sides = {"hflm": HFLM(**args), "wide": WideLM(**args)}
    kind = "cpu" if a.tiny else next((k for k in ("h200", "h100") if k in torch.cuda.get_device_name(0).lower()), "gpu")
    out = a.out or (tiny.results_path("eval_speed.json") if a.tiny else
                    REPO / "bench" / "results" / f"eval_speed_{kind}_{datetime.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    for lm in sides.values():  # untimed: the GPU's first generate (kernels loaded, cuBLAS set up), each side's
        lm.generate_until(reqs[:8], disable_tqdm=True)
    runs, answers = [], {}
    for _ in range(a.repeat):  # the file is written after every run: a call cut short keeps what ran
        run = {}
        for name, lm in sides.items():
            run[name], answers[name] = timed(lm, reqs)
        runs.append({**{k: round(v, 3) for k, v in run.items()}, "hflm_over_wide": round(run["hflm"] / run["wide"], 2)})
        print(runs[-1], flush=True)
        ratios = [r["hflm_over_wide"] for r in runs]
        result = {
            "gpu": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
            "model": str(a.model) if a.model else f"{'tiny' if a.tiny else a.shape} shape, random weights",
            "requests": len(reqs), "max_new_tokens": a.max_new_tokens, "batch_size": a.batch_size,
            "runs": runs, "ratio_min": min(ratios), "ratio_median": statistics.median(ratios),
            "wide_batch": sides["wide"].generation_batch(reqs),
            "same_answers": sum(x == y for x, y in zip(answers["hflm"], answers["wide"])),
        }
        out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))


if __name__ == "__main__":
    main()
