"""What the GGUF writer converts, checked before any weights load: the GGUF types gguf's quantizers write, the
architectures (``GGUF_ARCHS``) and the tokenizers (byte-level BPE). Anything else is a one-line ExportError
that names llama.cpp's own converter; why anyfit writes GGUF itself is at the top of ``gguf_writer``."""

from __future__ import annotations

from dataclasses import dataclass

from anyfit.export.errors import ExportError
from anyfit.export.local_files import local_json
from anyfit.model.source import ModelLocation

# GGUF types the numpy quantizers of ``gguf`` write.
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
# Types only llama.cpp's compiled llama-quantize makes (gguf's Python code can read them, not write them).
LLAMA_QUANTIZE_ONLY = ("q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k",
                       "iq4_xs", "iq4_nl", "iq3_m", "iq3_xxs", "iq2_m", "iq2_xs", "iq2_xxs", "iq1_s", "iq1_m")


@dataclass(frozen=True)
class GGUFArch:
    arch: str  # gguf.MODEL_ARCH member name
    permute_qk: bool  # llama.cpp's llama layout interleaves the rotary halves of q/k (transformers undoes it)


GGUF_ARCHS = {"LlamaForCausalLM": GGUFArch("LLAMA", True), "MistralForCausalLM": GGUFArch("LLAMA", True),
              "Qwen2ForCausalLM": GGUFArch("QWEN2", False), "Qwen3ForCausalLM": GGUFArch("QWEN3", False)}


def parse_gguf_types(gguf) -> tuple[str, ...]:
    """The ``--gguf`` types asked (repeated or comma-separated), lower-cased and without repeats; a type gguf's
    quantizers do not write, or gguf missing, is an ExportError."""
    types = [gguf] if isinstance(gguf, str) else list(gguf or ())
    types = [t.strip().lower() for item in types for t in item.split(",") if t.strip()]
    for t in types:
        if t in LLAMA_QUANTIZE_ONLY:
            raise ExportError(f"--gguf {t}: gguf's Python quantizers cannot write {t}; export f16 and run "
                              f"llama.cpp's `llama-quantize MODEL-F16.gguf MODEL-{t.upper()}.gguf {t.upper()}`, or "
                              f"pick one of {', '.join(GGUF_TYPES)}.")
        if t not in GGUF_TYPES:
            raise ExportError(f"--gguf {t!r} is not a GGUF type this export writes; choose from "
                              f"{', '.join(GGUF_TYPES)}.")
    if types:
        try:
            import gguf as _  # noqa: F401  (the check itself: whether gguf can be imported here)
        except ImportError:
            raise ExportError("GGUF export needs the 'gguf' package (llama.cpp's, a dependency of anyfit that is "
                              "missing here): `uv sync` in the anyfit repository, or pip install gguf==0.19.0."
                              ) from None
    return tuple(dict.fromkeys(types))


def check_gguf_support(location: ModelLocation) -> None:
    """Refuse, before any weights load, a model this writer does not convert. Reads the base's config.json
    and the tokenizer.json from their folders or the local hub cache; what is not at hand is checked when
    the GGUF file is written (from the exported folder)."""
    config, tok_json = local_json(location.base, "config.json"), local_json(location.tokenizer, "tokenizer.json")
    if config is not None:
        check_gguf_architecture(config)
    if tok_json is not None:
        check_gguf_tokenizer(tok_json)


def check_gguf_architecture(config: dict) -> None:
    archs = config.get("architectures") or []
    if not any(a in GGUF_ARCHS for a in archs):
        raise ExportError(f"GGUF export handles {', '.join(GGUF_ARCHS)}; this model is "
                          f"{', '.join(archs) or 'of an unrecorded architecture'}. Export without --gguf and convert "
                          "the folder with llama.cpp's convert_hf_to_gguf.py.")


def check_gguf_tokenizer(tok_json: dict) -> None:
    model = tok_json.get("model") or {}
    if model.get("type") != "BPE" or not _is_byte_level(tok_json):
        kind = f"a {model.get('type')}" if model.get("type") else "an unrecognised"
        raise ExportError("GGUF export handles byte-level BPE tokenizers (Llama 3, Qwen, SmolLM, GPT-2 style); this "
                          f"model's tokenizer is {kind} one (SentencePiece-style tokenizers such as Llama 2's and "
                          "Mistral's are not converted here). Export without --gguf and convert the folder with "
                          "llama.cpp's convert_hf_to_gguf.py.")


def _is_byte_level(tok_json: dict) -> bool:
    def has(node) -> bool:
        if isinstance(node, dict):
            return node.get("type") == "ByteLevel" or any(has(v) for v in node.values())
        if isinstance(node, list):
            return any(has(v) for v in node)
        return False

    return has(tok_json.get("pre_tokenizer")) or has(tok_json.get("decoder"))
