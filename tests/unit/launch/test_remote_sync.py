"""The job's syncer: a checkpoint reaches the store as soon as it is complete, the rest of the run folder on the
periodic push (and at the end); a checkpoint still being written is not sent."""

from __future__ import annotations

from anyfit.launch.remote import Syncer
from anyfit.launch.store import FolderStore


def test_a_complete_checkpoint_is_synced_at_once_the_rest_periodically(tmp_path):
    run, store = tmp_path / "run", tmp_path / "store"
    run.mkdir()
    # no thread: each look at the run folder is one tick, so nothing here depends on timing; no periodic push
    syncer = Syncer(FolderStore(store), run, every=3600.0)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    hidden = run / ".checkpoint-2.tmp"
    hidden.mkdir()
    (hidden / "model.safetensors").write_bytes(b"w" * 64)
    (hidden / "manifest.json").write_text("{}")
    syncer.tick()  # a checkpoint being written is not a checkpoint yet
    assert not (store / "checkpoint-2").exists()
    hidden.rename(run / "checkpoint-2")  # the loop's last step of a save
    syncer.tick()
    assert (store / "checkpoint-2" / "manifest.json").is_file()
    assert (store / "checkpoint-2" / "model.safetensors").read_bytes() == b"w" * 64
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    syncer.finish()  # the end of the run: everything, once more
    assert (store / "metrics.jsonl").read_text().count("\n") == 2
