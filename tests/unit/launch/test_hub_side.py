"""The Hub side of a launch through huggingface_hub's real client, against the local stand-in (tests/hub_standin.py):
the bundle's blobs sent once whatever launch ships them again, an interrupted upload resumed without sending anything
twice, and the run folder's store (checkpoints only when complete, pruned ones deleted, pulled back)."""

from __future__ import annotations

import hashlib
import json

import pytest
from hub_standin import LFS_FROM

from anyfit.config import ConfigError
from anyfit.launch.bundle import Bundle, Shipped
from anyfit.launch.hf_jobs import HfJobs
from anyfit.launch.store import HubStore

REPO = "me/anyfit-launches"


def bundle(tmp_path, run: str, contents: dict[str, bytes]) -> Bundle:
    """A staged launch whose blobs are ``contents`` (name -> bytes), as make_bundle lays it out."""
    blobs, files = {}, {}
    for name, data in contents.items():
        path = tmp_path / "src" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        digest = hashlib.sha256(data).hexdigest()
        blobs[digest], files[f"files/x/{name}"] = path, digest
    texts = {"launch.json": json.dumps({"run": run, "files": files}), "job.sh": "#!/bin/bash\n"}
    return Bundle(tmp_path / "bundle", run, blobs, texts, Shipped())


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


WHEEL, DATA, MORE = b"w" * (4 * LFS_FROM), b'{"prompt": "q"}\n', b"m" * (2 * LFS_FROM)


def test_a_blob_is_uploaded_once_whichever_launch_ships_it(hub, tmp_path):
    jobs = HfJobs("me")
    sent = jobs.upload(bundle(tmp_path / "1", "r1", {"wheel.whl": WHEEL, "d.jsonl": DATA}), REPO)
    assert sorted(sent) == sorted([sha(WHEEL), sha(DATA)])
    stored = hub.files(REPO, "dataset")
    assert stored[f"blobs/{sha(WHEEL)}"] == WHEEL and stored[f"blobs/{sha(DATA)}"] == DATA
    assert "launches/r1/launch.json" in stored and hub.repos[("dataset", REPO)].private
    assert hub.lfs_puts == [sha(WHEEL)]  # the large blob through LFS, the small one inline
    # a second launch: the same wheel and data and one new file; only the new one is sent
    before = list(hub.regular_sent)
    sent = jobs.upload(bundle(tmp_path / "2", "r2", {"wheel.whl": WHEEL, "d.jsonl": DATA, "more.bin": MORE}), REPO)
    assert sent == [sha(MORE)] and hub.lfs_puts == [sha(WHEEL), sha(MORE)]
    assert [p for p in hub.regular_sent[len(before):] if p.startswith("blobs/")] == []
    assert {"launches/r1/job.sh", "launches/r2/job.sh"} <= set(hub.files(REPO, "dataset"))


def test_an_interrupted_upload_resumes_without_sending_anything_twice(hub, tmp_path):
    jobs = HfJobs("me")
    hub.fail_commits = 1  # the content reaches the Hub, the commit does not: the connection drops
    staged = bundle(tmp_path, "r1", {"wheel.whl": WHEEL, "more.bin": MORE, "d.jsonl": DATA})
    with pytest.raises(ConfigError, match=r"^uploading the launch to me/anyfit-launches: .*\(HTTP 500\)$"):
        jobs.upload(staged, REPO)
    assert not any(p.startswith("blobs/") for p in hub.files(REPO, "dataset"))  # nothing half-committed
    assert sorted(hub.lfs_puts) == sorted([sha(WHEEL), sha(MORE)])
    jobs.upload(staged, REPO)  # the launch again: the LFS objects the Hub holds are not sent again
    assert sorted(hub.lfs_puts) == sorted([sha(WHEEL), sha(MORE)])
    assert {f"blobs/{sha(x)}" for x in (WHEEL, MORE, DATA)} <= set(hub.files(REPO, "dataset"))


def checkpoint(run, step: int, complete: bool = True):
    """A checkpoint folder as the loop leaves it: written under a hidden name, renamed once its manifest is in."""
    folder = run / (f"checkpoint-{step}" if complete else f".checkpoint-{step}.tmp")
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(bytes([step]) * (2 * LFS_FROM))
    (folder / "trainer_state.json").write_text(json.dumps({"step": step}))
    (folder / "manifest.json").write_text("{}")


def test_the_run_folder_store_on_the_hub(hub, tmp_path):
    run, store = tmp_path / "run", HubStore("me/r1")
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    checkpoint(run, 2)
    checkpoint(run, 4, complete=False)  # still being written: not sent
    assert store.push(run) and not store.push(run)  # nothing changed: nothing sent
    assert hub.repos[("model", "me/r1")].private
    held = hub.files("me/r1")
    assert set(held) == {"metrics.jsonl", "checkpoint-2/model.safetensors", "checkpoint-2/trainer_state.json",
                         "checkpoint-2/manifest.json"}
    # checkpoint-4 completes (renamed), checkpoint-2 is pruned (train.keep_last), the metrics grow
    (run / ".checkpoint-4.tmp").rename(run / "checkpoint-4")
    for p in (run / "checkpoint-2").iterdir():
        p.unlink()
    (run / "checkpoint-2").rmdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    puts = len(hub.lfs_puts)
    assert store.push(run)
    held = hub.files("me/r1")
    assert not any(p.startswith("checkpoint-2/") for p in held) and "checkpoint-4/manifest.json" in held
    assert held["metrics.jsonl"].count(b"\n") == 2 and len(hub.lfs_puts) == puts + 1  # only the new weights
    # pulled back on a fresh machine: the same files, the checkpoints to resume from
    back = tmp_path / "machine-2" / "run"
    assert HubStore("me/r1").pull(back) == ["checkpoint-4"]
    assert {p.relative_to(back).as_posix() for p in back.rglob("*") if p.is_file()} == set(held)
    assert HubStore("me/nothing-yet").pull(tmp_path / "fresh") == []


def test_a_checkpoint_whose_push_was_cut_short_is_not_pulled(hub, tmp_path):
    run, store = tmp_path / "run", HubStore("me/r2")
    run.mkdir()
    checkpoint(run, 2)
    store.push(run)
    checkpoint(run, 4)
    hub.fail_commit_of = "checkpoint-4/manifest.json"  # its files went up; the commit of its manifest is lost
    with pytest.raises(Exception, match="500"):
        store.push(run)
    held = hub.files("me/r2")
    assert "checkpoint-4/model.safetensors" in held and "checkpoint-4/manifest.json" not in held
    back = tmp_path / "back"
    assert HubStore("me/r2").pull(back) == ["checkpoint-2"] and not (back / "checkpoint-4").exists()
    assert store.push(run) and "checkpoint-4/manifest.json" in hub.files("me/r2")  # the next push completes it
