"""Forgetting measured while a run trains: how far the tuned model's next-token distributions have moved from the
base model's on text it already handled (``base_kl``), and an optional loss term that anchors to the base.

``base_kl`` is the mean per-token KL(base || tuned) in nats, over every position of a held-out text that has a next
token: the user's ``eval.base_text`` or, without one, the validation split's prompts. It is summed and counted the
way the validation loss is (``validation.validation_loss``), so it is the same on any process count.

- LoRA: exact. The base is the same model with its adapters disabled (PEFT's ``disable_adapter()``): no second
  model, one more forward per validation batch.
- Full fine-tuning: the base's weights are gone after the first update, so its top-k log-probabilities at every
  position (and the probability of the rest of the vocabulary as one bucket) are computed once before it, kept in
  memory and in the run folder (``BASE_TOPK``; a resume reads them there). The KL of those k + 1 outcomes is a
  *lower bound* of the full KL (merging outcomes never increases a KL); exact when k >= vocabulary.

``train.base_kl_weight`` (LoRA only: with full fine-tuning it would need a second model) adds weight x the summed
KL(base || tuned) over the micro-batch's trained tokens to the summed token loss, so ``step.backward_window``
normalises it by the window's trained tokens exactly as it does the loss. The value returned (and logged as
``loss``) stays the cross-entropy; only the gradient carries the term.
"""

from __future__ import annotations

import functools
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from anyfit.config import Config, ConfigError
from anyfit.data.batching import to_device
from anyfit.data.readers import read_file
from anyfit.data.tokenization import IGNORE_INDEX
from anyfit.training.loss import cross_entropy_sum, kept_logits, source_groups
from anyfit.training.parts import Parts
from anyfit.training.validation import validation_loss

BASE_TOPK = "base_topk.safetensors"  # the base model's top-k log-probabilities of the held-out text (full FT)
LOWER_BOUND = "a lower bound of the full KL"


@dataclass
class BaseText:
    """The held-out text ``base_kl`` is measured on: examples whose every next token counts (labels = ids)."""

    examples: list[dict]
    source: str  # 'eval.base_text <path>' or 'the validation prompts'

    @property
    def positions(self) -> int:
        return sum(len(e["input_ids"]) - 1 for e in self.examples)

    def digest(self) -> str:
        h = hashlib.sha256()
        for e in self.examples:
            h.update(torch.tensor(e["input_ids"], dtype=torch.int64).numpy().tobytes() + b"|")
        return h.hexdigest()


def held_out_text(cfg: Config, tokenizer, eval_examples) -> BaseText | None:
    """``eval.base_text`` (records with a ``text`` field, read as training data is), else the prompts of the
    validation examples (their tokens before the first trained one); at most ``eval.base_text_tokens`` tokens,
    each text cut to ``data.max_length``. None when there is neither."""
    budget, longest = cfg.eval.base_text_tokens, cfg.data.max_length
    texts: list[list[int]] = []
    if cfg.eval.base_text:
        path = Path(cfg.eval.base_text)
        for chunk in read_file(path):
            for i, record in enumerate(chunk):
                text = record.get("text") if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise ConfigError(f"eval.base_text: {chunk.locate(i)} has no 'text' field with a string (keys: "
                                      f"{sorted(record) if isinstance(record, dict) else type(record).__name__}); "
                                      "give one record per text as {\"text\": ...}.")
                texts.append(tokenizer(text)["input_ids"][:longest])
                budget -= len(texts[-1])
                if budget <= 0:
                    break
            if budget <= 0:
                break
        source = f"eval.base_text {path}"
    elif eval_examples is not None and len(eval_examples):
        for e in eval_examples:
            first = next((j for j, t in enumerate(e["labels"]) if t != IGNORE_INDEX), len(e["labels"]))
            texts.append(e["input_ids"][:first])
            budget -= first
            if budget <= 0:
                break
        source = "the validation prompts"
    else:
        return None
    if budget < 0:  # the last text fills the budget exactly
        texts[-1] = texts[-1][:len(texts[-1]) + budget]
    examples = [{"input_ids": list(t), "labels": list(t)} for t in texts if len(t) >= 2]
    if not examples:
        raise ConfigError(f"train.watch_base: {source} has no text of 2 tokens or more to measure base_kl on.")
    return BaseText(examples, source)


def kl_sum(tuned: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Sum over rows of KL(base || tuned) of (N, V) logits (or log-probabilities), in fp32."""
    return F.kl_div(F.log_softmax(tuned.float(), dim=-1), F.log_softmax(base.float(), dim=-1), reduction="sum",
                    log_target=True)


@torch.no_grad()
def lora_kl_sum(model, batch: dict, bare, chunk: int = 1024) -> torch.Tensor:
    """Summed exact KL(base || tuned) over a batch's kept positions; the base is ``bare`` with adapters disabled
    (``bare``: the PEFT model under the backend's wrapper ``model``)."""
    with bare.disable_adapter():
        base = kept_logits(model, batch)
    tuned = kept_logits(model, batch)
    total = torch.zeros((), device=tuned.device)
    for s in range(0, tuned.shape[0], chunk):  # fp32 log-probabilities of ``chunk`` rows at a time
        total += kl_sum(tuned[s:s + chunk], base[s:s + chunk])
    return total


def anchored_loss(bare, weight: float, chunk_tokens: int):
    """``loss_fn(model, batch)``: the summed token loss, whose gradient also carries weight x the summed exact
    KL(base || tuned) over the trained tokens (base: adapters disabled, no gradient). The value is the loss alone
    (``kl - kl.detach()`` is 0), so ``loss`` in metrics.jsonl stays the cross-entropy. With sources (``data.mix``)
    the loss is one sum per source and the anchor's term is spread evenly over them: their total carries it once."""

    def loss(model, batch):
        with torch.no_grad(), bare.disable_adapter():
            base = kept_logits(model, batch)
        logits = kept_logits(model, batch)
        kl = kl_sum(logits, base)
        ce = cross_entropy_sum(logits, batch["keep_targets"], chunk_tokens, *source_groups(batch))
        return ce + weight * (kl - kl.detach()) / ce.numel()

    return loss


# -- full fine-tuning: the base's top-k, once ------------------------------------------------------------------

@dataclass
class BaseTopK:
    """Per position of the held-out text (examples in order, each position but its last): the base's top-k token
    ids and log-probabilities, and the log-probability of every other token together (None when k >= V)."""

    ids: torch.Tensor  # (P, k) int64
    logp: torch.Tensor  # (P, k) fp32
    rest: torch.Tensor | None  # (P,) fp32

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ids, self.logp, self.rest) if t is not None)


@torch.no_grad()
def base_top_k(backend, model, examples: list[dict], k: int, micro_batch: int, collate_fn, device) -> BaseTopK:
    """The model's top-k of every position of ``examples`` (in their order), in micro-batches; every process
    computes all of them (a sharded model needs every process in every forward)."""
    parts: list[tuple[torch.Tensor, ...]] = []
    was_training = model.training
    model.eval()
    try:
        for i in range(0, len(examples), micro_batch):
            batch = to_device(collate_fn(examples[i:i + micro_batch]), device)
            logits = kept_logits(model, batch).float()
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            top, ids = logits.topk(min(k, logits.shape[-1]), dim=-1)
            rest = (torch.logsumexp(logits.scatter(1, ids, float("-inf")), dim=-1) - lse.squeeze(1)
                    if k < logits.shape[-1] else None)
            parts.append((ids.cpu(), (top - lse).cpu(), None if rest is None else rest.cpu()))
    finally:
        model.train(was_training)
        backend.after_eval(model)
    return BaseTopK(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                    None if parts[0][2] is None else torch.cat([p[2] for p in parts]))


def topk_collate(examples: list[dict], collate_fn, top: BaseTopK) -> dict:
    """``collate_fn``'s batch plus the base's top-k of its kept positions, in ``keep_targets``' order (each
    example's positions in turn: every position but the last is kept). Examples carry their first row ("row")."""
    batch = collate_fn(examples)
    rows = torch.cat([torch.arange(e["row"], e["row"] + len(e["input_ids"]) - 1) for e in examples])
    batch["base_ids"], batch["base_logp"] = top.ids[rows], top.logp[rows]
    if top.rest is not None:
        batch["base_rest"] = top.rest[rows]
    return batch


@torch.no_grad()
def topk_kl_sum(model, batch: dict) -> torch.Tensor:
    """Summed KL(base || tuned) over the base's top-k tokens and the rest of the vocabulary as one bucket: a lower
    bound of the full KL (exact when k >= V)."""
    logits = kept_logits(model, batch).float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    tuned, base = logits.gather(1, batch["base_ids"]) - lse, batch["base_logp"]
    if "base_rest" in batch:
        tuned_rest = torch.logsumexp(logits.scatter(1, batch["base_ids"], float("-inf")), dim=-1, keepdim=True) - lse
        tuned, base = torch.cat([tuned, tuned_rest], 1), torch.cat([base, batch["base_rest"].unsqueeze(1)], 1)
    return F.kl_div(tuned, base, reduction="sum", log_target=True)


def saved_top_k(path: Path, text: BaseText, k: int) -> BaseTopK | None:
    """The base's top-k saved in the run folder for this text and k, or None."""
    if not path.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    if meta.get("digest") != text.digest() or meta.get("k") != str(k):
        return None
    t = load_file(path)
    return BaseTopK(t["ids"], t["logp"], t.get("rest"))


# -- set-up -----------------------------------------------------------------------------------------------------

class BaseWatch:
    """``base_kl`` at every validation: ``measure`` returns it and prints a warning when it first grows past
    ``train.base_kl_warn`` (again after it fell back below)."""

    def __init__(self, text: BaseText, kl_fn, collate_fn, warn: float, exact: bool, say):
        self.text, self.kl_fn, self.collate_fn, self.warn, self.exact, self.say = \
            text, kl_fn, collate_fn, warn, exact, say
        self.above = False

    def measure(self, parts: Parts, micro_batch: int) -> float:
        kl = validation_loss(parts, self.text.examples, micro_batch, collate=self.collate_fn, loss_fn=self.kl_fn)
        if self.warn and kl > self.warn and not self.above:
            self.say(f"[anyfit] warning: base_kl={kl:.4f} nats/token on {self.text.source} is past "
                     f"train.base_kl_warn={self.warn}: the model is drifting from the base on text it already "
                     "handled (lower the learning rate, train fewer steps, or set train.base_kl_weight)")
        self.above = bool(self.warn) and kl > self.warn
        return kl

    def as_dict(self) -> dict:
        return {"text": self.text.source, "positions": self.text.positions,
                "kl": "exact (adapters disabled)" if self.exact else LOWER_BOUND}


def watching(cfg: Config) -> bool | None:
    """Whether ``train.watch_base`` asks for base_kl: True (asked), False, or None (auto: on with LoRA)."""
    w = cfg.train.watch_base
    if w == "auto":
        return None if (cfg.lora.enabled or cfg.lora.qlora) and cfg.eval.every > 0 else False
    return bool(w)


@dataclass
class Forgetting:
    """What a run gets from this module: the training step's ``loss`` and the ``watch`` (None: base_kl off)."""

    loss: object
    watch: BaseWatch | None = None

    def record(self) -> dict:
        """What ``run_info.json`` keeps: what base_kl measures, on what."""
        return {"base_kl": self.watch.as_dict()} if self.watch else {}


def watch_base(parts: Parts, resumed: bool) -> Forgetting:
    """Set-up, before the first update: the training loss (anchored with ``train.base_kl_weight``) and the base_kl
    watch. ``resumed``: the run continues a checkpoint (the base's top-k is read from the run folder, never computed
    from the resumed weights)."""
    return Forgetting(training_loss(parts.cfg, parts.bare, parts.loss_fn), set_up_watch(parts, resumed))


def set_up_watch(parts: Parts, resumed: bool) -> BaseWatch | None:
    """The run's ``BaseWatch`` (None when base_kl is off), with a printed line saying what it measures and on
    what; for full fine-tuning the base's top-k is computed (before the first update) or read here."""
    cfg, split, say, out = parts.cfg, parts.split, parts.say, parts.out
    micro_batch = 1 if cfg.train.micro_batch == "auto" else cfg.train.micro_batch
    asked = watching(cfg)
    if asked is False:
        return None
    lora = cfg.lora.enabled or cfg.lora.qlora
    if split.active:  # train.watch_base=true is refused with the split (hardware.runtime.sequence_parallel_problem)
        say("[anyfit] base_kl: off (not available with sequence parallel yet)")
        return None
    text = held_out_text(cfg, parts.tokenizer, parts.data.eval_examples)
    if text is None:
        if asked:
            raise ConfigError("train.watch_base=true needs held-out text: set eval.base_text (a JSONL file of "
                              "{\"text\": ...} records) or held-out data (eval.holdout, eval.path or eval.split).")
        say("[anyfit] base_kl: off (no held-out text: set eval.base_text, or hold data out with eval.holdout)")
        return None
    warn = cfg.train.base_kl_warn
    if lora:
        say(f"[anyfit] base_kl: exact KL(base || tuned) per token at every validation, on {text.positions} positions "
            f"of {text.source} (the base: the adapters disabled)")
        return BaseWatch(text, functools.partial(lora_kl_sum, bare=parts.bare), parts.collate, warn, True, say)
    k = cfg.eval.base_top_k
    examples, row = [], 0
    for e in text.examples:
        examples.append({**e, "row": row})
        row += len(e["input_ids"]) - 1
    text = BaseText(examples, text.source)
    path = out / BASE_TOPK
    top = saved_top_k(path, text, k) if resumed else None  # a resume reads the base's, never its own start's
    if top is not None:
        say(f"[anyfit] base_kl: the base model's top-{k} of {text.positions} positions read from {path}")
    elif resumed:
        say(f"[anyfit] base_kl: off for this resume: {path} does not hold the base model's top-{k} of "
            f"{text.source} (the base's weights are gone after the first update)")
        return None
    else:
        t0 = time.perf_counter()
        top = base_top_k(parts.backend, parts.model, text.examples, k, micro_batch, parts.collate,
                         parts.accelerator.device)
        seconds = time.perf_counter() - t0
        if parts.accelerator.is_main_process:
            out.mkdir(parents=True, exist_ok=True)
            save_file({"ids": top.ids, "logp": top.logp, **({"rest": top.rest} if top.rest is not None else {})},
                      str(path), metadata={"digest": text.digest(), "k": str(k)})
        say(f"[anyfit] base_kl: the base model's top-{k} log-probabilities of {text.positions} positions of "
            f"{text.source} computed before the first update in {seconds:.1f} s, {top.nbytes / 2**20:.1f} MiB held "
            f"on each process (saved to {path}); base_kl is the KL over those k tokens and the rest of the "
            f"vocabulary as one bucket: {LOWER_BOUND}" + (" (here exact: k >= vocabulary)" if top.rest is None
                                                          else ""))
    return BaseWatch(text, topk_kl_sum, functools.partial(topk_collate, collate_fn=parts.collate, top=top), warn,
                     top.rest is None, say)


def training_loss(cfg: Config, bare, loss_fn):
    """The training step's ``loss_fn``: ``loss_fn`` itself, or with ``train.base_kl_weight`` > 0 the anchored loss
    (LoRA only, and never with a sequence split: refused by the config's checks and
    ``hardware.runtime.sequence_parallel_problem``)."""
    weight = cfg.train.base_kl_weight
    if not weight:
        return loss_fn
    return anchored_loss(bare, weight, cfg.train.loss_chunk_tokens)
