"""Training against inference at start-up: the logits the training forward computes must be the ones ``generate``
computes, position by position, or the run trains a function nobody will run.

The training forward is the run's own (train mode, dropout off, the training dtype and autocast, the probes packed
or padded as the run's micro-batches are); the inference path is transformers' ``generate`` in eval mode, with the
KV cache (or the state cache a hybrid model asks for) that it builds itself: a prefill, then one token at a time,
each next token forced to the probe's own (teacher forcing), with ``output_logits``. Two probes from the data, of
at most ``PROBE_TOKENS`` tokens: the first is decoded from its first token on (every position through the cache), the
second after a prefill of its first half. A difference beyond the dtype's round-off (``tolerance``) is re-run with
hooks on the decoder layers, and the first layer whose hidden state at the first differing position differs is
named in the one line printed. ``check_inference`` refuses the run then (``InferenceMismatch``) unless
``train.inference_check=warn``; ``false`` skips it. Runs once at set-up, before step 1, with the adapters as they are
(LoRA starts at zero B: the base); under several processes every one runs it (sharded weights are gathered by the
forwards) and they agree on the largest difference. No peer checks this at start-up.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from anyfit.config import ConfigError
from anyfit.model.layers import decoder_stack
from anyfit.model.packing import stateful_layers
from anyfit.training.loss import MODEL_INPUTS
from anyfit.training.packing_check import agreed_max, reshard, transformers_model

PROBE_TOKENS = 32  # tens of tokens: past the tests' 8-token windows, a few dozen decode steps on any model


class InferenceMismatch(ConfigError):
    """The training forward and ``generate`` compute different logits; the message names the model and layer."""


@dataclass
class InferenceVerdict:
    """What the check found (recorded in run_info.json as ``inference_check``)."""

    agrees: bool
    line: str  # the one line printed
    error: float | None = None  # the largest difference, relative to the logits' scale at that position
    tolerance: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def unit_roundoff(compute_dtype: torch.dtype, device) -> float:
    """Half the machine epsilon of what the matmuls round to: the compute dtype, or TF32/bf16 where PyTorch is allowed
    to run fp32 matmuls in them (CUDA's TF32, ``torch.set_float32_matmul_precision``)."""
    if compute_dtype == torch.float32:
        precision = torch.get_float32_matmul_precision()
        if precision == "medium":
            return torch.finfo(torch.bfloat16).eps / 2
        if torch.device(device).type == "cuda" and (precision == "high" or torch.backends.cuda.matmul.allow_tf32):
            return 2.0 ** -11  # TF32 keeps 10 mantissa bits (hardware.runtime turns it on for runtime.tf32)
    return torch.finfo(compute_dtype).eps / 2


def tolerance(compute_dtype: torch.dtype, device, roundings: int, width: int, compared: int, chain: int = 0) -> float:
    """The largest difference, relative to the largest |value| compared, that round-off explains.

    Each path rounds every sublayer's output before adding it to the residual stream, and the head's (``roundings``
    of them): to the compute dtype (u), after fp32 accumulations that the two paths' kernels (a whole sequence, one
    token) run in different orders: a dot product of ``width`` terms (up to u_fp32 * sqrt(width) of its scale), and
    in a layer with a state along the sequence, the ``chain`` of the state's updates over the probe's tokens
    (recurrent when decoding, a chunked solve in training: carried from token to token, so up to u_fp32 * chain).
    Independent round-offs add like a random walk, times sqrt(roundings), and two paths differ by sqrt(2) of one;
    the largest of ``compared`` such differences lies within sqrt(2 ln compared) of their spread (the maximum of
    that many normal draws). A leaked window, a wrong position or a lost state moves logits by a sizeable part of
    their scale."""
    each = unit_roundoff(compute_dtype, device) + torch.finfo(torch.float32).eps / 2 * (math.sqrt(width) + chain)
    return math.sqrt(2 * math.log(max(compared, 2))) * math.sqrt(2 * roundings) * each


def probe_sequences(examples, tokens: int = PROBE_TOKENS) -> list[list[int]]:
    """The two longest of the data's first examples, each cut to ``tokens``."""
    lengths = [int(n) for n in examples.lengths[:100]]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])[:2]
    return [list(examples[i]["input_ids"])[:tokens] for i in order if lengths[i] >= 2]


def _inference_model(model: nn.Module) -> nn.Module:
    """The model ``generate`` belongs to: inside DDP's or DeepSpeed's ``.module``, with PEFT's wrapper kept (its
    adapters are part of what inference runs)."""
    from peft import PeftModel
    from transformers import PreTrainedModel

    while not isinstance(model, (PreTrainedModel, PeftModel)) and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


@contextlib.contextmanager
def _modes(model: nn.Module):
    """Every module's train/eval flag and the dropout/noise probabilities ``_training_forward`` zeroes, restored."""
    flags = [(m, m.training) for m in model.modules()]
    probabilities = [(m, name, getattr(m, name)) for m in model.modules() for name in vars(m)
                     if ("dropout" in name or "jitter" in name) and isinstance(getattr(m, name), float)]
    try:
        yield probabilities
    finally:
        for module, training in flags:
            module.training = training
        for module, name, value in probabilities:
            setattr(module, name, value)


def _training_forward(model: nn.Module, batch: dict, probabilities, device) -> torch.Tensor:
    """The run's forward in train mode with every dropout off: nn.Dropout modules in eval mode, and the
    probabilities that attention and routers read from their module while training (attention_dropout, jitter
    noise) zeroed."""
    model.train()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.eval()
    for module, name, _ in probabilities:
        setattr(module, name, 0.0)
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items() if k in MODEL_INPUTS}
    return model(**inputs, use_cache=False).logits.float()


def _spans(batch: dict, probes: list[list[int]]) -> list[tuple[int, int]]:
    """(row, first position) of each probe in the collated batch: one packed row, or one right-padded row each."""
    if "packed_lengths" in batch:
        starts = [0]
        for p in probes[:-1]:
            starts.append(starts[-1] + len(p))
        return [(0, s) for s in starts]
    return [(i, 0) for i in range(len(probes))]


class _Forced:
    """A logits processor that makes ``generate`` pick the probe's own next token (teacher forcing)."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        at = min(input_ids.shape[1], len(self.tokens) - 1)  # past the probe: any token (its logits are not read)
        forced = torch.full_like(scores, -math.inf)
        forced[:, self.tokens[at]] = 0.0
        return forced


def _generated_logits(model: nn.Module, probe: list[int], prefill: int, pad_id: int, device) -> torch.Tensor:
    """(len(probe) - prefill + 1, V) logits at positions prefill-1 .. len-1, as ``generate`` computes them."""
    from transformers import GenerationConfig, LogitsProcessorList

    vocab = transformers_model(model).config.get_text_config().vocab_size
    # generate stops at an end token; the probes are data, which hold them (end of turn): name as end one that is
    # never forced
    forced = set(probe)
    end = next(t for t in range(vocab) if t not in forced)
    # greedy, with the neutral values of the sampling knobs, so that the checkpoint's own (temperature, top_k, a
    # max_length) are not read into it and warned about; the forcing replaces the scores whatever they were
    config = GenerationConfig(max_length=len(probe) + 1, do_sample=False, num_beams=1, temperature=1.0, top_p=1.0,
                              top_k=50, output_logits=True, return_dict_in_generate=True, eos_token_id=end,
                              pad_token_id=pad_id)
    ids = torch.tensor([probe[:prefill]], device=device)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config,
                         logits_processor=LogitsProcessorList([_Forced(probe)]))
    if out.sequences[0, :len(probe)].tolist() != probe:  # the forcing is what makes the positions comparable
        raise RuntimeError("inference check: generate did not follow the forced tokens")
    return torch.cat(out.logits).float()


def _per_position(train_logits: torch.Tensor, span: tuple[int, int], generated: torch.Tensor, length: int,
                  prefill: int) -> torch.Tensor:
    """max |training - generate| / max |generate| at each of positions prefill-1 .. length-1."""
    row, start = span
    trained = train_logits[row, start + prefill - 1:start + length]
    return (trained - generated).abs().amax(dim=-1) / generated.abs().amax(dim=-1).clamp(min=1e-6)


def _layer_states(model: nn.Module, layers: nn.ModuleList):
    """Hooks recording each decoder layer's output hidden states of every call (the caller concatenates them)."""
    states: list[list[torch.Tensor]] = [[] for _ in layers]

    def record(i):
        def hook(_module, _args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            states[i].append(hidden.detach().float())
        return hook

    handles = [layer.register_forward_hook(record(i)) for i, layer in enumerate(layers)]
    return states, handles


@dataclass(frozen=True)
class Mismatch:
    """Where the two paths first differ: probe ``probe`` (its row ``span`` of the training ``batch``), decoded
    after a prefill of ``prefill`` tokens, at ``position``."""

    batch: dict
    span: tuple[int, int]
    probe: list[int]
    prefill: int
    position: int


def first_differing_layer(model: nn.Module, at: Mismatch, probabilities, pad_id: int, device, compute_dtype,
                          chain: int) -> str:
    """The first decoder layer whose output at ``at.position`` differs between the two paths beyond round-off."""
    batch, span, probe, prefill, position = at.batch, at.span, at.probe, at.prefill, at.position
    found = decoder_stack(transformers_model(model))
    if found is None:
        return "no decoder layers found to compare"
    layers = found[1]
    row, start = span
    trained, handles = _layer_states(model, layers)
    try:
        _training_forward(model, batch, probabilities, device)
    finally:
        for h in handles:
            h.remove()
    model.eval()
    generated, handles = _layer_states(model, layers)
    try:
        _generated_logits(_inference_model(model), probe, prefill, pad_id, device)
    finally:
        for h in handles:
            h.remove()
    for i, layer in enumerate(layers):
        a = trained[i][0][row, start + position]
        b = torch.cat([s[0] for s in generated[i]])[position]  # prefill then one position per decoding step
        error = float((a - b).abs().max() / b.abs().max().clamp(min=1e-6))
        if error > tolerance(compute_dtype, device, 2 * (i + 1), a.numel(), a.numel(), chain):
            return f"first in decoder layer {i} ({type(layer).__name__}, {error:.1e} of its scale)"
    return "the decoder layers agree: first after them (final norm or output layer)"


def check_inference(model: nn.Module, examples, collate, pad_id: int, device, compute_dtype: torch.dtype,
                    autocast=contextlib.nullcontext, mode: bool | str = True) -> InferenceVerdict:
    """Compare the training forward with ``generate`` on the probes (the module docstring). ``mode``: True refuses
    the run on a difference (``InferenceMismatch``), 'warn' says it and goes on, False skips the check. Collective
    under several processes (each runs the same forwards; they agree on the largest differences)."""
    if mode is False:
        return InferenceVerdict(True, "inference check: skipped (train.inference_check=false)")
    if isinstance(getattr(model, "_orig_mod", None), nn.Module):  # eagerly, as the packing self-test (its note)
        model = model._orig_mod
    inner = transformers_model(model)
    text = inner.config.get_text_config()
    probes = probe_sequences(examples)
    if not probes:
        return InferenceVerdict(True, "inference check: skipped (no example of 2 tokens or more)")
    # (probe, prefill): the first decoded from its first token on, the second after a prefill of half of it
    runs = [(0, 1), (len(probes) - 1, len(probes[-1]) // 2)]
    batch = collate([{"input_ids": p, "labels": list(p)} for p in probes])
    spans = _spans(batch, probes)
    chain = max(map(len, probes)) if stateful_layers(inner) else 0
    limit = tolerance(compute_dtype, device, 2 * text.num_hidden_layers + 1, text.hidden_size,
                      sum(len(probes[p]) - k + 1 for p, k in runs) * text.vocab_size, chain)
    with _modes(model) as probabilities, torch.no_grad(), autocast():
        try:
            train_logits = _training_forward(model, batch, probabilities, device)
            model.eval()
            errors = [_per_position(train_logits, spans[p], _generated_logits(_inference_model(model), probes[p], k,
                                                                              pad_id, device), len(probes[p]), k)
                      for p, k in runs]
            worst = agreed_max([float(e.max()) for e in errors])
            error = max(worst)
            where = ""
            if error > limit:  # the first run over the limit on any process: every process re-runs the same one
                r = next(i for i, e in enumerate(worst) if e > limit)
                (p, k), over = runs[r], errors[r] > limit
                position = k - 1 + int(over.nonzero()[0, 0] if over.any() else errors[r].argmax())
                where = (f"at position {position} of probe {p + 1} (prefill of {k}), "
                         + first_differing_layer(model, Mismatch(batch, spans[p], probes[p], k, position),
                                                 probabilities, pad_id, device, compute_dtype, chain))
        finally:
            reshard(model)
    if error <= limit:
        return InferenceVerdict(True, f"inference check: training forward and generate agree on {len(probes)} probes "
                                f"({sum(map(len, probes))} tokens, every position; error {error:.1e}, tolerance "
                                f"{limit:.0e})", error, limit)
    line = (f"inference check: {type(inner).__name__}'s training forward and generate (KV cache, one token at a "
            f"time) differ by {error:.1e} of the logits' scale (tolerance {limit:.0e} in "
            f"{str(compute_dtype).removeprefix('torch.')}) {where}")
    if mode == "warn":
        return InferenceVerdict(False, line + "; training anyway (train.inference_check=warn)", error, limit)
    raise InferenceMismatch(line + ". The model would be trained on a function inference does not compute: "
                            "report it, or set train.inference_check=warn to train anyway (false: skip the check).")
