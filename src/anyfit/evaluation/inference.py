"""Inference back ends behind one interface: ``backend.generate(prompts, params) -> list[Completion]``.

- ``TransformersBackend`` runs everywhere (CPU, MPS, CUDA): batched, left-padded, KV cache, greedy or
  seeded sampling, stop strings. It wraps an already-loaded model, so the training loop can use it too.
- ``VLLMBackend`` is the fast path on CUDA when ``vllm`` is installed (``pip install 'anyfit[vllm]'``).

A prompt is either a string (a user message rendered with the chat template, or raw text with
``params.chat=False``), a list of token ids used as they are (evaluation passes the exact ids the
training pipeline builds, ``anyfit.data.tokenization.prompt_token_ids``), or an ``ImagePrompt`` (a record with
images: ``anyfit.evaluation.image_prompts``), which needs the model's processor (``images``: a vision-language
model's, loaded beside it; a text-only model refuses one in one line). Strings are rendered by that same
pipeline, so a prompt typed at ``anyfit generate`` gets the tokens it would get in training.

Sampling settings a checkpoint ships in its ``generation_config.json`` (Qwen's repetition_penalty=1.05,
top_k=20, ...) are NOT applied: every knob is set explicitly, so both back ends decode the same way and
greedy means greedy.

Models are found and loaded by ``anyfit.model.loading.load_for_inference`` (a hub id or folder, a full
fine-tune's output folder, or a LoRA output folder); device and dtype come from the runtime policy.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import torch
from tqdm.auto import tqdm

from anyfit.config import Config, ConfigError, DataConfig
from anyfit.data.formats import Example
from anyfit.data.image_tokens import ImageTokens
from anyfit.data.records import DataError
from anyfit.data.templates import PromptLayout
from anyfit.data.tokenization import prompt_token_ids
from anyfit.hardware.memory import free_bytes, is_oom, release_cached
from anyfit.hardware.runtime import inference_policy
from anyfit.evaluation.image_prompts import ImagePrompt, processed_batch
from anyfit.model.loading import load_for_inference, model_dtype
from anyfit.model.processor import copy_processor_files, inference_processor
from anyfit.model.shape import kv_cache_bytes, shape_from_config
from anyfit.model.source import ModelLocation, locate_model
from anyfit.data.stopping import stop_token_ids

Prompt = str | list[int] | ImagePrompt
FinishReason = Literal["eos", "stop", "length"]
BatchSize = int | Literal["auto"]
BACKENDS = ("auto", "vllm", "transformers")
# Largest batch "auto" picks per device: beyond these the speed-up is small and latency per batch grows.
AUTO_BATCH_CAP = {"cpu": 64, "mps": 64, "cuda": 256}


class BackendUnavailable(ConfigError):
    """The requested inference back end cannot run here; the message says what to do instead."""


@dataclass(frozen=True)
class GenerationParams:
    """How to decode. ``temperature == 0`` is greedy; otherwise sampling with ``top_p``, repeatable with ``seed``."""

    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # the text is cut at the first one; generation stops when every row has one
    include_stop: bool = False  # keep the stop string at the end of the text (e.g. a closing </answer>)
    chat: bool = True  # string prompts: render as a user message laid out by ``layout`` (False: raw text)
    layout: PromptLayout = field(default_factory=PromptLayout, hash=False)  # the template, system prompt, options

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.stop, str):  # a bare string would be read as one stop string per character
            object.__setattr__(self, "stop", (self.stop,))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class BackendSettings:
    """How ``make_backend`` loads a model for generation: which back end (``auto``, ``vllm``, ``transformers``),
    on which device and in which dtype, how many prompts per batch (transformers back end), whether a LoRA
    adapter is merged first, where the tokenizer and weights come from, and the sampling seed of the engine."""

    backend: str = "auto"
    device: str = "auto"
    batch_size: BatchSize = "auto"
    dtype: str = "auto"
    merge_lora: bool = False
    tokenizer: str | None = None
    trust_remote_code: bool = False
    revision: str | None = None
    seed: int = 0

    @classmethod
    def from_config(cls, cfg: Config, **choices) -> BackendSettings:
        """The settings a config gives (``runtime.device``, ``eval.batch_size``, ``model.tokenizer``,
        ``model.trust_remote_code``, ``model.revision``); ``choices`` set the others (backend, dtype,
        merge_lora, seed) or replace these."""
        return cls(**{"device": cfg.runtime.device, "batch_size": cfg.eval.batch_size, "tokenizer": cfg.model.tokenizer,
                      "trust_remote_code": cfg.model.trust_remote_code, "revision": cfg.model.revision, **choices})

    def load(self, model: str | Path) -> InferenceBackend:
        """``model`` (hub id, folder, training or LoRA output folder) in the back end these settings pick."""
        return make_backend(model, **asdict(self))


@dataclass(frozen=True)
class Completion:
    """One generated answer. ``num_tokens`` counts generated tokens (the final EOS included);
    ``finish_reason``: ``eos`` (the model ended it), ``stop`` (a stop string), ``length`` (max_new_tokens)."""

    text: str
    num_tokens: int
    finish_reason: FinishReason
    prompt_tokens: int = 0


@runtime_checkable
class InferenceBackend(Protocol):
    """What every back end offers. ``tokenizer`` is the HF tokenizer prompts are rendered with."""

    name: str
    tokenizer: object

    def generate(self, prompts: Sequence[Prompt], params: GenerationParams) -> list[Completion]: ...


# --------------------------------------------------------------------------------------------------
# Choosing a back end


def vllm_available() -> bool:
    """Whether ``import vllm`` works (not only whether it is installed: a broken build counts as absent)."""
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError, or a CUDA/ABI error raised while importing
        return False
    return True


def select_backend(kind: str, device: str) -> Literal["vllm", "transformers"]:
    """Resolve ``auto | vllm | transformers`` for ``device``. auto takes vLLM only on CUDA with vllm
    importable; vLLM is never chosen off CUDA, and asking for it where it cannot run is an error."""
    if kind not in BACKENDS:
        raise ConfigError(f"Unknown inference backend {kind!r}; use one of {', '.join(BACKENDS)}.")
    if kind == "transformers":
        return "transformers"
    if device != "cuda":
        if kind == "vllm":
            raise BackendUnavailable(f"The vllm backend runs on CUDA GPUs only, and the device here is {device}. "
                                     "Use --backend transformers (or auto).")
        return "transformers"
    # Only now is vllm imported: it takes seconds, and CPU/MPS runs never need it.
    if vllm_available():
        return "vllm"
    if kind == "vllm":
        raise BackendUnavailable("--backend vllm was asked for, but 'import vllm' fails here. Install it with "
                                 "pip install 'anyfit[vllm]' (CUDA only), or use --backend transformers (or auto).")
    return "transformers"


def make_backend(model: str | Path, backend: str = "auto", device: str = "auto", batch_size: BatchSize = "auto",
                 dtype: str = "auto", merge_lora: bool = False, tokenizer: str | None = None,
                 trust_remote_code: bool = False, revision: str | None = None, seed: int = 0) -> InferenceBackend:
    """Load ``model`` (hub id, folder, training output dir, LoRA output dir) into the chosen back end, on the
    device and in the dtype the runtime policy picks (printed with its reasons on stderr)."""
    policy = inference_policy(device, dtype)
    print(f"[anyfit] inference runtime: {policy.describe()}", file=sys.stderr)
    device = policy.device
    if select_backend(backend, device) == "vllm":
        return VLLMBackend(model, dtype=dtype, merge_lora=merge_lora, tokenizer=tokenizer,
                           trust_remote_code=trust_remote_code, revision=revision, seed=seed)
    hf_model, hf_tokenizer = load_for_inference(model, device, policy.compute_dtype, merge_lora=merge_lora,
                                                tokenizer=tokenizer, trust_remote_code=trust_remote_code,
                                                revision=revision)
    images = ImageTokens(*inference_processor(hf_model.config, locate_model(model, tokenizer, revision), hf_tokenizer,
                                              str(model), revision=revision, trust_remote_code=trust_remote_code))
    return TransformersBackend(hf_model, hf_tokenizer, batch_size=batch_size, images=images)


# --------------------------------------------------------------------------------------------------
# Prompts


def encode_prompts(tokenizer, prompts: Sequence[Prompt], params: GenerationParams) -> list[list[int] | ImagePrompt]:
    """Token ids of each prompt, built by the training pipeline: chat-rendered (``params.chat``) or raw text; an
    ``ImagePrompt`` as it is.

    Raw text gets the tokenizer's leading special tokens (Llama's BOS) exactly as the training templates do.
    """
    chat = params.layout.data_config()
    raw = DataConfig(template="{prompt}")  # the text, verbatim
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            example = Example("prompt_completion", index=i, prompt=p, completion="")
            out.append(prompt_token_ids(example, tokenizer, chat if params.chat else raw))
        elif isinstance(p, ImagePrompt):
            out.append(p)
        else:
            out.append([int(t) for t in p])
        if not _ids(out[-1]):
            raise ValueError(f"prompt {i} is empty")
    return out


def _ids(prompt: list[int] | ImagePrompt) -> list[int]:
    """The ids the model is given for a prompt (an image prompt's with its image tokens)."""
    return prompt.ids if isinstance(prompt, ImagePrompt) else prompt


# --------------------------------------------------------------------------------------------------
# Batch size for generation


def plan_batch_size(free_bytes: int, kv_bytes_per_row: int, weight_bytes: int = 0, cap: int = 64,
                    usable_fraction: float = 0.8) -> int:
    """Rows that fit: (free memory x usable_fraction - weights still to be loaded) / KV cache per row, in [1, cap].

    The fraction leaves room for activations, the logits of the last position and allocator slack.
    """
    budget = free_bytes * usable_fraction - weight_bytes
    if kv_bytes_per_row <= 0:
        return cap
    return max(1, min(cap, int(budget // kv_bytes_per_row)))


def auto_batch_size(model, prompt_tokens: int, max_new_tokens: int, num_prompts: int | None = None,
                    weights_loaded: bool = True) -> int:
    """A generation batch size for ``model`` on its device: free memory over the KV cache one row needs."""
    param = next(model.parameters())
    device = param.device.type if param.device.type != "cuda" else str(param.device)
    weights = 0 if weights_loaded else sum(p.numel() * p.element_size() for p in model.parameters())
    per_row = kv_cache_bytes(shape_from_config(model.config), prompt_tokens + max_new_tokens, 1, param.element_size())
    cap = AUTO_BATCH_CAP[param.device.type]
    if num_prompts:
        cap = min(cap, num_prompts)
    return plan_batch_size(free_bytes(device), per_row, weights, cap)


# --------------------------------------------------------------------------------------------------
# Transformers


@contextlib.contextmanager
def _eval_mode(model):
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def _seeded(seed: int | None, device: torch.device):
    """Seed the sampling RNG without disturbing the caller's (a training run's) RNG stream."""
    if seed is None:
        yield
        return
    devices = []
    if device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


@dataclass
class TransformersBackend:
    """``model.generate`` on batches of left-padded prompts, longest first, with the KV cache.

    Works on any loaded causal LM, including a PEFT model in the middle of training: it switches to eval
    mode under ``torch.inference_mode`` and restores the training mode afterwards. Image prompts are batched apart
    from text ones, through ``images``' processor (a vision-language model's; ``anyfit.evaluation.image_prompts``).
    """

    model: object
    tokenizer: object
    batch_size: BatchSize = "auto"
    images: ImageTokens | None = None  # the model's processor for image prompts, or why it has none
    name: str = field(default="transformers", init=False)

    def __post_init__(self) -> None:
        if self.batch_size != "auto" and (not isinstance(self.batch_size, int) or self.batch_size < 1):
            raise ValueError(f"batch_size must be >= 1 or 'auto', got {self.batch_size!r}")

    def generate(self, prompts: Sequence[Prompt], params: GenerationParams) -> list[Completion]:
        if not prompts:
            return []
        ids = encode_prompts(self.tokenizer, prompts, params)
        model, tok = self.model, self.tokenizer
        images = self.images or ImageTokens()
        if images.processor is None and (shown := next((p for p in ids if isinstance(p, ImagePrompt)), None)):
            raise DataError(f"{shown.place} has {len(shown.images)} image(s), but {images.missing}; generate from a "
                            "vision-language checkpoint, or give text prompts.")
        eos_ids = eos_token_ids(model, tok)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else eos_ids[0]
        gen_config = _generation_config(params, eos_ids, pad_id)
        # Text prompts first, then image prompts (the processor batches those), each longest first.
        order = sorted(range(len(ids)), key=lambda i: (isinstance(ids[i], ImagePrompt), -len(_ids(ids[i]))))
        batch = self.batch_size
        if batch == "auto":
            batch = auto_batch_size(model, max(len(_ids(p)) for p in ids), params.max_new_tokens, len(ids))
        device = next(model.parameters()).device
        outputs: list[Completion | None] = [None] * len(ids)
        extra = {"tokenizer": tok} if params.stop else {}  # stop_strings need the tokenizer's vocabulary
        # A bar on stderr for what takes minutes (anyfit eval on hundreds of prompts); tqdm hides it for one batch.
        bar = tqdm(total=len(order), desc="generate", unit="prompt", leave=False, dynamic_ncols=True,
                   disable=len(order) <= batch)
        with torch.inference_mode(), _eval_mode(model), _seeded(params.seed, device), bar:
            start = 0
            while start < len(order):
                rows = order[start:start + batch]
                rows = [i for i in rows if isinstance(ids[i], ImagePrompt) == isinstance(ids[rows[0]], ImagePrompt)]
                inputs = left_padded([ids[i] for i in rows], pad_id, images, device, model_dtype(model))
                width = inputs["input_ids"].shape[1]
                try:
                    out = model.generate(**inputs, generation_config=gen_config, **extra)
                except Exception as e:  # noqa: BLE001 - only out-of-memory is handled
                    if not is_oom(e) or batch == 1:
                        raise
                    # The memory estimate leaves out activations; halve and redo this batch.
                    batch = max(1, batch // 2)
                    release_cached(device.type)
                    print(f"[anyfit] generation ran out of memory; retrying with batch size {batch}", file=sys.stderr)
                    continue
                for r, i in enumerate(rows):
                    outputs[i] = _finish(tok, out[r, width:].tolist(), eos_ids, params, len(_ids(ids[i])))
                start += len(rows)
                bar.update(len(rows))
        return outputs  # type: ignore[return-value]


def left_padded(prompts: list[list[int]] | list[ImagePrompt], pad_id: int, images: ImageTokens, device: torch.device,
                dtype: torch.dtype) -> dict:
    """``model.generate``'s inputs for a batch of prompts of one kind, padded on the left (every row's last prompt
    token in the last column): ids and attention mask; for image prompts, the processor's batch (pixel values,
    image grids, per-token types), floating-point tensors in the model's dtype."""
    if isinstance(prompts[0], ImagePrompt):
        out = processed_batch(prompts, images)  # type: ignore[arg-type]
        return {k: v.to(device, dtype) if torch.is_floating_point(v) else v.to(device)
                for k, v in out.items() if isinstance(v, torch.Tensor)}
    width = max(len(ids) for ids in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, ids in enumerate(prompts):
        input_ids[r, width - len(ids):] = torch.tensor(ids)
        attention_mask[r, width - len(ids):] = 1
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}


def _generation_config(params: GenerationParams, eos_ids: list[int], pad_id: int):
    from transformers import GenerationConfig

    # Every decoding knob is set, so nothing is filled in from the checkpoint's generation_config.json.
    neutral = dict(repetition_penalty=1.0, no_repeat_ngram_size=0, min_new_tokens=0, num_beams=1,
                   num_return_sequences=1)
    # Warpers act only when sampling (and transformers warns about them otherwise).
    sampling = {} if params.greedy else dict(temperature=params.temperature, top_p=params.top_p, top_k=0, min_p=0.0,
                                             typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0)
    return GenerationConfig(do_sample=not params.greedy, max_new_tokens=params.max_new_tokens, eos_token_id=eos_ids,
                            pad_token_id=pad_id, use_cache=True, stop_strings=list(params.stop) or None,
                            **neutral, **sampling)


def _finish(tokenizer, tokens: list[int], eos_ids: list[int], params: GenerationParams,
            prompt_tokens: int) -> Completion:
    """Text, token count and finish reason of one generated row (rows that finished early are padded)."""
    end = next((k for k, t in enumerate(tokens) if t in eos_ids), None)
    body = tokens if end is None else tokens[:end]
    text = tokenizer.decode(body, skip_special_tokens=True)
    cut = _first_stop(text, params.stop)
    if cut is not None:
        at, stop = cut
        # The fewest tokens whose text holds the stop string: the row ended there.
        lo, hi = 1, len(body)
        while lo < hi:
            mid = (lo + hi) // 2
            if stop in tokenizer.decode(body[:mid], skip_special_tokens=True):
                hi = mid
            else:
                lo = mid + 1
        return Completion(text[:at + len(stop)] if params.include_stop else text[:at], lo, "stop", prompt_tokens)
    if end is not None:
        return Completion(text, end + 1, "eos", prompt_tokens)
    return Completion(text, len(tokens), "length", prompt_tokens)


def _first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    hits = [(text.find(s), s) for s in stops if s and s in text]
    return min(hits) if hits else None


def eos_token_ids(model, tokenizer) -> list[int]:
    """Token ids that end an answer: the tokenizer's EOS, those the model's generation config and config name,
    and the chat template's end-of-turn tokens (``anyfit.data.stopping``: a base model's EOS is often not where
    its template ends a turn)."""
    ids = stop_token_ids(tokenizer, getattr(model, "generation_config", None), getattr(model, "config", None))
    if not ids:
        raise ValueError("neither the tokenizer, the model's configs nor its chat template name a token that ends "
                         "an answer")
    return ids


# --------------------------------------------------------------------------------------------------
# vLLM

_VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


class VLLMBackend:
    """vLLM's offline engine on CUDA. A LoRA output folder is served with a ``LoRARequest`` on its base
    model, or merged into a temporary folder first (``merge_lora``).

    An image prompt goes to vLLM as ``{"prompt_token_ids": the tokenizer's ids of its text, "multi_modal_data":
    {"image": [decoded images]}}``: ids with one placeholder per image, as the chat template writes it, which vLLM's
    own multi-modal processor expands (for a token prompt it applies the image's prompt update to the ids it is
    given, ``BaseMultiModalProcessor._apply_prompt_updates``; already expanded ids would be expanded again)."""

    name = "vllm"

    def __init__(self, model: str | Path, *, dtype: str = "auto", merge_lora: bool = False,
                 tokenizer: str | None = None, trust_remote_code: bool = False, revision: str | None = None,
                 seed: int = 0, gpu_memory_utilization: float = 0.85, max_model_len: int | None = None,
                 **engine_kwargs) -> None:
        select_backend("vllm", inference_policy().device)  # a clear error off CUDA or without vllm
        import vllm
        from transformers import AutoConfig, AutoTokenizer

        loc = locate_model(model, tokenizer, revision)
        if loc.gguf_file:
            raise BackendUnavailable(f"{model}: GGUF weights are not served with vLLM by anyfit; use --backend "
                                     "transformers, or convert the model to a safetensors folder first.")
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.lora_request = None
        weights = loc.base
        if loc.adapter and merge_lora:
            # Merged on the CPU in the serving dtype, written once, served as a plain model.
            self._tmp = tempfile.TemporaryDirectory(prefix="anyfit-merged-")
            merged, tok = load_for_inference(model, "cpu", "bfloat16" if dtype == "auto" else dtype, merge_lora=True,
                                             tokenizer=tokenizer, trust_remote_code=trust_remote_code,
                                             revision=revision)
            merged.save_pretrained(self._tmp.name)
            tok.save_pretrained(self._tmp.name)
            # a vision-language model's processor files, which vLLM reads to process images (the run saved them)
            copy_processor_files(Path(loc.adapter), Path(self._tmp.name))
            weights = self._tmp.name
            loc = ModelLocation(base=weights, tokenizer=weights)
            del merged
        elif loc.adapter:
            from vllm.lora.request import LoRARequest

            rank = int(json.loads((Path(loc.adapter) / "adapter_config.json").read_text()).get("r", 16))
            engine_kwargs.setdefault("enable_lora", True)
            engine_kwargs.setdefault("max_lora_rank", next((r for r in _VLLM_LORA_RANKS if r >= rank), rank))
            self.lora_request = LoRARequest("anyfit-adapter", 1, loc.adapter)
        self.tokenizer = AutoTokenizer.from_pretrained(loc.tokenizer, trust_remote_code=trust_remote_code)
        config = AutoConfig.from_pretrained(loc.base, trust_remote_code=trust_remote_code,
                                            **({"revision": revision} if revision and not self._tmp else {}))
        # the processor decides each image prompt's ids and placeholders (vLLM loads its own to expand them)
        self.images = ImageTokens(*inference_processor(config, loc, self.tokenizer, str(model), revision=revision,
                                                       trust_remote_code=trust_remote_code))
        # vLLM stops at the EOS of the model's generation config by itself; the template's end of turn is added.
        self.stop_ids = stop_token_ids(self.tokenizer)
        self.llm = vllm.LLM(model=weights, tokenizer=loc.tokenizer, dtype=dtype, seed=seed,
                            trust_remote_code=trust_remote_code, gpu_memory_utilization=gpu_memory_utilization,
                            max_model_len=max_model_len,
                            **({"revision": revision} if revision and not self._tmp else {}), **engine_kwargs)

    def generate(self, prompts: Sequence[Prompt], params: GenerationParams) -> list[Completion]:
        from vllm import SamplingParams

        if not prompts:
            return []
        ids = encode_prompts(self.tokenizer, prompts, params)

        def sampling(i: int) -> SamplingParams:
            # One seed per prompt: a row's sample does not depend on the other rows.
            seed = None if params.greedy or params.seed is None else params.seed + i
            return SamplingParams(n=1, temperature=params.temperature, top_p=1.0 if params.greedy else params.top_p,
                                  max_tokens=params.max_new_tokens, stop=list(params.stop) or None,
                                  include_stop_str_in_output=params.include_stop, seed=seed,
                                  stop_token_ids=self.stop_ids, skip_special_tokens=True)

        outs = self.llm.generate([_vllm_prompt(p) for p in ids], [sampling(i) for i in range(len(ids))],
                                 lora_request=self.lora_request, use_tqdm=False)
        completions = []
        for p, out in zip(map(_ids, ids), outs):
            o = out.outputs[0]
            if o.finish_reason == "length":
                reason: FinishReason = "length"
            else:  # "stop": a stop string (stop_reason is the string) or EOS / a stop token (None or an id)
                reason = "stop" if isinstance(o.stop_reason, str) else "eos"
            completions.append(Completion(o.text, len(o.token_ids), reason, len(p)))
        return completions

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _vllm_prompt(prompt: list[int] | ImagePrompt) -> dict:
    """vLLM's ``TokensPrompt`` of a prompt: an image prompt's ids unexpanded, its images decoded beside them."""
    if isinstance(prompt, ImagePrompt):
        return {"prompt_token_ids": prompt.text_ids, "multi_modal_data": {"image": prompt.pictures()}}
    return {"prompt_token_ids": prompt}

