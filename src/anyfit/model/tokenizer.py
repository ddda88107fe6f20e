"""The tokenizer of a configured model, with a pad token: what ``anyfit prepare`` and ``anyfit render`` need, without
the modeling stack (transformers' modeling code and anyfit's attention: about 6 s of a 2-core VM's start-up that a
data-only command would pay for nothing)."""

from __future__ import annotations

from anyfit.config import ConfigError, ModelConfig
from anyfit.hub import check_model_id
from anyfit.model.source import ModelSource


def load_tokenizer(cfg: ModelConfig):
    """The tokenizer, with a pad token set when it has none (padding is masked out, so EOS is safe)."""
    from transformers import AutoTokenizer

    src = ModelSource.from_config(cfg)
    if src.gguf_file and not cfg.tokenizer:  # gguf's reader says nothing useful of a file cut short
        src.check_weights()
    kwargs = dict(trust_remote_code=cfg.trust_remote_code, revision=cfg.revision)
    if cfg.tokenizer:
        check_model_id(cfg.tokenizer, cfg.revision, key="model.tokenizer")
        tok = AutoTokenizer.from_pretrained(cfg.tokenizer, **kwargs)
    else:
        tok = AutoTokenizer.from_pretrained(src.path, gguf_file=src.gguf_file, **kwargs)
    return ensure_pad_token(tok, cfg.tokenizer or cfg.name_or_path)


def ensure_pad_token(tokenizer, name: str):
    """Give a tokenizer without a pad token its EOS (or UNK) as pad: padding is masked out, so it is safe."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
    if tokenizer.pad_token is None:
        raise ConfigError(f"The tokenizer of {name} has no pad, eos or unk token to pad with.")
    return tokenizer
