"""How a chat template lays out an assistant turn's reasoning, read from the template's own rendering.

Templates differ in the text around a reasoning trace (Qwen3: ``<think>\\n{r}\\n</think>\\n\\n``, GLM-4.7/5:
``<think>{r}</think>``, MiniMax-M3: ``<mm:think>{r}</mm:think>``, gpt-oss: its analysis channel, then
``<|end|><|start|>assistant<|channel|>final<|message|>``), and some generation prompts open the block themselves
(GLM's and DeepSeek-R1's ``<think>``). A fixed guess trains text the model never sees at inference, so the layout
is probed once per template and options: an assistant turn with marker reasoning and a marker answer is rendered
after the generation prompt, and the text between them is read back. The model then writes, after the generation
prompt, ``lead + reasoning + between + answer``; a turn without reasoning is the same with an empty trace (GLM-4.7's
``</think>`` after the prompt's ``<think>``). Templates that read no reasoning key, or whose rendering of the probe
does not hold the marker after the generation prompt, give no layout: the data's own inline ``<think>`` text is used
where it has one, or ``data.reasoning_layout`` where the user names one, and anything else is refused in one line
(``anyfit.data.chat``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# How templates read a message's reasoning: the key, as Jinja code names it.
_REASONING_KEY = {"reasoning_content": re.compile(r"reasoning_content"),
                  "thinking": re.compile(r"message\.thinking|\[['\"]thinking['\"]\]")}
# Probe texts no real conversation holds.
_USER, _REASONING, _ANSWER = "anyfit-probe-user", "anyfit-probe-reasoning", "anyfit-probe-answer"


@dataclass(frozen=True)
class ReasoningLayout:
    """The text the model writes around a trace after the generation prompt: ``lead`` before it, ``between`` it and
    the answer. ``source`` says where it was read: 'template', 'data' (the record's inline block) or
    'data.reasoning_layout'."""

    lead: str
    between: str
    source: str = "template"

    def around(self, reasoning: str) -> str:
        return self.lead + reasoning + self.between

    @property
    def empty(self) -> str:
        """The block of a turn without reasoning, as this layout writes it (GLM's '</think>', Qwen3's
        '<think>\\n\\n</think>\\n\\n'); '' where it has no closing text (gpt-oss's channels)."""
        return self.around("") if self.between.strip() else ""

    def end_of(self, turn: str, reasoning: str) -> int | None:
        """Where the trace ``reasoning`` and the text closing it end in ``turn``; None where it is not there."""
        at = turn.find(reasoning) if reasoning else -1
        if at < 0:
            return None
        end = at + len(reasoning)
        return end + len(self.between) if turn.startswith(self.between, end) else end


@dataclass(frozen=True)
class TemplateReasoning:
    """What one template (under its options) does with reasoning: ``key`` (the message key it reads, None: none),
    ``layout`` (None: not readable from it), ``inline_native`` (it splits a ``<think>`` block written in the content
    itself, exactly as it lays the key out: such a record is handed over as written)."""

    key: str | None
    layout: ReasoningLayout | None
    inline_native: bool


_CACHE: dict[tuple[str, str], TemplateReasoning] = {}


def reasoning_key(source: str) -> str | None:
    """The message key a chat template reads a reasoning trace from (None: it reads none)."""
    return next((k for k, r in _REASONING_KEY.items() if r.search(source)), None)


def template_reasoning(tokenizer: PreTrainedTokenizerBase, source: str, kwargs: dict[str, Any]) -> TemplateReasoning:
    """The reasoning traits of the template ``source`` under ``kwargs`` (probed once, then cached)."""
    cache = (source, json.dumps(kwargs, sort_keys=True, default=str))
    if cache not in _CACHE:
        _CACHE[cache] = _probe(tokenizer, source, kwargs)
    return _CACHE[cache]


def user_layout(given: str) -> ReasoningLayout:
    """data.reasoning_layout ('<think>\\n{reasoning}\\n</think>\\n\\n') as a layout."""
    lead, between = given.split("{reasoning}", 1)
    return ReasoningLayout(lead, between, "data.reasoning_layout")


def data_layout(content: str, reasoning: str, answer: str) -> ReasoningLayout | None:
    """The layout an inline ``<think>`` block of the record itself writes (its own tags and whitespace)."""
    at = content.find(reasoning) if reasoning else content.find("</think>")
    end = at + len(reasoning) if reasoning else at
    tail = len(content) - len(answer) if answer and content.endswith(answer) else len(content)
    if at < 0 or tail < end:
        return None
    return ReasoningLayout(content[:at].lstrip(), content[end:tail], "data")


def _render(tokenizer: PreTrainedTokenizerBase, source: str, kwargs: dict[str, Any], messages: list[dict],
            generation_prompt: bool = False) -> str | None:
    try:
        return tokenizer.apply_chat_template(messages, chat_template=source, tokenize=False,
                                             add_generation_prompt=generation_prompt, **kwargs)
    except Exception:  # a probe the template refuses: it shows no layout
        return None


def _probe(tokenizer: PreTrainedTokenizerBase, source: str, kwargs: dict[str, Any]) -> TemplateReasoning:
    key = reasoning_key(source)
    user = {"role": "user", "content": _USER}
    prompt = _render(tokenizer, source, kwargs, [user], generation_prompt=True)
    layout = None
    if key and prompt is not None:
        shown = _render(tokenizer, source, kwargs, [user, {"role": "assistant", "content": _ANSWER,
                                                           key: _REASONING}])
        if shown and shown.startswith(prompt) and _REASONING in shown and _ANSWER in shown:
            turn = shown[len(prompt):]
            at, answer = turn.index(_REASONING), turn.index(_ANSWER)
            if at < answer:
                layout = ReasoningLayout(turn[:at], turn[at + len(_REASONING):answer])
    inline_native = False
    if key:  # the same trace written inline, with the whitespace distilled traces put around it
        spaced = f"\n{_REASONING}\n"
        by_key = _render(tokenizer, source, kwargs, [user, {"role": "assistant", "content": _ANSWER, key: spaced}])
        inline = _render(tokenizer, source, kwargs,
                         [user, {"role": "assistant", "content": f"<think>{spaced}</think>\n\n{_ANSWER}"}])
        inline_native = by_key is not None and by_key == inline and _REASONING in inline
    return TemplateReasoning(key, layout, inline_native)
