"""report.html's rendering: one self-contained page (inline SVG plot, inline CSS, no scripts,
nothing fetched) from what the report stage read. Jinja2 with autoescaping writes the HTML;
matplotlib draws the loss curve as SVG with a fixed hash salt and no date, so the same inputs
give the same bytes."""
from __future__ import annotations

import io

TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{{ recipe }}: mindxtrain report</title>
<style>
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 72em; color: #222; }
table { border-collapse: collapse; margin: .5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: .25em .6em; text-align: left; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
code { font-size: 90%; }
</style></head><body>
<h1>{{ recipe }}</h1>
<p>manifest digest <code id="manifest-digest">{{ manifest_digest }}</code> &middot;
verify with <code>doit verify:{{ recipe }}</code></p>
{% if anchor %}<p id="anchor">anchored on chain {{ anchor.chain_id }} in registry <code>{{ anchor.registry }}</code>
by transaction <code>{{ anchor.tx_hash }}</code>, block {{ anchor.block_number }} ({{ anchor.time }})</p>
{% else %}<p id="anchor">not anchored</p>{% endif %}

<h2>Evaluation</h2>
<p id="scored">{% if heldout_rows < kept.heldout %}Scored on {{ heldout_rows }} of the {{ kept.heldout }} held-out rows{% if left_out %}: {{ left_out|join("; ") }}{% endif %}.{% else %}Scored on all {{ heldout_rows }} held-out rows.{% endif %}</p>
<table id="eval"><tr><th>model</th>{% for m in metrics %}<th>{{ m }}</th>{% endfor %}</tr>
{% for name, scores in models %}<tr><td>{{ name }}</td>{% for m in metrics %}<td class="n">{{ fmt(scores.get(m)) }}</td>{% endfor %}</tr>
{% endfor %}</table>

<h2>Training</h2>
{{ loss_svg | safe }}
<p>{{ steps }} steps; loss {{ fmt(first_loss) }} at the first, {{ fmt(last_loss) }} at the last.</p>

<h2>Data</h2>
<table id="data"><tr><th>source</th><th>rows read</th></tr>
{% for source, n in rows_in %}<tr><td>{{ source }}</td><td class="n">{{ n }}</td></tr>{% endfor %}
<tr><th>kept for training</th><td class="n">{{ kept.train }}</td></tr>
<tr><th>kept held out</th><td class="n">{{ kept.heldout }}</td></tr>
<tr><th>held out, scored by eval</th><td class="n">{{ heldout_rows }}</td></tr>
</table>
<table id="drops"><tr><th>dropped because</th><th>rows</th></tr>
{% for reason, n in drops %}<tr><td>{{ reason }}</td><td class="n">{{ n }}</td></tr>
{% else %}<tr><td colspan="2">no row dropped</td></tr>{% endfor %}
</table>
<p>{% if sequences %}{{ sequences }} packed sequences of {{ sequence_length }} tokens, {{ tokens }} tokens, packing efficiency {{ fmt(packing) }}{% else %}{{ kept.train }} training rows kept whole (not packed), {{ tokens }} tokens{% endif %}.</p>

<h2>Plan</h2>
<table id="decisions">{% for k, v in decisions %}<tr><th>{{ k }}</th><td>{{ v }}</td></tr>{% endfor %}</table>
{% if gpu_only %}<p id="gpu-only">Planned for the CPU: what only a GPU plan decides ({{ gpu_only|join(", ") }}) does not apply and is left out.</p>{% endif %}
{% if measurements %}<p>The probe's measurements ({{ measurements|length }}):</p>
<table id="probe"><tr>{% for c in probe_columns %}<th>{{ c }}</th>{% endfor %}</tr>
{% for m in measurements %}<tr>{% for c in probe_columns %}<td>{{ m.get(c, "") }}</td>{% endfor %}</tr>
{% endfor %}</table>{% endif %}

<h2>Stages</h2>
<table id="stages"><tr><th>stage</th><th>key</th><th>digest</th><th>wall time (s)</th></tr>
{% for s in stages %}<tr><td>{{ s.name }}</td><td><code>{{ s.key }}</code></td><td><code>{{ s.digest[:16] }}</code></td><td class="n">{{ fmt(s.seconds) }}</td></tr>
{% endfor %}</table>
{% if dropped_rows %}
<h2>Dropped rows</h2>
{% set dropped_total = drops|sum(attribute=1) %}<details id="dropped"><summary>{% if dropped_rows|length < dropped_total %}The first {{ dropped_rows|length }} of the {{ dropped_total }} dropped rows (all of them: <code>shards/dropped.jsonl</code>){% else %}The {{ dropped_total }} dropped rows (also in <code>shards/dropped.jsonl</code>){% endif %}</summary>
<table id="dropped-rows"><tr><th>source</th><th>row</th><th>reason</th><th>duplicate of</th></tr>
{% for d in dropped_rows %}<tr><td>{{ d.source }}</td><td class="n">{{ d.line or d.row }}</td><td>{{ d.reason }}</td><td>{{ d.duplicate_of }}</td></tr>
{% endfor %}</table>
</details>{% endif %}
</body></html>
"""


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.3e}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def loss_svg(steps: list[dict]) -> str:
    """The loss (and learning rate, right axis) per step, as an inline <svg> element."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    with matplotlib.rc_context({"svg.hashsalt": "mindxtrain", "svg.fonttype": "none"}):
        fig, ax = plt.subplots(figsize=(8, 3.2))
        ax.plot([s["step"] for s in steps], [s["loss"] for s in steps], color="tab:blue", label="loss")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        lr = ax.twinx()
        lr.plot([s["step"] for s in steps], [s.get("learning_rate", 0.0) for s in steps], color="tab:gray",
                linewidth=0.8, label="learning rate")
        lr.set_ylabel("learning rate")
        fig.tight_layout()
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
        plt.close(fig)
    svg = buf.getvalue()
    return svg[svg.index("<svg"):]


def render(**page) -> str:
    from jinja2 import Environment

    return Environment(autoescape=True, keep_trailing_newline=True).from_string(TEMPLATE).render(fmt=fmt, **page)
