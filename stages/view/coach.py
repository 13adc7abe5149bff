"""The Coach's pages: the builds of this project in a browser, read-only. Everything is read from
the recipes and the store as `doit show`, `status` and `verify` read them, rendered on the server
by Jinja2 with autoescaping (usable without JavaScript, which no page has), styled inline and
fetching nothing from anywhere (a Content-Security-Policy of 'self' says so to the browser).

    /                              the catalogue: every recipe, what it is, model, method, hardware
    /recipes/<name>                status and why, the stage graph (keys, digests), its builds
    /recipes/<name>/report         the current report.html, as `doit report` wrote it
    /recipes/<name>/diff?a=&b=     two builds of it: inputs changed, stages rebuilt, eval deltas
    /recipes/<name>/dropped?q=&reason=   its dropped rows, searched
"""
from __future__ import annotations

import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path

from stages.engine import catalogue, project, status
from stages.engine.errors import UserError
from stages.engine.store import read_json

KEY = re.compile(r"[0-9a-f]{32}")
DROPPED_SHOWN = 200  # matching dropped rows listed on a page; the count says how many match
NEEDS = re.compile(r"GPU memory: (\d+) GiB")  # what a GPU recipe states it needs (tests/test_catalogue.py)


def model_summary(model) -> str:
    """What a recipe's model is, in a few words: a hub id at its revision, a local path, or the
    shape a config builds."""
    if model.hub:
        return f"{model.hub} @ {model.revision[:12]}"
    if model.path:
        return model.path
    c = model.config
    shape = f"{c.num_hidden_layers} layers x {c.hidden_size}"
    return f"{c.architecture} from config ({shape}{', ' + str(c.num_experts) + ' experts' if 'Moe' in c.architecture else ''})"


def catalogue_rows() -> list[dict]:
    """Every recipe of recipes/: its name, whole description, model, method, hardware and the GPU
    memory it states it needs; a recipe that does not load shows its one-line error instead."""
    rows = []
    for name in project.recipe_names():
        row = {"name": name, "description": catalogue.description(name)}
        needs = NEEDS.search(row["description"])
        try:
            r = project.recipe(name)
        except UserError as e:
            rows.append({**row, "error": str(e)})
            continue
        gpus = r.hardware.gpus
        rows.append({**row, "model": model_summary(r.model),
                     "method": r.train.method + ("" if r.train.peft == "none" else f" + {r.train.peft}"),
                     "hardware": r.hardware.profile + (f" x {gpus}" if gpus > 1 else ""),
                     "memory_gib": int(needs.group(1)) if needs else None})
    return rows


def built_at(path: Path) -> str:
    return datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def builds(name: str) -> list[dict]:
    """Every manifest of the recipe in the store, oldest first: its key, digest, when it was built,
    whether the recipe resolves to it now, and the trained model's scores."""
    st, found = project.store(), []
    current = (st.pointer(name, "manifest") or {}).get("key")
    for sidecar in (st.objects / "manifest").glob("*.json"):
        key, meta = sidecar.stem, read_json(sidecar)
        manifest = read_json(st.path("manifest", key) / "manifest.json") if KEY.fullmatch(key) else None
        if not meta or not isinstance(manifest, dict) or manifest.get("recipe_name") != name:
            continue
        found.append({"key": key, "digest": meta["digest"], "built": built_at(sidecar), "current": key == current,
                      "trained": (manifest.get("eval") or {}).get("trained") or {}})
    return sorted(found, key=lambda b: (b["built"], b["key"]))


def stage_graph(name: str, table: dict) -> list[dict]:
    """The stage table as this recipe resolves it now: each stage, what it reads, its key and digest."""
    st, rows = project.store(), []
    for stage, row in table.items():
        ptr = st.pointer(name, stage)
        rows.append({"name": stage, "upstream": list(row.upstream) + [f"{u} (optional)" for u in row.optional],
                     "key": ptr and ptr["key"], "digest": ptr and ptr["digest"], "doc": row.doc})
    return rows


def manifest_of(name: str, key: str) -> dict | None:
    """The manifest stored under `key`, if it is one of this recipe's."""
    if not KEY.fullmatch(key or ""):
        return None
    manifest = read_json(project.store().path("manifest", key) / "manifest.json")
    return manifest if isinstance(manifest, dict) and manifest.get("recipe_name") == name else None


def code_of(manifest: dict) -> dict[str, str]:
    """Every code file the build's stages ran, with its digest (from the inputs the receipt records)."""
    code = dict(manifest.get("code") or {})
    for art in (manifest.get("artifacts") or {}).values():
        code.update((art.get("inputs") or {}).get("code") or {})
    return code


def scores(manifest: dict) -> dict[str, dict]:
    """model -> metric -> value, the quantized exports under 'quantized <scheme>'."""
    ev = manifest.get("eval") or {}
    found = {m: ev[m] for m in ("base", "trained") if isinstance(ev.get(m), dict)}
    found.update({f"quantized {s}": q for s, q in (ev.get("quantized") or {}).items()})
    return found


def diff(a: dict, b: dict) -> dict:
    """What changed from build a to build b: the inputs (recipe fields, versions, code), which stages
    were rebuilt (and which of those gave the same bytes: early cutoff), and every score's delta."""
    inputs = [f"recipe {d}" for d in status.differences(a.get("recipe"), b.get("recipe"))]
    inputs += [f"version of {d}" for d in status.differences(a.get("versions"), b.get("versions"))]
    code_a, code_b = code_of(a), code_of(b)
    inputs += [f"{path} changed" for path in sorted(set(code_a) | set(code_b)) if code_a.get(path) != code_b.get(path)]
    stages = []
    for stage in a.get("artifacts", {}):
        art_a, art_b = a["artifacts"][stage], (b.get("artifacts") or {}).get(stage, {})
        if art_a.get("key") == art_b.get("key"):
            what = "reused"
        else:
            what = "rebuilt, same bytes" if art_a.get("digest") == art_b.get("digest") else "rebuilt"
        stages.append({"name": stage, "what": what, "a": art_a.get("digest", ""), "b": art_b.get("digest", "")})
    score_a, score_b, deltas = scores(a), scores(b), []
    for model in sorted(set(score_a) | set(score_b)):
        for metric in sorted(set(score_a.get(model, {})) | set(score_b.get(model, {}))):
            va, vb = score_a.get(model, {}).get(metric), score_b.get(model, {}).get(metric)
            delta = vb - va if isinstance(va, (int, float)) and isinstance(vb, (int, float)) else None
            deltas.append({"model": model, "metric": metric, "a": va, "b": vb, "delta": delta})
    return {"inputs": inputs, "stages": stages, "scores": deltas}


def dropped(name: str, query: str, reason: str) -> dict:
    """The current build's dropped rows (shards/dropped.jsonl) whose reason is `reason` (any if
    empty) and whose line holds `query` (any if empty): how many match, the first DROPPED_SHOWN of
    them, and every reason with its count."""
    st = project.store()
    ptr = st.pointer(name, "shards")
    path = ptr and st.path("shards", ptr["key"]) / "dropped.jsonl"
    if not path or not path.is_file():
        return {"built": False, "rows": [], "matches": 0, "reasons": {}}
    rows, matches, reasons, needle = [], 0, {}, query.casefold()
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            reasons[row.get("reason")] = reasons.get(row.get("reason"), 0) + 1
            if (reason and row.get("reason") != reason) or (needle and needle not in line.casefold()):
                continue
            matches += 1
            if len(rows) < DROPPED_SHOWN:
                rows.append(row)
    return {"built": True, "rows": rows, "matches": matches, "reasons": dict(sorted(reasons.items()))}


def serving(name: str) -> dict | None:
    """Where `doit serve:<name>` is serving the recipe's model now (artifacts/<name>/serving.json,
    which serve writes while it runs), if its process is alive."""
    found = read_json(project.store().root / name / "serving.json")
    if not isinstance(found, dict) or not isinstance(found.get("pid"), int):
        return None
    try:
        os.kill(found["pid"], 0)
    except OSError:
        return None  # a serve that was killed left it behind
    return found


def current_report(name: str) -> Path | None:
    ptr = project.store().pointer(name, "report")
    path = ptr and project.store().path("report", ptr["key"]) / "report.html"
    return path if path and path.is_file() else None


STYLE = """body { font: 14px/1.45 system-ui, sans-serif; margin: 1.5em auto; max-width: 80em; color: #222; padding: 0 1em; }
nav a { margin-right: 1em; } table { border-collapse: collapse; margin: .5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: .25em .6em; text-align: left; vertical-align: top; }
td.n { text-align: right; font-variant-numeric: tabular-nums; } code { font-size: 90%; }
.error { color: #a00; } .current { font-weight: bold; } p.status { white-space: pre-wrap; font-family: monospace; }"""

TEMPLATES = {
    "base.html": """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{% block title %}{% endblock %} - mindxtrain coach</title>
<style>{{ style }}</style></head><body>
<nav><a href="/">catalogue</a>{% block nav %}{% endblock %}</nav>
{% block body %}{% endblock %}
</body></html>
""",
    "catalogue.html": """{% extends "base.html" %}{% block title %}recipes{% endblock %}{% block body %}
<h1>Recipes</h1>
<table id="catalogue"><tr><th>recipe</th><th>what it is</th><th>model</th><th>method</th><th>hardware</th><th>GPU memory</th></tr>
{% for r in rows %}<tr id="recipe-{{ r.name }}"><td><a href="/recipes/{{ r.name }}">{{ r.name }}</a></td>
<td class="description">{{ r.description }}</td>
{% if r.error %}<td colspan="4" class="error">{{ r.error }}</td>{% else %}
<td>{{ r.model }}</td><td class="method">{{ r.method }}</td><td class="hardware">{{ r.hardware }}</td>
<td class="n">{{ (r.memory_gib ~ " GiB") if r.memory_gib else "-" }}</td>{% endif %}</tr>
{% endfor %}</table>
{% endblock %}""",
    "recipe.html": """{% extends "base.html" %}{% block title %}{{ name }}{% endblock %}
{% block nav %}<a href="/recipes/{{ name }}/report">report</a><a href="/recipes/{{ name }}/dropped">dropped rows</a>{% endblock %}
{% block body %}
<h1>{{ name }}</h1>
<p>{{ description }}</p>
{% if served %}<p id="served">served now as <code>{{ served.model_id }}</code> at <a href="{{ served.url }}/models">{{ served.url }}</a></p>{% endif %}
<h2>Status</h2>
<p class="status" id="status">{{ status }}</p>
<h2>Stages</h2>
<table id="stages"><tr><th>stage</th><th>reads</th><th>key</th><th>digest</th><th>what it builds</th></tr>
{% for s in stages %}<tr id="stage-{{ s.name }}"><td>{{ s.name }}</td><td>{{ s.upstream|join(", ") or "-" }}</td>
<td><code class="key">{{ s.key or "not built" }}</code></td><td><code class="digest">{{ s.digest or "" }}</code></td><td>{{ s.doc }}</td></tr>
{% endfor %}</table>
<h2>Builds</h2>
{% if builds %}<form action="/recipes/{{ name }}/diff" method="get">
<table id="builds"><tr><th>from</th><th>to</th><th>built</th><th>manifest key</th><th>digest</th>{% for m in metrics %}<th>{{ m }}</th>{% endfor %}</tr>
{% for b in builds %}<tr{% if b.current %} class="current"{% endif %}>
<td><input type="radio" name="a" value="{{ b.key }}"{% if loop.index == builds|length - 1 %} checked{% endif %}></td>
<td><input type="radio" name="b" value="{{ b.key }}"{% if loop.last %} checked{% endif %}></td>
<td>{{ b.built }}{% if b.current %} (current){% endif %}</td><td><code>{{ b.key }}</code></td><td><code>{{ b.digest[:16] }}</code></td>
{% for m in metrics %}<td class="n">{{ fmt(b.trained.get(m)) }}</td>{% endfor %}</tr>
{% endfor %}</table>
<button type="submit">compare</button></form>
{% else %}<p>Never built: <code>doit manifest:{{ name }}</code></p>{% endif %}
{% endblock %}""",
    "diff.html": """{% extends "base.html" %}{% block title %}{{ name }}: two builds{% endblock %}
{% block nav %}<a href="/recipes/{{ name }}">{{ name }}</a>{% endblock %}
{% block body %}
<h1>{{ name }}: <code>{{ a[:12] }}</code> to <code>{{ b[:12] }}</code></h1>
<h2>Inputs changed</h2>
<ul id="inputs">{% for line in d.inputs %}<li>{{ line }}</li>{% else %}<li>none</li>{% endfor %}</ul>
<h2>Stages</h2>
<table id="rebuilt"><tr><th>stage</th><th></th><th>digest before</th><th>digest after</th></tr>
{% for s in d.stages %}<tr id="rebuilt-{{ s.name }}"><td>{{ s.name }}</td><td class="what">{{ s.what }}</td><td><code>{{ s.a[:16] }}</code></td><td><code>{{ s.b[:16] }}</code></td></tr>
{% endfor %}</table>
<h2>Scores</h2>
<table id="scores"><tr><th>model</th><th>metric</th><th>before</th><th>after</th><th>change</th></tr>
{% for s in d.scores %}<tr><td>{{ s.model }}</td><td>{{ s.metric }}</td><td class="n">{{ fmt(s.a) }}</td><td class="n">{{ fmt(s.b) }}</td><td class="n delta">{{ fmt(s.delta) }}</td></tr>
{% endfor %}</table>
{% endblock %}""",
    "dropped.html": """{% extends "base.html" %}{% block title %}{{ name }}: dropped rows{% endblock %}
{% block nav %}<a href="/recipes/{{ name }}">{{ name }}</a>{% endblock %}
{% block body %}
<h1>{{ name }}: dropped rows</h1>
{% if not found.built %}<p>No data built yet: <code>doit shards:{{ name }}</code></p>{% else %}
<form action="/recipes/{{ name }}/dropped" method="get">
<input type="search" name="q" value="{{ q }}" placeholder="text in the row">
<select name="reason"><option value="">any reason</option>
{% for r, n in found.reasons.items() %}<option value="{{ r }}"{% if r == reason %} selected{% endif %}>{{ r }} ({{ n }})</option>{% endfor %}
</select> <button type="submit">search</button></form>
<p id="matches">{{ found.matches }} matching rows{% if found.matches > found.rows|length %}, the first {{ found.rows|length }} shown{% endif %}.</p>
<table id="dropped"><tr><th>source</th><th>row</th><th>reason</th><th>detail</th></tr>
{% for d in found.rows %}<tr><td>{{ d.source }}</td><td class="n">{{ d.line or d.row }}</td><td>{{ d.reason }}</td>
<td>{{ d.duplicate_of or d.detail or d.text or "" }}</td></tr>{% endfor %}</table>{% endif %}
{% endblock %}""",
}


def fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def build_app(table: dict):
    """The Coach's FastAPI app over this project's recipes and store (the cwd's)."""
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.responses import FileResponse, HTMLResponse
    from jinja2 import DictLoader, Environment

    env = Environment(loader=DictLoader(TEMPLATES), autoescape=True)
    app = FastAPI(title="mindxtrain coach", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def self_only(request: Request, call_next):
        response = await call_next(request)
        response.headers["Content-Security-Policy"] = "default-src 'self'; style-src 'unsafe-inline'"
        return response

    def page(template: str, **values) -> HTMLResponse:
        return HTMLResponse(env.get_template(template).render(style=STYLE, fmt=fmt, **values))

    def recipe_name(name: str) -> str:
        if name not in project.recipe_names():
            raise HTTPException(404, f"no recipe {name!r}")
        return name

    @app.get("/", response_class=HTMLResponse)
    def index():
        return page("catalogue.html", rows=catalogue_rows())

    @app.get("/recipes/{name}", response_class=HTMLResponse)
    def recipe(name: str):
        name, found = recipe_name(name), builds(name)
        metrics = sorted({m for b in found for m in b["trained"]})
        return page("recipe.html", name=name, description=catalogue.description(name), served=serving(name),
                    status="\n".join(status.lines(name, table)), stages=stage_graph(name, table), builds=found,
                    metrics=metrics)

    @app.get("/recipes/{name}/report")
    def report(name: str):
        path = current_report(recipe_name(name))
        if path is None:
            raise HTTPException(404, f"no report of {name} yet: run doit report:{name}")
        return FileResponse(path, media_type="text/html")

    @app.get("/recipes/{name}/diff", response_class=HTMLResponse)
    def compare(name: str, a: str, b: str):
        name = recipe_name(name)
        old, new = manifest_of(name, a), manifest_of(name, b)
        if old is None or new is None:
            raise HTTPException(404, f"{a if old is None else b} is not a build of {name}")
        return page("diff.html", name=name, a=a, b=b, d=diff(old, new))

    @app.get("/recipes/{name}/dropped", response_class=HTMLResponse)
    def dropped_rows(name: str, q: str = "", reason: str = ""):
        name = recipe_name(name)
        return page("dropped.html", name=name, q=q, reason=reason, found=dropped(name, q[:200], reason[:100]))

    return app
