"""Mixtures of experts trained exactly: LoRA reaches the routed experts (never the router) in every family, with the
default dropout, and the adapter saves and loads back; the router's load-balancing loss is transformers' own
``aux_loss`` times the coefficient, added once per micro-batch, and nothing at all with the coefficient 0."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from moe_families import CURRENT_MOE, MOE, NUM_EXPERTS, WITH_AUX_LOSS, moe_config, moe_model
from peft import PeftModel

from anyfit.backends.replicated import Replicated
from anyfit.config import ConfigError, LoraConfig
from anyfit.data.batching import collate
from anyfit.model.loading import apply_lora, count_parameters
from anyfit.model.moe import balance_routers, moe_summary, router_balance_of
from anyfit.model.shape import shape_from_config
from anyfit.training.metrics import StepMeter
from anyfit.training.step import backward_window


def _adapter_names(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


@CURRENT_MOE
@pytest.mark.parametrize("family", list(MOE))
def test_auto_lora_adapts_the_experts_never_the_router(family):
    """Default settings (target_modules auto, dropout 0.05) on every family: no error, adapters on the fused expert
    tensors and on the linear layers, none on a router or gate, the planner's count equal to PEFT's, and
    lora.experts=false leaves the experts out."""
    model = apply_lora(moe_model(family), LoraConfig(enabled=True, r=4))
    names = _adapter_names(model)
    assert any(".experts." in n for n in names), f"{family}: no adapter on the routed experts"
    assert not any(part in n for n in names for part in (".router.", ".gate.", "shared_expert_gate")), names
    assert any("self_attn" in n or "linear_attn" in n for n in names)
    dropouts = {type(m.lora_dropout["default"]).__name__ for m in model.modules()
                if hasattr(m, "lora_dropout") and "default" in m.lora_dropout and hasattr(m, "in_features")
                and type(m).__name__ == "Linear"}
    assert dropouts == {"Dropout"}  # lora.dropout stays on the linear layers' adapters
    model(input_ids=torch.randint(3, 512, (2, 8))).logits.sum().backward()
    trained = count_parameters(model)[0]
    shape = shape_from_config(moe_config(family))
    assert shape.lora_params(4) == trained

    without = apply_lora(moe_model(family), LoraConfig(enabled=True, r=4, experts=False))
    assert not any(".experts." in n for n in _adapter_names(without))
    assert shape.lora_params(4, experts=False) == count_parameters(without)[0] < trained
    line = moe_summary(model, trained, True, "auto")[0]
    assert f"of {NUM_EXPERTS} experts per token" in line and "in the routed experts" in line


@CURRENT_MOE
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_the_adapter_loads_back_with_peft(family, tmp_path):
    """DeepSeek-V3's dense and shared-expert gate/up/down projections keep their adapter (PEFT's v5 conversion
    would have moved those names onto the experts), and the saved adapter loads back into the same model."""
    model = apply_lora(moe_model(family), LoraConfig(enabled=True, r=4))
    if family == "deepseek_v3":
        names = _adapter_names(model)
        assert any("layers.0.mlp.down_proj" in n for n in names)  # the dense first layer
        assert any("shared_experts.gate_proj" in n for n in names)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    model.eval()
    ids = torch.randint(3, 512, (2, 8))
    want = model(input_ids=ids).logits
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(moe_model(family), tmp_path).eval()
    # stock PEFT forms W + BA, the trained model adds the low-rank path (anyfit.model.expert_lora): the same up to
    # fp32 round-off (tests/unit/model/test_expert_lora.py's bound)
    got = loaded(input_ids=ids).logits
    assert ((got - want).norm() / want.norm()).item() <= 2**7 * torch.finfo(torch.float32).eps


@CURRENT_MOE
def test_explicit_targets_name_experts_and_routers_are_refused():
    model = apply_lora(moe_model("qwen3_moe"), LoraConfig(enabled=True, r=4, target_modules=["q_proj", "down_proj"]))
    names = _adapter_names(model)
    assert any("experts" in n for n in names) and not any("gate_up_proj" in n or "k_proj" in n for n in names)
    with pytest.raises(ConfigError, match="lora.experts=false"):
        apply_lora(moe_model("qwen3_moe"), LoraConfig(enabled=True, experts=False, target_modules=["gate_up_proj"]))
    with pytest.raises(ConfigError, match="match no module"):
        apply_lora(moe_model("llama4"), LoraConfig(enabled=True, target_modules=["router"]))


def _rows(seed: int, rows: int = 2, length: int = 12) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 512, (rows, length), generator=g).tolist()
    return [{"input_ids": r, "labels": list(r)} for r in ids]


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _window(model, micro_batches: list[list[dict]]) -> None:
    batches = [collate(rows, pad_id=0) for rows in micro_batches]
    tokens = sum(int(b["keep"].sum()) for b in batches)
    backward_window(Replicated("test"), Accelerator(cpu=True), model, batches, tokens)


@pytest.mark.parametrize("family", WITH_AUX_LOSS)
def test_one_micro_batch_trains_transformers_own_loss(family):
    """With one micro-batch, the update is the gradient of transformers' own training loss:
    mean token loss + router_aux_loss_coef x aux_loss (labels given, output_router_logits=True)."""
    coef = 0.5  # large, so the term shows in every gradient
    rows = _rows(0)
    ours = moe_model(family)
    balance = balance_routers(ours, coef)
    _window(ours, [rows])
    theirs = moe_model(family)
    theirs.router_aux_loss_coef = coef
    ids = torch.tensor([r["input_ids"] for r in rows])
    out = theirs(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, output_router_logits=True)
    out.loss.backward()
    got, want = _grads(ours), _grads(theirs)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    total, count = balance.drain()
    assert count == 1 and torch.allclose(total, out.aux_loss.detach())


def test_coefficient_zero_changes_nothing():
    """Coefficient 0, or auto where the config does not ask (output_router_logits=false, the shipped default):
    nothing is installed, the model's forward and the gradient are the plain token loss's."""
    for setting in (0.0, "auto"):
        model = moe_model("qwen3_moe")
        assert balance_routers(model, setting) is None and router_balance_of(model) is None
        _window(model, [_rows(0)])
        plain = moe_model("qwen3_moe")
        _window(plain, [_rows(0)])
        assert all(torch.equal(a, b) for a, b in zip(_grads(model).values(), _grads(plain).values()))
    # auto follows the config when it asks
    asked = moe_model("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.02)
    assert balance_routers(asked, "auto").coef == 0.02


def test_the_term_is_once_per_micro_batch_and_logged_apart():
    """Two micro-batches: the objective is the window's mean token loss + coef x the mean of their aux losses; the
    metrics line carries that mean as aux_loss, and loss stays the token loss."""
    coef = 0.5
    first, second = _rows(1), _rows(2)
    model = moe_model("mixtral")
    balance = balance_routers(model, coef)
    _window(model, [first, second])
    got = _grads(model)
    total, count = balance.drain()

    ref = moe_model("mixtral")
    auxes, loss_sum, tokens = [], 0.0, 0
    for rows in (first, second):
        ids = torch.tensor([r["input_ids"] for r in rows])
        out = ref(input_ids=ids, attention_mask=torch.ones_like(ids), output_router_logits=True)
        logits = out.logits[:, :-1].reshape(-1, out.logits.shape[-1])
        loss_sum = loss_sum + torch.nn.functional.cross_entropy(logits, ids[:, 1:].reshape(-1), reduction="sum")
        tokens += ids[:, 1:].numel()
        auxes.append(out.aux_loss)
    (loss_sum / tokens + coef * (auxes[0] + auxes[1]) / 2).backward()
    for name, want in _grads(ref).items():
        torch.testing.assert_close(got[name], want, rtol=1e-4, atol=1e-6, msg=name)
    assert count == 2 and torch.allclose(total, (auxes[0] + auxes[1]).detach())

    balance.total, balance.count = total, count  # as the window left them
    meter = StepMeter(torch.device("cpu"), router=balance)
    meter.add(torch.tensor(3.0), True, 2, 10)
    record = meter.line(Accelerator(cpu=True), "cpu", step=1)
    assert record["loss"] == 1.5 and record["aux_loss"] == pytest.approx(float(total) / 2, rel=1e-5)
    assert "aux_loss" not in StepMeter(torch.device("cpu")).line(Accelerator(cpu=True), "cpu", step=1)


def test_a_coefficient_for_a_model_without_the_loss_is_one_line():
    with pytest.raises(ConfigError, match="computes no router load-balancing loss"):
        balance_routers(moe_model("llama4"), 0.01)
    assert balance_routers(moe_model("deepseek_v3"), "auto") is None
