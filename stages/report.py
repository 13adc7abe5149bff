"""report: one self-contained report.html of a build, for people: the scores of base, trained
and quantized models, the loss curve, what happened to the data (every drop by reason, the first
dropped rows), the plan's decisions and the probe's measurements, and every stage's key, digest
and wall time, and where the manifest is anchored on a chain, if it is. Built from the manifest
and the files it names, plus the stages' run-time measurements, which are therefore part of its
key (stages/engine/stage.py: Stage.runs), and the anchor's anchor.json where `doit anchor` has
anchored this manifest (an optional upstream: reporting never needs the chain).
The page reads top to bottom as a team lead compares two builds: scores (and how many held-out
rows were scored: eval.limit caps them), the loss, the data, the plan, the stages in build order;
the dropped rows themselves last, folded.
`doit report:<recipe>`; the page is at artifacts/<recipe>/latest/report/report.html."""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from stages.engine import jsontext
from stages.view.html import loss_svg, render

FIRST_DROPPED = 50  # dropped rows listed on the page; dropped.jsonl has them all
# what only a GPU plan decides (the probe's attention kernel, compile, fused loss, checkpointing, the
# environment block): on a CPU these are the defaults, applied to nothing, and the page leaves them out
GPU_ONLY = ("sdpa_backend", "rocm_fa_library", "compile", "fused_cross_entropy", "gradient_checkpointing", "env")


def left_out(evaluation: dict, heldout: int) -> list[str]:
    """Why eval scored fewer held-out rows than the shards hold, a clause each."""
    limit = (evaluation.get("settings") or {}).get("limit")
    clauses = [f"eval.limit ({limit}) caps how many are scored"] if limit and limit < heldout else []
    if evaluation.get("heldout_longer_than_context"):
        clauses.append(f"{evaluation['heldout_longer_than_context']} longer than the model's context left out")
    if evaluation.get("heldout_special_token_text"):
        clauses.append(f"{evaluation['heldout_special_token_text']} quoting a special token's text left out "
                       "(lm-eval would read it as the token)")
    return clauses


def build(ctx, out: Path) -> None:
    up, runs = ctx.upstream, ctx.inputs["runs"]
    manifest = jsontext.read(up["manifest"] / "manifest.json")
    evaluation = jsontext.read(up["eval"] / "eval.json")
    stats = jsontext.read(up["shards"] / "stats.json")
    steps = [jsontext.loads(line) for line in (up["checkpoint"] / "metrics.jsonl").read_text().splitlines()]
    dropped = []
    with open(up["shards"] / "dropped.jsonl") as f:
        for line, _ in zip(f, range(FIRST_DROPPED)):
            row = jsontext.loads(line)
            first = row.get("duplicate_of") or {}
            row["duplicate_of"] = f"{first.get('source')}:{first.get('line') or first.get('row')}" if first else ""
            dropped.append(row)
    models = [(m, evaluation[m]) for m in ("base", "trained") if m in evaluation]
    models += [(f"quantized {s}", q) for s, q in evaluation.get("quantized", {}).items()]
    metrics = sorted({k for _, scores in models for k in scores})
    measurements = (runs["plan"].get("probe") or {}).get("measurements", [])
    anchor = None
    if "anchor" in up:  # absent unless anchored for this manifest
        anchor = jsontext.read(up["anchor"] / "anchor.json")
        anchor["time"] = datetime.fromtimestamp(anchor["timestamp"], timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    plan = manifest["plan"]
    on_cpu = plan.get("device") == "cpu"
    decisions = sorted((k, json.dumps(v) if isinstance(v, (dict, list)) else v) for k, v in plan.items()
                       if not (on_cpu and k in GPU_ONLY))
    order = list(runs)  # the report's row lists the stages whose runs it reads in build order
    stages = sorted(manifest["artifacts"].items(), key=lambda s: order.index(s[0]) if s[0] in order else len(order))
    html = render(
        recipe=ctx.recipe_name, manifest_digest=ctx.artifacts["manifest"]["digest"], anchor=anchor,
        heldout_rows=evaluation.get("heldout_rows"), left_out=left_out(evaluation, stats["kept"]["heldout"]),
        models=models, metrics=metrics,
        loss_svg=loss_svg(steps) if steps else "<p>no steps logged</p>", steps=len(steps),
        first_loss=steps[0]["loss"] if steps else None, last_loss=steps[-1]["loss"] if steps else None,
        rows_in=sorted(stats["rows_in"].items()), kept=stats["kept"], drops=sorted(stats["dropped"].items()),
        dropped_rows=dropped, tokens=stats["tokens"],  # packing: only where the data kind packs its rows
        sequences=stats.get("sequences"), sequence_length=stats.get("sequence_length"),
        packing=stats.get("packing_efficiency"),
        decisions=decisions, gpu_only=[k for k in GPU_ONLY if k in plan] if on_cpu else [],
        measurements=measurements, probe_columns=sorted({c for m in measurements for c in m}),
        stages=[{"name": s, "key": a["key"], "digest": a["digest"], "seconds": runs.get(s, {}).get("seconds")}
                for s, a in stages]
        + [{"name": "manifest", "key": ctx.artifacts["manifest"]["key"],
            "digest": ctx.artifacts["manifest"]["digest"], "seconds": runs["manifest"].get("seconds")}],
    )
    (out / "report.html").write_text(html)
    ctx.log.debug("report.html: %d bytes", len(html))
