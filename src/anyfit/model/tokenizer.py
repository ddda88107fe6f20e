"""The tokenizer of a configured model, with a pad token: what ``anyfit prepare`` and ``anyfit render`` need, without
the modeling stack (transformers' modeling code and anyfit's attention: about 6 s of a 2-core VM's start-up that a
data-only command would pay for nothing).

The tokenizer is checked against its own ``tokenizer.json``: transformers 5 rebuilds some tokenizers from the class
their config names instead of their file (DeepSeek-R1's config says LlamaTokenizerFast over a byte-level vocabulary:
transformers 5.18 then drops its spaces and newlines; MiniMax-M1/M2's says GPT2Tokenizer: 5.23 then splits text with
GPT-2's pattern, not MiniMax's). Such a tokenizer trains ids the model was not released with, so it is reloaded as
the file itself (transformers' generic fast tokenizer), in one printed line.
"""

from __future__ import annotations

import os
from pathlib import Path

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
    return ensure_pad_token(as_its_file(tok, cfg.revision), cfg.tokenizer or cfg.name_or_path)


# Spaces, newlines, tabs, digits and non-Latin text: what a tokenizer rebuilt from the wrong class gets wrong.
_PROBE = "Two  spaces,\n\nnew lines\tand tabs: 1234 héllo wörld 你好 <think>\nstep\n</think>\n\n"


def as_its_file(tokenizer, revision: str | None = None):
    """``tokenizer``, or, where its ids differ from its own tokenizer.json's on a probe text, that file loaded as
    it is (see the module docstring); a ConfigError where even that differs."""
    file = _tokenizer_file(tokenizer.name_or_path, revision)
    if file is None:  # a GGUF or slow tokenizer: no file to check against
        return tokenizer
    from tokenizers import Tokenizer

    expected = Tokenizer.from_file(str(file)).encode(_PROBE, add_special_tokens=False).ids
    if tokenizer(_PROBE, add_special_tokens=False)["input_ids"] == expected:
        return tokenizer
    import transformers
    from transformers import PreTrainedTokenizerFast

    exact = PreTrainedTokenizerFast.from_pretrained(file.parent)
    if exact(_PROBE, add_special_tokens=False)["input_ids"] != expected:
        raise ConfigError(f"The tokenizer of {tokenizer.name_or_path} encodes text differently from its own "
                          f"tokenizer.json under transformers {transformers.__version__}, also when loaded as that file: "
                          "upgrade transformers, or set model.tokenizer to a tokenizer that loads as it is.")
    if os.environ.get("RANK", "0") == "0":  # once per run, not once per process of a launched run
        print(f"[anyfit] tokenizer: transformers {transformers.__version__} built {type(tokenizer).__name__} for "
              f"{tokenizer.name_or_path}, whose ids differ from its own tokenizer.json's; loaded that file as it is "
              "instead (the tokenizer the model was released with)")
    return exact


def _tokenizer_file(name_or_path: str, revision: str | None) -> Path | None:
    """The tokenizer.json a tokenizer was loaded from: in its folder, or in the hub cache (no download)."""
    local = Path(name_or_path) / "tokenizer.json"
    if local.is_file():
        return local
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name_or_path, "tokenizer.json", revision=revision)
    except Exception:  # not a hub id
        return None
    return Path(cached) if isinstance(cached, str) else None


def ensure_pad_token(tokenizer, name: str):
    """Give a tokenizer without a pad token its EOS (or UNK) as pad: padding is masked out, so it is safe."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
    if tokenizer.pad_token is None:
        raise ConfigError(f"The tokenizer of {name} has no pad, eos or unk token to pad with.")
    return tokenizer
