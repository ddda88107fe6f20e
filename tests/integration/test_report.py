"""``anyfit report``: one self-contained HTML page of a run, written at the end of every run. Checked on a real tiny
run (with validation and generation before and after), on one without evaluation, on a run that has not logged
a step yet, on a folder that holds no run, and opened in a real browser (headless Chromium) when one is
installed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
import yaml
from tiny_runs import config_for, write_dataset

from anyfit.cli import main
from anyfit.runfolder import GENERATIONS, METRICS, REPORT, RUN_CONFIG, RUN_INFO
from anyfit.training.loop import train
from anyfit.training.report import SECTIONS, write_report

SECTION_IDS = [key for key, _ in SECTIONS]


class Page(HTMLParser):
    """What the tests read of a page: element ids, headings, and every URL it would fetch."""

    def __init__(self, text: str):
        super().__init__()
        self.ids: list[str] = []
        self.headings: list[str] = []
        self.fetches: list[str] = []
        self.svgs = 0
        self._heading = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.append(attrs["id"])
        self._heading = tag in ("h1", "h2", "h3")
        self.svgs += tag == "svg"
        for name in ("src", "href"):
            value = attrs.get(name) or ""
            if value and not value.startswith(("#", "data:")):
                self.fetches.append(value)
        if tag == "link" or tag == "script":
            self.fetches.append(f"<{tag}>")

    def handle_data(self, data):
        if self._heading and data.strip():
            self.headings.append(data.strip())
            self._heading = False


@pytest.fixture(scope="module")
def evaluated_run(tiny_qwen2_dir, tmp_path_factory):
    """One tiny run with validation and generation accuracy before and after (shared by the module's tests)."""
    tmp = tmp_path_factory.mktemp("report_run")
    data = write_dataset(tmp / "d.jsonl", n=20)
    out = tmp / "run"
    lines: list[str] = []
    train(config_for(tiny_qwen2_dir, data, out, "train.effective_batch=4", "train.micro_batch=2", "train.max_steps=4",
                     "eval.holdout=4", "eval.every=2", "eval.generate_before=true", "eval.generate_at_end=true",
                     "eval.num_generate=4", "eval.max_new_tokens=4", "eval.batch_size=2"),
          echo=lambda *a: lines.append(" ".join(map(str, a))))
    return out, lines


@pytest.mark.slow
def test_every_run_leaves_its_report_with_every_section(evaluated_run):
    out, lines = evaluated_run
    assert f"[anyfit] report: {out / REPORT}" in lines
    text = (out / REPORT).read_text(encoding="utf-8")
    page = Page(text)
    assert [i for i in page.ids if i in SECTION_IDS] == SECTION_IDS
    assert [h for h in page.headings if h in dict(SECTIONS).values()] == list(dict(SECTIONS).values())
    assert not page.fetches, page.fetches  # self-contained: nothing to fetch when it is opened
    assert page.svgs >= 4  # loss, learning rate, gradient norm, generation accuracy, throughput, memory
    assert "Finished: 4 of 4 steps" in text
    assert "validation loss" in text and "No validation was run" not in text
    # generation before and after, with three example answers each (generations.jsonl, kept by the loop)
    saved = [json.loads(line) for line in (out / GENERATIONS).read_text().splitlines()]
    assert [g["step"] for g in saved] == [0, 0, 0, 4, 4, 4]
    assert {"prompt", "gold", "answer", "completion", "correct"} <= set(saved[0])
    assert "Example answers before training" in text and "Example answers at step 4" in text
    assert text.count('class="example"') == 6
    # speed and memory beside what the planner predicted at the start (recorded in run_info.json)
    planned = json.loads((out / RUN_INFO).read_text())["planned"]
    assert planned["peak_mem_gib"] > 0 and planned["tokens_per_s"] > 0, planned
    assert re.search(r"<th>tokens/s</th><td[^>]*>[\d,.]+</td><td[^>]*>[\d,.]+</td>", text)
    # the data report and the config
    assert "records loaded" in text and "Mask audit" in text
    assert "max_steps: 4" in text
    # what is not in this run says so in one line each
    assert "Loss per data source" not in text and "No forgetting measure (base_kl)" in text


@pytest.mark.slow
def test_the_report_draws_per_source_losses_and_forgetting_when_logged(evaluated_run, tmp_path):
    """Keys other parts of anyfit log (loss/SOURCE, val_loss/SOURCE, base_kl) become curves without a change here."""
    out, _ = evaluated_run
    run = tmp_path / "run"
    shutil.copytree(out, run, ignore=shutil.ignore_patterns("*.safetensors", "checkpoint-*"))
    records = [json.loads(line) for line in (run / METRICS).read_text().splitlines()]
    for r in records:
        if "loss" in r:
            r.update({"loss/math": r["loss"] * 1.1, "loss/chat": r["loss"] * 0.9})
        if "val_loss" in r:
            r.update({"val_loss/math": r["val_loss"], "base_kl": 0.01 * r["step"]})
    (run / METRICS).write_text("".join(json.dumps(r) + "\n" for r in records))
    text = write_report(run).read_text()
    assert "Loss per data source" in text and "loss/math" in text and "val_loss/math" in text
    assert "Forgetting" in text and "No forgetting measure" not in text


@pytest.mark.slow
def test_a_run_without_evaluation_says_so(evaluated_run, tmp_path, capsys):
    """The run's folder as a run without evaluation leaves it: each missing section is one line naming the keys
    that would fill it."""
    out, _ = evaluated_run
    run = tmp_path / "run"
    shutil.copytree(out, run, ignore=shutil.ignore_patterns("*.safetensors", "checkpoint-*", GENERATIONS))
    records = [json.loads(line) for line in (run / METRICS).read_text().splitlines()]
    (run / METRICS).write_text("".join(json.dumps(r) + "\n" for r in records if "loss" in r))
    config = yaml.safe_load((run / RUN_CONFIG).read_text())
    config["eval"].update(every=0, holdout=0, generate_before=False, generate_at_end=False)
    (run / RUN_CONFIG).write_text(yaml.safe_dump(config))
    assert main(["report", str(run), "--out", str(tmp_path / "page.html")]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'page.html'}"
    text = (tmp_path / "page.html").read_text()
    assert "No validation was run: set eval.every" in text
    assert "No generation evaluation was run: set eval.generate_before=true" in text
    assert Page(text).ids[:len(SECTION_IDS)] == SECTION_IDS


def test_a_run_with_no_step_logged_yet(tmp_path):
    """A run that is starting (config and run_info written, the lock held, no metrics line): a page, not an error."""
    run = tmp_path / "run"
    run.mkdir()
    (run / RUN_CONFIG).write_text("model:\n  name_or_path: tiny\neval:\n  every: 0\n")
    (run / RUN_INFO).write_text(json.dumps({"steps": 10, "data": {"loaded": 3, "kept": 3, "total_tokens": 30,
                                                                 "trainable_tokens": 12}}))
    text = write_report(run).read_text()
    assert "No training step logged yet" in text and "records loaded" in text
    assert [i for i in Page(text).ids if i in SECTION_IDS] == SECTION_IDS


def test_a_resumed_run_keeps_the_example_answers_up_to_its_checkpoint(tmp_path):
    """Like the metrics lines: the evaluations after the checkpoint run again, and a fresh run starts without."""
    from anyfit.runfolder import read_generations, write_generations
    from anyfit.training.run_record import start_run_dir

    write_generations(tmp_path, [{"step": s, "answer": str(s)} for s in (0, 0, 4, 8)])
    start_run_dir(tmp_path, 4, "model: {}\n", {})
    assert [g["step"] for g in read_generations(tmp_path)] == [0, 0, 4]
    start_run_dir(tmp_path, None, "model: {}\n", {})
    assert read_generations(tmp_path) == [] and not (tmp_path / GENERATIONS).exists()


def test_a_folder_that_is_not_a_run_is_one_error_line(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a run")
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("anyfit: error:") and "not the output folder" in err[0]
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert not (tmp_path / REPORT).exists()


def _chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


@pytest.mark.slow
@pytest.mark.skipif(_chromium() is None, reason="no chromium binary (CI installs Debian's chromium in .ci/run)")
def test_the_page_renders_in_a_browser(evaluated_run, tmp_path):
    """Headless Chromium opens the page (file://, no network) and draws it: the screenshot holds the charts'
    colours, not a blank page."""
    import numpy as np
    from matplotlib.image import imread

    out, _ = evaluated_run
    shot = tmp_path / "shot.png"
    subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--screenshot={shot}", "--window-size=1200,2400", (out / REPORT).resolve().as_uri()],
                   check=True, capture_output=True, timeout=300)
    pixels = np.rint(imread(shot)[..., :3] * 255).astype(np.int32)
    assert pixels.shape[:2] == (2400, 1200)
    inked = (pixels < 235).any(axis=-1).mean()
    colours = np.unique(pixels[..., 0] << 16 | pixels[..., 1] << 8 | pixels[..., 2])
    assert inked > 0.03 and len(colours) > 50, (inked, len(colours))
    palette = [31 << 16 | 119 << 8 | 180, 255 << 16 | 127 << 8 | 14]  # the charts' first two line colours
    assert np.isin(palette, colours).all()
