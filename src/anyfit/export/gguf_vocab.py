"""The tokenizer in a GGUF file: llama.cpp's "gpt2" (byte-level BPE) vocabulary, and llama.cpp's name for the
tokenizer's pre-tokenizer, found by how it splits a probe text (``llama_cpp_pre_tokenizer``)."""

from __future__ import annotations

from pathlib import Path

import gguf
import regex

from anyfit.export.errors import ExportError
from anyfit.export.local_files import read_json

# llama.cpp's pre-tokenizer names and the splitting each stands for (its llama-vocab.cpp), tried in order
# against the tokenizer's own pre-tokenizer on PROBE_TEXT. Several expressions apply one after the other.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_PRE_TOKENIZERS = {
    "qwen2": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "llama-bpe": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                  r"|\s+(?!\S)|\s+",),
    "smollm": (r"\p{N}", _GPT2),
    "gpt-2": (_GPT2,),
}
PROBE_TEXT = ("Hello world! I'm here, you'll see: DON'T stop.\n\n\tIndented  twice   spaces 12 345 67890 "
              "3.14159 $1,000.50 ab12cd x=y+z; foo_bar(baz) -> {'k': [1, 2]}\r\nhéllo wörld Ünïcode "
              "日本語テキスト 🙂🙂 end...   \n  \n")


def llama_cpp_pre_tokenizer(tokenizer) -> str:
    """llama.cpp's name for how ``tokenizer`` splits text before BPE, found by splitting PROBE_TEXT both
    ways; an ExportError if none of the known ones splits it the same (llama.cpp would tokenize differently)."""
    backend = tokenizer.backend_tokenizer
    text = backend.normalizer.normalize_str(PROBE_TEXT) if backend.normalizer is not None else PROBE_TEXT
    split = ([(text, (0, len(text)))] if backend.pre_tokenizer is None
             else backend.pre_tokenizer.pre_tokenize_str(text))
    pieces = [text[a:b] for _, (a, b) in split]
    for name, expressions in _PRE_TOKENIZERS.items():
        candidate = [text]
        for expression in expressions:
            pattern = regex.compile(expression)
            candidate = [piece for part in candidate for piece in _split_keeping_gaps(pattern, part)]
        if candidate == pieces:
            return name
    raise ExportError("GGUF export: this tokenizer splits text before BPE in a way none of llama.cpp's known "
                      f"pre-tokenizers ({', '.join(_PRE_TOKENIZERS)}) does; convert the exported folder with "
                      "llama.cpp's convert_hf_to_gguf.py.")


def _split_keeping_gaps(pattern, text: str) -> list[str]:
    """The matches and the text between them, in order (how tokenizers' and llama.cpp's splits work)."""
    pieces, pos = [], 0
    for m in pattern.finditer(text):
        if m.start() > pos:
            pieces.append(text[pos:m.start()])
        if m.end() > m.start():
            pieces.append(m.group())
        pos = m.end()
    if pos < len(text):
        pieces.append(text[pos:])
    return pieces


def add_vocab(writer, tokenizer, folder: Path, config) -> None:
    """llama.cpp's "gpt2" vocabulary: every id up to the model's vocab size (ids the tokenizer lacks become
    unused [PAD<i>] entries), token types from the tokenizer's added tokens, the merges, special ids and the
    chat template (gguf's SpecialVocab reads those from the folder)."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(llama_cpp_pre_tokenizer(tokenizer))
    reverse = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    size = config.vocab_size  # llama.cpp wants one token per embedding row
    if max(reverse) >= size:
        raise ExportError(f"GGUF export: the tokenizer has ids up to {max(reverse)} but the model only {size} "
                          "embedding rows; resize the embeddings to the tokenizer before exporting.")
    tokens, types = [], []
    for i in range(size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(reverse[i])
            # <|...|> tokens marked not special (Qwen's fim and repo tokens) are still control tokens to
            # llama.cpp: never produced from plain text, not printed; its converter marks them so too
            looks_special = reverse[i].startswith("<|") and reverse[i].endswith("|>")
            types.append(gguf.TokenType.CONTROL if added[i].special or looks_special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    prefix_space = read_json(folder / "tokenizer_config.json").get("add_prefix_space")
    if prefix_space is not None and writer.arch == "llama":  # as llama.cpp's converter records it
        writer.add_add_space_prefix(bool(prefix_space))
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=size).add_to_gguf(writer, quiet=True)
