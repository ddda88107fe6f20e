"""A run on one page: ``report.html``, written at the end of every run and by ``anyfit report RUN``.

One self-contained HTML file: inline CSS, the charts as inline SVG (``anyfit.training.svg_chart``), no script, no
font or picture fetched, so it opens the same on a laptop, from a rented GPU's folder or as an e-mail attachment.
It is read from the run folder alone (``anyfit.runfolder``): ``metrics.jsonl`` (the curves, speed, generation
accuracy), ``generations.jsonl`` (example answers), ``run_info.json`` (policy, batch, the data report, what the
planner predicted) and ``config.yaml``. Its sections, each an ``id`` to link to: ``summary``, ``curves``,
``generation``, ``speed``, ``data``, ``config``. A section without data says so in one line and names what would
fill it, so that an empty part of the page is never mistaken for a missing feature.

Imports neither torch nor transformers: ``anyfit report`` starts in a fraction of a second.
"""

from __future__ import annotations

import html
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import anyfit
from anyfit.config import ConfigError
from anyfit.data.audit import audit_lines
from anyfit.data.source_names import curve_prefixes, source_key
from anyfit.durable import replacing
from anyfit.runfolder import (
    LOCK,
    LOSS_CURVES,
    METRICS,
    REPORT,
    RUN_CONFIG,
    RUN_INFO,
    checkpoint_dirs,
    checkpoint_step,
    has_final_model,
    read_generations,
    read_metrics,
    read_run_info,
    run_of,
)
from anyfit.training.checkpoints.best import read_best
from anyfit.training.svg_chart import Series, line_chart

THUMBNAIL_PREFIX = "data:image/png;base64,"  # the only images the report shows: thumbnails the run made
SECTIONS = (("summary", "Summary"), ("curves", "Curves"), ("generation", "Generation accuracy"),
            ("speed", "Speed and memory"), ("data", "Data"), ("config", "Config"))
STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;max-width:1180px;
padding:16px 24px;color:#1d1d1f;background:#fff}
h1{font-size:22px;margin:4px 0}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
nav a{margin-right:14px}.status{font-weight:600}.missing{color:#8a5a00;background:#fff7e0;padding:4px 8px;
border-left:3px solid #e0a800}table{border-collapse:collapse;margin:6px 0}td,th{border:1px solid #ddd;
padding:3px 8px;text-align:left;vertical-align:top}th{background:#f4f4f6}.charts{display:flex;flex-wrap:wrap;gap:12px}
svg.chart{font:11px system-ui,sans-serif;background:#fff;border:1px solid #eee}svg .title{font-size:13px;
font-weight:600}svg .grid{stroke:#e6e6e6}svg .frame{fill:none;stroke:#999}
pre{background:#f6f8fa;padding:8px;overflow:auto;max-height:420px;white-space:pre-wrap;word-break:break-word;
margin:4px 0}.example{border:1px solid #ddd;border-radius:4px;padding:6px 10px;margin:8px 0}
.io{display:grid;grid-template-columns:1fr 1fr;gap:10px}
.thumbs img{max-width:160px;max-height:160px;margin:6px 6px 0 0;border:1px solid #ddd}
.ok{color:#1a7f37;font-weight:600}.bad{color:#c62828;font-weight:600}.note{color:#555}
"""


@dataclass
class RunView:
    """What the page is made of, read once from the run folder."""

    folder: Path
    config_text: str | None = None
    config: dict[str, Any] = field(default_factory=dict)  # config.yaml's sections, for the hints
    info: dict[str, Any] = field(default_factory=dict)  # run_info.json
    records: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl
    generations: list[dict[str, Any]] = field(default_factory=list)  # generations.jsonl
    columns: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # metric -> (step, value), one pass

    @classmethod
    def read(cls, run_dir: str | Path) -> RunView:
        """The run in ``run_dir`` (a checkpoint folder stands for its run); a ``ConfigError`` where the folder
        holds no run."""
        folder = run_of(Path(run_dir))[0]
        if not any((folder / name).is_file() for name in (RUN_CONFIG, RUN_INFO, METRICS)):
            raise ConfigError(f"{run_dir} is not the output folder of an anyfit training run (no {RUN_CONFIG}, "
                              f"{RUN_INFO} or {METRICS}): give a run's train.output_dir.")
        view = cls(folder, info=read_run_info(folder), records=read_metrics(folder),
                   generations=read_generations(folder))
        for r in view.records:
            if _number(r.get("step")):
                for key, value in r.items():
                    if _number(value) and key != "step":
                        view.columns.setdefault(key, []).append((r["step"], float(value)))
        if (folder / RUN_CONFIG).is_file():
            view.config_text = (folder / RUN_CONFIG).read_text(encoding="utf-8", errors="replace")
            try:
                parsed = yaml.safe_load(view.config_text)
            except yaml.YAMLError:
                parsed = None
            view.config = parsed if isinstance(parsed, dict) else {}
        return view

    def setting(self, key: str, default: Any = None) -> Any:
        """A dotted config key (``eval.every``) as config.yaml has it."""
        section, _, name = key.partition(".")
        values = self.config.get(section)
        return values.get(name, default) if isinstance(values, dict) else default

    def series(self, key: str) -> list[tuple[float, float]]:
        """``(step, value)`` of every metrics line that carries ``key`` as a number."""
        return self.columns.get(key, [])

    def keys(self, *prefixes: str) -> list[str]:
        """The numeric metric keys that start with one of ``prefixes``, in order of first appearance."""
        return [k for k in self.columns if k.startswith(prefixes)]


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the page of ``run_dir`` to ``out`` (default: ``run_dir/report.html``), whole or not at all; returns
    the file."""
    view = RunView.read(run_dir)
    target = Path(out) if out is not None else view.folder / REPORT
    target.parent.mkdir(parents=True, exist_ok=True)
    with replacing(target) as tmp:
        tmp.write_text(render(view), encoding="utf-8")
    return target


def render(view: RunView) -> str:
    """The page's HTML."""
    name = html.escape(view.folder.resolve().name)
    nav = "".join(f'<a href="#{key}">{title}</a>' for key, title in SECTIONS)
    body = "".join(f'<section id="{key}"><h2>{title}</h2>{part(view)}</section>' for (key, title), part in zip(
        SECTIONS, (_summary, _curves, _generation, _speed, _data, _config)))
    written = time.strftime("%Y-%m-%d %H:%M")
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>anyfit run {name}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{STYLE}</style></head>'
            f'<body><h1>anyfit run: {name}</h1><p class="note">{html.escape(str(view.folder.resolve()))}; written '
            f'{written} by anyfit {html.escape(anyfit.__version__)}</p><nav>{nav}</nav>{body}</body></html>\n')


def _summary(view: RunView) -> str:
    info, batch = view.info, view.info.get("batch") or {}
    policy, params = info.get("policy") or {}, info.get("parameters") or {}
    rows = [("model", view.setting("model.name_or_path")), ("method", _method(view)),
            ("device", f"{policy.get('device', '?')}, {policy.get('precision', '?')}" if policy else None),
            ("batch", f"effective {batch.get('effective_batch')} = micro-batch {batch.get('micro_batch')} x "
                      f"accumulation {batch.get('accumulation')} x processes {batch.get('processes')}"
             if batch else None),
            ("parameters", f"{params['trainable']:,} trainable of {params['total']:,}"
             if _number(params.get("trainable")) and _number(params.get("total")) else None)]
    losses = view.series("loss")
    if losses:
        rows.append(("training loss", f"{losses[0][1]:.4g} at step {losses[0][0]} -> {losses[-1][1]:.4g} at step "
                                      f"{losses[-1][0]}"))
    vals = view.series("val_loss")
    if vals:
        best = min(vals, key=lambda p: p[1])
        rows.append(("validation loss", f"{vals[-1][1]:.4g} at step {vals[-1][0]} (best {best[1]:.4g} at step "
                                        f"{best[0]})"))
    best_kept = read_best(view.folder)
    if best_kept:  # train.keep_best
        rows.append(("best checkpoint", f"{best_kept['checkpoint']}: {best_kept['metric']} {best_kept['value']:.4g} "
                                        f"at step {best_kept['step']} (what anyfit export takes by default)"))
    accuracy = view.series("gen_accuracy")
    if accuracy:
        rows.append(("generation accuracy", " -> ".join(f"{v:.1%} (step {s:g})" for s, v in _ends(accuracy))))
    versions = info.get("versions") or {}
    if versions:
        rows.append(("versions", ", ".join(f"{k} {v}" for k, v in versions.items() if k != "platform")))
    reasons = "".join(f"<li>{html.escape(str(r))}</li>" for r in policy.get("reasons", []))
    return (f'<p class="status">{html.escape(_status(view))}</p>'
            + _table(("", ""), [(k, v) for k, v in rows if v is not None])
            + (f'<details><summary>why this runtime</summary><ul>{reasons}</ul></details>' if reasons else ""))


def _method(view: RunView) -> str | None:
    if not view.config:
        return None
    if view.setting("lora.qlora"):
        return f"QLoRA, rank {view.setting('lora.r')}"
    if view.setting("lora.enabled"):
        return f"LoRA, rank {view.setting('lora.r')}"
    return "full fine-tuning"


def _status(view: RunView) -> str:
    """Where the run stands, in one sentence."""
    steps = view.info.get("steps")
    logged = [s for s, _ in view.series("loss")]
    done = int(max(logged)) if logged else 0
    of = f" of {steps}" if steps else ""
    if has_final_model(view.folder):
        return f"Finished: {done}{of} steps; the final model is in this folder."
    if not logged:
        return "No training step logged yet (the run is starting, or stopped before its first step)."
    if steps and done >= steps:
        return f"All {steps} steps ran; no final model in this folder (a profiling run saves none)."
    checkpoints = checkpoint_dirs(view.folder)
    newest = checkpoint_step(checkpoints[-1]) if checkpoints else None
    if newest == done:
        return (f"Stopped after step {done}{of} with checkpoint-{done}; continue with: anyfit train <config> "
                f"train.output_dir={view.folder} train.resume=auto")
    lock = " A run holds this folder's lock file: it may still be going." if (view.folder / LOCK).exists() else ""
    saved = f"newest checkpoint: checkpoint-{newest}" if newest is not None else "no checkpoint"
    return f"Not finished: step {done}{of} logged so far ({saved}).{lock}"


def _curves(view: RunView) -> str:
    if not view.series("loss"):
        return _missing(f"No training step logged yet: {METRICS} has no loss line.")
    charts = [line_chart("Loss", [Series(label, view.series(key), markers=marked)
                                  for key, label, marked in LOSS_CURVES], "loss (mean per trained token)")]
    notes = [] if view.series("val_loss") else [_no_validation(view)]
    charts.append(line_chart("Learning rate", [Series("learning rate", view.series("lr"))], "learning rate",
                             y_floor=0.0))
    if view.series("grad_norm"):
        charts.append(line_chart("Gradient norm", [Series("gradient norm", view.series("grad_norm"))], "norm"))
    sources = view.keys(*curve_prefixes())
    if sources:  # one line per source: training solid, validation with markers
        charts.append(line_chart("Loss per data source", [Series(k, view.series(k), markers=k.startswith("val_"))
                                                           for k in sources], "loss (mean per trained token)"))
    if len(view.setting("data.mix") or []) > 1 and not view.keys(source_key("val_loss", "")):
        notes.append(_missing("No validation loss per data source: it is measured on held-out records of each "
                              "data.mix source (eval.holdout and eval.every); eval.path holds no sources."))
    if view.series("base_kl"):
        charts.append(line_chart("Forgetting (base_kl)", [Series("base_kl", view.series("base_kl"), markers=True)],
                                 "base_kl", y_floor=0.0))
    else:
        notes.append(_missing("No forgetting measure (base_kl): set train.watch_base (on by default with LoRA and "
                              "eval.every) to see how far the model drifts from its base."))
    return f'<div class="charts">{"".join(charts)}</div>{"".join(notes)}'


def _no_validation(view: RunView) -> str:
    held_out = view.setting("eval.holdout") or view.setting("eval.path") or view.setting("eval.split")
    if view.setting("eval.every") and not held_out:
        return _missing("No validation loss: eval.every is set but no data is held out (set eval.holdout, eval.path "
                        "or eval.split).")
    return _missing("No validation was run: set eval.every (with held-out data: eval.holdout, eval.path or "
                    "eval.split).")


def _generation(view: RunView) -> str:
    evals = [r for r in view.records if _number(r.get("gen_accuracy"))]
    if not evals:
        return _missing("No generation evaluation was run: set eval.generate_before=true and "
                        "eval.generate_at_end=true (held-out data with gold answers: eval.holdout, eval.path or "
                        "eval.split).")
    ends = _ends(evals)
    rows = [(f"{'before' if r['step'] == 0 else 'step ' + str(r['step'])}", _share(r.get("gen_accuracy")),
             _share(r.get("gen_format_rate")), _share(r.get("gen_fallback_rate")), r.get("gen_n"),
             _round(r.get("gen_mean_completion_tokens"), 1)) for r in ends]
    parts = [_table(("evaluation", "accuracy", "answer in the asked form", "last-number guesses", "examples",
                     "mean answer tokens"), rows)]
    if len(evals) == 1:
        parts.append(_missing(f"One generation evaluation only (step {evals[0]['step']}): set "
                              "eval.generate_before=true and eval.generate_at_end=true for before and after."))
    else:
        chart = line_chart("Generation accuracy", [
            Series("accuracy", view.series("gen_accuracy"), markers=True),
            Series("answer in the asked form", view.series("gen_format_rate"), markers=True, dashed=True)],
            "share of held-out examples", y_floor=0.0, y_ceiling=1.0)
        parts.append(f'<div class="charts">{chart}</div>')
    for r in ends:
        shown = [g for g in view.generations if g.get("step") == r["step"]]
        title = "before training" if r["step"] == 0 else f"at step {r['step']}"
        parts.append(f"<h3>Example answers {title}</h3>")
        parts.append("".join(_example(g) for g in shown) if shown else
                     _missing("No example answers were saved for this evaluation (generations.jsonl)."))
    return "".join(parts)


def _example(g: dict[str, Any]) -> str:
    verdict = '<span class="ok">correct</span>' if g.get("correct") else '<span class="bad">wrong</span>'
    answer = "no answer found" if g.get("answer") is None else f'answer <b>{html.escape(str(g["answer"]))}</b>'
    return (f'<div class="example">{verdict}: {answer}, expected '
            f'<b>{html.escape(str(g.get("gold")))}</b> (answer form: {html.escape(str(g.get("answer_form")))})'
            f'{_thumbnails(g.get("images"))}'
            f'<div class="io"><div><div class="note">prompt</div><pre>{html.escape(str(g.get("prompt")))}</pre></div>'
            f'<div><div class="note">the model wrote</div><pre>{html.escape(str(g.get("completion")))}</pre></div>'
            "</div></div>")


def _thumbnails(images: Any) -> str:
    """The example's images as the run kept them (PNG data URIs, ``training.validation.example_answer``); anything
    else in the file is not shown."""
    shown = [uri for uri in images if isinstance(uri, str) and uri.startswith(THUMBNAIL_PREFIX)] \
        if isinstance(images, list) else []
    tags = [f'<img alt="image {k + 1}" src="{html.escape(uri)}">' for k, uri in enumerate(shown)]
    return f'<div class="thumbs">{"".join(tags)}</div>' if tags else ""


def _speed(view: RunView) -> str:
    logged = [r for r in view.records if _number(r.get("tokens_per_s"))]
    if not logged:
        return _missing("No training step logged yet: no speed or memory to show.")
    # the first interval holds the start-up (first allocations, warm-up): left out of the medians when there are more
    steady = logged[1:] if len(logged) >= 3 else logged
    measured = {"tokens/s": statistics.median(r["tokens_per_s"] for r in steady),
                "MFU": _median([r.get("mfu") for r in steady]),
                "peak memory per device (GiB)": max((r["peak_mem_gib"] for r in logged
                                                     if _number(r.get("peak_mem_gib"))), default=None)}
    planned, planned_line = _planned(view)
    rows = [(name, _fmt(name, value), _fmt(name, planned.get(name)), _ratio(value, planned.get(name)))
            for name, value in measured.items()]
    parts = [_table(("", "measured", "planned", "measured / planned"), rows)]
    parts.append(f'<p class="note">Measured: the median over {len(steady)} logged interval(s)'
                 f'{" (the first, with the start-up, left out)" if steady is not logged else ""}; peak memory is '
                 f'the largest any line logged (process 0).{planned_line}</p>')
    if (view.info.get("policy") or {}).get("device") == "cpu":
        parts.append('<p class="note">On CPU the measured peak is the process\'s resident memory (Python, torch '
                     "and the data included); the plan's is the training step's.</p>")
    micro = sorted({r["micro_batch"] for r in logged if _number(r.get("micro_batch"))})
    if len(micro) > 1:
        parts.append(f'<p class="note">The micro-batch changed during the run ({", ".join(map(str, micro))}): '
                     "an out-of-memory step was redone with a smaller one.</p>")
    throughput = [Series("tokens/s", view.series("tokens_per_s"))]
    if _number(planned.get("tokens/s")):
        first, last = logged[0]["step"], logged[-1]["step"]
        throughput.append(Series("planned", [(first, planned["tokens/s"]), (last, planned["tokens/s"])], dashed=True))
    charts = [line_chart("Throughput", throughput, "real tokens per second", y_floor=0.0)]
    if view.series("peak_mem_gib"):
        charts.append(line_chart("Peak memory", [Series("peak memory (process 0)", view.series("peak_mem_gib"))],
                                 "GiB", y_floor=0.0))
    return "".join(parts) + f'<div class="charts">{"".join(charts)}</div>'


def _planned(view: RunView) -> tuple[dict[str, float], str]:
    """The planner's prediction by the speed table's row names, and a sentence on where it comes from."""
    planned = view.info.get("planned")
    if not isinstance(planned, dict):
        return {}, " The plan's prediction was not recorded for this run (run_info.json has no 'planned')."
    if planned.get("error"):
        return {}, f" The planner could not estimate this run: {html.escape(str(planned['error']))}."
    peak = (view.info.get("mfu") or {}).get("peak_tflops_per_device")
    flops = planned.get("model_tflops_per_s_per_device")
    mfu = flops / peak if _number(flops) and _number(peak) and peak > 0 else None
    line = (f" Planned: anyfit plan's estimates for {html.escape(str(planned.get('machine', 'this machine')))} at "
            f"micro-batch {planned.get('micro_batch')}, memory at the longest example ({planned.get('seq_len')} "
            "tokens), time at the mean length; MFU against the same peak as the run's.")
    return {"tokens/s": planned.get("tokens_per_s"), "MFU": mfu,
            "peak memory per device (GiB)": planned.get("peak_mem_gib")}, line


def _data(view: RunView) -> str:
    data = view.info.get("data")
    if not isinstance(data, dict) or not data:
        return _missing(f"No data report: {RUN_INFO} is missing (the run did not get past its start).")
    total, trained = data.get("total_tokens") or 0, data.get("trainable_tokens") or 0
    rows = [("records loaded", data.get("loaded")), ("examples kept", data.get("kept")),
            ("tokens", f"{total:,}"),
            ("trained tokens", f"{trained:,} ({trained / total:.0%} of the tokens)" if total else f"{trained:,}"),
            ("longest / mean example", f"{data.get('max_length')} / {_round(data.get('mean_length'), 1)} tokens "
                                       f"(data.max_length={data.get('length_limit')})"),
            ("truncated", f"{data.get('truncated', 0)} examples cut to data.max_length, "
                          f"{data.get('truncated_tokens', 0):,} tokens cut away")]
    dropped = {"longer than data.max_length (data.overlong=drop)": data.get("dropped_overlong"),
               "nothing to train on": data.get("dropped_nothing_to_train"),
               "no trained token left within data.max_length": data.get("dropped_no_target"),
               "no answer (r1_zero)": data.get("dropped_no_answer")}
    rows += [(f"dropped: {why}", n) for why, n in dropped.items() if n]
    lines = audit_lines(data)
    if not data.get("audit"):
        lines.append("Mask audit: nothing found (every trained span ends where generation stops; no prompt turn "
                     "is trained).")
    return _table(("", ""), rows) + "".join(f"<p>{html.escape(line)}</p>" for line in lines)


def _config(view: RunView) -> str:
    if view.config_text is None:
        return _missing(f"No {RUN_CONFIG} in this folder.")
    return f"<pre>{html.escape(view.config_text)}</pre>"


def _table(header: tuple[str, ...], rows: list[tuple[Any, ...]]) -> str:
    head = "" if not any(header) else "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>"
    body = "".join("<tr>" + "".join(_cell(c, first=i == 0) for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def _cell(value: Any, first: bool) -> str:
    if first:
        return f"<th>{html.escape(str(value))}</th>"
    return "<td>-</td>" if value is None else f"<td>{html.escape(str(value))}</td>"


def _missing(text: str) -> str:
    return f'<p class="missing">{html.escape(text)}</p>'


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _ends(items: list) -> list:
    """The first and the last (once when they are the same)."""
    return items[:1] + items[-1:] if len(items) > 1 else items


def _median(values: list[Any]) -> float | None:
    numbers = [v for v in values if _number(v)]
    return statistics.median(numbers) if numbers else None


def _round(value: Any, digits: int) -> Any:
    return round(value, digits) if _number(value) else value


def _share(value: Any) -> str | None:
    return f"{value:.1%}" if _number(value) else None


def _fmt(name: str, value: Any) -> str | None:
    if not _number(value):
        return None
    if name == "MFU":
        return f"{value:.2%}"
    return f"{value:,.1f}" if name == "tokens/s" else f"{value:.3f}"


def _ratio(measured: Any, planned: Any) -> str | None:
    return f"{measured / planned:.2f}" if _number(measured) and _number(planned) and planned else None
