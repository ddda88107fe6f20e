"""A transformers model folder as one GGUF file of a given type (``write_gguf``), one tensor at a time, with the
tokenizer as llama.cpp's "gpt2" (byte-level BPE) vocabulary and llama.cpp's name for its pre-tokenizer, found
by how it splits a probe text (``llama_cpp_pre_tokenizer``). What it converts is checked before any weights
load (``request.check_gguf_support``); every file is then checked by ``gguf_check``."""

# Why the file is written here with the ``gguf`` package (llama.cpp's own, pinned) rather than a converter:
# llama.cpp's convert_hf_to_gguf.py is not on PyPI. ``gguf`` carries the writer, the reference quantizers (F32,
# F16, BF16, Q8_0, Q5_0/1, Q4_0/1, TQ1_0/TQ2_0; K-quants only dequantize), the tensor-name tables and the
# special-vocab reader, but not the conversion. ``convert-hf-to-gguf`` (0.1.1) is a third-party repackaging that
# ships its own top-level ``gguf`` package over the pinned one (which copy wins depends on install order;
# removing either breaks the other) and needs sentencepiece; llama-cpp-python compiles llama.cpp. So this module
# adds only what the conversion script decides, for Llama (also SmolLM, Mistral's architecture), Qwen2/2.5 and
# Qwen3 with a byte-level BPE tokenizer (not SentencePiece, such as Llama 2's); anything else is refused with a
# line naming llama.cpp's script.

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import regex
import torch
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig, AutoTokenizer

from anyfit.export import ExportError
from anyfit.export.request import GGUF_ARCHS, GGUFArch, check_gguf_architecture, check_gguf_tokenizer, read_json
from anyfit.model.unloaded import is_kept_file

_FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
               "q5_1": "MOSTLY_Q5_1", "q5_0": "MOSTLY_Q5_0", "q4_1": "MOSTLY_Q4_1", "q4_0": "MOSTLY_Q4_0"}


def tensor_type(qtype: str, gguf_name: str, shape: tuple[int, ...]):
    """GGML type of one tensor in a ``qtype`` file, as llama.cpp's converter decides it: 1-D tensors (norms,
    biases) stay F32; rows that do not split into whole quantization blocks fall back to F16; in the 4- and
    5-bit files the embeddings and the output head, the most sensitive matrices, get Q8_0 (llama-quantize
    would give them Q6_K, which gguf cannot write)."""
    types = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0,
             "q5_1": gguf.GGMLQuantizationType.Q5_1, "q5_0": gguf.GGMLQuantizationType.Q5_0,
             "q4_1": gguf.GGMLQuantizationType.Q4_1, "q4_0": gguf.GGMLQuantizationType.Q4_0}
    if len(shape) < 2 or qtype == "f32":
        return gguf.GGMLQuantizationType.F32
    wanted = types[qtype]
    if qtype.startswith(("q4", "q5")) and gguf_name in ("token_embd.weight", "output.weight"):
        wanted = gguf.GGMLQuantizationType.Q8_0
    block = gguf.GGML_QUANT_SIZES[wanted][0]
    if shape[-1] % block:
        return gguf.GGMLQuantizationType.F16
    return wanted


def write_gguf(folder: Path, path: Path, qtype: str, name: str | None = None, echo=print) -> Path:
    """Write the transformers model in ``folder`` (safetensors, tokenizer) as one GGUF file of type ``qtype``.

    Tensors are read, converted and written one at a time (the header first, with every tensor's size
    computed up front), so memory stays at about one tensor whatever the model's size; a progress bar counts
    the parameters. The file appears under its name only when complete.
    """
    check_gguf_architecture(read_json(folder / "config.json"))
    check_gguf_tokenizer(read_json(folder / "tokenizer.json"))
    config = AutoConfig.from_pretrained(folder)
    spec = next(GGUF_ARCHS[a] for a in config.architectures if a in GGUF_ARCHS)
    arch = gguf.MODEL_ARCH[spec.arch]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tensors = _list_tensors(folder)
    tie = bool(getattr(config, "tie_word_embeddings", False))
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    plan = []  # (hf name, gguf name, shape, ggml type)
    for hf_name, (file, shape) in tensors.items():
        if hf_name.endswith("rotary_emb.inv_freq") or (tie and hf_name == "lm_head.weight"):
            continue  # recomputed by llama.cpp / the tied embeddings are the head
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ExportError(f"GGUF export: no llama.cpp tensor for {hf_name!r} of {config.architectures[0]}; "
                              "convert the exported folder with llama.cpp's convert_hf_to_gguf.py.")
        plan.append((hf_name, gguf_name, tuple(shape), tensor_type(qtype, gguf_name, tuple(shape))))
    rope_freqs = _llama3_rope_factors(config)

    partial = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(partial, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name or folder.name)
    total = sum(math.prod(shape) for _, _, shape, _ in plan)
    writer.add_size_label(gguf.size_label(total, 0, 0, 0))
    _add_hparams(writer, config, spec, rope_freqs is not None)
    writer.add_file_type(gguf.LlamaFileType[_FILE_TYPES[qtype]])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_vocab(writer, tokenizer, folder, config)
    for _, gguf_name, shape, ggml_type in plan:
        writer.add_tensor_info(gguf_name, shape, np.dtype(np.float32), _nbytes(shape, ggml_type), raw_dtype=ggml_type)
    if rope_freqs is not None:
        writer.add_tensor_info("rope_freqs.weight", rope_freqs.shape, np.dtype(np.float32), rope_freqs.nbytes,
                               raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    with tqdm(total=total, unit="param", unit_scale=True, desc=f"gguf {qtype}", leave=False) as bar, \
            _SafetensorsReader() as reader:
        for hf_name, gguf_name, shape, ggml_type in plan:
            data = reader.get(tensors[hf_name][0], hf_name).to(torch.float32)
            if spec.permute_qk and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                data = _permute(data, config.num_attention_heads)
            elif spec.permute_qk and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                data = _permute(data, config.num_key_value_heads)
            writer.write_tensor_data(gguf.quants.quantize(data.numpy(), ggml_type))
            bar.update(math.prod(shape))
    if rope_freqs is not None:
        writer.write_tensor_data(rope_freqs)
    writer.close()
    partial.replace(path)
    echo(f"[anyfit] export: wrote {path.name} ({path.stat().st_size / 2**20:.1f} MiB)")
    return path


def _list_tensors(folder: Path) -> dict[str, tuple[Path, list[int]]]:
    """Every tensor of the safetensors weights in ``folder``: name -> (file, shape), in file order. The source's
    tensors the model does not load (MTP layers, ``anyfit.model.unloaded``) are left out: llama.cpp's architectures
    here have no place for them, and a GGUF file holds the model transformers runs."""
    index = folder / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
             else ["model.safetensors"])
    files = [name for name in files if not is_kept_file(Path(name))]
    out: dict[str, tuple[Path, list[int]]] = {}
    for name in files:
        with safe_open(folder / name, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                out[key] = (folder / name, list(f.get_slice(key).get_shape()))
    return out


class _SafetensorsReader:
    """Tensors read one at a time from their files (each file opened once)."""

    def __enter__(self):
        self.handles: dict[Path, Any] = {}
        return self

    def get(self, file: Path, name: str) -> torch.Tensor:
        if file not in self.handles:
            self.handles[file] = safe_open(file, framework="pt").__enter__()
        return self.handles[file].get_tensor(name)

    def __exit__(self, *exc):
        for handle in self.handles.values():
            handle.__exit__(None, None, None)


def _nbytes(shape: tuple[int, ...], ggml_type) -> int:
    block, size = gguf.GGML_QUANT_SIZES[ggml_type]
    return math.prod(shape) // block * size


def _permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """transformers keeps the two rotary halves of each head apart; llama.cpp's llama layout interleaves them."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def rope_settings(config) -> dict[str, Any]:
    """The rotary settings, from transformers 5's ``rope_parameters`` or the older ``rope_scaling`` + theta."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _add_hparams(writer, config, spec: GGUFArch, llama3_rope: bool) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads or config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)
    if spec.arch == "LLAMA":
        writer.add_rope_dimension_count(head_dim)
    rope = rope_settings(config)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    kind = rope["rope_type"]
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    elif kind not in ("default",) and not (kind == "llama3" and llama3_rope):
        raise ExportError(f"GGUF export: rope_type {kind!r} is not converted here; convert the exported folder "
                          "with llama.cpp's convert_hf_to_gguf.py.")


def _llama3_rope_factors(config):
    """Llama 3.1+'s frequency-dependent rope scaling, which llama.cpp reads as a rope_freqs tensor."""
    rope = rope_settings(config)
    if rope["rope_type"] != "llama3":
        return None
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    base = float(rope.get("rope_theta", 10000.0))
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old_context = float(rope["original_max_position_embeddings"])
    factors = []
    for i in range(0, dim, 2):
        wavelength = 2 * math.pi / (1.0 / base ** (i / dim))
        if wavelength < old_context / high:
            factors.append(1.0)
        elif wavelength > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


# --------------------------------------------------- the tokenizer: llama.cpp's vocabulary and pre-tokenizer


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
