"""Conversations through the tokenizer's own chat template: what is trained, and that nothing was left out.

``ChatTemplate`` applies the template with the record's ``tools`` and each message's tool calls and reasoning in the
keys the template reads (``reasoning_content`` for Qwen3 and DeepSeek, ``thinking`` for gpt-oss; a template that
reads neither gets the reasoning inline as ``<think>...</think>`` before the answer, the convention of DeepSeek-R1
and its distills). Tool-call arguments are handed over as JSON objects, as transformers documents them, and as JSON
strings to a template that can only concatenate strings (DeepSeek-V3's).

``chat_parts`` splits a conversation into trained and masked text by rendering it incrementally: for assistant
turn i, the text before it is the template applied to ``messages[:i]`` with the generation prompt (what the model
is given at inference), and the turn is what ``messages[:i+1]`` adds. Templates that render earlier turns
differently once the conversation goes on (Qwen3 and DeepSeek-R1 drop earlier turns' reasoning) make the text
before a later turn differ from what was already laid out: that turn then starts a new example, in the context the
template gives it at inference. So a record can make several examples; each assistant turn is trained exactly once.

Every trained turn is checked against its message: its reasoning, the names of its tool calls, every tool result
and every tool definition must be in the rendered text, else the record is refused in one line (templates drop
what they do not know without a word). HF's ``return_assistant_tokens_mask`` is not used: it needs
``{% generation %}`` markers that most chat templates lack.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from anyfit.data.messages import Message
from anyfit.data.records import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# How templates read a message's reasoning: the key, as Jinja code names it.
_REASONING_KEY = {"reasoning_content": re.compile(r"reasoning_content"),
                  "thinking": re.compile(r"message\.thinking|\[['\"]thinking['\"]\]")}
# What closes a reasoning trace in the templates seen (Qwen3, DeepSeek-R1, GLM-Z1, ...): kept out of the loss with
# the trace when data.train_reasoning is off.
_OPEN_REASONING = re.compile(r"<think>\n?$")
_CLOSE_REASONING = re.compile(r"\s*(</think>|</thinking>|<\|end_of_thought\|>)?\s*")


@dataclass(frozen=True)
class Segment:
    """A piece of the rendered text; ``trained`` segments carry loss under ``train_on: completion``."""

    text: str
    trained: bool


class ChatTemplate:
    """The tokenizer's chat template, applied to one record's conversation (``place`` names it in errors)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, place: str, tools: list[dict] | None = None):
        self.tokenizer, self.place, self.tools = tokenizer, place, tools
        self.reasoning_key = _reasoning_key(template_text(tokenizer))

    def apply(self, messages: list[Message], generation_prompt: bool) -> str:
        """The template's text of ``messages`` (with the generation prompt when asked)."""
        shown = [self._shown({k: v for k, v in m.items() if k != "weight"}) for m in messages]
        kwargs: dict[str, Any] = {"tools": self.tools} if self.tools else {}
        try:
            try:
                return self.tokenizer.apply_chat_template(shown, tokenize=False, add_generation_prompt=generation_prompt,
                                                          **kwargs)
            except TypeError:
                if not any(m.get("tool_calls") for m in shown):
                    raise
                # A template that joins the arguments as a string ('"arguments": ' + tool_call.arguments).
                return self.tokenizer.apply_chat_template([_string_arguments(m) for m in shown], tokenize=False,
                                                          add_generation_prompt=generation_prompt, **kwargs)
        except Exception as e:  # jinja raises its own errors (e.g. "roles must alternate") from template code
            raise DataError(f"{self.place}: the chat template failed on this conversation: "
                            f"{' '.join(str(e).split())}") from e

    def _shown(self, m: Message) -> Message:
        """The message as this template reads it: reasoning under its key, or inline before the answer."""
        reasoning = m.get("reasoning_content")
        if reasoning is None or self.reasoning_key == "reasoning_content":
            return m
        shown = {k: v for k, v in m.items() if k != "reasoning_content"}
        if self.reasoning_key:
            shown[self.reasoning_key] = reasoning
        else:
            shown["content"] = f"<think>\n{reasoning.strip()}\n</think>\n\n{m['content']}"
        return shown

    def check_rendered(self, messages: list[Message]) -> None:
        """A DataError when the template leaves out a tool result or a tool definition of the conversation."""
        if not self.tools and not any(m["role"] == "tool" for m in messages):
            return
        text = self.apply(messages, False)
        for j, m in enumerate(messages):
            if m["role"] == "tool" and m["content"].strip() not in text:
                raise DataError(f"{self.place}: message {j} has role 'tool', but the tokenizer's chat template does "
                                "not render tool messages (its text is missing from the result). Remove the tool turns "
                                "or use a tokenizer whose chat template has a tool role.")
        if not self.tools:
            return
        names = [(tool.get("function") or tool).get("name") for tool in self.tools]
        # A template without tools renders the same text with and without them (a tool call can name a tool anyway).
        bare = ChatTemplate(self.tokenizer, self.place).apply(messages, False)
        missing = next((name for name in names if name and name not in text), None)
        if missing or bare == text:
            raise DataError(f"{self.place}: the tokenizer's chat template does not render the 'tools' column (the "
                            f"definition{f' of {missing!r}' if missing else 's'} would be missing). Use a tokenizer "
                            "whose chat template takes tools, or set data.ignore_fields: [tools] to train without them.")

    def check_turn(self, turn: str, message: Message, index: int) -> None:
        """A DataError when a trained turn's text lacks the reasoning or a tool call its message holds."""
        reasoning = (message.get("reasoning_content") or "").strip()
        if reasoning and reasoning not in turn:
            raise DataError(f"{self.place}: the chat template does not render the reasoning of assistant turn {index} "
                            f"(it would train the turn without it{', with an empty think block' if '<think>' in turn else ''}"
                            "). Use a tokenizer whose chat template renders reasoning_content, or set "
                            "data.ignore_fields: [reasoning_content] to train the answers alone.")
        for call in message.get("tool_calls") or ():
            name = call["function"]["name"]
            if name not in turn:
                raise DataError(f"{self.place}: the chat template does not render the tool call {name!r} of assistant "
                                f"turn {index} (it would train the turn without the call). Use a tokenizer whose chat "
                                "template renders tool_calls.")


def chat_parts(messages: list[Message], trained_turns: list[int], chat: ChatTemplate,
               train_reasoning: bool = True) -> list[list[Segment]]:
    """The conversation as examples of trained and masked segments (see the module docstring); one example unless the
    template renders earlier turns differently later on. Whitespace after a turn's end token (Qwen's newline after
    <|im_end|>) is formatting between turns, so it goes to the next masked piece; after the last trained turn it is
    dropped (the model stops before it). Messages after the last assistant turn carry no loss and are left out."""
    chat.check_rendered(messages)
    parts: list[list[Segment]] = []
    segments: list[Segment] = []
    done = ""  # the text the current example's segments cover so far
    for i in trained_turns:
        before = chat.apply(messages[:i], True)
        through = chat.apply(messages[: i + 1], False)
        if not through.startswith(before):
            through = _opened_reasoning(before, through, messages[i])
        if not through.startswith(before):
            at = next((k for k, (a, b) in enumerate(zip(before, through)) if a != b), len(before))
            raise DataError(
                f"{chat.place}: the tokenizer's chat template renders the conversation before assistant turn {i} "
                f"differently once the turn is added ({before[max(0, at - 30):at + 30]!r} becomes "
                f"{through[max(0, at - 30):at + 30]!r}; some templates add e.g. '<think>' to the generation prompt "
                "only), so the trained span cannot be found. Use data.template=trl (TRL's rule: the loss starts where "
                "the token ids differ), or a tokenizer whose chat template renders prefixes stably.")
        if not before.startswith(done):  # earlier turns now render otherwise: this turn is an example of its own
            parts.append(segments)
            segments, done = [], ""
        turn = through[len(before):].rstrip()
        chat.check_turn(turn, messages[i], i)
        segments.append(Segment(before[len(done):], trained=False))
        segments += _turn_segments(turn, messages[i], train_reasoning)
        done = before + turn
    if not trained_turns:  # nothing to learn; kept so the caller can count and report it
        segments.append(Segment(chat.apply(messages, False), trained=False))
    parts.append(segments)
    return parts


@functools.lru_cache(maxsize=16)
def _reasoning_key(source: str) -> str | None:
    """The message key a chat template reads a reasoning trace from (None: it reads none); once per template."""
    return next((k for k, r in _REASONING_KEY.items() if r.search(source)), None)


def _opened_reasoning(before: str, through: str, message: Message) -> str:
    """``through`` as the model writes it when the generation prompt opens the think block itself (DeepSeek-R1's
    and QwQ's '<think>\n', Qwen3.5's) but the template renders a finished turn without its reasoning: the turn's
    reasoning, the closing tag, then the answer as the template renders it. A turn without reasoning gets an empty
    think block, as those models write one. ``through`` unchanged when the generation prompt opens none."""
    opened = _OPEN_REASONING.search(before)
    head = before[:opened.start()] if opened else None
    if head is None or not through.startswith(head) or through[len(head):].lstrip().startswith("<think>"):
        return through
    reasoning = message.get("reasoning_content") or ""
    if not reasoning and "</think>" in message.get("content", ""):
        reasoning = message["content"].split("</think>")[0].split("<think>")[-1]
    rest = through[len(head):]
    return before + reasoning.strip() + "\n</think>" + ("" if rest.startswith("\n") else "\n\n") + rest


def _turn_segments(turn: str, message: Message, train_reasoning: bool) -> list[Segment]:
    """The turn as one trained piece; without ``train_reasoning``, its reasoning (and the tag closing it) masked."""
    if train_reasoning:
        return [Segment(turn, trained=True)]
    reasoning = (message.get("reasoning_content") or "").strip()
    if reasoning and reasoning in turn:
        end = turn.index(reasoning) + len(reasoning)
    elif "</think>" in message["content"] and "</think>" in turn:  # reasoning written inline in the content
        end = turn.index("</think>")
    else:
        return [Segment(turn, trained=True)]
    end += _CLOSE_REASONING.match(turn, end).end() - end
    return [Segment(turn[:end], trained=False), Segment(turn[end:], trained=True)]


def _string_arguments(m: Message) -> Message:
    if not m.get("tool_calls"):
        return m
    calls = [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"],
                                                                          ensure_ascii=False)}}
             for c in m["tool_calls"]]
    return {**m, "tool_calls": calls}


def template_text(tokenizer: PreTrainedTokenizerBase) -> str:
    """The tokenizer's chat template source (its 'default' when it ships named variants); a DataError without one."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named variants: 'default' is the one apply_chat_template uses
        template = template.get("default")
    if not template:
        raise DataError("The tokenizer has no chat template, so this data cannot be rendered with data.template=chat "
                        "(or trl, for conversations). Choose data.template=plain, r1_zero or a custom string with "
                        "{prompt}, or set model.tokenizer to one that has a chat template.")
    return template


def default_system_prompt(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The system turn a chat template adds by itself to a conversation that has none (SmolLM2's, Qwen2.5's),
    or None. Found by rendering one user turn with a marker as the system prompt and once without: where the
    marker stood, the second rendering holds the default."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker, user = "\x00anyfit-system\x00", [{"role": "user", "content": "hi"}]
    try:
        marked = tokenizer.apply_chat_template([{"role": "system", "content": marker}, *user], tokenize=False)
        plain = tokenizer.apply_chat_template(user, tokenize=False)
    except Exception:  # a template that refuses system turns has no default one either
        return None
    if marked.count(marker) != 1:
        return None
    before, after = marked.split(marker)
    if len(plain) <= len(before) + len(after) or not plain.startswith(before) or not plain.endswith(after):
        return None
    return plain[len(before):len(plain) - len(after)]
