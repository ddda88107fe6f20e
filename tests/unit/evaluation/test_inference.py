import importlib.util
import json

import pytest
import torch

from anyfit.config import ConfigError
from anyfit.evaluation import inference
from anyfit.evaluation.inference import (
    BackendUnavailable,
    Completion,
    GenerationParams,
    TransformersBackend,
    plan_batch_size,
    select_backend,
)
from anyfit.model.loading import load_for_inference
from anyfit.model.shape import kv_cache_bytes, shape_from_config
from anyfit.model.source import locate_model

PROMPTS = [
    "What is 59 + 63?",
    "Hi",
    "Sam has 12 apples and picks 30 more. How many apples does Sam have now? Put the final answer in \\boxed{}.",
    "A much longer prompt, so that the batch really needs left padding: " + "word " * 20,
]


@pytest.fixture(scope="module")
def tiny(full_vocab_llama_dir):
    return load_for_inference(full_vocab_llama_dir, device="cpu")


@pytest.mark.slow
def test_greedy_same_at_batch_1_and_n_and_deterministic(tiny):
    model, tok = tiny
    params = GenerationParams(max_new_tokens=10)
    one = TransformersBackend(model, tok, batch_size=1).generate(PROMPTS, params)
    many = TransformersBackend(model, tok, batch_size=3).generate(PROMPTS, params)
    again = TransformersBackend(model, tok, batch_size=3).generate(PROMPTS, params)
    assert one == many == again
    assert all(isinstance(c, Completion) and c.text and c.num_tokens == 10 and c.finish_reason == "length" for c in one)
    assert one[1].prompt_tokens < one[3].prompt_tokens


def test_raw_prompts_skip_the_chat_template(tiny):
    model, tok = tiny
    backend = TransformersBackend(model, tok, batch_size=2)
    raw = backend.generate(["What is 59 + 63?"], GenerationParams(max_new_tokens=4, chat=False))
    chat = backend.generate(["What is 59 + 63?"], GenerationParams(max_new_tokens=4))
    assert raw[0].prompt_tokens == len(tok("What is 59 + 63?")["input_ids"]) < chat[0].prompt_tokens
    # Token ids are used as they are.
    ids = tok("What is 59 + 63?")["input_ids"]
    assert backend.generate([ids], GenerationParams(max_new_tokens=4)) == raw


@pytest.mark.slow
def test_stop_strings_cut_and_stop_early(tiny):
    model, tok = tiny
    backend = TransformersBackend(model, tok, batch_size=4)
    full = backend.generate(PROMPTS, GenerationParams(max_new_tokens=12))
    text = full[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = backend.generate(PROMPTS, GenerationParams(max_new_tokens=12, stop=(stop,)))
    at = text.index(stop)
    assert cut[0].text == text[:at] and cut[0].finish_reason == "stop" and cut[0].num_tokens < 12
    kept = backend.generate(PROMPTS[:1], GenerationParams(max_new_tokens=12, stop=(stop,), include_stop=True))
    assert kept[0].text == text[:at + len(stop)]
    for c, f in zip(cut[1:], full[1:]):  # rows without the stop string are untouched
        assert c == f if stop not in f.text else c.finish_reason == "stop"

    # Generation stops once every row has hit a stop string: fewer forward passes than max_new_tokens.
    calls = []
    hook = model.register_forward_hook(lambda *a: calls.append(1))
    try:
        backend.generate(PROMPTS[:1], GenerationParams(max_new_tokens=12, stop=(stop,)))
    finally:
        hook.remove()
    assert len(calls) == cut[0].num_tokens < 12


@pytest.mark.slow
def test_seeded_sampling_is_repeatable_and_leaves_the_rng_alone(tiny):
    model, tok = tiny
    backend = TransformersBackend(model, tok, batch_size=2)
    state = torch.get_rng_state()
    runs = [backend.generate(PROMPTS[:2], GenerationParams(max_new_tokens=6, temperature=1.0, top_p=0.95, seed=seed))
            for seed in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert [x.text for x in runs[0]] != [x.text for x in runs[2]]
    assert torch.equal(torch.get_rng_state(), state)  # a training run's RNG stream is not disturbed


def test_runs_in_inference_mode_and_restores_training_mode(full_vocab_llama_dir, qwen_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(full_vocab_llama_dir, dtype=torch.float32)
    model.train()
    modes = []
    hook = model.register_forward_hook(lambda m, *a: modes.append((torch.is_inference_mode_enabled(), m.training)))
    try:
        TransformersBackend(model, qwen_tokenizer, 2).generate(PROMPTS[:2], GenerationParams(max_new_tokens=3))
    finally:
        hook.remove()
    assert modes and all(inf and not training for inf, training in modes)
    assert model.training
    assert all(p.grad is None for p in model.parameters())


def test_checkpoint_generation_config_is_not_applied(full_vocab_llama_dir, qwen_tokenizer):
    """A checkpoint's sampling defaults (Qwen ships repetition_penalty=1.05) must not leak into greedy decoding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(full_vocab_llama_dir, dtype=torch.float32)
    params = GenerationParams(max_new_tokens=6)
    plain = TransformersBackend(model, qwen_tokenizer, 2).generate(PROMPTS[:2], params)
    model.generation_config.repetition_penalty = 5.0
    model.generation_config.do_sample = True
    model.generation_config.top_k = 1
    assert TransformersBackend(model, qwen_tokenizer, 2).generate(PROMPTS[:2], params) == plain


def test_bad_params():
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenerationParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        GenerationParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        GenerationParams(top_p=0)
    assert GenerationParams(stop="###").stop == ("###",)


# --- back end choice --------------------------------------------------------------------------------


def test_select_backend_never_picks_vllm_off_cuda(monkeypatch):
    monkeypatch.setattr(inference, "vllm_available", lambda: True)
    assert select_backend("auto", "cpu") == "transformers"
    assert select_backend("auto", "mps") == "transformers"
    assert select_backend("auto", "cuda") == "vllm"
    assert select_backend("transformers", "cuda") == "transformers"
    with pytest.raises(BackendUnavailable, match="CUDA"):
        select_backend("vllm", "cpu")


def test_forcing_vllm_without_it_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(inference, "vllm_available", lambda: False)
    assert select_backend("auto", "cuda") == "transformers"
    with pytest.raises(BackendUnavailable, match=r"pip install 'anyfit\[vllm\]'"):
        select_backend("vllm", "cuda")
    with pytest.raises(ConfigError, match="Unknown inference backend"):
        select_backend("tgi", "cpu")


# --- loading --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_dir(full_vocab_llama_dir, tmp_path_factory):
    """A LoRA output folder as training writes it: adapter weights + config, and the tokenizer."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(full_vocab_llama_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            task_type="CAUSAL_LM"))
    torch.manual_seed(1)
    with torch.no_grad():  # LoRA's B starts at zero; make the adapter change the outputs
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    out = tmp_path_factory.mktemp("lora_run")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(full_vocab_llama_dir).save_pretrained(out)
    return out


@pytest.mark.slow
def test_lora_output_dir_loads_base_and_adapter(lora_dir, full_vocab_llama_dir, tiny):
    from peft import PeftModel

    loc = locate_model(lora_dir)
    assert loc.adapter == str(lora_dir) and loc.tokenizer == str(lora_dir)
    assert json.loads((lora_dir / "adapter_config.json").read_text())["base_model_name_or_path"] == loc.base

    adapted, tok = load_for_inference(lora_dir)
    merged, _ = load_for_inference(lora_dir, merge_lora=True)
    base, _ = tiny
    assert isinstance(adapted, PeftModel) and not isinstance(merged, PeftModel)
    ids = tok("What is 2+2?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        a, m, b = (x(ids).logits for x in (adapted, merged, base))
    assert torch.allclose(a, m, atol=1e-4)  # merging changes nothing
    assert not torch.allclose(a, b, atol=1e-3)  # the adapter is applied
    out = TransformersBackend(adapted, tok, 2).generate(PROMPTS[:2], GenerationParams(max_new_tokens=4))
    assert len(out) == 2 and all(c.num_tokens == 4 for c in out)


def test_full_model_dir_and_unfinished_run(full_vocab_llama_dir, tmp_path):
    assert locate_model(full_vocab_llama_dir).adapter is None
    (tmp_path / "checkpoint-5").mkdir()
    (tmp_path / "checkpoint-10").mkdir()
    with pytest.raises(ConfigError, match="checkpoint-10"):
        locate_model(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        locate_model(tmp_path / "nowhere")


# --- batch size -----------------------------------------------------------------------------------


def test_kv_cache_size(tiny):
    model, _ = tiny
    # 2 (K, V) x 2 layers x 2 KV heads x head_dim 8 (32 wide / 4 heads) x 100 tokens x 4 bytes
    assert kv_cache_bytes(shape_from_config(model.config), 100, 1, 4) == 2 * 2 * 2 * 8 * 100 * 4


def test_plan_batch_size():
    gib = 2**30
    assert plan_batch_size(10 * gib, kv_bytes_per_row=gib // 10, weight_bytes=0, cap=1000) == 80
    assert plan_batch_size(10 * gib, kv_bytes_per_row=gib // 10, weight_bytes=4 * gib, cap=1000) == 40
    assert plan_batch_size(10 * gib, kv_bytes_per_row=1, cap=64) == 64  # capped
    assert plan_batch_size(gib, kv_bytes_per_row=10 * gib, cap=64) == 1  # at least one row


def test_auto_batch_size_on_cpu(tiny):
    model, tok = tiny
    assert inference.auto_batch_size(model, 50, 50) == 64  # tiny model, plenty of RAM: the CPU cap
    assert inference.auto_batch_size(model, 50, 50, num_prompts=3) == 3
    out = TransformersBackend(model, tok, "auto").generate(PROMPTS[:2], GenerationParams(max_new_tokens=2))
    assert len(out) == 2



def test_out_of_memory_halves_the_batch(tiny, monkeypatch):
    model, tok = tiny
    params = GenerationParams(max_new_tokens=2)
    expected = TransformersBackend(model, tok, 1).generate(PROMPTS[:3], params)
    real, sizes = model.generate, []

    def generate(input_ids, **kwargs):
        sizes.append(len(input_ids))
        if len(input_ids) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(input_ids=input_ids, **kwargs)

    monkeypatch.setattr(model, "generate", generate)
    assert TransformersBackend(model, tok, 4).generate(PROMPTS[:3], params) == expected
    assert sizes == [3, 2, 1, 1, 1]

@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None or not torch.cuda.is_available(),
                    reason="needs vllm and a CUDA GPU")
def test_vllm_backend_matches_transformers_greedy(full_vocab_llama_dir):
    from anyfit.evaluation.inference import VLLMBackend

    params = GenerationParams(max_new_tokens=8)
    vllm_out = VLLMBackend(full_vocab_llama_dir, dtype="float32", gpu_memory_utilization=0.3).generate(PROMPTS, params)
    model, tok = load_for_inference(full_vocab_llama_dir, device="cuda", dtype="float32")
    hf_out = TransformersBackend(model, tok, 4).generate(PROMPTS, params)
    assert len(vllm_out) == len(PROMPTS)
    assert [c.num_tokens for c in vllm_out] == [c.num_tokens for c in hf_out]
    # Kernels differ; on a random tiny model most greedy rows still agree.
    assert sum(v.text == h.text for v, h in zip(vllm_out, hf_out)) >= len(PROMPTS) // 2
