"""The shape of a decoder-only LM, from its config alone: sizes, parameter counts, KV-cache bytes, LoRA targets.

One owner for these numbers: the planner sizes memory and FLOPs with them, generation sizes its batch
from ``kv_cache_bytes``, and model loading resolves ``lora.target_modules`` with ``resolve_lora_targets``
(the planner resolves over the shape's projections, loading over the real model's linear layers, by the
same rule).

The Llama family and GPT-2 are counted by closed formulas (read from their modeling code); other
architectures are built on PyTorch's meta device, which allocates nothing. A mixture of experts carries its
routed experts' fused tensors beside the linear layers: every parameter counts for memory (``params``), the
token's top_k experts for compute (``active_params``, ``active_matmul_params``; ``anyfit.model.moe``).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, replace

from anyfit.config import ConfigError, ModelConfig
from anyfit.model.composite import is_composite, language_modules, language_parameters, model_class
from anyfit.model.expert_lora import splits_lora
from anyfit.model.moe import moe_blocks
from anyfit.model.packing import stateful_kinds
from anyfit.model.source import ModelSource
from anyfit.model.vision import part_sizes

# Leaf names of the projections LoRA usually targets, by architecture family. Used to order and
# explain the automatic choice; the choice itself comes from the model's own modules.
KNOWN_TARGETS = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",  # Llama, Qwen, Mistral, Gemma
    "c_attn", "c_proj", "c_fc",  # GPT-2
    "query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h",  # BLOOM, Falcon, GPT-NeoX
    "qkv_proj", "gate_up_proj", "out_proj", "fc1", "fc2", "Wqkv", "wq", "wk", "wv", "wo", "w1", "w2", "w3",
)


def resolve_lora_targets(present: list[str], spec: list[str] | str) -> list[str]:
    """Resolve ``lora.target_modules`` over the linear-layer leaf names ``present`` in the model body:
    'auto'/'all-linear' -> every one (the well-known projections first); an explicit list is checked so a
    typo fails here, not deep inside PEFT."""
    if spec in ("auto", "all-linear"):
        known = [n for n in KNOWN_TARGETS if n in present]
        targets = known + [n for n in present if n not in known]
        if not targets:
            raise ConfigError("lora.target_modules=auto found no linear layers in this model; list them explicitly.")
        return targets
    spec = [spec] if isinstance(spec, str) else list(spec)
    missing = [t for t in spec if t not in present]
    if missing:
        hints = {m: difflib.get_close_matches(m, present, n=1) for m in missing}
        hint = "; ".join(f"'{m}' -> did you mean '{h[0]}'?" for m, h in hints.items() if h)
        raise ConfigError(f"lora.target_modules {missing} match no module of this model. Its linear layers are: "
                          f"{', '.join(present)}. {hint}".strip())
    return spec




@dataclass(frozen=True)
class Projection:
    """A family of linear layers of the decoder body (one per layer): what LoRA can target."""

    name: str  # leaf module name, as lora.target_modules matches it (q_proj, c_attn, ...)
    d_in: int
    d_out: int
    count: int  # modules with this name and shape in the body
    group: str  # whose output it reads: attn_in | attn_out | mlp_in | mlp_mid | other


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a decoder-only LM, read from its config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    params: int  # total, counting tied embeddings once
    embedding_params: int  # input embeddings (and learned positions)
    head_params: int  # an untied output head (0 when tied)
    projections: tuple[Projection, ...]
    gated_mlp: bool = True
    counted_by: str = "formula"  # or "meta device"
    # Mixtures of experts (anyfit.model.moe): the routed experts' fused weight tensors, as projections of one expert
    # (count = layers x experts), every routed-expert parameter, and what one token uses of them (top_k of experts)
    experts: tuple[Projection, ...] = ()
    routed_params: int = 0
    active_routed_params: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    # whether LoRA on them can run as base plus low-rank path (anyfit.model.expert_lora: transformers' experts-interface
    # classes; the run confirms it with a check at start) rather than PEFT's W + BA formed per forward
    experts_split: bool = False
    # A composite checkpoint's parts outside the language model (anyfit.model.vision): always loaded; the tower and
    # the projector train as model.train_vision and model.train_projector say (the planner's Setup), audio never.
    # The tower's linear layers, as projections, are what LoRA adapts with train_vision=lora.
    tower_params: int = 0
    projector_params: int = 0
    audio_params: int = 0
    tower_projections: tuple[Projection, ...] = ()
    tower_hidden: int = 0  # the tower's width and the pixels a side of a patch it embeds (its vision_config)
    tower_patch: int = 0
    # Patches the tower embeds for one example's images at the processor's size limit (kept pixels / patch^2):
    # set where the processor is on hand (``anyfit plan``), 0 where it is not (no tower activations then).
    tower_patches: int = 0
    router_params: int = 0  # the routers' (and gates') matrices: every token passes through them
    stateful: str = ""  # layers with a state along the sequence (anyfit.model.packing): never split over processes

    @property
    def active_params(self) -> int:
        """Parameters one token passes through: all but the routed experts it is not sent to (= params if dense)."""
        return self.params - self.routed_params + self.active_routed_params

    @property
    def active_body_params(self) -> int:
        """Matmul weights of the body one token passes through: the linear layers and its top_k experts' tensors
        (compute: FLOPs per token; memory counts every parameter, ``params``)."""
        share = self.experts_per_token / self.num_experts if self.num_experts else 0.0
        return (self.body_linear_params + self.router_params
                + round(share * sum(p.d_in * p.d_out * p.count for p in self.experts)))

    @property
    def tower_saved_per_patch(self) -> int:
        """Elements a trained tower keeps for its backward per patch, over all its layers: each linear layer's input
        and output (inputs for the weight gradients; outputs as the next op's saved input: attention's q, k, v,
        the MLP's activation), and two norm inputs per layer. Against what autograd saves in transformers' towers
        (tests/unit/planning/test_tower_plan.py): 0.73-1.28 of it on six families (rotary embeddings and fp32
        casts uncounted, a norm's and a GELU's copies counted where a tower does not keep them)."""
        layers = max((p.count for p in self.tower_projections), default=0)
        return sum((p.d_in + p.d_out) * p.count for p in self.tower_projections) + 2 * self.tower_hidden * layers

    @property
    def outside_params(self) -> int:
        """A composite's parameters outside its language model (0 for a plain language model)."""
        return self.tower_params + self.projector_params + self.audio_params

    def fully_trained_outside(self, train_vision: str, train_projector: bool) -> int:
        """Parameters outside the language model that train whole: the tower with train_vision=full, the projector
        with train_projector."""
        return self.tower_params * (train_vision == "full") + self.projector_params * train_projector

    def tower_lora_params(self, r: int, spec: list[str] | str = "auto") -> int:
        """Adapter parameters on the vision tower's linear layers (model.train_vision=lora): every one with
        auto/all-linear, the names a list shares with the tower (anyfit.model.vision.tower_lora_targets)."""
        names = None if spec in ("auto", "all-linear") else set([spec] if isinstance(spec, str) else spec)
        return sum(r * (p.d_in + p.d_out) * p.count for p in self.tower_projections if names is None or p.name in names)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def body_linear_params(self) -> int:
        """Weights of the body's linear layers (what QLoRA quantizes, and most of the matmul FLOPs)."""
        return sum(p.d_in * p.d_out * p.count for p in self.projections)

    @property
    def matmul_params(self) -> int:
        """Linear-layer weights in a matmul: the body's projections plus the output head (tied or not); the routed
        experts' fused tensors are not among them (``active_matmul_params``)."""
        return self.body_linear_params + self.vocab_size * self.hidden_size

    @property
    def active_matmul_params(self) -> int:
        """Weights used in a matmul per token: ``matmul_params`` and the token's top_k experts."""
        return self.active_body_params + self.vocab_size * self.hidden_size

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (everything but embeddings, head and final norm, over the layers)."""
        return (self.params - self.embedding_params - self.head_params) // max(1, self.num_layers)

    def lora_targets(self, spec: list[str] | str, experts: bool = True) -> list[str]:
        """Resolve lora.target_modules exactly as model loading does, over this shape's projections and fused
        expert tensors (the latter kept with ``lora.experts``)."""
        linear = list(dict.fromkeys(p.name for p in self.projections))
        resolved = resolve_lora_targets(list(dict.fromkeys(linear + [p.name for p in self.experts])), spec)
        return resolved if experts else [n for n in resolved if n in linear]

    def lora_params(self, r: int, spec: list[str] | str = "auto", experts: bool = True) -> int:
        """Adapter parameters: r x (d_in + d_out) for every targeted linear layer and targeted expert (PEFT's
        adapter of a fused expert tensor holds one r-rank pair per expert)."""
        targets = set(self.lora_targets(spec, experts))
        fused = self.experts if experts else ()
        return sum(r * (p.d_in + p.d_out) * p.count for p in (*self.projections, *fused) if p.name in targets)

    def folded_expert_params(self, spec: list[str] | str = "auto", experts: bool = True) -> int:
        """Weights of the targeted fused expert tensors one token passes through (its top_k experts)."""
        targets = set(self.lora_targets(spec, experts)) if experts else set()
        share = self.experts_per_token / self.num_experts if self.num_experts else 0.0
        return round(share * sum(p.d_in * p.d_out * p.count for p in self.experts if p.name in targets))

    def lora_flops(self, r: int, spec: list[str] | str = "auto", experts: bool = True, split: bool = False) -> float:
        """Training FLOPs per token that LoRA adds to the frozen base's 4 x ``active_matmul_params``: 6 per adapter
        parameter of a linear layer; on the fused expert tensors ``split_lora_flops`` for the split path
        (``split``), else PEFT's: it folds the adapter into the weight (W + BA, once per forward) and takes that
        folded tensor's whole gradient, so the token's experts cost their weight gradient (2 per weight) as in full
        fine-tuning, and their adapters run per micro-batch, not per token."""
        linear = 6.0 * self.lora_params(r, spec, experts=False)
        if split and experts:
            return linear + self.split_lora_flops(self.lora_params(r, spec) - self.lora_params(r, spec, False), spec)
        return linear + 2.0 * self.folded_expert_params(spec, experts)

    def split_lora_flops(self, adapter: int, spec: list[str] | str = "auto") -> float:
        """FLOPs per token of ``adapter`` parameters on the targeted fused expert tensors computed as base plus
        low-rank path (anyfit.model.expert_lora.SplitProjection) in the token's top_k experts: the two thin products
        forward, their input and factor gradients backward (6 per adapter parameter, as a linear layer's), and the
        backward's recompute of x·A (2 x r x d_in)."""
        targets = set(self.lora_targets(spec))
        fused = [p for p in self.experts if p.name in targets]
        both = sum((p.d_in + p.d_out) * p.count for p in fused)
        if not both or not self.num_experts:
            return 0.0
        reading = sum(p.d_in * p.count for p in fused) / both  # the share of an adapter's parameters in A
        return self.experts_per_token / self.num_experts * adapter * (6.0 + 2.0 * reading)

    def describe(self) -> str:
        tied = "tied" if self.tie_word_embeddings else "untied"
        moe = (f" ({self.active_params / 1e6:,.1f}M active per token: {self.experts_per_token} of "
               f"{self.num_experts} routed experts)" if self.num_experts else "")
        return (f"{self.model_type}: {self.params / 1e6:,.1f}M parameters{moe} ({self.counted_by}); embeddings "
                f"{self.embedding_params / 1e6:,.1f}M ({tied}), {self.num_layers} layers, hidden {self.hidden_size}, "
                f"heads {self.num_heads} (kv {self.num_kv_heads}, head_dim {self.head_dim}), intermediate "
                f"{self.intermediate_size}, vocab {self.vocab_size:,}"
                + (f"; plus {self.outside_params / 1e6:,.1f}M outside the language model (vision tower "
                   f"{self.tower_params / 1e6:,.1f}M, projector {self.projector_params / 1e6:,.1f}M"
                   + (f", audio {self.audio_params / 1e6:,.1f}M" if self.audio_params else "")
                   + "), frozen unless model.train_vision / model.train_projector" if self.outside_params else ""))


# Llama-family decoders: which biases and extra norms each model type has (read from their modeling code).
_LLAMA_LIKE = {
    # model_type: (q/k/v bias, o bias, mlp bias, per-head q/k norms) -- a str is the config attribute to read
    "llama": ("attention_bias", "attention_bias", "mlp_bias", False),
    "mistral": (False, False, False, False),
    "qwen2": (True, False, False, False),
    # Qwen2-VL's and Qwen2.5-VL's language models: Qwen2's layers (M-RoPE changes no weight); transformers maps no
    # AutoModelForCausalLM to their text configs, so the meta-device count below cannot build them
    "qwen2_vl_text": (True, False, False, False),
    "qwen2_5_vl_text": (True, False, False, False),
    "qwen3": ("attention_bias", "attention_bias", False, True),
    "gemma": ("attention_bias", "attention_bias", False, False),
}


def load_model_config(cfg: ModelConfig):
    """The transformers config of ``model.name_or_path`` (folder, hub id, or GGUF file); no weights are read."""
    from transformers import AutoConfig

    src = ModelSource.from_config(cfg)
    try:
        config = AutoConfig.from_pretrained(src.path, gguf_file=src.gguf_file, revision=cfg.revision,
                                            trust_remote_code=cfg.trust_remote_code)
    except ValueError as e:
        if "does not recognize this architecture" in str(e):  # a model_type this transformers does not know
            import transformers

            kind = re.search(r"model type `([^`]*)`", str(e))
            raise ConfigError(f"The model config of {cfg.name_or_path!r} has model_type "
                              f"{kind.group(1) if kind else '?'!r}, which transformers {transformers.__version__} "
                              "does not know: upgrade transformers (pip install -U transformers), or set "
                              "model.trust_remote_code=true if the model ships its own code.") from e
        raise ConfigError(f"Cannot read the model config of {cfg.name_or_path!r} ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]}). Offline, point model.name_or_path at a local folder "
                          "with config.json or a .gguf file.") from e
    except OSError as e:
        raise ConfigError(f"Cannot read the model config of {cfg.name_or_path!r} ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]}). Offline, point model.name_or_path at a local folder "
                          "with config.json or a .gguf file.") from e
    except Exception as e:  # transformers' own checks of the sizes (huggingface_hub's strict dataclass errors)
        raise ConfigError(f"The model config of {cfg.name_or_path!r} is inconsistent: {_innermost(e)}. Fix its "
                          "config.json, or point model.name_or_path at the model's own.") from e
    if src.gguf_file is None:  # a GGUF file's metadata holds every size; a config.json may leave some out
        from transformers import PretrainedConfig

        raw, _ = PretrainedConfig.get_config_dict(src.path, revision=cfg.revision)
        problem = size_problem(config, raw)
        if problem:
            raise ConfigError(f"The config.json of {cfg.name_or_path!r} {problem}. Fix it, or point "
                              "model.name_or_path at the model's own.")
    return config


# The sizes a formula family's config.json must state: missing, transformers fills in its class's defaults (a
# 7B Llama's), and the plan would be of another model than the one named.
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def size_problem(config, raw: dict) -> str:
    """What is wrong with the sizes of a Llama-family or GPT-2 ``config.json`` ('' when nothing): a size it
    leaves out, a size that is not positive, heads that do not divide the width or key/value heads that do not
    divide the heads. Other architectures are counted by building them, which checks them."""
    model_type = getattr(config, "model_type", "")
    if (model_type not in _LLAMA_LIKE and model_type != "gpt2") or config.get_text_config() is not config:
        return ""
    names = getattr(type(config), "attribute_map", {})
    required = _REQUIRED if model_type in _LLAMA_LIKE else tuple(k for k in _REQUIRED if k != "intermediate_size")
    missing = [k for k in required if k not in raw and names.get(k) not in raw]
    if missing:
        return f"leaves out {', '.join(missing)} (transformers would fill in its {type(config).__name__} defaults)"
    sizes = {k: getattr(config, k, None) for k in (*required, "num_key_value_heads", "head_dim")}
    bad = [f"{k}={v}" for k, v in sizes.items() if v is not None and (not isinstance(v, int) or v <= 0)]
    if bad:
        return f"has sizes that are not positive whole numbers ({', '.join(bad)})"
    heads, kv = sizes["num_attention_heads"], sizes["num_key_value_heads"] or sizes["num_attention_heads"]
    if not sizes["head_dim"] and sizes["hidden_size"] % heads:
        return (f"has hidden_size={sizes['hidden_size']}, not a multiple of num_attention_heads={heads}, and no "
                "head_dim")
    if heads % kv:
        return f"has num_attention_heads={heads}, not a multiple of num_key_value_heads={kv}"
    return ""


def _innermost(error: BaseException) -> str:
    """The first line of the deepest cause (transformers wraps its check's ValueError in a validation error)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200].rstrip(".")


def model_shape(cfg: ModelConfig) -> ModelShape:
    """The shape of the configured model, from its config alone."""
    return shape_from_config(load_model_config(cfg))


def shape_from_config(config) -> ModelShape:
    """Sizes and parameter count from a transformers ``PretrainedConfig``."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", "") or getattr(config, "model_type", "")
    tied = bool(getattr(config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", True)))
    if model_type in _LLAMA_LIKE:
        shape = _llama_like_shape(text, model_type, tied)
    elif model_type == "gpt2":
        shape = _gpt2_shape(text)
    else:
        shape = _meta_shape(text if is_composite(config) else config, text, model_type, tied,
                            config if is_composite(config) else None)
    # a composite (vision-language) checkpoint: its language model is planned, the rest is loaded and frozen
    shape = replace(shape, stateful=stateful_kinds(config))
    if not is_composite(config):
        return shape
    sizes = part_sizes(config)
    tower = tuple(Projection(name, d_in, d_out, count, "other") for name, d_in, d_out, count in sizes.tower_linears)
    vision = getattr(config, "vision_config", None)
    patch = getattr(vision, "patch_size", 0)
    return replace(shape, tower_params=sizes.tower, projector_params=sizes.projector, audio_params=sizes.audio,
                   tower_projections=tower, tower_patch=patch if type(patch) is int else 0,
                   tower_hidden=getattr(vision, "hidden_size", 0) or getattr(vision, "embed_dim", 0) or 0)


def _flag(config, value) -> bool:
    return bool(getattr(config, value, False)) if isinstance(value, str) else value


def _llama_like_shape(c, model_type: str, tied: bool) -> ModelShape:
    qkv_bias, o_bias, mlp_bias, qk_norm = (_flag(c, v) for v in _LLAMA_LIKE[model_type])
    h, inter, n_layers, vocab = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or h // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = h * q + 2 * h * kv + q * h + qkv_bias * (q + 2 * kv) + o_bias * h + qk_norm * 2 * head_dim
    mlp = 3 * h * inter + mlp_bias * (2 * inter + h)
    layer = attention + mlp + 2 * h  # two RMSNorm weights
    head = 0 if tied else vocab * h
    params = vocab * h + n_layers * layer + h + head  # + final norm
    proj = (Projection("q_proj", h, q, n_layers, "attn_in"), Projection("k_proj", h, kv, n_layers, "attn_in"),
            Projection("v_proj", h, kv, n_layers, "attn_in"), Projection("o_proj", q, h, n_layers, "attn_out"),
            Projection("gate_proj", h, inter, n_layers, "mlp_in"), Projection("up_proj", h, inter, n_layers, "mlp_in"),
            Projection("down_proj", inter, h, n_layers, "mlp_mid"))
    return ModelShape(model_type, vocab, h, inter, n_layers, heads, kv_heads, head_dim, tied, params, vocab * h, head,
                      proj)


def _gpt2_shape(c) -> ModelShape:
    h, n_layers, heads, vocab = c.n_embd, c.n_layer, c.n_head, c.vocab_size
    inter = c.n_inner or 4 * h
    # LayerNorms have weight and bias; every Conv1D has a bias; positions are learned; the head is tied.
    layer = 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + 2 * h + (h * inter + inter) + (inter * h + h)
    embeddings = vocab * h + c.n_positions * h
    params = embeddings + n_layers * layer + 2 * h
    proj = (Projection("c_attn", h, 3 * h, n_layers, "attn_in"), Projection("c_proj", h, h, n_layers, "attn_out"),
            Projection("c_fc", h, inter, n_layers, "mlp_in"), Projection("c_proj", inter, h, n_layers, "mlp_mid"))
    return ModelShape("gpt2", vocab, h, inter, n_layers, heads, heads, h // heads, True, params, embeddings, 0, proj,
                      gated_mlp=False)


def _meta_shape(config, text, model_type: str, tied: bool, whole=None) -> ModelShape:
    """Count an architecture without a formula by building it on the meta device (no memory is allocated); a
    composite's language model whose text config no causal-LM class takes (Qwen2.5-VL's) is counted inside the
    composite built whole (``whole``: its config)."""
    import torch
    from torch import nn
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        modules, params = list(model.named_modules()), sum(p.numel() for p in model.parameters())
    except Exception as e:  # any failure means: no shape for this architecture, unless the composite builds
        if whole is None:
            raise ConfigError(f"anyfit plan has no formula for model_type {model_type!r} and could not build it on "
                              f"the meta device ({type(e).__name__}: {e}).") from e
        with torch.device("meta"):
            model = model_class(whole).from_config(whole)
        modules, params = list(language_modules(model)), sum(p.numel() for p in _language_parameters(model))
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    embeddings = sum(p.numel() for p in emb.parameters())
    head_params = 0 if head is None or head.weight is emb.weight else sum(p.numel() for p in head.parameters())
    blocks = moe_blocks(model)
    gates = {gate for block in blocks for gate in block.gates}  # routers: never LoRA targets (anyfit.model.moe)
    shapes: dict[tuple[str, int, int], int] = {}
    for name, module in modules:
        if module is head or name in gates:
            continue
        if isinstance(module, nn.Linear):
            key = (name.rsplit(".", 1)[-1], module.in_features, module.out_features)
        elif isinstance(module, Conv1D):
            key = (name.rsplit(".", 1)[-1], module.weight.shape[0], module.weight.shape[1])
        else:
            continue
        shapes[key] = shapes.get(key, 0) + 1
    h = text.hidden_size
    heads = _largest(text, "num_attention_heads")
    experts: dict[tuple[str, int, int], int] = {}  # one expert's slice of each fused tensor, x experts x layers
    by_name = dict(model.named_modules())
    for block in blocks:
        module = by_name[f"{block.path}.{block.experts}"]
        for name, (n, d1, d2) in block.tensors:  # (experts, out, in), or (experts, in, out) where is_transposed
            key = (name, d1, d2) if getattr(module, "is_transposed", False) else (name, d2, d1)
            experts[key] = experts.get(key, 0) + n
    split = all(splits_lora(by_name[f"{b.path}.{b.experts}"]) for b in blocks)
    return ModelShape(model_type, text.vocab_size, h, getattr(text, "intermediate_size", None) or 4 * h,
                      text.num_hidden_layers, heads, _largest(text, "num_key_value_heads") or heads,
                      _largest(text, "head_dim") or h // heads, tied, params, embeddings, head_params,
                      tuple(Projection(n, i, o, k, "other") for (n, i, o), k in shapes.items()),
                      counted_by="meta device",
                      experts=tuple(Projection(n, i, o, k, "experts") for (n, i, o), k in experts.items()),
                      experts_split=bool(blocks) and split,
                      routed_params=sum(b.params for b in blocks),
                      active_routed_params=sum(b.active_params for b in blocks),
                      num_experts=blocks[0].num_experts if blocks else 0,
                      experts_per_token=blocks[0].top_k if blocks else 0,
                      router_params=sum(module.weight.numel() for name, module in model.named_modules()
                                        if name in gates and getattr(module, "weight", None) is not None))


def _language_parameters(model) -> list:
    """The parameters of a composite's language model (``composite.language_parameters``), each once."""
    ids = language_parameters(model)
    return [p for p in model.parameters() if id(p) in ids]


def _largest(text, name: str):
    """``text.<name>``, or where it varies across layers (Gemma-4's global layers have wider heads: transformers
    refuses to read one value for all) its largest, the conservative size for memory."""
    try:
        return getattr(text, name, None)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError: read it per layer
        return max(getattr(text.per_layer_config[i], name, None) or 0 for i in range(text.num_hidden_layers))


def kv_cache_bytes(shape: ModelShape, tokens: int, batch: int, dtype_bytes: int) -> int:
    """KV cache of generation: 2 (K and V) x layers x kv_heads x head_dim x tokens x batch x bytes."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * tokens * batch * dtype_bytes
