"""Greedy generation from chat prompts, batched: the small engine behind before/after samples."""

from __future__ import annotations

import torch


def render_chat_prompt(tokenizer, prompt: str, system_prompt: str | None = None) -> str:
    """The user ``prompt`` in the tokenizer's chat template, ending where the assistant's answer begins."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@torch.inference_mode()
def greedy_generate(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 8,
                    system_prompt: str | None = None) -> list[str]:
    """Greedy completions (decoded, special tokens removed) of each user prompt, in the input order.

    Prompts are rendered with the chat template and left-padded, so every row's last prompt token
    sits in the last column and all rows decode in step with the KV cache. Rows are batched by
    length (longest first) to waste little compute on padding; a row stops at the tokenizer's EOS
    (or the model's generation EOS, e.g. ``<|im_end|>``) or after ``max_new_tokens``.
    """
    from transformers import GenerationConfig

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    eos_ids = _eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    # A fresh config: the checkpoint's generation_config may ask for sampling (temperature, top_p).
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos_ids,
                                  pad_token_id=pad_id, use_cache=True)

    texts = [render_chat_prompt(tokenizer, p, system_prompt) for p in prompts]
    # The template already holds the special tokens (BOS, role markers): add none on top.
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    outputs: list[str] = [""] * len(prompts)
    try:
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            width = max(len(ids[i]) for i in rows)
            input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
            attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, i in enumerate(rows):
                input_ids[r, width - len(ids[i]):] = torch.tensor(ids[i])
                attention_mask[r, width - len(ids[i]):] = 1
            out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                 generation_config=gen_config)
            for r, i in enumerate(rows):
                outputs[i] = tokenizer.decode(out[r, width:], skip_special_tokens=True)
    finally:
        model.train(was_training)
    return outputs


def _eos_ids(model, tokenizer) -> list[int]:
    """Token ids that end an answer: the tokenizer's EOS plus any the model's generation config names."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for i in ([gen_eos] if isinstance(gen_eos, int) else (gen_eos or [])):
        if i not in ids:
            ids.append(i)
    if not ids:
        raise ValueError("neither the tokenizer nor the model's generation config defines an EOS token")
    return ids
