"""Mixtures of experts: which tensors of a model are routed experts and what one token uses of them, LoRA on
them, and the router's load-balancing loss.

transformers 5 keeps each MoE layer's routed experts as fused 3-D parameters (``experts.gate_up_proj``,
``experts.down_proj``: experts x out x in, or experts x in x out) beside a router module that carries ``top_k``
and ``num_experts``; shared experts and dense layers stay ``nn.Linear``. Everything here is read from the built
model (real, or on the meta device for the planner), so Qwen3-MoE, Mixtral, OLMoE, gpt-oss, DeepSeek-V3, GLM-4-MoE,
Granite-MoE, ERNIE-4.5-MoE, Llama-4, Qwen3.5-MoE and Qwen3-Next are covered without a table per family.
"""

from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass

import torch
from torch import nn

from anyfit.config import ConfigError, LoraConfig


@dataclass(frozen=True)
class MoeBlock:
    """One MoE layer: a router choosing ``top_k`` of ``num_experts`` for each token, and the experts' tensors."""

    path: str  # the module holding router and experts (model.layers.3.mlp)
    experts: str  # the experts module's leaf name ("experts")
    num_experts: int
    top_k: int
    tensors: tuple[tuple[str, tuple[int, ...]], ...]  # the fused 3-D weights: (parameter name, shape)
    params: int  # every parameter of the routed experts (their biases too)
    gates: tuple[str, ...]  # full names of what routes: the router, and linear gates beside the experts

    @property
    def active_params(self) -> int:
        """What one token uses of the routed experts: top_k of num_experts."""
        return self.params * self.top_k // self.num_experts


def _shape(param: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(param, "ds_shape", param.shape))  # DeepSpeed ZeRO-3 empties a partitioned parameter


def moe_blocks(model: nn.Module) -> list[MoeBlock]:
    """The MoE layers of ``model``: a module with 3-D parameters whose sibling is a router of as many experts (read
    through PEFT's wrappers, which hold the wrapped module as ``base_layer``)."""
    modules = dict(model.named_modules())
    blocks = []
    for name, module in modules.items():
        fused = [(p, _shape(t)) for p, t in module.named_parameters(recurse=False) if len(_shape(t)) == 3]
        name = name.replace(".base_layer", "")
        if not fused or "." not in name:
            continue
        parent, _, leaf = name.rpartition(".")
        siblings = dict(modules[parent].named_children())
        routers = [n for n, c in siblings.items() if n != leaf and hasattr(c, "top_k")
                   and getattr(c, "num_experts", None) == fused[0][1][0]]
        if not routers:
            continue
        # a linear layer sitting beside the experts (Qwen3-Next's shared_expert_gate, Llama-4's router, which is
        # an nn.Linear) scales or routes; it does not transform the hidden state: LoRA leaves it alone
        gates = [n for n, c in siblings.items() if n in routers or isinstance(c, nn.Linear)]
        blocks.append(MoeBlock(parent, leaf, fused[0][1][0], int(siblings[routers[0]].top_k), tuple(fused),
                               sum(_numel(t) for t in module.parameters()),
                               tuple(f"{parent}.{n}" for n in gates)))
    return blocks


def _numel(param: torch.Tensor) -> int:
    return getattr(param, "ds_numel", param.numel())


def expert_leaf_names(blocks: list[MoeBlock]) -> list[str]:
    """The fused expert tensors' names (gate_up_proj, down_proj): what ``lora.target_modules`` may name."""
    return list(dict.fromkeys(name for b in blocks for name, _ in b.tensors))


@dataclass(frozen=True)
class LoraTargets:
    """What PEFT adapts: linear layers by leaf name (``target_modules``), and parameters (``target_parameters``:
    the fused expert tensors, and see ``lora_targets``)."""

    modules: list[str]
    parameters: list[str]
    left_out: list[str]  # linear layers that cannot be adapted here (QLoRA, see ``lora_targets``)


def lora_targets(model: nn.Module, resolved: list[str], linear: list[str], cfg: LoraConfig) -> LoraTargets:
    """Split the resolved ``lora.target_modules`` (over ``linear`` leaf names and ``expert_leaf_names``) into PEFT's
    modules and parameters. The routed experts are adapted when named, or with auto/all-linear unless
    ``lora.experts=false``; PEFT matches a parameter target by its end ("experts.gate_up_proj").

    Written by hand because of PEFT 0.21's transformers-v5 config conversion: for the Qwen2-MoE-style families
    (DeepSeek-V3, GLM-4-MoE, ERNIE-4.5-MoE, Qwen3-Next, ...) it rewrites a ``target_modules`` entry named
    gate_proj/up_proj/down_proj into the routed experts' fused tensors and drops the linear layers of that name
    (dense layers, shared experts) from the adapter (huggingface/peft#3711). Which names it would rewrite is
    asked of PEFT itself; those layers go to it as parameters (their ``.weight``) instead, which it adapts the
    same way and saves and loads back unchanged. Under QLoRA those weights are 4-bit and are left out."""
    blocks = moe_blocks(model)
    fused = {name: f"{b.experts}.{name}" for b in blocks for name, _ in b.tensors}
    experts = [fused[n] for n in resolved if n in fused]
    only_experts = [n for n in resolved if n in fused and n not in linear]
    if not cfg.experts:
        if only_experts and cfg.target_modules not in ("auto", "all-linear"):
            raise ConfigError(f"lora.target_modules names the routed experts' {', '.join(only_experts)} but "
                              "lora.experts=false; drop them from the list, or set lora.experts=true.")
        experts = []
    modules = [n for n in resolved if n in linear]
    rewritten = _rewritten_by_peft(model, modules)
    parameters = list(dict.fromkeys(experts))
    if not cfg.qlora:
        parameters += [f"{name}.weight" for name in modules if name in rewritten]
    kept = [n for n in modules if n not in rewritten]
    if parameters and not peft_takes_parameters():
        import peft

        raise ConfigError(f"LoRA on the routed experts' fused tensors needs PEFT's target_parameters (PEFT 0.17+; "
                          f"{peft.__version__} is installed): upgrade peft, or set lora.experts=false to adapt "
                          "attention and dense layers only.")
    if not kept and not parameters:
        raise ConfigError("lora.target_modules leaves nothing to adapt in this model; name its attention "
                          "projections (or set lora.target_modules=auto).")
    return LoraTargets(kept, parameters, sorted(rewritten) if cfg.qlora else [])


@functools.cache
def peft_takes_parameters() -> bool:
    """Whether the installed PEFT adapts parameters (``LoraConfig.target_parameters``, PEFT 0.17 and later)."""
    from peft import LoraConfig as PeftLoraConfig

    return "target_parameters" in inspect.signature(PeftLoraConfig).parameters


def _rewritten_by_peft(model: nn.Module, linear: list[str]) -> set[str]:
    """The ``target_modules`` names PEFT's transformers-v5 conversion would take away from linear layers."""
    from peft import LoraConfig as PeftLoraConfig

    try:
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:  # a PEFT without the conversion
        return set()
    trial = PeftLoraConfig(target_modules=list(linear))
    convert_peft_config_for_transformers(trial, model=model, conversions=None)
    return set(linear) - set(trial.target_modules or ())


def restore_dropout(model: nn.Module, dropout: float) -> None:
    """PEFT refuses ``lora_dropout`` once any parameter is targeted (a fused tensor's input cannot be dropped out
    per adapter: lora_B(lora_A(dropout(x))) does not factor through the weight). The adapter is built with dropout
    0 and ``lora.dropout`` goes back on the linear layers' adapters, where PEFT applies it as usual."""
    from peft.tuners.lora import Linear as LoraLinear

    for module in model.modules():
        if isinstance(module, LoraLinear):
            for name in module.lora_dropout:
                module.lora_dropout[name] = nn.Dropout(p=dropout)


def adapter_in_experts(model: nn.Module) -> int:
    """Adapter parameters on the routed experts' fused tensors (PEFT's ``ParamWrapper`` over a 3-D tensor)."""
    if "peft" not in sys.modules:  # no adapter was built: importing PEFT (and bitsandbytes) costs seconds per run
        return 0
    try:
        from peft.tuners.lora import ParamWrapper
    except ImportError:  # a PEFT before target_parameters adapts no fused tensor
        return 0
    return sum(p.numel() for m in model.modules() if isinstance(m, ParamWrapper) and m.num_experts > 1
               for part in (m.lora_A, m.lora_B) for p in part.parameters())


def moe_summary(model: nn.Module, trainable: int, lora: bool, router_setting: float | str) -> list[str]:
    """Lines for an MoE model (none for a dense one): total and active parameters, the adapter's share in the
    experts, and the router's load-balancing loss."""
    wrapper, model = model, _causal_lm(model)
    blocks = moe_blocks(model)
    if not blocks:
        return []
    total = sum(_numel(p) for p in model.parameters() if not (lora and p.requires_grad))  # the base model's
    active = total - sum(b.params - b.active_params for b in blocks)
    b = blocks[0]
    line = (f"[anyfit] mixture of experts: {len(blocks)} MoE layers, {b.top_k} of {b.num_experts} experts per "
            f"token: {_count(active)} of {_count(total)} parameters active")
    if lora:
        in_experts = adapter_in_experts(model)
        line += (f"; adapter {_count(trainable)} trainable, {_count(in_experts)} of it in the routed experts"
                 + ("" if in_experts else " (lora.experts=false, or lora.target_modules names none of them)"))
        left_out = wrapper.__dict__.get("anyfit_left_out")
        if left_out:
            line += (f"; under QLoRA the 4-bit {', '.join(left_out)} layers stay without an adapter (PEFT 0.21 "
                     "rewrites these names into the experts: huggingface/peft#3711)")
    coef, why = router_loss_coef(model, router_setting)
    aux = (f"coefficient {coef:g} ({why}), added once per micro-batch and logged as aux_loss" if coef > 0
           else f"none ({why})")
    return [line, f"[anyfit] router load-balancing loss: {aux}"]


def _count(n: int) -> str:
    """12.3M, 3.35B, 6.91k: three significant figures, for the summary line of any size of model."""
    units = ((1e9, "B"), (1e6, "M"), (1e3, "k"))
    return next((f"{n / unit:,.{2 if n < 10 * unit else 1}f}{name}" for unit, name in units if n >= unit), str(n))


def _causal_lm(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


# -- the router's load-balancing loss ---------------------------------------------------------------------------

def computes_router_loss(model: nn.Module) -> bool:
    """Whether transformers' forward of this model returns the load-balancing ``aux_loss`` when asked: its forward
    takes ``output_router_logits`` and its modeling code has ``load_balancing_loss_func`` (DeepSeek-V3 and GLM-4-MoE
    balance with a bias instead, Llama-4 computes none)."""
    takes = "output_router_logits" in inspect.signature(type(model).forward).parameters
    return takes and hasattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func")


def router_loss_coef(model: nn.Module, setting: float | str) -> tuple[float, str]:
    """(coefficient, why) of the load-balancing loss: ``train.router_aux_loss_coef`` (auto: what the config asks)."""
    config = model.config.get_text_config()
    coef = getattr(config, "router_aux_loss_coef", None)
    if not computes_router_loss(model):
        if setting != "auto" and setting:
            raise ConfigError(f"train.router_aux_loss_coef={setting}: {type(model).__name__} computes no router "
                              "load-balancing loss in transformers; set train.router_aux_loss_coef=auto (or 0).")
        return 0.0, f"{type(model).__name__} computes no router load-balancing loss in transformers"
    if setting != "auto":
        return float(setting), f"train.router_aux_loss_coef={setting}"
    asks = bool(getattr(config, "output_router_logits", False))
    if not asks or not coef:
        return 0.0, (f"off, as the model's config asks (output_router_logits={str(asks).lower()}, "
                     f"router_aux_loss_coef={coef}); train.router_aux_loss_coef={coef or 0.001} adds it")
    return float(coef), f"router_aux_loss_coef={coef} from the model's config (output_router_logits=true)"


class RouterBalance:
    """Asks the model for its router logits in every forward that takes gradients (a forward pre-hook, so the
    model's config, which is saved with it, stays as it was) and keeps the ``aux_loss`` transformers computes from
    them, for ``anyfit.training.step.backward_window`` to add and the metrics to log (``aux_loss``)."""

    def __init__(self, coef: float):
        self.coef = coef
        self.last: torch.Tensor | None = None
        self.total: torch.Tensor | None = None  # taken aux losses since the last metrics line (on the device)
        self.count = 0

    def ask(self, module, args, kwargs):
        if torch.is_grad_enabled():  # training forwards only: evaluation and generation run as configured
            kwargs["output_router_logits"] = True
        return args, kwargs

    def keep(self, module, args, output):
        aux = getattr(output, "aux_loss", None)
        self.last = aux if isinstance(aux, torch.Tensor) else None

    def weighted(self, micro_batches: int) -> torch.Tensor | float:
        """The last forward's ``coef x aux_loss / micro_batches`` (0 when it computed none), kept for the log."""
        aux, self.last = self.last, None
        if aux is None:
            return 0.0
        detached = aux.detach().float()
        self.total = detached if self.total is None else self.total + detached
        self.count += 1
        return aux * (self.coef / micro_batches)

    def drain(self) -> tuple[torch.Tensor | None, int]:
        """(summed aux losses, how many) since the last call."""
        total, count = self.total, self.count
        self.total, self.count = None, 0
        return total, count


def balance_routers(model: nn.Module, setting: float | str) -> RouterBalance | None:
    """Install ``RouterBalance`` on an MoE model whose coefficient (``router_loss_coef``) is not 0."""
    if not moe_blocks(model):
        return None
    coef, _ = router_loss_coef(model, setting)
    if coef <= 0:
        return None
    balance = RouterBalance(coef)
    model.register_forward_pre_hook(balance.ask, with_kwargs=True)
    model.register_forward_hook(balance.keep)
    model.anyfit_router_balance = balance
    return balance


def router_balance_of(model: nn.Module) -> RouterBalance | None:
    """The ``RouterBalance`` inside ``model`` (under DDP, FSDP2, DeepSpeed or PEFT wrappers), or None."""
    return next((m.__dict__["anyfit_router_balance"] for m in model.modules()
                 if "anyfit_router_balance" in m.__dict__), None)
