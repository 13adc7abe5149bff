"""shards: the training data, read, cleaned, tokenized, masked and packed + stats.json.

What the shards hold is the recipe's method's data kind (its row of stages/train/methods.py
names a module of stages/data/kinds/: chat, text, preference, prompt): how a raw row becomes its
record, what cleaning reads of it, how it is tokenized and laid out in the shards.

First pass (stages/data/sources.py), per source, by one worker process per core: rows read,
converted, described for cleaning and tokenized as the kind says, with the model's own chat
template. A source's prepared rows are kept in the store under their own key, so an edit to one
file of several prepares only that file again.

Second pass, over every row of every source in order, on arrays (stages/data/prepared.py):
exact and near dedupe and the repetition filter (stages/data/cleaning.py), a stable held-out
split and the length rules (stages/data/selection.py); then documents are packed and written
as shards (stages/data/shard_writer.py). Every row read is kept or counted under a reason.
"""
from __future__ import annotations

import importlib
import json
from collections import Counter
from pathlib import Path

import numpy as np

from stages.data import cleaning, files
from stages.data.prepared import Prepared
from stages.data.selection import LENGTH_REASONS, counted, length_rules, write_drop_list
from stages.data.shard_writer import write_shards
from stages.data.sources import label_of, prepare_source
from stages.engine import jsontext
from stages.engine.errors import RecipeError, UserError
from stages.train.methods import METHODS


def code_modules(recipe) -> list[str]:
    """The method's data kind's module: part of this stage's code, as the modules it imports are."""
    return [METHODS[recipe.train.method].kind_module]


def extra_inputs(recipe, root: Path, store) -> dict:
    """Each local source file's content digest is an input of the key (via the stat cache)."""
    digests = {}
    for i, src in enumerate(recipe.data.sources):
        if src.path is None:
            continue  # a hub source is named by id and pinned revision, both in the recipe
        p = root / src.path
        if not p.is_file():
            raise RecipeError(f"data.sources.{i}.path", f"{src.path} not found{' (a directory)' if p.is_dir() else ''}; "
                              f"correct the path (relative to the project) or put the file there")
        digests[src.path] = store.stat.digest(p)
    return digests


def unit_of(src) -> str:
    """How a source's rows are counted: lines of a JSON Lines file, rows of anything else."""
    jsonl = src.path is not None and (src.file_format == "jsonl" or (src.file_format == "auto" and files.file_format(src.path) == "jsonl"))
    return "line" if jsonl else "row"


def part_inputs(ctx, src, kind: str) -> dict:
    """What one source's prepared rows depend on: its content and the per-row settings only,
    so editing one file (or a global setting such as max_length) leaves other files' work reusable."""
    d = ctx.recipe.data
    return {"code": ctx.inputs["code"], "tokenizer": ctx.inputs["upstream"]["base"],
            "source": src.model_dump(mode="json"), "content": ctx.inputs["extra"].get(src.path),
            "kind": kind, "on_error": d.on_error, "seed": d.seed, "max_row_bytes": d.max_row_bytes,
            "near": [d.dedupe.ngram, d.dedupe.num_perm] if d.dedupe.near_threshold else None}


def build(ctx, out: Path) -> None:
    from transformers import AutoTokenizer

    data, method = ctx.recipe.data, METHODS[ctx.recipe.train.method]
    kind = importlib.import_module(method.kind_module)
    tok = AutoTokenizer.from_pretrained(ctx.upstream["base"])
    dropped, rows_in, parts, first_pass = Counter(), {}, [], []
    for src in data.sources:
        part, reused = ctx.cached("source", part_inputs(ctx, src, method.kind),
                                  lambda tmp, src=src: prepare_source(ctx, src, kind, tmp))
        ctx.log.debug("%s: %s", label_of(src), "prepared rows reused from the store" if reused
                     else "read, cleaned and tokenized")
        part_stats = jsontext.read(part / "stats.json")
        if not part_stats["rows_in"]:
            raise UserError(f"{label_of(src)}: no rows (the source is empty); fill it or remove it from data.sources")
        rows_in[label_of(src)] = part_stats["rows_in"]
        dropped.update(part_stats["dropped"])
        first_pass.append(part_stats["drops"])
        parts.append(part)
    prepared = Prepared(parts, data.sources, kind)
    codes, of = cleaning.drop_reasons(prepared.fingerprint, prepared.repetition, data.dedupe, data.filters,
                                      prepared.signature_chunks, prepared.lines)
    dropped.update(counted(codes, cleaning.REASONS))
    listing = prepared.drops(np.arange(len(codes)), codes, cleaning.REASONS, of)
    kept = np.flatnonzero(codes == 0)
    cutoff = data.heldout_fraction * 2**32
    held, train = kept[prepared.split[kept] < cutoff], kept[prepared.split[kept] >= cutoff]
    (out / "heldout").mkdir()
    with open(out / "heldout" / "heldout.jsonl", "w", encoding="utf-8") as f:
        for record in prepared.records(held):
            f.write(json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n")

    L = data.max_length
    codes, cut, loss = length_rules(prepared.longest[train], prepared.loss_tokens[train],
                                    lambda at: prepared.loss_up_to(train[at], L), data, kind.LEARNS)
    dropped.update(counted(codes, LENGTH_REASONS))
    docs = train[codes == 0]
    listing += prepared.drops(train, codes, LENGTH_REASONS)
    write_drop_list(out / "dropped.jsonl", [label_of(src) for src in data.sources],
                    [unit_of(src) for src in data.sources], first_pass, listing)
    if not len(docs):
        read = ", ".join(f"{label}: {n} rows" for label, n in rows_in.items())
        raise UserError(f"data: no training rows left after cleaning ({read}; {len(held)} held out, dropped "
                        f"{dict(dropped)}); check the sources and filters")
    sequences, shards = write_shards(out / "train", prepared, docs, L, tok.pad_token_id, ctx.progress)
    stats = {
        "kind": method.kind,
        "rows_in": dict(sorted(rows_in.items())),
        "rows_in_total": sum(rows_in.values()),
        "kept": {"train": len(docs), "heldout": len(held)},
        "dropped": dict(sorted(dropped.items())),
        "truncated_kept": len(cut),
        "tokens": int(np.minimum(prepared.lengths[docs], L).sum()),
        "loss_tokens": int(loss[codes == 0].sum()),
        "shards": shards,
    }
    if kind.PACKED:
        stats.update(sequences=sequences, sequence_length=L,
                     packing_efficiency=round(stats["tokens"] / (sequences * L), 6))
    assert stats["rows_in_total"] == len(docs) + len(held) + sum(dropped.values()), stats
    (out / "stats.json").write_text(json.dumps(stats, indent=1, sort_keys=True) + "\n")
    ctx.log.debug("%d rows in: %d train, %d held out, dropped %s", stats["rows_in_total"], len(docs),
                 len(held), stats["dropped"])
    if "packing_efficiency" in stats:
        ctx.log.debug("packed %d documents (%d tokens) into %d sequences of %d: efficiency %.3f",
                     len(docs), stats["tokens"], sequences, L, stats["packing_efficiency"])


def summary(path: Path) -> list[str]:
    """stats.json's counts, for `doit show`."""
    stats = jsontext.read(path / "stats.json")
    dropped = ", ".join(f"{reason} {n}" for reason, n in stats["dropped"].items()) or "none"
    return [f"stats.json: {stats['rows_in_total']} rows in, {stats['kept']['train']} train, "
            f"{stats['kept']['heldout']} held out; dropped: {dropped}"]
