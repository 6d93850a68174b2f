"""report.html: one self-contained page (plots embedded) a user can forward.

Headline numbers first, then one table per stage, the plots, and the manifest.
A few lines of script mark the page once every image has decoded
(`<body data-images-loaded="N">`), so a headless browser can check what it rendered.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from ddpflow.config import Config
from ddpflow.core.quoting import html_text

CSS = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1000px;color:#222}
h1{font-size:1.6em}h2{margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.5em 0;display:block;max-width:100%;overflow-x:auto}
td,th{padding:.3em .7em;border:1px solid #ccc}
th{background:#f4f4f4;text-align:left}.bad{color:#b00020;font-weight:bold}
.ok{color:#1b5e20}img{max-width:100%;border:1px solid #eee}pre{background:#f8f8f8;
padding:1em;overflow:auto;font-size:.8em}
"""

ONLOAD = """
window.addEventListener('load', function () {
  var imgs = Array.prototype.slice.call(document.images);
  var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;
  document.body.setAttribute('data-images-loaded', String(ok));
  document.body.setAttribute('data-images-total', String(imgs.length));
  // a wide table scrolls inside itself: the page never gets wider than the window
  document.body.setAttribute('data-page-overflow',
    String(document.documentElement.scrollWidth > window.innerWidth));
});
"""


def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        if v and abs(v) < 1e-3:  # a small difference is not zero: 2.86e-06, not 0.0000
            return f"{v:.2e}"
        return f"{v:.4f}" if abs(v) < 10 else f"{v:,.1f}"
    return html_text(str(v))


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode()
    return f'<img alt="{html_text(alt)}" src="data:image/png;base64,{data}">'


def render(cfg: Config, summary: dict, manifest: dict, figures: dict[str, Path],
           metric: str = "val_acc", classes: list | None = None) -> str:
    rows = summary["stages"]
    state = ('<span class="ok">finished</span>' if summary["finished"]
             else '<span class="bad">NOT FINISHED</span>')
    label = metric.replace("_", " ")
    # samples/s overall: samples / wall time from the command to the result; steady state:
    # the logged intervals only (no start-up, first interval, validation, checkpoint stalls)
    test = "test_" + metric.split("_", 1)[-1]  # val_acc -> test_acc: the held-out split
    head = ["stage", label, f"best {label}", f"{test.replace('_', ' ')} (test split)", "steps",
            "wall time (s)", "start-up (s)",
            "samples/s overall", "samples/s steady state", "per rank", "data wait", "ranks",
            "precision", "global batch"]
    keys = ["stage", f"final_{metric}", "best_value", test, "steps", "wall_time_s", "startup_s",
            "wall_samples_per_s", "mean_samples_per_s", "samples_per_s_per_rank",
            "data_wait_fraction", "world_size", "precision", "global_batch"]
    if any(r.get("final_val_balanced_acc") is not None for r in rows) \
            and metric != "val_balanced_acc":  # classification: what imbalance shows in
        head[2:2], keys[2:2] = ["val balanced acc"], ["final_val_balanced_acc"]
    trs = []
    for r in rows:
        r = {**r, "data_wait_fraction": (f"{100 * r['data_wait_fraction']:.1f} %"
                                         if r.get("data_wait_fraction") is not None else None)}
        cells = [_fmt(r.get(k)) for k in keys] if r["finished"] else \
            [_fmt(r["stage"]), f'<span class="bad">not finished</span>: {_fmt(r["note"])}'] + \
            [""] * (len(keys) - 2)
        trs.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    headline = (f'<table id="headline"><tr>{"".join(f"<th>{html_text(h)}</th>" for h in head)}'
                f'</tr>{"".join(trs)}</table>')
    details = []
    for r in rows:
        items = "".join(f"<tr><th>{html_text(k)}</th><td>{_fmt(v)}</td></tr>"
                        for k, v in r.items())
        details.append(f"<h3>{html_text(r['stage'])}</h3><table>{items}</table>")
    captions = {"loss_accuracy": f"Training loss and {metric} across all stages",
                "confusion_test": "Confusion matrix of the last stage on the test split",
                "throughput": "Throughput (all ranks) and the share of step time spent "
                              "waiting for data",
                "rank_step_time": "Step time of each rank"}
    imgs = "".join(f"<figure>{_img(p, captions.get(k, k))}<figcaption>"
                   f"{html_text(captions.get(k, k))}"
                   f"</figcaption></figure>" for k, p in figures.items())
    man = html_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>ddpflow report: {html_text(cfg.run)}</title>
<style>{CSS}</style><script>{ONLOAD}</script></head>
<body data-images-loaded="0">
<h1>ddpflow run <code>{html_text(cfg.run)}</code>: {state}</h1>
<p>config hash <code>{html_text(summary['config_hash'])}</code>, {len(rows)} stage(s),
git revision <code>{html_text(str(manifest.get('git_revision')))}</code>,
torch {html_text(str(manifest.get('torch')))}</p>
<h2>Headline</h2>{headline}
<h2>Plots</h2>{imgs or '<p>No metrics recorded yet.</p>'}
{_per_class(rows, classes)}
{_held_out(summary)}
{_memory(rows)}
<h2>Stages</h2>{''.join(details)}
<h2>Manifest</h2><pre id="manifest">{man}</pre>
</body></html>
"""


def _per_class(rows: list[dict], classes: list | None) -> str:
    """Each class's recall (right answers over its samples) per finished classification
    stage, on the validation split (and the test split where the stage had one): the
    lowest of each column marked. The first 100 classes."""
    cols = [(r["stage"], split, r.get(f"{'final_val' if split == 'val' else 'test'}_recall"))
            for r in rows if r.get("finished") for split in ("val", "test")]
    cols = [c for c in cols if isinstance(c[2], list)]
    if not cols:
        return ""
    n = max(len(c[2]) for c in cols)
    lows = [min((v for v in c[2] if v is not None), default=None) for c in cols]

    def cell(values, i, low):
        v = values[i] if i < len(values) else None
        return (f'<td class="bad">{_fmt(v)}</td>' if v is not None and v == low
                else f"<td>{_fmt(v)}</td>")
    head = "".join(f"<th>{html_text(stage)} ({split})</th>" for stage, split, _ in cols)
    trs = "".join(f"<tr><td>{_fmt(classes[i] if classes and i < len(classes) else i)}</td>"
                  + "".join(cell(c[2], i, low) for c, low in zip(cols, lows)) + "</tr>"
                  for i in range(min(n, 100)))
    return (f'<h2>Recall per class</h2><p>Per class: the share of its images classified '
            f'right (a class the split lacks: –); their mean is the balanced accuracy, the '
            f'lowest of each column in red</p><table id="recall"><tr><th>class</th>{head}'
            f'</tr>{trs}</table>')


def _memory(rows: list[dict]) -> str:
    """Memory per rank by kind (the largest rank's), one row per finished stage."""
    kinds = [("params", "parameters"), ("grads", "gradients"), ("optimizer", "optimizer state"),
             ("activations", "activations"),
             ("activations_without_checkpointing", "activations without checkpointing"),
             ("peak", "peak")]
    done = [r for r in rows if r.get("finished") and r.get("mem_peak_mib") is not None]
    if not done:
        return ""
    head = "".join(f"<th>{html_text(h)}</th>" for h in
                   ["stage", "strategy", "ranks"] + [label for _, label in kinds])
    trs = "".join("<tr>" + "".join(f"<td>{_fmt(v)}</td>" for v in [
        r["stage"], r.get("strategy"), r.get("world_size")] + [
        r.get(f"mem_{k}_mib") for k, _ in kinds]) + "</tr>" for r in done)
    return (f'<h2>Memory per rank (MiB)</h2><p>Parameters, gradients and optimizer state '
            f'as each rank holds them (a shard under fsdp); activations: what one micro-batch '
            f'kept for the backward; peak: the GPU allocator\'s (a CPU: the process\'s resident '
            f'set)</p><table id="memory"><tr>{head}</tr>{trs}</table>')


def _held_out(summary: dict) -> str:
    """The test split (`ddpflow evaluate`: never used to choose anything) and the export."""
    parts = []
    ev = summary.get("evaluation")
    if ev and ev.get("samples"):
        pc = ev["per_class"]
        rows = "".join(f"<tr><td>{_fmt(c)}</td><td>{_fmt(pc['precision'][i])}</td>"
                       f"<td>{_fmt(pc['recall'][i])}</td><td>{_fmt(pc['f1'][i])}</td>"
                       f"<td>{_fmt(pc['support'][i])}</td></tr>"
                       for i, c in enumerate(ev["classes"][:100]))
        parts.append(
            f'<h2>Test split</h2><p id="test">stage {_fmt(ev["stage"])}, '
            f'{_fmt(ev["weights"]["holds"])} weights: <b>test acc {_fmt(ev["acc"])}</b>, '
            f'top-5 {_fmt(ev["top5"])}, loss {_fmt(ev["loss"])} over {_fmt(ev["samples"])} '
            f'held-out images (model selection used the val split only)</p>'
            f'<table><tr><th>class</th><th>precision</th><th>recall</th><th>F1</th>'
            f'<th>support</th></tr>{rows}</table>')
    elif ev:
        parts.append(f"<h2>Test split</h2><p>{_fmt(ev.get('note'))}</p>")
    ex = summary.get("export")
    if ex:
        rows = "".join(
            f"<tr><td>{_fmt(f)}</td><td>{_fmt((ex['files'] or {}).get(f, {}).get('file'))}</td>"
            f"<td>{'ok' if c['ok'] else '<span class=bad>' + _fmt(c.get('error')) + '</span>'}"
            f"</td><td>{_fmt(c.get('max_abs_diff'))}</td></tr>"
            for f, c in (ex.get("checks") or {}).items())
        parts.append(f'<h2>Export</h2><p>bundle <code>{_fmt(ex["folder"])}</code> '
                     f'(<code>ddpflow predict --bundle ...</code>); {_fmt(ex["check_rule"])}</p>'
                     f'<table id="export"><tr><th>format</th><th>file</th><th>check</th>'
                     f'<th>max |diff|</th></tr>{rows}</table>')
    return "".join(parts)
