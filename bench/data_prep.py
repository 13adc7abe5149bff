"""Data preparation throughput: mindxtrain's shards stage vs TRL's own tokenize + pack.

One run, same rows, same tokenizer, same sequence length, same number of processes:

  trl   SFTTrainer(...) on the rows as a datasets JSON dataset: its own dataset preparation
        (chat template, tokenization, assistant-only masks, BFD packing) with
        assistant_only_loss, packing, dataset_num_proc = --procs; the clock starts at loading
  ours  `doit shards:bench` on a project whose recipe reads the same JSONL: read, exact and
        near dedupe (MinHash LSH), filters, held-out split, Qwen3-template masks, BFD packing,
        safetensors shards
  ours_exact_dedupe_only  the same with near dedupe off (closer to what TRL does: it
        does no dedupe at all)

Corpus (--corpus):
  real (the default)  chat rows of real text with a real long tail, regenerated offline from
        sources anyone can name: user turns are the real prompts of ../shared/datasets (GSM8K
        questions, HH-RLHF human turns, MT-Bench, FastChat's sample); assistant turns are
        consecutive excerpts (lognormal length, median 500 characters, cut at line ends) of
        Python source as people write it: CPython's standard library (its tests hold many
        scripts and much Unicode) and the installed packages this project pins (torch,
        transformers, ...), in sorted path order; every other turn starts with a real answer
        (GSM8K's worked solutions, HH-RLHF's assistant turns). The excerpts are read once each
        until the ~530 MB of source runs out (after about 440k rows), then again with boundaries
        shifted by half an excerpt. Tokenizer: Qwen3's real one (../shared/tokenizers/qwen3,
        151,669 tokens) on a tiny Qwen3 with vocab_size 151,936.
  synthetic  the earlier best case, kept for comparison: random draws from GSM8K's few
        thousand distinct words, with an 8,192-token BPE trained on those rows.

Each runs in its own process; rows/s and tokens/s are counted on rows in, peak RSS comes from
the kernel (wait4). Prints a table and writes it as JSON under bench/results/. TRL's datasets
cache for 1M rows takes tens of GB of disk; on a smaller disk --trl-rows gives it a prefix.

    python -m bench.data_prep --rows 1000000 --out bench/results/data_prep_1m.json [--only trl ours]

--tiny: data/tiny/chat.jsonl's rows (3,000 at most) and the tiny model's character tokenizer
under TRL's Qwen3 chat template, the rest as above: no ../shared needed (a smoke test, not a
measurement).
"""
from __future__ import annotations

import argparse
import gzip
import itertools
import json
import math
import os
import random
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from bench import tiny

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
VARIANTS = ["trl", "ours", "ours_exact_dedupe_only"]
EXCERPT_MEDIAN = 500  # characters


def real_prompts_and_answers() -> tuple[list[str], list[str]]:
    """The real user prompts and assistant answers of ../shared/datasets, in file order."""
    prompts, answers = [], []
    d = SHARED / "datasets"
    for name in ("train.jsonl", "test.jsonl"):
        for line in (d / "gsm8k" / name).read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            prompts.append(row["question"])
            answers.append(row["answer"])
    with gzip.open(d / "hh-rlhf-harmless" / "test.jsonl.gz", "rt", encoding="utf-8") as f:
        for line in f:
            for turn in json.loads(line)["chosen"].split("\n\nHuman: ")[1:]:
                human, _, assistant = turn.partition("\n\nAssistant: ")
                prompts.append(human.strip())
                if assistant.strip():
                    answers.append(assistant.strip())
    for line in (d / "mt-bench" / "question.jsonl").read_text(encoding="utf-8").splitlines():
        prompts += json.loads(line)["turns"]
    for conv in json.loads((d / "fastchat-dummy-conversation" / "dummy_conversation.json").read_text(encoding="utf-8")):
        prompts += [m["value"] for m in conv["conversations"] if m["from"] == "human"]
    return [p for p in prompts if p.strip()], answers


def source_files() -> list[Path]:
    """CPython's standard library and the installed packages' Python sources, sorted."""
    paths = sysconfig.get_paths()
    roots = sorted({Path(paths["stdlib"]), Path(paths["purelib"]), Path(paths["platlib"])})
    return sorted({p for root in roots for p in root.rglob("*.py") if p.is_file()})


def excerpts(rng: random.Random):
    """Consecutive excerpts of the source files, lognormal in length, cut at line ends; once the
    files run out, again with boundaries shifted by half an excerpt."""
    files = source_files()
    for shift in itertools.count():
        carry = ""
        for path in files:
            text = carry + path.read_text(encoding="utf-8", errors="replace")
            at = (EXCERPT_MEDIAN // 2) * (shift % 2) if not carry else 0
            while True:
                want = int(min(8000, max(20, rng.lognormvariate(math.log(EXCERPT_MEDIAN), 0.8))))
                end = text.find("\n", at + want)
                if end < 0:
                    carry = text[at:]
                    break
                yield text[at:end]
                at = end + 1


def make_real_rows(path: Path, n: int, seed: int = 0) -> None:
    """n chat rows, 1-3 turns: a real prompt, then an excerpt of real source (half of them
    after a real answer); a system prompt on a quarter of the rows."""
    rng = random.Random(seed)
    prompts, answers = real_prompts_and_answers()
    source = excerpts(random.Random(seed + 1))
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            messages = [{"role": "system", "content": "You are a careful assistant."}] if i % 4 == 0 else []
            for _ in range(rng.choice((1, 1, 2, 3))):
                answer = next(source)
                if rng.random() < 0.5:
                    answer = rng.choice(answers) + "\n\n" + answer
                messages += [{"role": "user", "content": rng.choice(prompts)}, {"role": "assistant", "content": answer}]
            f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")


def words_corpus() -> list[str]:
    """The synthetic case's words: GSM8K's distinct words."""
    text = " ".join(json.loads(line)["question"]
                    for line in (SHARED / "datasets" / "gsm8k" / "train.jsonl").read_text().splitlines())
    return sorted(set(text.split()))


def make_synthetic_rows(path: Path, n: int, seed: int = 0) -> None:
    """n distinct chat rows, 1-3 turns, answer lengths lognormal (median ~120 words)."""
    rng, words = random.Random(seed), words_corpus()
    with open(path, "w") as f:
        for i in range(n):
            messages = [{"role": "system", "content": "You are a careful assistant."}] if i % 4 == 0 else []
            for _ in range(rng.choice((1, 1, 2, 3))):
                q = " ".join(rng.choices(words, k=rng.randint(8, 40))) + "?"
                a = " ".join(rng.choices(words, k=max(1, min(1500, int(rng.lognormvariate(4.8, 0.8))))))
                messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            f.write(json.dumps({"messages": messages}) + "\n")


def tiny_qwen3(path: Path, tok) -> None:
    """A one-layer Qwen3 around `tok` (TRL's trainer needs a model; ours reads its tokenizer)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=max(len(tok), 151936 if len(tok) > 150000 else 0), hidden_size=32,
                         intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    Qwen3ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)


def make_real_base(path: Path) -> None:
    from transformers import AutoTokenizer

    tiny_qwen3(path, AutoTokenizer.from_pretrained(SHARED / "tokenizers" / "qwen3"))


def make_tiny_rows(path: Path, n: int) -> int:
    """The first n rows of data/tiny/chat.jsonl (all 3,000 at most); returns how many."""
    with open(tiny.CHAT, encoding="utf-8") as f, open(path, "w", encoding="utf-8") as out:
        lines = [line for _, line in zip(range(n), f)]
        out.writelines(lines)
    return len(lines)


def qwen3_template() -> str:
    """TRL's copy of Qwen3's chat template, with the generation markers its assistant_only_loss needs."""
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()


def make_tiny_base(path: Path) -> None:
    """The tiny model's character tokenizer under Qwen3's chat template."""
    from stages.model.tiny import char_tokenizer

    tok = char_tokenizer()
    tok.chat_template = qwen3_template()
    tiny_qwen3(path, tok)


def make_synthetic_base(path: Path, corpus: Path) -> None:
    """A BPE tokenizer trained on the rows' words, with Qwen3's chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    lines = (line for i, line in enumerate(open(corpus)) if i < 20000)
    bpe.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=8192, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = qwen3_template()
    tiny_qwen3(path, tok)


TRL_CHILD = r'''
import sys, time, json
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer
rows, base, max_length, procs, work = sys.argv[1:6]
tok = AutoTokenizer.from_pretrained(base)
model = AutoModelForCausalLM.from_pretrained(base)
args = SFTConfig(output_dir=work, max_length=int(max_length), packing=True, packing_strategy="bfd",
                 assistant_only_loss=True, dataset_num_proc=int(procs), report_to="none",
                 use_cpu=True, bf16=False)
start = time.perf_counter()
ds = load_dataset("json", data_files=rows, split="train", cache_dir=work)
out = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok).train_dataset
seconds = time.perf_counter() - start
tokens = sum(len(ids) for ids in out["input_ids"])
print(json.dumps({"seconds": seconds, "tokens": tokens, "sequences": len(out)}))
'''


def run_measured(cmd: list[str], cwd: Path) -> tuple[str, float, int]:
    """(stdout, wall seconds, peak RSS in MiB) of a child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{cmd[:3]} failed:\n{out[-3000:]}")
    return out, time.perf_counter() - start, usage.ru_maxrss // 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--corpus", choices=("real", "synthetic"), default="real")
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--procs", type=int, default=os.cpu_count())
    ap.add_argument("--out", help="default bench/results/data_prep.json")
    ap.add_argument("--only", choices=VARIANTS, nargs="+", default=VARIANTS, help="a subset of the variants")
    ap.add_argument("--trl-rows", type=int, help="TRL on the first N rows only: its datasets cache for 1M rows "
                    "needs more disk than this machine has free (rates are per row, so they stay comparable)")
    ap.add_argument("--tiny", action="store_true", help="data/tiny and the character tokenizer: a smoke test")
    a = ap.parse_args()
    a.out = a.out or (tiny.results_path("data_prep.json") if a.tiny else REPO / "bench" / "results" / "data_prep.json")

    work = Path(tempfile.mkdtemp(prefix="bench-data-"))
    rows = work / "rows.jsonl"
    if a.tiny:
        a.corpus, a.rows = "tiny", make_tiny_rows(rows, a.rows)
        make_tiny_base(work / "base")
    elif a.corpus == "real":
        make_real_rows(rows, a.rows)
        make_real_base(work / "base")
    else:
        make_synthetic_rows(rows, a.rows)
        make_synthetic_base(work / "base", rows)
    print(f"{a.corpus} corpus: {a.rows} rows ({rows.stat().st_size / 2**20:.0f} MiB) in {work}", flush=True)

    results = {}
    if "trl" in a.only:
        trl_rows = rows
        if a.trl_rows and a.trl_rows < a.rows:
            trl_rows = work / "trl_rows.jsonl"
            with open(rows) as f, open(trl_rows, "w") as out:
                out.writelines(line for _, line in zip(range(a.trl_rows), f))
        out, seconds, rss = run_measured([sys.executable, "-c", TRL_CHILD, str(trl_rows), str(work / "base"),
                                          str(a.max_length), str(a.procs), str(work / "trl")], work)
        results["trl"] = json.loads(out.strip().splitlines()[-1]) | {"wall_seconds": seconds, "peak_rss_mib": rss,
                                                                     "rows": min(a.trl_rows or a.rows, a.rows)}
        report(a, results)
    for name, dedupe in (("ours", {}), ("ours_exact_dedupe_only", {"near_threshold": None})):
        if name not in a.only:
            continue
        project = work / name
        subprocess.run(["git", "clone", "-q", str(REPO), str(project)], check=True)
        (project / "data" / "bench.jsonl").symlink_to(rows)  # data lives in the project: linked there
        (project / "bench-base").symlink_to(work / "base")
        (project / "recipes" / "bench.yaml").write_text(json.dumps({
            "model": {"path": "bench-base"},
            "data": {"sources": [{"path": "data/bench.jsonl"}], "max_length": a.max_length, "heldout_fraction": 0.0,
                     "dedupe": dedupe},
        }))
        out, seconds, rss = run_measured([sys.executable, "-m", "doit", "shards:bench"], project)
        key = json.loads((project / "artifacts" / "bench" / "shards.json").read_text())["key"]
        stats = json.loads((project / "artifacts" / "store" / "shards" / key / "stats.json").read_text())
        results[name] = {"seconds": seconds, "tokens": stats["tokens"], "sequences": stats["sequences"],
                         "wall_seconds": seconds, "peak_rss_mib": rss, "dropped": stats["dropped"],
                         "packing_efficiency": stats["packing_efficiency"]}
        report(a, results)


def report(a, results: dict) -> None:
    """Print the table and write the JSON; called after each variant, so a run cut short
    still leaves the variants that finished."""
    trl = results.get("trl")
    table = {"corpus": a.corpus, "rows": a.rows, "max_length": a.max_length, "procs": a.procs, "cpus": os.cpu_count(), **results}
    for r in results.values():
        r["rows_per_s"] = round(r.get("rows", a.rows) / r["seconds"], 1)
        r["tokens_per_s"] = round(r["tokens"] / r["seconds"], 1)
    print(f"{'':24} {'rows':>8} {'rows/s':>8} {'tokens/s':>10} {'seconds':>8} {'peak RSS MiB':>13} {'sequences':>10} {'vs trl':>7}")
    for name, r in results.items():
        vs = "-"
        if trl:
            r["vs_trl_rows_per_s"] = round(r["rows_per_s"] / trl["rows_per_s"], 2)
            vs = f"{r['vs_trl_rows_per_s']}x"
        print(f"{name:24} {r.get('rows', a.rows):>8} {r['rows_per_s']:>8.0f} {r['tokens_per_s']:>10.0f} {r['seconds']:>8.1f} "
              f"{r['peak_rss_mib']:>13} {r['sequences']:>10} {vs:>7}", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
