"""Generation accuracy during a run on image records: a tiny vision-language model (``tests/vlm_fixtures``) trained
on image questions with held-out ones scored before and after training (``eval.generate_before/at_end``), their
example answers kept with thumbnails of their images, which the run's report shows."""

from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image
from test_report import Page
from tiny_runs import config_for
from vlm_fixtures import built_vlm, missing_for, write_image

from anyfit.cli import main
from anyfit.runfolder import GENERATIONS, REPORT
from anyfit.training.loop import train
from anyfit.training.validation import example_answer


def _image_questions(folder, n: int):
    """JSON Lines of ``n`` questions about images, relative image paths, answers ``#### k``."""
    records = []
    for k in range(n):
        write_image(folder / "images" / f"{k}.png", 300 if k == 0 else 64, 200 if k == 0 else 48, seed=k)
        records.append({"messages": [
            {"role": "user", "content": [{"type": "image", "path": f"images/{k}.png"},
                                         {"type": "text", "text": f"How many squares are in picture {k}?"}]},
            {"role": "assistant", "content": f"I count them. #### {k % 3}"}]})
    path = folder / "questions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.slow
def test_generation_accuracy_on_held_out_image_questions_before_and_after(tmp_path):
    if why := missing_for("qwen3_5"):
        pytest.skip(why)
    data = _image_questions(tmp_path / "data", 10)
    out = tmp_path / "run"
    train(config_for(built_vlm("qwen3_5"), data, out, "data.template=chat", "train.effective_batch=4",
                     "train.micro_batch=2", "train.max_steps=2", "eval.holdout=4", "eval.generate_before=true",
                     "eval.generate_at_end=true", "eval.num_generate=4", "eval.max_new_tokens=4", "eval.batch_size=2"),
          echo=lambda *a: None)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    scored = {r["step"]: r for r in metrics if "gen_accuracy" in r}
    assert sorted(scored) == [0, 2] and all(r["gen_n"] == 4 for r in scored.values())
    saved = [json.loads(line) for line in (out / GENERATIONS).read_text().splitlines()]
    assert [g["step"] for g in saved] == [0, 0, 0, 2, 2, 2]
    for g in saved:  # one thumbnail each, a PNG of at most 160 pixels a side
        (uri,) = g["images"]
        thumbnail = Image.open(io.BytesIO(base64.b64decode(uri.removeprefix("data:image/png;base64,"))))
        assert thumbnail.format == "PNG" and max(thumbnail.size) <= 160
        assert g["prompt"].count("<|image_pad|>") == 1
    page = Page((out / REPORT).read_text(encoding="utf-8"))
    assert not page.fetches  # the thumbnails are in the page
    assert (out / REPORT).read_text(encoding="utf-8").count('<img alt="image 1" src="data:image/png;base64,') == 6

    # the trained model's folder (its processor saved beside it) scored afterwards by anyfit eval
    scores = tmp_path / "eval"
    assert main(["eval", f"data.path={data}", "data.num_samples=3", "runtime.device=cpu", "--model", str(out),
                 "--max-new-tokens", "2", "--out", str(scores)]) == 0
    rows = [json.loads(line) for line in (scores / "predictions.jsonl").read_text().splitlines()]
    assert [r["gold"] for r in rows] == ["0", "1", "2"] and all(len(r["images"]) == 1 for r in rows)


def test_an_example_answer_keeps_at_most_three_thumbnails_of_its_prompt_images(tmp_path):
    from anyfit.data.formats import Example
    from anyfit.data.images import ImageRef

    refs = tuple(ImageRef(path=str(write_image(tmp_path / f"{k}.png", 400, 100 + k, seed=k))) for k in range(5))
    row = {"index": 7, "prompt": "p", "gold": "1", "extracted": None, "completion": "c", "correct": False,
           "how": "none", "images": [ref.describe() for ref in refs[:4]]}  # the fifth is in the answer turn
    kept = example_answer(3, row, Example(kind="messages", index=7, messages=[], images=refs))
    sizes = [Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1]))).size for u in kept["images"]]
    assert sizes == [(160, 40), (160, 40), (160, 41)]
    assert "images" not in example_answer(3, {**row, "images": []}, Example(kind="messages", messages=[]))


def test_the_report_shows_only_the_thumbnails_the_run_made():
    from anyfit.training.report import _example

    made = "data:image/png;base64,iVBORw0KGgo="
    shown = _example({"prompt": "p", "gold": "1", "answer": "1", "correct": True, "completion": "c",
                      "images": [made, "javascript:alert(1)", "https://example.com/x.png", 3]})
    assert shown.count("<img") == 1 and f'src="{made}"' in shown
    assert "<img" not in _example({"prompt": "p", "gold": "1", "answer": None, "completion": "c"})
