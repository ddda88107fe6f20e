"""Each GGUF file loaded back with transformers and compared with the merged model before the export is kept
(``check_gguf``): it must hold exactly the merged model with its weights rounded to the file's types; how far
that rounding moves it from the merged model is measured and reported (``GGUFAgreement``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from anyfit.export import ExportError
from anyfit.export.gguf_writer import rope_settings, tensor_type
from anyfit.export.request import GGUF_ARCHS, GGUFAgreement

VERIFY_PROMPTS = ("The capital of France is", "def fibonacci(n):\n    return",
                  "Question: Tom has 12 apples and gives away 5. How many are left?\nAnswer:",
                  "Once upon a time, in a quiet village by the sea,")
VERIFY_NEW_TOKENS = 8


@dataclass
class _Reference:
    prompts: list[list[int]]
    logits: list[torch.Tensor]
    greedy: list[list[int]]


def _prompt_ids(tokenizer) -> list[list[int]]:
    """VERIFY_PROMPTS as token ids, plus one chat turn through the chat template when there is one."""
    ids = [tokenizer(p, add_special_tokens=True)["input_ids"] for p in VERIFY_PROMPTS]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": "Hello! Who are you?"}], tokenize=False,
                                             add_generation_prompt=True)
        ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids


@torch.no_grad()
def _outputs(model, prompts: list[list[int]], pad_id: int,
             generate: bool = True) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Each prompt's logits at every position, and (``generate``) its greedy continuation."""
    logits, greedy = [], []
    for ids in prompts:
        x = torch.tensor([ids])
        logits.append(model(x).logits[0].float())
        if generate:  # no eos: every prompt compares VERIFY_NEW_TOKENS tokens
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=VERIFY_NEW_TOKENS,
                                 do_sample=False, pad_token_id=pad_id, eos_token_id=None)
            greedy.append(out[0, len(ids):].tolist())
    return logits, greedy


def reference_outputs(model, tokenizer) -> _Reference:
    """The merged model's logits and greedy continuations on the check prompts (computed before its
    memory is given back, so the GGUF model can be loaded in its place)."""
    prompts = _prompt_ids(tokenizer)
    model.generation_config.do_sample = False  # a sampling default would only warn here; greedy is asked
    logits, greedy = _outputs(model, prompts, tokenizer.pad_token_id)
    return _Reference(prompts, logits, greedy)


def check_gguf(path: Path, folder: Path, tokenizer, reference: _Reference, qtype: str) -> GGUFAgreement:
    """Load ``path`` with transformers (dequantized to fp32) and compare it with the merged model.

    The tokenizer transformers rebuilds from the file must give the same ids for the prompts. The model must
    equal the merged model in ``folder`` with every weight rounded to the type it has in the file, within
    CONVERSION_TOLERANCE; how far rounding moved it from ``reference`` (the merged model as exported) is
    measured and reported, not judged: that is the price of the type, not an error.
    """
    try:
        gguf_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except Exception as e:  # whatever transformers cannot read is a failed export, said in one line
        raise ExportError(f"transformers cannot read the {qtype} GGUF file just written: "
                          f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    for ids in reference.prompts:
        text = tokenizer.decode(ids, skip_special_tokens=False)
        again = gguf_tok(text, add_special_tokens=False)["input_ids"]
        expected = tokenizer(text, add_special_tokens=False)["input_ids"]
        if again != expected:
            raise ExportError(f"the {qtype} GGUF file's tokenizer splits {text[:40]!r} into {again[:12]} ..., the "
                              f"model's tokenizer into {expected[:12]} ...; the GGUF export is wrong for this "
                              "tokenizer.")
    model.eval()
    logits, greedy = _outputs(model, reference.prompts, tokenizer.pad_token_id)
    del model
    rounded, _ = _outputs(_rounded_model(folder, qtype), reference.prompts, tokenizer.pad_token_id, generate=False)
    conversion = max(_max_rel_diff(got, want) for got, want in zip(logits, rounded))
    max_abs = max(float((got - ref).abs().max()) for got, ref in zip(logits, reference.logits))
    max_rel = max(_max_rel_diff(got, ref) for got, ref in zip(logits, reference.logits))
    same = sum(int((got.argmax(-1) == ref.argmax(-1)).sum()) for got, ref in zip(logits, reference.logits))
    positions = sum(ref.shape[0] for ref in reference.logits)
    matches = sum(a == b for a, b in zip(greedy, reference.greedy))
    return GGUFAgreement(qtype, conversion, max_abs, max_rel, same / positions, matches, len(greedy))


def _max_rel_diff(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |logit difference| at a position over the spread (max - min) of ``ref``'s logits there."""
    spread = (ref.amax(dim=-1) - ref.amin(dim=-1)).clamp_min(1e-12)
    return float(((got - ref).abs().amax(dim=-1) / spread).max())


def _rounded_model(folder: Path, qtype: str):
    """The merged model in ``folder`` (fp32) with every weight rounded through gguf's quantizer to the type
    ``write_gguf`` gives it in a ``qtype`` file: the model the file should hold."""
    config = AutoConfig.from_pretrained(folder)
    rope = rope_settings(config)
    if rope["rope_type"] != "default":
        # transformers' GGUF reader builds plain rope for these architectures: it reads neither llama.cpp's
        # rope_freqs tensor (Llama 3.1+) nor the rope.scaling keys write_gguf records, so compare like with like
        config.rope_parameters = {"rope_type": "default", "rope_theta": rope.get("rope_theta", 10000.0)}
    model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32)
    spec = next(GGUF_ARCHS[a] for a in config.architectures if a in GGUF_ARCHS)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[spec.arch], config.num_hidden_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied head is the embedding: rounded with it
            gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
            ggml_type = tensor_type(qtype, gguf_name, tuple(param.shape))
            rounded = gguf.quants.dequantize(gguf.quants.quantize(param.detach().numpy(), ggml_type), ggml_type)
            param.copy_(torch.from_numpy(rounded.reshape(param.shape)))
    return model.eval()
