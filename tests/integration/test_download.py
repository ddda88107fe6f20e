"""``anyfit download``: the plan of what a config needs, local paths, offline errors, and the download flow
against a fake hub on 127.0.0.1 (this machine has no internet; the real hub is never contacted)."""

import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
from endpoints import DroppingPort
from tiny_runs import HANG_S

from anyfit.cli import main
from anyfit.config import ConfigError, load_config
from anyfit.download import plan_downloads, select_model_files


def _cfg(*overrides):
    return load_config(None, list(overrides))


def test_plan_lists_model_tokenizer_data_and_eval(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n')
    plan = plan_downloads(_cfg("model.name_or_path=Qwen/Qwen2.5-0.5B", "model.revision=v1", "model.tokenizer=org/tok",
                               f"data.path={data}", "eval.path=openai/gsm8k", "eval.split=test[:100]",
                               "data.subset=main"))
    assert [(d.kind, d.key, d.name, d.local) for d in plan] == [
        ("model", "model.name_or_path", "Qwen/Qwen2.5-0.5B", False), ("tokenizer", "model.tokenizer", "org/tok", False),
        ("dataset", "data.path", str(data), True), ("dataset", "eval.path", "openai/gsm8k", False)]
    assert plan[0].revision == "v1" and plan[1].revision is None
    assert (plan[3].subset, plan[3].split) == ("main", "test[:100]")


def test_plan_eval_split_of_the_training_set_is_its_own_item():
    plan = plan_downloads(_cfg("model.name_or_path=a/b", "data.path=openai/gsm8k", "data.subset=main",
                               "eval.split=test"))
    assert [(d.key, d.split) for d in plan[1:]] == [("data.path", "train"), ("eval.split", "test")]
    # the same split twice is fetched once
    assert len(plan_downloads(_cfg("data.path=openai/gsm8k", "eval.split=train"))) == 1


FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "merges.txt",
         "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
         "pytorch_model.bin", "original/consolidated.00.pth", "onnx/model.onnx", "onnx/config.json",
         "model-q4.gguf", "README.md", ".gitattributes", "modeling_x.py"]


def test_select_model_files_takes_safetensors_and_side_files_only():
    assert select_model_files(FILES) == sorted([
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "merges.txt",
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"])
    assert "modeling_x.py" in select_model_files(FILES, remote_code=True)


def test_select_model_files_bin_only_and_gguf():
    bin_only = [f for f in FILES if not f.endswith(".safetensors")]
    assert "pytorch_model.bin" in select_model_files(bin_only)
    chosen = select_model_files(FILES, gguf_file="model-q4.gguf")
    assert "model-q4.gguf" in chosen and not any(f.endswith((".safetensors", ".bin")) for f in chosen)
    with pytest.raises(ConfigError, match="no 'x.gguf'; its .gguf files: model-q4.gguf"):
        select_model_files(FILES, gguf_file="x.gguf")
    with pytest.raises(ConfigError, match="set model.gguf_file"):
        select_model_files(["config.json", "model-q4.gguf"])


def test_local_paths_are_checked_and_skipped(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n')
    assert main(["download", f"model.name_or_path={model}", f"data.path={data}"]) == 0
    out = capsys.readouterr().out
    assert out.count("local path, skipped") == 2
    assert out.strip().splitlines()[-1].startswith("downloaded 0 of 2 items (0 B) into the Hugging Face cache; 2 local")


def test_missing_local_path_is_a_one_line_error(tmp_path, capsys):
    assert main(["download", f"model.name_or_path={tmp_path}/nope/model", "data.path=x.jsonl"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("anyfit: error: model.name_or_path:") and "does not exist" in err and err.count("\n") == 1


def _run(args, env, timeout=HANG_S):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    return subprocess.run([sys.executable, "-m", "anyfit", "download", *args], env={**base, **env},
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_offline_is_a_fast_one_line_error(tmp_path):
    hub = DroppingPort()  # fast: offline, nothing is asked of the network (no timeouts to wait out)
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": hub.url}
    r = _run(["model.name_or_path=nobody/no-such-model"], env)
    assert r.returncode == 2 and hub.connections == 0
    assert r.stderr.startswith("anyfit: error: model.name_or_path: offline (HF_HUB_OFFLINE is set)")
    assert r.stderr.count("\n") == 1
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n')
    r = _run([f"model.name_or_path={data.parent}", "data.path=openai/gsm8k"], env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "data.path: offline (HF_HUB_OFFLINE is set): cannot download data set openai/gsm8k" in r.stderr
    assert hub.connections == 0


# A two-file model repository, served the way the hub's HTTP API answers the few requests snapshot_download
# and anyfit's checks make: repo info, the recursive tree listing, and HEAD/GET on resolve/<revision>/<file>.
SHA = "0123456789abcdef0123456789abcdef01234567"
REPO = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"\0" * 1000,
        "pytorch_model.bin": b"\1" * 5000}


class FakeHub(BaseHTTPRequestHandler):
    requests: ClassVar[list[str]] = []

    def log_message(self, *args):  # keep pytest's output clean
        pass

    def _send(self, body: bytes, ctype="application/json", extra=None, head=False):
        self.send_response(200)
        for k, v in {"Content-Type": ctype, "Content-Length": str(len(body)), **(extra or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _answer(self, head: bool):
        path = self.path.split("?", 1)[0]
        FakeHub.requests.append(f"{self.command} {path}")
        if not path.startswith(("/api/models/org/tiny", "/org/tiny/")):
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if "/tree/" in path:
            tree = [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for name, data in REPO.items()]
            return self._send(json.dumps(tree).encode(), head=head)
        if "/revision/" in path:
            info = {"id": "org/tiny", "sha": SHA, "siblings": [{"rfilename": n} for n in REPO]}
            return self._send(json.dumps(info).encode(), head=head)
        if "/resolve/" in path:
            name = path.split("/resolve/", 1)[1].split("/", 1)[1]
            data = REPO[name]
            etag = '"' + hashlib.sha1(data).hexdigest() + '"'
            return self._send(data, "application/octet-stream", {"X-Repo-Commit": SHA, "ETag": etag}, head=head)
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):
        self._answer(head=False)

    def do_HEAD(self):
        self._answer(head=True)


@pytest.fixture
def fake_hub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    FakeHub.requests = []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.slow
def test_download_flow_against_a_fake_hub(tmp_path, fake_hub):
    env = {"HF_ENDPOINT": fake_hub, "HF_HOME": str(tmp_path / "hf"), "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1",
           "HF_HUB_DISABLE_XET": "1"}
    r = _run(["model.name_or_path=org/tiny", "--to", str(tmp_path / "out")], env)
    assert r.returncode == 0, r.stderr
    model = tmp_path / "out" / "model"
    assert (model / "config.json").read_bytes() == REPO["config.json"]
    assert (model / "model.safetensors").stat().st_size == 1000
    assert not (model / "pytorch_model.bin").exists()  # safetensors are there: the .bin is skipped
    assert "2 files, 1.0 KB (skipping 1 other files" in r.stdout
    assert "downloaded 1 of 1 items (1.0 KB) into" in r.stdout
    assert f"model.name_or_path={model}" in r.stdout
    assert not any("pytorch_model.bin" in q for q in FakeHub.requests)

    # a missing local path fails before anything is fetched
    r = _run(["model.name_or_path=org/tiny", "data.path=missing.jsonl"], {**env, "HF_HOME": str(tmp_path / "hf2")})
    assert r.returncode == 2 and "data.path: missing.jsonl is a local path that does not exist" in r.stderr
    assert not (tmp_path / "hf2" / "hub" / "models--org--tiny").exists()

    r = _run(["model.name_or_path=org/typo"], env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert r.stderr.startswith("anyfit: error: model.name_or_path: the hub has no model 'org/typo'")
