"""Model sizes the planner comparisons and the README's hardware table use, written out from each model's config.json
(or the source's yaml) so that nothing is downloaded; one table for benchmarks/published_memory.py,
benchmarks/published_speed.py and scripts/hardware_guide.py."""

from __future__ import annotations

from transformers import GemmaConfig, LlamaConfig, MistralConfig

# From Lightning-AI/litgpt litgpt/config.py (Config defaults: n_embd 4096, n_head 32): padded vocabularies, as LitGPT
# builds them; untied heads except Gemma. Then the torchtune / torchtitan / llm-foundry models.
MODELS: dict[str, object] = {
    "Llama-2-7B": LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                              num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=False),
    "Llama-2-13B": LlamaConfig(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                               num_attention_heads=40, num_key_value_heads=40, tie_word_embeddings=False),
    "Llama-3-8B": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                              num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "Mistral-7B-v0.1": MistralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "TinyLlama-1.1B": LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                  num_attention_heads=32, num_key_value_heads=4, tie_word_embeddings=False),
    "Gemma-2B": GemmaConfig(vocab_size=256000, hidden_size=2048, intermediate_size=16384, num_hidden_layers=18,
                            num_attention_heads=8, num_key_value_heads=1, head_dim=256, tie_word_embeddings=True),
    "Llama-3.1-70B": LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                 num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False),
    "Llama-3.2-3B": LlamaConfig(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                num_attention_heads=24, num_key_value_heads=8, tie_word_embeddings=True),
    # MPT-7B (d 4096, 32 layers, 32 heads, GELU MLP of 4d, vocab 50368, tied): written as a Llama whose gated MLP
    # has the same weights (3 x 4096 x 10923 ~ 2 x 4096 x 16384), so the matmul FLOPs match.
    "MPT-7B": LlamaConfig(vocab_size=50368, hidden_size=4096, intermediate_size=10923, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=True),
}
MODELS["Llama-3.1-8B"] = MODELS["Llama-3-8B"]  # the same sizes (3.1 changed the rotary scaling and the context)
