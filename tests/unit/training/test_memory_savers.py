"""The memory savers a run can choose: state-light optimizers and checkpointing every N-th layer."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from anyfit.config import ConfigError, load_config
from anyfit.hardware.runtime import resolve_runtime
from anyfit.model.loading import load_model
from anyfit.training.optim import build_optimizer


def _state_elements(optimizer) -> int:
    return sum(v.numel() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim > 0)


def _one_step(model, optimizer) -> None:
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()


def test_adafactor_keeps_a_fraction_of_adamws_state_and_trains(tiny_llama_dir):
    sizes = {}
    for name in ("adamw", "adafactor"):
        cfg = load_config(None, [f"model.name_or_path={tiny_llama_dir}", f"train.optimizer={name}",
                                 "train.learning_rate=1e-2"])
        torch.manual_seed(0)
        model = load_model(cfg, resolve_runtime(cfg.runtime))
        before = model.model.layers[0].mlp.up_proj.weight.detach().clone()
        optimizer = build_optimizer(model, cfg.train, "cpu", fused=True)
        _one_step(model, optimizer)
        assert not torch.equal(before, model.model.layers[0].mlp.up_proj.weight)  # it updated the weights
        sizes[name] = _state_elements(optimizer)
    params = sum(p.numel() for p in model.parameters())
    assert sizes["adamw"] == 2 * params
    assert sizes["adafactor"] < 0.1 * sizes["adamw"]  # factored second moments, no first moment


@pytest.mark.parametrize("name", ["adamw_8bit", "paged_adamw_8bit"])
def test_8bit_optimizers_are_refused_off_cuda_before_loading(name, tiny_llama_dir):
    from anyfit.training.optim import check_optimizer

    with pytest.raises(ConfigError, match=f"train.optimizer={name} needs CUDA.*adafactor"):
        check_optimizer(name, "cpu")


def test_8bit_adamw_under_fsdp_is_torchaos_on_any_device_and_paged_stays_unsharded():
    from anyfit.hardware.runtime import sharding_refusal
    from anyfit.training.optim import check_optimizer

    if importlib.util.find_spec("torchao"):
        check_optimizer("adamw_8bit", "cpu", sharded=True)  # torchao's AdamW8bit: DTensor states, no CUDA needed
    else:  # an install without it (the lower-bounds job): what to install, in one line
        with pytest.raises(ConfigError, match="pip install 'torchao"):
            check_optimizer("adamw_8bit", "cpu", sharded=True)
    with pytest.raises(ConfigError, match="needs CUDA"):
        check_optimizer("paged_adamw_8bit", "cpu", sharded=True)
    cfg = load_config(None, ["model.name_or_path=unused", "runtime.sharding=fsdp"])
    assert sharding_refusal(cfg, "cuda", "bf16", "adamw_8bit") == ""
    assert "adamw_8bit (torchao" in sharding_refusal(cfg, "cuda", "bf16", "paged_adamw_8bit")


def test_checkpointing_every_second_layer_keeps_gradients(tiny_qwen2_dir):
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    grads, flags = [], []
    for extra in ([], ["model.gradient_checkpointing=true", "model.checkpoint_every=2"]):
        cfg = load_config(None, [f"model.name_or_path={tiny_qwen2_dir}", *extra])
        torch.manual_seed(0)
        model = load_model(cfg, resolve_runtime(cfg.runtime))
        model.train()
        flags.append([layer.gradient_checkpointing for layer in model.model.layers])
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert flags == [[False, False], [True, False]]  # layer 0 recomputed, layer 1 keeps its activations
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


@pytest.fixture
def moved(monkeypatch) -> list[torch.Tensor]:
    """The tensors model.activation_offload moves to host RAM, every size (the tiny model's are a few KB)."""
    from anyfit.model import offload

    monkeypatch.setattr(offload, "MIN_BYTES", 0)
    out: list[torch.Tensor] = []
    pack = offload._ToHost._pack

    def counting(self, t):
        packed = pack(self, t)
        if not isinstance(packed, torch.Tensor):
            out.append(t)
        return packed

    monkeypatch.setattr(offload._ToHost, "_pack", counting)
    return out


@pytest.mark.parametrize("extra, autocast", [
    ([], False), ([], True), (["model.gradient_checkpointing=true"], True), (["lora.enabled=true"], False),
    (["lora.enabled=true", "model.gradient_checkpointing=true", "model.checkpoint_every=2"], False),
], ids=["full", "full-autocast", "full-ckpt-autocast", "lora", "lora-ckpt2"])
def test_activation_offload_moves_activations_not_weights_and_changes_nothing(extra, autocast, tiny_llama_dir, moved):
    """model.activation_offload: the same loss and gradients bit for bit (a copy out and back is exact), something
    moved, and never a weight, a view of one or autocast's bf16 copy of one (those would cost a model's worth of
    copies); evaluation moves nothing."""
    ids = torch.randint(0, 1000, (2, 13), generator=torch.Generator().manual_seed(0))  # 26 tokens: no weight's size
    results = []
    for on in ("false", "true"):
        cfg = load_config(None, [f"model.name_or_path={tiny_llama_dir}", *extra, f"model.activation_offload={on}"])
        torch.manual_seed(0)
        model = load_model(cfg, resolve_runtime(cfg.runtime))
        model.train()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters() if p.grad is not None]))
    assert moved
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() >= 2}
    shapes |= {s[::-1] for s in shapes}
    assert not [t.shape for t in moved if t.untyped_storage().data_ptr() in storages or tuple(t.shape) in shapes]
    assert torch.equal(results[0][0], results[1][0])
    assert len(results[0][1]) == len(results[1][1]) > 0
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))
    count = len(moved)
    with torch.no_grad():
        model(input_ids=ids)
    assert len(moved) == count


def test_activation_offload_under_fsdp2_moves_activations_not_the_gathered_weights(tiny_llama_dir, moved):
    """FSDP2 gathers each layer's weights into new parameters for its forward: those stay; the run is the same."""
    import torch.distributed as dist

    from anyfit.backends.fsdp import shard_model

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ids = torch.randint(0, 1000, (2, 13), generator=torch.Generator().manual_seed(0))
        results = []
        for on in ("false", "true"):
            cfg = load_config(None, [f"model.name_or_path={tiny_llama_dir}", "model.gradient_checkpointing=true",
                                     f"model.activation_offload={on}"])
            torch.manual_seed(0)
            model = shard_model(load_model(cfg, resolve_runtime(cfg.runtime)), torch.float32, False,
                                torch.device("cpu"))
            model.train()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            results.append((loss.detach(), [p.grad.full_tensor() for p in model.parameters()]))
    finally:
        dist.destroy_process_group()
    assert moved and not [t.shape for t in moved if isinstance(t, torch.nn.Parameter) or t._base is not None
                          and isinstance(t._base, torch.nn.Parameter)]
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


def _saved_bytes_and_grads(cfg, ids, autocast: bool, wrap=None):
    """(loss, trainable gradients, bytes the forward saved for the backward) of one forward and backward."""
    torch.manual_seed(0)
    model = load_model(cfg, resolve_runtime(cfg.runtime))
    model = wrap(model) if wrap else model
    model.train()
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
    torch.manual_seed(1)  # the recomputation must restore the forward's RNG state itself
    loss.backward()
    grads = [(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) for p in model.parameters()
             if p.grad is not None]
    return loss.detach(), grads, sum(saved)


@pytest.mark.slow
@pytest.mark.parametrize("extra, autocast", [
    ([], False), ([], True), (["model.gradient_checkpointing=true"], False),
    (["lora.enabled=true", "lora.dropout=0.0"], False),
], ids=["full", "full-autocast", "full-ckpt", "lora"])
def test_tiled_mlp_computes_the_same_loss_and_gradients_and_keeps_no_mlp_activations(extra, autocast,
                                                                                      full_vocab_llama_dir):
    """model.tiled_mlp: 2 x 100 tokens over a 32-wide model, so 4 tiles per MLP. The loss is the same (each token's
    MLP output does not depend on the tiling) and the gradients are too, to fp32 round-off: a weight's gradient
    is a sum over the 200 tokens, tiled as 4 partial sums of 50 (relative round-off ~200 x 2^-24, 1e-5 of the
    largest entry). Autocast recomputes in bf16 as the forward ran (its tolerance below). Without checkpointing the forward keeps, per layer, at least the gated
    MLP's gate and up outputs less (2 x tokens x intermediate_size fp32 values, or bf16 under autocast)."""
    ids = torch.randint(0, 1000, (2, 100), generator=torch.Generator().manual_seed(0))
    runs = [_saved_bytes_and_grads(load_config(None, [f"model.name_or_path={full_vocab_llama_dir}", *extra,
                                                      f"model.tiled_mlp={on}"]), ids, autocast)
            for on in ("false", "true")]
    (loss, grads, saved), (tiled_loss, tiled_grads, tiled_saved) = runs
    torch.testing.assert_close(tiled_loss, loss, rtol=1e-6, atol=0)
    assert len(grads) == len(tiled_grads) > 0
    # Under autocast each tile's bf16 outputs (weight-gradient partial sums, the input gradients a norm weight's
    # gradient sums over the 200 tokens) are rounded to 8 mantissa bits, where the untiled matmul rounds once; which
    # values are rounded where depends on the CPU's bf16 kernels (oneDNN's AVX-512 BF16 path blocks and rounds
    # otherwise than the fp32-convert path). The rounding errors of 200 tokens add like a random walk: about
    # sqrt(200) x 2^-9 = 2.8% of one token's contribution, and a norm weight's gradient is a sum with cancellation,
    # so up to 3% of the largest entry (1.3% seen on an AMD EPYC with AVX-512 BF16; a wrong tile is off by O(1)).
    scale = 3e-2 if autocast else 1e-5
    for a, b in zip(grads, tiled_grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=scale * float(a.abs().max()))
    if not extra:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(full_vocab_llama_dir)
        per_value = 2 if autocast else 4
        assert saved - tiled_saved >= config.num_hidden_layers * 2 * ids.numel() * config.intermediate_size * per_value


def test_tiled_mlp_keeps_parameter_names_and_runs_under_fsdp2(tiny_llama_dir):
    import torch.distributed as dist

    from anyfit.backends.fsdp import shard_model

    ids = torch.randint(0, 1000, (2, 100), generator=torch.Generator().manual_seed(0))
    names = []
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        runs = []
        for on in ("false", "true"):
            cfg = load_config(None, [f"model.name_or_path={tiny_llama_dir}", f"model.tiled_mlp={on}"])
            runs.append(_saved_bytes_and_grads(cfg, ids, False, wrap=lambda m: (
                names.append([n for n, _ in m.named_parameters()]),
                shard_model(m, torch.float32, False, torch.device("cpu")))[1]))
    finally:
        dist.destroy_process_group()
    assert names[0] == names[1]  # checkpoints, PEFT targets and exports see the same model
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-6, atol=0)
    for a, b in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5 * float(a.abs().max()))


def test_tiled_mlp_recomputes_with_the_forwards_dropout_masks(tiny_llama_dir):
    """With LoRA dropout the tiles draw their masks one after the other (not the untiled run's masks, which are
    drawn over the whole sequence at once): the recomputation must draw the same ones, whatever the RNG did in
    between. Reference: the same tiles run with ordinary autograd, from the same seed."""
    cfg = load_config(None, [f"model.name_or_path={tiny_llama_dir}", "model.tiled_mlp=true", "lora.enabled=true",
                             "lora.dropout=0.5", "lora.target_modules=[gate_proj,up_proj,down_proj]"])
    model = load_model(cfg, resolve_runtime(cfg.runtime))
    model.train()
    mlp = model.base_model.model.model.layers[0].mlp
    x = torch.randn(2, 100, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
    weight = torch.randn(2, 100, 32, generator=torch.Generator().manual_seed(1))
    results = []
    for tiled in (False, True):
        torch.manual_seed(5)
        out = mlp(x) if tiled else torch.cat([mlp.mlp_forward(t) for t in x.chunk(4, dim=-2)], dim=-2)
        torch.manual_seed(99)  # the backward must not depend on the RNG's state when it runs
        (out * weight).sum().backward()
        results.append([out.detach(), x.grad.clone()] + [p.grad.clone() for p in mlp.parameters() if p.requires_grad])
        x.grad = None
        mlp.zero_grad(set_to_none=True)
    assert len(results[0]) == len(results[1]) == 2 + 6  # output, input gradient, three LoRA pairs
    for a, b in zip(*results):  # the same masks; the weight gradients summed over the tiles in another order
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5 * float(a.abs().max()))


def _fused_or_not(tiny_llama_dir, extra, fused: bool, ids, autocast: bool, wrap=None):
    """(summed token loss, trainable gradients) of one anyfit loss forward/backward."""
    from anyfit.data.batching import collate
    from anyfit.training.loss import token_loss_sum

    cfg = load_config(None, [f"model.name_or_path={tiny_llama_dir}", *extra, f"train.fused_loss={str(fused).lower()}"])
    torch.manual_seed(0)
    model = load_model(cfg, resolve_runtime(cfg.runtime))
    model = wrap(model) if wrap else model
    model.train()
    batch = collate([{"input_ids": row, "labels": [-100] * 5 + row[5:]} for row in ids.tolist()], pad_id=0,
                    packed=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = token_loss_sum(model, batch, chunk_tokens=64)
    loss.backward()
    grads = [(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) for p in model.parameters()
             if p.grad is not None]
    return loss.detach(), grads


@pytest.mark.slow
@pytest.mark.parametrize("extra, autocast", [([], False), ([], True), (["lora.enabled=true"], False)],
                         ids=["full", "full-autocast", "lora"])
def test_fused_loss_computes_the_same_loss_and_gradients_without_the_logits(extra, autocast, tiny_llama_dir):
    """train.fused_loss: head and loss chunk by chunk (64 rows of 190 trained positions here). The same summed loss
    and gradients as the head's full logits and the chunked cross-entropy, to round-off: the head weight's gradient
    is summed over 3 chunks instead of one matmul over all rows (fp32: ~1e-6 of the largest entry; under autocast
    each chunk's bf16 product is rounded before the fp32 sum: under 1%)."""
    ids = torch.randint(0, 1000, (2, 100), generator=torch.Generator().manual_seed(0))
    (loss, grads), (fused, fused_grads) = (_fused_or_not(tiny_llama_dir, extra, fused, ids, autocast)
                                           for fused in (False, True))
    torch.testing.assert_close(fused, loss, rtol=1e-5 if not autocast else 1e-2, atol=0)
    assert len(grads) == len(fused_grads) > 0
    scale = 1e-2 if autocast else 1e-5
    for a, b in zip(grads, fused_grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=scale * float(a.abs().max()))


def test_fused_loss_keeps_the_model_as_it_was_and_runs_under_fsdp2(tiny_llama_dir):
    import torch.distributed as dist

    from anyfit.backends.fsdp import shard_model
    from anyfit.model.head import FusedHead

    cfg = load_config(None, [f"model.name_or_path={tiny_llama_dir}", "train.fused_loss=true"])
    model = load_model(cfg, resolve_runtime(cfg.runtime))
    assert isinstance(model.lm_head, FusedHead) and model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(0))
    plain = load_model(load_config(None, [f"model.name_or_path={tiny_llama_dir}"]), resolve_runtime(cfg.runtime))
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits)  # outside the loss: logits
    ids = torch.randint(0, 1000, (2, 100), generator=torch.Generator().manual_seed(0))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        runs = [_fused_or_not(tiny_llama_dir, [], fused, ids, False,
                              wrap=lambda m: shard_model(m, torch.float32, False, torch.device("cpu")))
                for fused in (False, True)]
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-5, atol=0)
    for a, b in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5 * float(a.abs().max()))
