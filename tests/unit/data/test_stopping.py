"""The tokens that end generation: the chat template's end of turn (tool-call turns included), read from real
templates by rendering, beside the tokenizer's and the model's EOS."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from tokenizers import AddedToken
from transformers import AutoTokenizer

from anyfit.data.stopping import end_of_turn_tokens, stop_token_ids, turn_ends, write_generation_config

# (answer's end, tool-call turn's end) of real templates.
REAL = {
    # A tool call ends '</tool_call><|im_end|>': <tool_call> is an added token, but not a special one.
    "qwen-2.5": ("<|im_end|>", "<|im_end|>"),
    "qwen-3": ("<|im_end|>", "<|im_end|>"),
    # Its template takes arguments as a JSON string only, and ends a call turn with non-special tool tokens
    # ('<｜tool▁call▁end｜><｜tool▁calls▁end｜>') before the EOS.
    "deepseek-r1": ("<｜end▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    # Nothing follows an answer until the next turn's role token, which is what ends it; tool_calls are not rendered.
    "glm-4": ("<|user|>", None),
}


@pytest.mark.parametrize("name", REAL)
def test_turn_ends_of_real_templates(name, real_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(real_tokenizer_dir(name))
    assert turn_ends(tok) == REAL[name]
    assert end_of_turn_tokens(tok) == list(dict.fromkeys(t for t in REAL[name] if t))


# gpt-oss's shape: an answer ends with <|return|>, a tool-call turn with <|call|>.
CALLS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}{{ c.function.name }}({{ c.function.arguments | tojson }})"
    "{% endfor %}<|call|>{% elif m.role == 'assistant' %}{{ m.content }}<|return|>{% else %}{{ m.content }}<|im_end|>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_tool_call_turn_with_its_own_end_token(qwen_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    tok.add_tokens([AddedToken("<|return|>", special=True), AddedToken("<|call|>", special=True)],
                   special_tokens=True)
    tok.chat_template = CALLS_TEMPLATE
    assert turn_ends(tok) == ("<|return|>", "<|call|>")
    im_end, ret, call = tok.convert_tokens_to_ids(["<|im_end|>", "<|return|>", "<|call|>"])
    assert stop_token_ids(tok) == [im_end, ret, call]


def test_a_base_models_eos_is_joined_by_the_templates_end_of_turn(qwen_base_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(qwen_base_tokenizer_dir)
    endoftext, im_end = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    assert tok.eos_token_id == endoftext
    assert stop_token_ids(tok) == [endoftext, im_end]
    # the model's configs' EOS ids come after the tokenizer's, each once
    configs = SimpleNamespace(eos_token_id=[7, endoftext]), SimpleNamespace(eos_token_id=None)
    assert stop_token_ids(tok, *configs) == [endoftext, 7, im_end]

    tok.chat_template = None  # no template: only the EOS
    assert turn_ends(tok) == (None, None) and stop_token_ids(tok) == [endoftext]


def test_the_generation_config_keeps_what_the_model_ships(qwen_base_tokenizer_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(qwen_base_tokenizer_dir)
    endoftext, im_end = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    shipped = {"bos_token_id": endoftext, "eos_token_id": endoftext, "do_sample": True, "temperature": 0.7,
               "top_k": 20, "repetition_penalty": 1.05}
    (tmp_path / "generation_config.json").write_text(json.dumps(shipped))
    model = SimpleNamespace(config=SimpleNamespace(eos_token_id=endoftext),
                            generation_config=SimpleNamespace(eos_token_id=endoftext))
    assert write_generation_config(tmp_path, model, tok) == ["<|endoftext|>", "<|im_end|>"]
    written = json.loads((tmp_path / "generation_config.json").read_text())
    assert written == {**shipped, "eos_token_id": [endoftext, im_end]}
