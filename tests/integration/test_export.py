"""``anyfit export``: merged folders that reload with the same logits, GGUF files that hold the model, the
model card, the Hub upload (against a recording fake Hub on 127.0.0.1) and every bad input as one line."""

from __future__ import annotations

import base64
import json
import os
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
import tiny_runs
import torch
from tiny_runs import config_for, cut_qwen_tokenizer, write_dataset
from transformers import AutoModelForCausalLM

from anyfit.cli import main
from anyfit.export import ExportError, gguf_writer
from anyfit.export import request as gguf_support  # what the GGUF writer converts is checked with the request
from anyfit.export.folder import export
from anyfit.export.gguf_writer import llama_cpp_pre_tokenizer
from anyfit.training.loop import train

IDS = torch.tensor([[3, 17, 42, 256, 511, 7, 99, 300]])


def logits_of(model_or_dir, ids=IDS) -> torch.Tensor:
    model = model_or_dir
    if not isinstance(model, torch.nn.Module):
        model = AutoModelForCausalLM.from_pretrained(model_or_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(ids).logits


# Fixtures: a tiny Llama with a cut-down Qwen2.5 tokenizer (GGUF files of the full 151k vocabulary take
# transformers 10+ s to read back), a full fine-tune run and a LoRA run.


def save_tiny(out: Path, tokenizer_dir: Path, arch: str = "llama", **overrides) -> Path:
    """The shared tiny model, 64 wide with a gentler init and no BOS (what the GGUF checks were written on)."""
    return tiny_runs.save_tiny(out, tokenizer_dir, arch, hidden_size=64, intermediate_size=128, bos_token_id=None,
                               initializer_range=0.1, **overrides)


@pytest.fixture(scope="module")
def small_tokenizer_dir(tmp_path_factory, qwen_tokenizer_dir) -> Path:
    out = tmp_path_factory.mktemp("qwen_cut_tokenizer")
    cut_qwen_tokenizer(qwen_tokenizer_dir, out)
    return out


@pytest.fixture(scope="module")
def small_llama_dir(tmp_path_factory, small_tokenizer_dir) -> Path:
    return save_tiny(tmp_path_factory.mktemp("small_llama"), small_tokenizer_dir)


def qwen3_template(real_tokenizer_dir) -> str:
    return json.loads((real_tokenizer_dir("qwen-3") / "tokenizer_config.json").read_text())["chat_template"]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny_llama_dir, real_tokenizer_dir) -> Path:
    """A finished full fine-tune of the tiny Llama (real Qwen2.5 tokenizer): 2 steps, on chats rendered with Qwen3's
    real chat template (data.chat_template) in its non-thinking mode (data.chat_template_kwargs)."""
    tmp = tmp_path_factory.mktemp("full_run")
    (tmp / "qwen3.jinja").write_text(qwen3_template(real_tokenizer_dir))
    cfg = config_for(tiny_llama_dir, write_dataset(tmp / "d.jsonl", n=8), tmp / "run", "train.effective_batch=4",
                     "train.micro_batch=4", "train.max_steps=2", "train.learning_rate=1e-2", "data.template=chat",
                     f"data.chat_template={tmp / 'qwen3.jinja'}", "data.chat_template_kwargs={enable_thinking: false}")
    train(cfg, echo=lambda *a: None)
    return tmp / "run"


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, small_llama_dir) -> Path:
    """A finished LoRA run on the small Llama, with a validation loss in its metrics: 3 steps."""
    tmp = tmp_path_factory.mktemp("lora_run")
    cfg = config_for(small_llama_dir, write_dataset(tmp / "d.jsonl", n=12), tmp / "run", "lora.enabled=true",
                     "lora.dropout=0.0", "lora.r=4", "train.effective_batch=4", "train.micro_batch=4",
                     "train.max_steps=3", "train.learning_rate=5e-2", "eval.holdout=4", "eval.every=3")
    train(cfg, echo=lambda *a: None)
    return tmp / "run"


# Merged folders


@pytest.mark.slow
def test_full_fine_tune_exports_fp32_with_the_same_logits(full_run, tmp_path, capsys):
    out = tmp_path / "exports" / "new" / "exported"  # missing folders above --out are created
    assert main(["export", str(full_run), "--out", str(out), "--dtype", "fp32"]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "README.md",
            "config.yaml"} <= {p.name for p in out.iterdir()}
    torch.testing.assert_close(logits_of(out), logits_of(full_run), rtol=0, atol=0)
    card = (out / "README.md").read_text()
    assert "full fine-tuning" in card and "Final training loss (step 2)" in card
    assert f"anyfit export {full_run} --out {out} --dtype fp32" in card  # the command that made it
    assert "learning_rate: 0.01" in card  # the training config, verbatim
    assert not list(tmp_path.glob(".*partial"))  # nothing half-written left behind
    mask = os.umask(0)
    os.umask(mask)
    # readable by whoever may read the other files: transformers writes weights private (600), mkdtemp too (700)
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == {p.name: 0o666 & ~mask for p in out.iterdir()}
    assert out.stat().st_mode & 0o777 == 0o777 & ~mask
    assert (full_run / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask  # the run's own final model

    # asked again: refused, then replaced with --overwrite
    assert main(["export", str(full_run), "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["export", str(full_run), "--out", str(out), "--dtype", "bf16", "--overwrite"]) == 0
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16


@pytest.mark.slow
def test_the_export_renders_qwen3_prompts_as_trained_without_the_options(full_run, tiny_llama_dir,
                                                                         real_tokenizer_dir, tmp_path):
    """Trained with Qwen3's template and {enable_thinking: false}: the export renders that way with no options
    passed (a server given the folder), still thinks when asked to, and its chat_template.jinja alone, rendered with
    Jinja as vLLM or llama.cpp would, gives the same. A run saved before the options were written into its template
    (its chat_template.jinja without them) gets them in its export too."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from transformers import AutoTokenizer

    trained = AutoTokenizer.from_pretrained(tiny_llama_dir)
    trained.chat_template = qwen3_template(real_tokenizer_dir)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Repeat red"},
            {"role": "assistant", "content": "red #0"}, {"role": "user", "content": "Repeat blue gold"}]

    def rendering(tok, **options) -> str:
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **options)

    no_thinking, thinking = rendering(trained, enable_thinking=False), rendering(trained, enable_thinking=True)
    assert no_thinking.endswith("<think>\n\n</think>\n\n") and no_thinking != thinking
    older = tmp_path / "older"  # the run as saved before: its own template, no defaults
    shutil.copytree(full_run, older)
    (older / "chat_template.jinja").write_text(qwen3_template(real_tokenizer_dir))
    assert rendering(AutoTokenizer.from_pretrained(older)) == thinking
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)  # transformers' settings, vLLM's
    for run in (full_run, older):
        out = export(run, tmp_path / f"{run.name}-export", echo=lambda *a: None).out
        served = AutoTokenizer.from_pretrained(out)
        assert rendering(served) == no_thinking, run
        assert rendering(served, enable_thinking=True) == thinking  # a server's explicit option still wins
        assert rendering(served, enable_thinking=False) == no_thinking
        text = env.from_string((out / "chat_template.jinja").read_text()).render(
            messages=msgs, add_generation_prompt=True, bos_token=served.bos_token, eos_token=served.eos_token)
        assert text == no_thinking


def test_lora_run_merges_into_a_folder_with_the_adapter_on_base_logits(lora_run, small_llama_dir, tmp_path):
    from peft import PeftModel

    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"accuracy": 0.625, "n": 8, "format_rate": 0.75, "model": "lora"}))
    result = export(lora_run, tmp_path / "merged", eval_summary=summary, echo=lambda *a: None)
    out = result.out
    assert result.merged_adapter and result.dtype == "fp32"  # the base's recorded dtype
    assert not (out / "adapter_config.json").exists() and (out / "model.safetensors").is_file()

    on_base = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(small_llama_dir, dtype=torch.float32),
                                        lora_run)
    base_only = logits_of(small_llama_dir)
    expected = logits_of(on_base)
    assert (expected - base_only).abs().max() > 1e-3  # the adapter moved the model: the test can tell
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(merged).__name__ == "LlamaForCausalLM"  # no PEFT wrapper left
    torch.testing.assert_close(logits_of(merged), expected, rtol=1e-5, atol=1e-5)

    card = (out / "README.md").read_text()
    metrics = [json.loads(line) for line in (lora_run / "metrics.jsonl").read_text().splitlines()]
    val_loss = [m["val_loss"] for m in metrics if "val_loss" in m][-1]
    assert str(small_llama_dir) not in card.split("## Training")[0]  # a path on this machine tells a reader nothing
    for text in (f"A supervised fine-tune of a local model folder `{small_llama_dir.name}`", "LoRA (r=4, alpha=32", "merged into the base",
                 "Source: `", "template: `plain`", f"Validation loss (step 3): {val_loss:.4f}", "| accuracy | 62.5% |",
                 "| format_rate | 75.0% |", "- lora"):
        assert text in card, text
    assert card.startswith("---\nlibrary_name: transformers")  # Hub metadata first


def test_the_export_stops_generating_at_the_chat_templates_end_of_turn(tiny_qwen2_dir, tmp_path):
    """A base model whose EOS is <|endoftext|> while its chat template ends turns with <|im_end|> (Qwen2.5 and
    SmolLM2 base models): transformers, generating from the export, ends the answer at <|im_end|>."""
    from transformers import AutoTokenizer, LogitsProcessor

    base = tmp_path / "base"  # the tiny Qwen2, with the base tokenizer and configs that stop at <|endoftext|> only
    shutil.copytree(tiny_qwen2_dir, base)
    tokenizer_config = json.loads((base / "tokenizer_config.json").read_text())
    (base / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "eos_token": "<|endoftext|>"}))
    tok = AutoTokenizer.from_pretrained(base)
    endoftext, im_end = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    shipped = {"bos_token_id": endoftext, "eos_token_id": endoftext, "repetition_penalty": 1.05, "top_k": 20}
    (base / "generation_config.json").write_text(json.dumps(shipped))
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "eos_token_id": endoftext}))

    lines = []
    out = export(base, tmp_path / "out", dtype="fp32", echo=lines.append).out
    assert "[anyfit] export: generation stops at <|endoftext|>, <|im_end|>" in lines
    written = json.loads((out / "generation_config.json").read_text())
    assert written["eos_token_id"] == [endoftext, im_end]
    assert {k: written[k] for k in ("bos_token_id", "repetition_penalty", "top_k")} == {
        "bos_token_id": endoftext, "repetition_penalty": 1.05, "top_k": 20}  # the rest as the base ships it

    class EndOfTurnAtStep(LogitsProcessor):
        """The answer "Hi Hi" and then <|im_end|>; the same word after it, had generation gone on."""

        def __init__(self, start: int, word: int):
            self.start, self.word = start, word

        def __call__(self, input_ids, scores):
            forced = torch.full_like(scores, -float("inf"))
            forced[:, im_end if input_ids.shape[1] - self.start == 2 else self.word] = 0
            return forced

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hi twice."}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    start, word = prompt["input_ids"].shape[1], tok("Hi")["input_ids"][0]

    def generate(**settings) -> list[int]:
        ids = model.generate(**prompt, max_new_tokens=10, do_sample=False,
                             logits_processor=[EndOfTurnAtStep(start, word)], **settings)
        return ids[0, start:].tolist()

    assert generate() == [word, word, im_end]  # the export's own generation config
    assert len(generate(eos_token_id=endoftext)) == 10  # the base's: on past the turn to max_new_tokens


# GGUF


@pytest.mark.parametrize("qtype", ["f16", "q8_0"])
def test_gguf_holds_the_merged_model(qtype, lora_run, tmp_path):
    result = export(lora_run, tmp_path / "out", gguf=qtype, echo=lambda *a: None)
    path, agreement = result.gguf[qtype], result.agreement[qtype]
    assert path == result.out / f"out-{qtype.upper()}.gguf" and path.is_file()
    assert agreement.conversion_diff <= 1e-5  # the file is exactly the merged model, rounded
    assert agreement.greedy_match == agreement.prompts == 5  # 4 prompts + 1 chat turn
    # the rounding itself stays small at these widths (on a real model too: see the README)
    assert agreement.max_rel_diff < (0.005 if qtype == "f16" else 0.1)
    assert agreement.top1_agreement >= 0.9
    print(f"{qtype}: {agreement.describe()}")

    # what another tool sees: transformers reads the file with the same next-token choices
    reread = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ids = torch.tensor([[5, 60, 301, 999, 1000, 42]])
    torch.testing.assert_close(logits_of(reread, ids), logits_of(result.out, ids), rtol=0,
                               atol=0.05 if qtype == "q8_0" else 0.005)
    card = (result.out / "README.md").read_text()
    assert f"| `{path.name}` | {qtype} |" in card and "- gguf" in card


@pytest.mark.parametrize(("arch", "qtype"), [("qwen2", "q4_0"), ("qwen3", "q5_1")])
def test_qwen_ggufs_at_low_widths(arch, qtype, tmp_path, small_tokenizer_dir):
    # Qwen2 has q/k/v biases, Qwen3 q/k norms; neither permutes q/k
    model_dir = save_tiny(tmp_path / arch, small_tokenizer_dir, arch=arch)
    result = export(model_dir, tmp_path / "out", dtype="fp32", gguf=qtype, echo=lambda *a: None)
    agreement = result.agreement[qtype]
    assert agreement.conversion_diff <= 1e-5
    print(f"{qtype} ({arch}): {agreement.describe()}")


def test_llama3_rope_scaling_goes_into_the_gguf(tmp_path, small_tokenizer_dir):
    import gguf

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # small: the scaling bites
    model_dir = save_tiny(tmp_path / "llama3", small_tokenizer_dir, rope_parameters=rope)
    result = export(model_dir, tmp_path / "out", gguf="f16", echo=lambda *a: None)
    assert result.agreement["f16"].conversion_diff <= 1e-5
    tensors = {t.name: t for t in gguf.GGUFReader(result.gguf["f16"]).tensors}
    assert tensors["rope_freqs.weight"].data.tolist() == gguf_writer._llama3_rope_factors(
        AutoModelForCausalLM.from_pretrained(model_dir).config).tolist()


def test_a_wrong_conversion_fails_the_export(small_llama_dir, tmp_path, monkeypatch):
    # llama.cpp's llama layout interleaves the rotary halves of q and k; leave that out and the check sees it
    monkeypatch.setitem(gguf_support.GGUF_ARCHS, "LlamaForCausalLM", gguf_support.GGUFArch("LLAMA", False))
    with pytest.raises(ExportError, match="does not hold the merged model"):
        export(small_llama_dir, tmp_path / "out", gguf="f16", echo=lambda *a: None)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".*partial"))


def test_llama_cpp_pre_tokenizer_is_recognised_by_how_it_splits(qwen_tokenizer):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    assert llama_cpp_pre_tokenizer(qwen_tokenizer) == "qwen2"

    def with_pre(pre) -> PreTrainedTokenizerFast:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre
        return PreTrainedTokenizerFast(tokenizer_object=tok)

    llama3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")
    assert llama_cpp_pre_tokenizer(with_pre(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(llama3), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))) == "llama-bpe"
    assert llama_cpp_pre_tokenizer(with_pre(pre_tokenizers.ByteLevel(add_prefix_space=False))) == "gpt-2"
    assert llama_cpp_pre_tokenizer(with_pre(pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]))) == "smollm"
    with pytest.raises(ExportError, match="none of llama.cpp's known"):
        llama_cpp_pre_tokenizer(with_pre(pre_tokenizers.Whitespace()))


def test_llama3_rope_factors_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = LlamaConfig(hidden_size=2048, num_attention_heads=32, head_dim=64, max_position_embeddings=131072,
                         rope_parameters=rope)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    default = 1.0 / 500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    factors = torch.from_numpy(gguf_writer._llama3_rope_factors(config))
    torch.testing.assert_close(default / factors, scaled, rtol=1e-5, atol=0)  # llama.cpp divides by them


# The Hub, up to the HTTP boundary: a fake Hub on 127.0.0.1 that records what it is sent


class FakeHub(BaseHTTPRequestHandler):
    requests: ClassVar[list[tuple[str, str, str | None, bytes]]] = []
    refuse = False

    def log_message(self, *args):
        pass

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.requests.append(("POST", self.path, self.headers.get("authorization"), body))
        host = f"http://{self.headers['Host']}"
        if self.refuse:
            return self._reply(401, {"error": "Invalid credentials in Authorization header"})
        if self.path == "/api/repos/create":
            request = json.loads(body)
            return self._reply(200, {"url": f"{host}/{request['organization']}/{request['name']}"})
        if self.path == "/api/validate-yaml":
            return self._reply(200, {"errors": [], "warnings": []})
        if self.path.endswith("/preupload/main"):  # everything inline: no LFS or Xet storage behind this fake
            files = json.loads(body)["files"]
            return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                               for f in files]})
        if self.path.endswith("/commit/main"):
            repo = self.path.removeprefix("/api/models/").removesuffix("/commit/main")
            return self._reply(200, {"commitUrl": f"{host}/{repo}/commit/{'a' * 40}", "commitOid": "a" * 40})
        self._reply(404, {"error": f"not faked: {self.path}"})


@pytest.fixture
def fake_hub():
    from huggingface_hub import HfApi

    FakeHub.requests, FakeHub.refuse = [], False
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield HfApi(endpoint=f"http://127.0.0.1:{server.server_address[1]}", token="hf_test_token")
    server.shutdown()
    server.server_close()


def test_push_creates_the_repo_and_uploads_the_folder_in_one_commit(fake_hub, small_llama_dir, tmp_path):
    result = export(small_llama_dir, tmp_path / "out", push="someone/tiny-export", private=True, api=fake_hub,
                    echo=lambda *a: None)
    assert result.pushed == f"{fake_hub.endpoint}/someone/tiny-export"
    paths = [p for _, p, _, _ in FakeHub.requests]
    assert paths == ["/api/repos/create", "/api/validate-yaml", "/api/models/someone/tiny-export/preupload/main",
                     "/api/models/someone/tiny-export/commit/main"]
    assert all(auth == "Bearer hf_test_token" for _, _, auth, _ in FakeHub.requests)
    assert json.loads(FakeHub.requests[0][3]) == {"name": "tiny-export", "organization": "someone",
                                                  "visibility": "private", "type": "model"}
    lines = [json.loads(line) for line in FakeHub.requests[-1][3].decode().splitlines()]
    uploaded = {line["value"]["path"]: base64.b64decode(line["value"]["content"]) for line in lines
                if line["key"] == "file"}
    assert set(uploaded) == {p.name for p in result.out.iterdir()}
    assert uploaded["README.md"] == (result.out / "README.md").read_bytes()
    assert uploaded["model.safetensors"] == (result.out / "model.safetensors").read_bytes()


def test_a_refused_push_is_one_line_and_keeps_the_export(fake_hub, small_llama_dir, tmp_path):
    FakeHub.refuse = True
    with pytest.raises(ExportError, match=r"pushing .* to someone/tiny failed: .*401") as e:
        export(small_llama_dir, tmp_path / "out", push="someone/tiny", api=fake_hub, echo=lambda *a: None)
    assert "\n" not in str(e.value) and (tmp_path / "out" / "model.safetensors").is_file()

    from huggingface_hub import HfApi

    nobody = HfApi(endpoint="http://127.0.0.1:9", token="hf_test_token")  # nothing listens there
    with pytest.raises(ExportError, match="ConnectError"):
        export(small_llama_dir, tmp_path / "out2", push="someone/tiny", api=nobody, echo=lambda *a: None)


# Every bad input: one line, exit 2, before any weights are loaded


def run_cli(capsys, *args: str) -> str:
    assert main(["export", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("anyfit: error: ") and err.count("\n") == 1, err
    return err


def test_bad_inputs_are_one_line_errors(capsys, tmp_path, small_llama_dir, monkeypatch):
    assert "does not exist" in run_cli(capsys, str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    assert "neither a model" in run_cli(capsys, str(tmp_path / "empty"))
    unfinished = tmp_path / "unfinished"
    (unfinished / "checkpoint-4").mkdir(parents=True)
    (unfinished / "config.yaml").write_text("train: {max_steps: 8}\n")
    err = run_cli(capsys, str(unfinished))
    assert "unfinished training run" in err and "checkpoint-4" in err
    assert "--dtype 'float8'" in run_cli(capsys, str(small_llama_dir), "--dtype", "float8")
    assert "not a GGUF type" in run_cli(capsys, str(small_llama_dir), "--gguf", "q3")
    assert "llama-quantize" in run_cli(capsys, str(small_llama_dir), "--gguf", "q4_k_m")
    (tmp_path / "taken").mkdir()
    assert "already exists" in run_cli(capsys, str(small_llama_dir), "--out", str(tmp_path / "taken"))
    assert "would replace the model" in run_cli(capsys, str(small_llama_dir), "--out", str(small_llama_dir))
    (tmp_path / "a-file").write_text("")
    assert "a-file is a file, not a folder" in run_cli(capsys, str(small_llama_dir), "--out",
                                                       str(tmp_path / "a-file" / "x" / "o"))
    assert "no such file" in run_cli(capsys, str(small_llama_dir), "--out", str(tmp_path / "o"),
                                     "--eval-summary", str(tmp_path / "summary.json"))
    assert "not a Hub repository id" in run_cli(capsys, str(small_llama_dir), "--out", str(tmp_path / "o"),
                                                "--push", "a/b/c")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    assert "GGUF export handles" in run_cli(capsys, str(gpt2), "--out", str(tmp_path / "o"), "--gguf", "f16")
    monkeypatch.setitem(__import__("sys").modules, "gguf", None)  # as if gguf were not installed
    assert "pip install gguf" in run_cli(capsys, str(small_llama_dir), "--out", str(tmp_path / "o"), "--gguf", "f16")
    assert not (tmp_path / "o").exists()


def test_push_without_a_token_is_refused_before_exporting(capsys, tmp_path, small_llama_dir, monkeypatch):
    from huggingface_hub import get_token

    monkeypatch.delenv("HF_TOKEN", raising=False)
    if get_token() is not None:
        pytest.skip("this machine has a stored Hugging Face token")
    assert "needs a Hugging Face token" in run_cli(capsys, str(small_llama_dir), "--out", str(tmp_path / "o"),
                                                   "--push", "someone/tiny")
    assert not (tmp_path / "o").exists()


def test_a_checkpoint_exports_with_the_metrics_up_to_its_step(lora_run, tmp_path):
    # a checkpoint folder is a complete model; its metrics are the run's lines up to its step
    checkpoint = tmp_path / "run" / "checkpoint-2"
    shutil.copytree(lora_run, checkpoint, ignore=shutil.ignore_patterns("metrics.jsonl", "run_info.json"))
    lines = [json.loads(line) for line in (lora_run / "metrics.jsonl").read_text().splitlines()]
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    result = export(checkpoint, tmp_path / "out", echo=lambda *a: None)
    card = (result.out / "README.md").read_text()
    assert "Final training loss (step 2)" in card and "Validation loss" not in card  # val_loss came at step 3


def test_the_runs_template_options_are_the_saved_templates_defaults(tiny_qwen2_dir, tmp_path):
    """data.chat_template and data.chat_template_kwargs: the tokenizer saved with a checkpoint, the final model and
    the export renders as training did for a caller that passes no options (a server given the folder)."""
    from transformers import AutoTokenizer

    from anyfit.training.loop import train

    template = tmp_path / "t.jinja"
    template.write_text("{% if mode is defined and mode == 'short' %}SHORT {% endif %}{% for m in messages %}"
                        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    cfg = config_for(tiny_qwen2_dir, write_dataset(tmp_path / "d.jsonl", n=8), tmp_path / "run", "data.template=chat",
                     f"data.chat_template={template}", "data.chat_template_kwargs={mode: short}",
                     "train.effective_batch=4", "train.micro_batch=4", "train.max_steps=2", "train.save_every=1")
    train(cfg)
    out = export(tmp_path / "run", tmp_path / "out", dtype="fp32", echo=lambda *a: None).out
    chat = [{"role": "user", "content": "Hi?"}]
    for folder in (tmp_path / "run", tmp_path / "run" / "checkpoint-1", out):
        tok = AutoTokenizer.from_pretrained(folder)
        assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False).startswith("SHORT "), folder
        assert not tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, mode="long").startswith(
            "SHORT")
