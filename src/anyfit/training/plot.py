"""A run's curves as a picture: training loss, validation loss (each source's too, with ``data.mix``) and
generation accuracy against the step, read from its ``metrics.jsonl`` (``anyfit plot RUN``; ``loss.png`` is written
at the end of every run)."""

from __future__ import annotations

from pathlib import Path

from anyfit.config import ConfigError
from anyfit.data.source_names import curve_prefixes
from anyfit.runfolder import LOSS_CURVES, METRICS, PLOT, read_metrics


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the curves of ``run_dir`` into ``out`` (default: ``run_dir/loss.png``); returns the file."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write files only (a training machine has no screen)
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    if not (run_dir / METRICS).is_file():
        raise ConfigError(f"{run_dir} has no {METRICS}: give the output folder of an anyfit training run.")
    records = read_metrics(run_dir)
    series = {key: [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
              for key in (*(key for key, _, _ in LOSS_CURVES), "gen_accuracy")}
    if not any(series.values()):
        raise ConfigError(f"{run_dir / METRICS} holds no loss or evaluation lines yet.")
    fig, loss_ax = plt.subplots(figsize=(8, 4.5))
    for key, label, marked in LOSS_CURVES:
        if series[key]:
            steps, values = zip(*series[key])
            loss_ax.plot(steps, values, "o-" if marked else "-", label=label, markersize=3)
    keys = _source_keys(records)  # data.mix: thin lines, one colour per source, validation dotted
    colours = {name: f"C{2 + i}" for i, name in enumerate(dict.fromkeys(k.split("/", 1)[1] for k in keys))}
    for key in keys:
        steps, values = zip(*[(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))])
        name = key.split("/", 1)[1]
        loss_ax.plot(steps, values, ":o" if key.startswith("val_") else "-", linewidth=0.9, markersize=2,
                     color=colours[name], label=f"{'validation' if key.startswith('val_') else 'training'} loss, {name}")
    loss_ax.set_xlabel("optimizer step")
    loss_ax.set_ylabel("loss (mean per trained token)")
    handles, labels = loss_ax.get_legend_handles_labels()
    if series["gen_accuracy"]:  # on its own axis: accuracy is a share, not a loss
        acc_ax = loss_ax.twinx()
        steps, values = zip(*series["gen_accuracy"])
        acc_ax.plot(steps, values, "s--", color="tab:green", label="generation accuracy", markersize=4)
        acc_ax.set_ylabel("generation accuracy")
        acc_ax.set_ylim(0, 1)
        more_handles, more_labels = acc_ax.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    loss_ax.legend(handles, labels, loc="upper right")
    loss_ax.set_title(run_dir.resolve().name)
    loss_ax.grid(alpha=0.3)
    target = Path(out) if out is not None else run_dir / PLOT
    fig.tight_layout()
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target


def _source_keys(records: list[dict]) -> list[str]:
    """``loss/<name>`` and ``val_loss/<name>`` keys, in order of first appearance."""
    return list(dict.fromkeys(k for r in records for k in r if k.startswith(curve_prefixes())))
