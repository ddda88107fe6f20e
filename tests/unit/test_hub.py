"""Model names that are not local paths: one-line errors, fast, offline or with a typo, without the hub.

The hub is never contacted: offline mode, a closed port (connection refused at once), a port that drops every
connection, and a stand-in hub on localhost that answers the way huggingface.co does (status and X-Error-Code
headers). "Fast" is shown by what is asked, not by a clock: offline, no connection at all; unreachable or
answering, a bounded number of requests (no client retries with back-off, which is what made such errors slow)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from endpoints import DroppingPort
from tiny_runs import HANG_S

from anyfit.config import ConfigError
from anyfit.hub import check_dataset_id, check_model_id, data_looks_local, innermost_message, is_hub_id, looks_local

UNREACHABLE = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused at once


@pytest.fixture
def dropping_port() -> Iterator[DroppingPort]:
    port = DroppingPort()
    yield port
    port.sock.close()


def run_check(tmp_path, name: str, check: str = "check_model_id", **env: str) -> dict:
    """check_model_id in a fresh interpreter (huggingface_hub reads HF_* settings at import) with its own
    empty cache; returns the error message (None if it passed)."""
    code = textwrap.dedent(f"""
        import json
        from anyfit.config import ConfigError
        from anyfit.hub import {check}
        try:
            {check}({name!r})
            error = None
        except ConfigError as e:
            error = str(e)
        print(json.dumps({{"error": error}}))
    """)
    base = {"PATH": "/usr/bin:/bin", "HF_HOME": str(tmp_path / "hf"), "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                          timeout=HANG_S, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def cache_model(tmp_path, repo: str, filename: str = "config.json") -> None:
    """Lay out the hub cache the way a download leaves it (refs/main -> snapshots/<commit>/<file>)."""
    folder = tmp_path / "hf" / "hub" / f"models--{repo.replace('/', '--')}"
    commit = "0" * 40
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    (folder / "snapshots" / commit).mkdir(parents=True)
    (folder / "snapshots" / commit / filename).write_text("{}")


def test_local_paths_are_left_to_the_loader(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-model").mkdir()
    for name in ("my-model", "./missing", "/abs/missing", "~/missing", "model.gguf", str(tmp_path)):
        assert looks_local(name)
        check_model_id(name, None)  # no error: ModelSource explains missing paths itself
    assert not looks_local("Qwen/Qwen2.5-0.5B") and not looks_local("gpt2")


def test_an_invalid_name_is_explained(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="not a valid hub id") as e:
        check_model_id("Qwen/Qwen2.5 0.5B/extra", None)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["Qwen/Qwen2.5-0.5b-instrukt", "my-model"])
def test_offline_and_not_cached_fails_fast_in_one_line(tmp_path, name, dropping_port):
    result = run_check(tmp_path, name, HF_HUB_OFFLINE="1", HF_ENDPOINT=dropping_port.url)
    # no network wait: a lookup would cost the hub client's 10 s timeout and its retries; offline, nothing is asked
    assert dropping_port.connections == 0
    assert result["error"].startswith(f"model.name_or_path: offline (HF_HUB_OFFLINE is set) and {name} is not in "
                                      "the local cache, and it is not a local path either")
    assert "\n" not in result["error"]


def test_offline_and_cached_passes(tmp_path):
    cache_model(tmp_path, "Qwen/Qwen2.5-0.5B-Instruct")
    assert run_check(tmp_path, "Qwen/Qwen2.5-0.5B-Instruct", HF_HUB_OFFLINE="1")["error"] is None


def test_an_unreachable_hub_fails_fast_in_one_line(tmp_path, dropping_port):
    dropped = run_check(tmp_path, "Qwen/Qwen2.5-0.5b-instrukt", HF_ENDPOINT=dropping_port.url)
    assert dropped["error"].startswith("model.name_or_path: cannot reach the hub")
    assert 1 <= dropping_port.connections <= MAX_LOOKUPS  # asked once, no retries with back-off
    result = run_check(tmp_path, "Qwen/Qwen2.5-0.5b-instrukt", HF_ENDPOINT=UNREACHABLE)
    assert result["error"].startswith(f"model.name_or_path: cannot reach the hub at {UNREACHABLE} to look up "
                                      "Qwen/Qwen2.5-0.5b-instrukt")
    assert "\n" not in result["error"]
    # a cached model needs no hub
    cache_model(tmp_path, "Qwen/Qwen2.5-0.5B-Instruct")
    assert run_check(tmp_path, "Qwen/Qwen2.5-0.5B-Instruct", HF_ENDPOINT=UNREACHABLE)["error"] is None


# Requests one check may make: the model's config.json, then (GGUF-only repositories) the file asked for; on a
# dropped connection the HTTP client reconnects once (2 seen). A client retrying with back-off makes more.
MAX_LOOKUPS = 2


class FakeHub(BaseHTTPRequestHandler):
    """Answers HEAD [/datasets]/<org>/<name>/resolve/<revision>/<file> as the hub does, by the repository name;
    counts the requests (``FakeHub.requests``)."""

    requests = 0

    ANSWERS = {"typo": (401, "RepoNotFound"), "gated": (403, "GatedRepo"), "gguf-only": (404, "EntryNotFound"),
               "broken": (500, None), "ok": (200, None)}

    def do_HEAD(self):  # noqa: N802 - http.server's naming
        type(self).requests += 1
        _, org, name, _, revision, filename = self.path.removeprefix("/datasets").split("/", 5)
        status, code = self.ANSWERS[name]
        if revision == "no-such-branch":
            status, code = 404, "RevisionNotFound"
        if name == "gguf-only" and filename.endswith(".gguf"):
            status, code = 200, None
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Repo-Commit", "0" * 40)
        self.send_header("ETag", '"abc"')
        self.send_header("Content-Length", "2")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_hub(monkeypatch):
    from huggingface_hub import constants

    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    yield
    server.shutdown()


@pytest.mark.parametrize("name, revision, gguf_file, expected", [
    ("Org/typo", None, None, "the hub has no model 'Org/typo' (or it is private and you are not logged in), "
                             "and it is not a local path either"),
    ("Org/gated", None, None, "Org/gated is gated: accept its conditions"),
    ("Org/ok", "no-such-branch", None, "model.revision: 'no-such-branch' is not a branch, tag or commit of Org/ok"),
    ("Org/gguf-only", None, None, "has no config.json. Is it a GGUF-only repository?"),
    ("Org/broken", None, None, "cannot reach the hub"),
    ("Org/ok", None, None, None),
    ("Org/gguf-only", None, "m-Q4.gguf", None),
])
def test_hub_answers_become_one_line_errors(fake_hub, name, revision, gguf_file, expected):
    FakeHub.requests = 0
    if expected is None:
        check_model_id(name, revision, gguf_file)
    else:
        with pytest.raises(ConfigError) as e:
            check_model_id(name, revision, gguf_file)
        assert expected in str(e.value) and "\n" not in str(e.value)
    assert 1 <= FakeHub.requests <= MAX_LOOKUPS  # each answer taken as it comes, not retried


@pytest.mark.parametrize("name, expected", [
    ("Org/typo", "data.path: the hub has no data set 'Org/typo' (or it is private and you are not logged in)"),
    ("Org/gated", "data.path: data set Org/gated is gated: accept its conditions"),
    ("Org/broken", "data.path: cannot reach the hub"),
    ("Org/ok", None),
    ("Org/gguf-only", None),  # a repository without a card (README.md) still exists
])
def test_hub_answers_on_data_sets_become_one_line_errors(fake_hub, name, expected):
    if expected is None:
        check_dataset_id(name)
    else:
        with pytest.raises(ConfigError) as e:
            check_dataset_id(name)
        assert str(e.value).startswith(expected) and "\n" not in str(e.value)


@pytest.mark.slow
def test_data_set_offline_unreachable_or_cached(tmp_path, dropping_port):
    offline = run_check(tmp_path, "openai/gsm8k", "check_dataset_id", HF_DATASETS_OFFLINE="1")
    assert offline["error"].startswith("data.path: offline (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set) and "
                                       "data set openai/gsm8k is not in the local cache")
    unreachable = run_check(tmp_path, "openai/gsm8k", "check_dataset_id", HF_ENDPOINT=UNREACHABLE)
    assert unreachable["error"].startswith(f"data.path: cannot reach the hub at {UNREACHABLE} to look up data set "
                                           "openai/gsm8k")
    dropped = run_check(tmp_path, "openai/gsm8k", "check_dataset_id", HF_ENDPOINT=dropping_port.url)
    assert dropped["error"].startswith("data.path: cannot reach the hub")
    assert 1 <= dropping_port.connections <= MAX_LOOKUPS  # not datasets' ~30 s of retries
    (tmp_path / "hf" / "hub" / "datasets--openai--gsm8k").mkdir(parents=True)  # what a download leaves
    assert run_check(tmp_path, "openai/gsm8k", "check_dataset_id", HF_ENDPOINT=UNREACHABLE)["error"] is None


def test_one_owner_tells_hub_names_from_paths(tmp_path, monkeypatch):
    """Models, data sets and model cards ask the same module (the rules differ: a data set name has no suffix)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for spec in ("train.jsonl", "data/x", "./gsm8k", "a/b/c", "/abs/file", "~/f", "raw.csv", tmp_path.name):
        assert data_looks_local(spec) or spec == tmp_path.name, spec
    (tmp_path / "gsm8k").mkdir()
    assert data_looks_local("gsm8k")  # exists here
    for spec in ("openai/gsm8k", "HuggingFaceH4/MATH-500", "gsm8k-like"):
        assert not data_looks_local(spec), spec
    assert is_hub_id("Qwen/Qwen2.5-0.5B") and not is_hub_id("gpt2") and not is_hub_id("./Qwen/x")


def test_the_innermost_message_of_a_chain():
    try:
        try:
            raise FileNotFoundError("no such split: 'tset'")
        except FileNotFoundError as e:
            raise RuntimeError("generic wrapper") from e
    except RuntimeError as outer:
        assert innermost_message(outer) == "no such split: 'tset'."
    assert innermost_message(ValueError()) == "ValueError."
