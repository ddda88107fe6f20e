from transformers import AutoModelForCausalLM, AutoTokenizer


def test_tiny_models_load(tiny_llama_dir, tiny_qwen2_dir, qwen_small_tokenizer_dir):
    for d in (tiny_llama_dir, tiny_qwen2_dir):
        m = AutoModelForCausalLM.from_pretrained(d)
        assert m.config.num_hidden_layers == 2
        assert m.config.vocab_size == len(AutoTokenizer.from_pretrained(qwen_small_tokenizer_dir))
