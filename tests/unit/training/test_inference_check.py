"""The start-up check that the training forward computes the logits ``generate`` computes with its cache
(``training.inference_check``): it passes on every family of ``tests/families.py`` and on composites, packed or
padded as the packing self-test decides; it refuses, in one line naming the model class and the first differing
layer, a model whose cached decoding is broken on purpose; ``warn`` goes on and ``false`` skips it."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from families import FAMILIES, Examples, tiny_model
from transformers import AutoConfig, AutoModelForImageTextToText, LlamaForCausalLM

from anyfit.config import ConfigError, load_config
from anyfit.data.batching import collate
from anyfit.model.attention import register
from anyfit.training.inference_check import InferenceMismatch, check_inference, tolerance, unit_roundoff
from anyfit.training.packing_check import choose_packing


def _examples(vocab: int = 512) -> Examples:
    g = torch.Generator().manual_seed(1)
    out = Examples()
    for length in (40, 23, 12):  # past the families' windows of 8 tokens
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": list(ids)})
    return out


def _check(model, mode=True, packed: bool | None = None):
    """As set-up runs it: after the packing self-test, with the collate it chose."""
    examples = _examples(model.config.get_text_config().vocab_size)
    if packed is None:
        packed = choose_packing(model, examples, functools.partial(collate, pad_id=0), 64, "cpu", torch.float32,
                                contextlib.nullcontext).packed
    return check_inference(model, examples, functools.partial(collate, pad_id=0, packed=packed), 0, "cpu",
                           torch.float32, mode=mode)


@pytest.mark.parametrize("family", FAMILIES)
def test_training_forward_equals_generate_for_every_family(family):
    register()
    verdict = _check(tiny_model(family, "anyfit_varlen"))
    assert verdict.agrees and verdict.error <= verdict.tolerance, verdict.line
    assert "agree on 2 probes" in verdict.line


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_moe", "qwen3_5"])
def test_bf16_autocast_passes_within_bf16_round_off(family):
    """The run's mixed precision: both paths under bf16 autocast, the tolerance from bf16's epsilon."""
    model = tiny_model(family)
    verdict = check_inference(model, _examples(), functools.partial(collate, pad_id=0), 0, "cpu", torch.bfloat16,
                              lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    assert verdict.agrees, verdict.line
    assert verdict.tolerance > 1e3 * tolerance(torch.float32, "cpu", 5, 32, 32 * 512)


_TEXT = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=512, pad_token_id=0)
_COMPOSITES = {
    "qwen3_5": dict(text_config=dict(_TEXT, layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8,
                                     linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4),
                    vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32)),
    "mistral3": dict(text_config=dict(_TEXT, model_type="mistral", sliding_window=8),
                     vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=2, head_dim=16, image_size=32,
                                        patch_size=8)),
}


@pytest.mark.parametrize("model_type", _COMPOSITES)
def test_a_composite_checkpoint_trained_on_text_passes(model_type):
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(model_type, **_COMPOSITES[model_type]))
    verdict = _check(model, packed=False)
    assert verdict.agrees, verdict.line


def test_lora_adapters_with_dropout_pass_as_they_start():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model("qwen3"), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.5,
                                                           target_modules=["q_proj", "v_proj", "down_proj"]))
    verdict = _check(model, packed=False)
    assert verdict.agrees, verdict.line
    assert model.training  # each module's mode is given back


class CacheBrokenLlama(LlamaForCausalLM):
    """A Llama whose layer 1 moves its output by 0.1% of its scale (not along itself: the final norm would undo
    that) when the KV cache already holds tokens: decoding is broken, the training forward (no cache) is not."""

    def __init__(self, config):
        super().__init__(config)
        self.model.layers[1].register_forward_hook(self._perturb, with_kwargs=True)

    @staticmethod
    def _perturb(module, args, kwargs, output):
        cache = kwargs.get("past_key_values")
        if cache is None or cache.get_seq_length(module.self_attn.layer_idx) <= output.shape[1]:
            return output  # no cache, or only this call's own tokens in it (a prefill)
        return output + 1e-3 * output.flip(-1)


def _broken():
    torch.manual_seed(0)
    from families import tiny_config

    return CacheBrokenLlama(tiny_config("llama"))


def test_a_broken_cache_path_refuses_the_run_in_one_line_naming_the_class_and_layer():
    with pytest.raises(InferenceMismatch) as refused:
        _check(_broken(), packed=False)
    assert isinstance(refused.value, ConfigError)  # the CLI's one "anyfit: error:" line, exit 2
    line = str(refused.value)
    assert "\n" not in line
    assert "CacheBrokenLlama" in line and "decoder layer 1 (LlamaDecoderLayer" in line, line
    assert "at position 1 of probe 1" in line, line  # the first decoded position
    assert "train.inference_check=warn" in line


def test_warn_goes_on_and_false_skips():
    verdict = _check(_broken(), mode="warn", packed=False)
    assert not verdict.agrees and verdict.error > verdict.tolerance
    assert "decoder layer 1" in verdict.line and "training anyway" in verdict.line
    skipped = _check(_broken(), mode=False, packed=False)
    assert skipped.agrees and skipped.error is None and "skipped" in skipped.line


def test_the_tolerance_follows_the_dtype_and_the_depth():
    fp32 = tolerance(torch.float32, "cpu", 5, 32, 10_000)
    assert fp32 < tolerance(torch.bfloat16, "cpu", 5, 32, 10_000) < tolerance(torch.bfloat16, "cpu", 65, 32, 10_000)
    assert fp32 < 1e-5  # fp32 round-off, far below the 1e-3 the broken model moves its layer by
    was = torch.backends.cuda.matmul.allow_tf32
    try:  # fp32 matmuls on CUDA in TF32 (runtime.tf32) round to 10 mantissa bits
        torch.backends.cuda.matmul.allow_tf32 = True
        assert unit_roundoff(torch.float32, "cuda") == 2.0 ** -11 > unit_roundoff(torch.float32, "cpu")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was


@pytest.mark.parametrize("value, mode", [("warn", "warn"), ("false", False), ("true", True)])
def test_the_setting_reads_true_warn_or_false(value, mode):
    assert load_config(None, [f"train.inference_check={value}"]).train.inference_check == mode
    assert load_config(None, []).train.inference_check is True
    with pytest.raises(ConfigError):
        load_config(None, ["train.inference_check=maybe"])
