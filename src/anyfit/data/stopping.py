"""Which tokens end a generated answer: the tokenizer's EOS, the EOS ids the model's configs name, and the
token(s) its chat template ends an assistant turn with, a tool-call turn's included.

A base model's EOS is often not its template's end of turn (Qwen2.5 and SmolLM2 base models: ``<|endoftext|>``,
while turns end with ``<|im_end|>``), so a fine-tune on that template, generated with the base's settings, runs
past its answer. The end of turn is read from the template itself, by rendering a probe conversation: no list of
known models. One rule for every consumer: generation (``anyfit.evaluation.inference``) stops there, and the
export and a run's model folders write it into generation_config.json (``write_generation_config``), so other
tools stop there too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

GENERATION_CONFIG = "generation_config.json"

# Probe texts no template writes by itself, so where they land in a rendering is unambiguous.
_QUESTION, _REPLY, _NEXT, _RESULT = "anyfit-question", "anyfit-reply", "anyfit-next", "anyfit-result"
_TOOL = "anyfit_probe"
_TOOLS = [{"type": "function", "function": {
    "name": _TOOL, "description": "A probe.",
    "parameters": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}}]


def end_of_turn_tokens(tokenizer) -> list[str]:
    """The special tokens that end an assistant turn in the tokenizer's chat template (``turn_ends``), each once
    ([] without a chat template)."""
    return list(dict.fromkeys(t for t in turn_ends(tokenizer) if t))


def turn_ends(tokenizer) -> tuple[str | None, str | None]:
    """(the token that ends an answer, the one that ends a tool-call turn) in the tokenizer's chat template; None
    where it has none (no template, tool calls not rendered, no special token there).

    A turn's end is the first special token the template writes after the turn's content (the last tool call's
    arguments) when the turn ends the conversation: that is what a fine-tune learns to write last. Some
    templates write none there and end a turn with the next one's role token (GLM's ``<|user|>``); then it is
    the first special token after the content once another message follows."""
    if not getattr(tokenizer, "chat_template", None):
        return None, None
    specials = _special_tokens_pattern(tokenizer)
    user = {"role": "user", "content": _QUESTION}
    answer = _turn_end(tokenizer, specials, [user, {"role": "assistant", "content": _REPLY}],
                       [{"role": "user", "content": _NEXT}], _REPLY, _NEXT)
    tool_call: str | None | bool = None
    for call, results in _tool_call_turns():  # the first form this template renders the calls of
        tool_call = _turn_end(tokenizer, specials, [user, call], results, _argument(len(results)), _RESULT,
                              tools=_TOOLS)
        if tool_call is not False:
            break
    return answer or None, tool_call or None


def stop_token_ids(tokenizer, *configs) -> list[int]:
    """The ids that end generation, each once: the tokenizer's EOS, each config's ``eos_token_id`` (a model's
    generation config and config), then the chat template's end-of-turn tokens."""
    ids = [tokenizer.eos_token_id]
    for config in configs:
        eos = getattr(config, "eos_token_id", None)
        ids += [eos] if isinstance(eos, int) else list(eos or [])
    ids += [tokenizer.convert_tokens_to_ids(t) for t in end_of_turn_tokens(tokenizer)]
    return list(dict.fromkeys(i for i in ids if i is not None))


def write_generation_config(folder: Path, model, tokenizer) -> list[str]:
    """Set ``eos_token_id`` in the generation_config.json of ``folder`` (a model folder ``save_pretrained``
    wrote) to every stop id (``stop_token_ids``), the other settings the model ships kept as written; returns
    the stop tokens. Edited as JSON: a round trip through GenerationConfig would validate, and could refuse,
    settings the base model ships."""
    path = Path(folder) / GENERATION_CONFIG
    if path.is_file():
        settings = json.loads(path.read_text(encoding="utf-8"))
    else:  # a model without one: what transformers would derive from its config
        from transformers import GenerationConfig

        settings = GenerationConfig.from_model_config(model.config).to_diff_dict()
    ids = stop_token_ids(tokenizer, getattr(model, "generation_config", None), model.config)
    if not ids:
        return []
    settings["eos_token_id"] = ids if len(ids) > 1 else ids[0]
    path.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return tokenizer.convert_ids_to_tokens(ids)


def _tool_call_turns():
    """(assistant turn, tool results) in the forms templates expect, tried in order: two calls (a template may
    end each call with a token and only the turn with another: DeepSeek-R1-Distill), then one (Llama 3.1 refuses
    two); arguments as a dict (transformers' convention) or a JSON string (DeepSeek's templates concatenate
    them); content None (transformers leaves the key out) or empty."""
    for n in (2, 1):
        for as_text in (False, True):
            for content in (None, ""):
                calls = [{"id": f"anyfit00{k}", "type": "function",  # 9 characters: Mistral's templates check
                          "function": {"name": _TOOL, "arguments": json.dumps({"a": _argument(k)}) if as_text
                                       else {"a": _argument(k)}}} for k in range(1, n + 1)]
                results = [{"role": "tool", "tool_call_id": f"anyfit00{k}", "name": _TOOL, "content": _RESULT}
                           for k in range(1, n + 1)]
                yield {"role": "assistant", "content": content, "tool_calls": calls}, results


def _argument(k: int) -> str:
    return f"anyfit-value-{k}"


def _turn_end(tokenizer, specials: re.Pattern, turn: list[dict], following: list[dict], marker: str, next_marker: str,
              **kwargs) -> str | None | bool:
    """The end token of the last message of ``turn`` (the rule: ``turn_ends``); None when the template writes
    no special token after it, False when it does not render it (``marker`` missing)."""
    last = _render(tokenizer, turn, kwargs)
    if last is None or marker not in last:
        return False
    found = specials.search(last, last.rindex(marker) + len(marker))
    if found:
        return found.group()
    more = _render(tokenizer, turn + following, kwargs)
    if more is None or marker not in more:
        return None
    start = more.rindex(marker) + len(marker)
    stop = more.find(next_marker, start)
    found = specials.search(more, start, stop if stop >= 0 else len(more))
    return found.group() if found else None


def _render(tokenizer, messages: list[dict], kwargs: dict) -> str | None:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, **kwargs)
    except Exception:  # noqa: BLE001 - jinja raises its own errors from template code: this form is not supported
        return None


def _special_tokens_pattern(tokenizer) -> re.Pattern:
    """Added tokens marked special (Qwen's <|im_end|>, not its <tool_call>), longest first so none is read as a
    prefix of another; a pattern that never matches when there are none."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    tokens = {t.content for t in decoder.values() if getattr(t, "special", False)}
    tokens |= set(getattr(tokenizer, "all_special_tokens", []) or [])
    tokens.discard("")
    if not tokens:
        return re.compile(r"(?!)")
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))
