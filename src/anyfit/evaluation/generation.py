"""Greedy generation from chat prompts: the small helper behind before/after samples (``anyfit quickstart``).

A thin wrapper over ``anyfit.evaluation.inference.TransformersBackend``, which holds the batching, padding and
stopping logic shared by ``anyfit generate`` and ``anyfit eval``.
"""

from __future__ import annotations

from anyfit.evaluation.inference import GenerationParams, TransformersBackend


def render_chat_prompt(tokenizer, prompt: str, system_prompt: str | None = None) -> str:
    """The user ``prompt`` in the tokenizer's chat template, ending where the assistant's answer begins."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def greedy_generate(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 8,
                    system_prompt: str | None = None) -> list[str]:
    """Greedy completions (decoded, special tokens removed) of each user prompt, in the input order.

    Prompts are rendered with the chat template and left-padded; a row stops at the tokenizer's EOS (or
    the model's generation EOS, e.g. ``<|im_end|>``) or after ``max_new_tokens``. The model's training
    mode is restored afterwards.
    """
    if batch_size != "auto" and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    params = GenerationParams(max_new_tokens=max_new_tokens, chat=True, system_prompt=system_prompt)
    return [c.text for c in TransformersBackend(model, tokenizer, batch_size).generate(prompts, params)]
