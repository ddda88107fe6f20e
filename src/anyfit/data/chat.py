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

Every trained turn is checked against its message: its reasoning (also written inline as ``<think>...</think>``),
the names of its tool calls, every tool result and every tool definition must be in the rendered text, else the
record is refused in one line (templates drop what they do not know without a word). HF's
``return_assistant_tokens_mask`` is not used: it needs ``{% generation %}`` markers that most chat templates lack.

The template is met where it stands (``anyfit.data.template_probes`` asks it once): content as parts where it reads
parts, the tool role as it spells it, a system message folded or dropped (data.system_fallback) where it has no
system role, ``data.chat_template_kwargs`` handed to it. An empty think block it writes before a turn without
reasoning is context unless data.train_empty_think, and so is one its generation prompt alone writes (Gemma-4's empty
thought channel: the turn is trained after it, as the model writes it at inference); a turn it ends with the next
turn's header (GLM's ``<|user|>``) gets that header token as its trained stop (``ChatTemplate.with_stop``). The
segments are tokenized as one text (``anyfit.data.tokenization``), as inference tokenizes the conversation.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anyfit.data.messages import Message, content_texts, inline_reasoning, prepend_text
from anyfit.data.reasoning_layout import ReasoningLayout, TemplateReasoning, data_layout, template_reasoning, user_layout
from anyfit.data.records import DataError
from anyfit.data.stopping import turn_ends
from anyfit.data.template_probes import TOOL_ROLES, Traits, as_parts, traits

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# The trace a turn is rendered with to read the template's layout around it (text no real record holds).
_TRACE = "anyfit-probe-trace"
# Per-message keys that say whether a turn is trained; read by anyfit, never handed to a template.
_LOSS_KEYS = ("weight",)


@dataclass(frozen=True)
class Segment:
    """A piece of the rendered text; ``trained`` segments carry loss under ``train_on: completion``."""

    text: str
    trained: bool


@dataclass(frozen=True)
class TemplateOptions:
    """The data.* settings that decide how a conversation meets the template: ``kwargs`` handed to it
    (data.chat_template_kwargs, a record's own over them), ``system`` (data.system_fallback: what to do with a system
    message the template has no role for), ``train_empty_think`` (train the empty think block a template writes
    before a turn without reasoning), ``train_reasoning``, ``cut_reasoning_ok`` (reasoning_content is in
    data.ignore_fields: a template that cuts an inline trace may), ``reasoning_layout`` (data.reasoning_layout: the
    text around a trace where the template does not show it)."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    system: str = "refuse"
    train_empty_think: bool = False
    train_reasoning: bool = True
    cut_reasoning_ok: bool = False
    reasoning_layout: str | None = None


class ChatTemplate:
    """The tokenizer's chat template, applied to one record's conversation (``place`` names it in errors)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, place: str, tools: list[dict] | None = None,
                 options: TemplateOptions | None = None):
        self.tokenizer, self.place, self.tools = tokenizer, place, tools
        self.options = options or TemplateOptions()
        self.source = template_text(tokenizer)
        self.empty_think = 0  # turns whose empty think block was found (kept as context unless trained)
        self.next_header_stop = 0  # turns given the next turn's header as their stop (with_stop)

    @functools.cached_property
    def name(self) -> str:
        """How errors name the template: asked for by errors only (a ChatTemplate is made per record, and finding the
        name builds a path)."""
        return template_name(self.tokenizer)

    @functools.cached_property
    def traits(self) -> Traits:
        return traits(self.tokenizer, self.source, self.options.kwargs)

    @functools.cached_property
    def reasoning(self) -> TemplateReasoning:
        return template_reasoning(self.tokenizer, self.source, self.options.kwargs)

    @property
    def reasoning_key(self) -> str | None:
        return self.reasoning.key

    def apply(self, messages: list[Message], generation_prompt: bool) -> str:
        """The template's text of ``messages`` (with the generation prompt when asked)."""
        shown = [self._shown(m) for m in self._with_system(messages)]
        kwargs: dict[str, Any] = {**self.options.kwargs, **({"tools": self.tools} if self.tools else {})}
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
            roles = "/".join(m["role"] for m in messages)
            raise DataError(f"{self.place}: the chat template of {self.name} failed on this conversation (roles "
                            f"{roles}), saying: {' '.join(str(e).split())}. Change the record to what this template "
                            "accepts, or set data.chat_template to a template that renders it.") from e

    def _with_system(self, messages: list[Message]) -> list[Message]:
        """The messages with a system message the template has no role for folded into the first user turn or
        dropped, as data.system_fallback says; refused in one line by default."""
        at = next((j for j, m in enumerate(messages) if m["role"] == "system"), None)
        if at is None or self.traits.system:
            return messages
        if self.options.system == "refuse":
            raise DataError(f"{self.place}: the chat template of {self.name} has no system role (it refuses or leaves "
                            "out a system message). Set data.system_fallback: fold (the system prompt goes before the "
                            "first user message, a blank line between) or drop (train without it), or remove the "
                            "system prompt from the data.")
        system = messages[at]["content"]
        rest = [m for j, m in enumerate(messages) if j != at]
        if self.options.system == "fold":
            first = next((j for j, m in enumerate(rest) if m["role"] == "user"), None)
            if first is None:
                raise DataError(f"{self.place}: data.system_fallback=fold needs a user message to fold the system "
                                "prompt into, and this conversation has none.")
            rest[first] = {**rest[first], "content": prepend_text(rest[first]["content"], f"{system}\n\n")}
        return rest

    def _shown(self, m: Message) -> Message:
        """The message as this template reads it: reasoning under its key (a trace written inline too, unless the
        template splits inline blocks itself exactly as it lays the key out), or, for a template that reads none,
        inline as data.reasoning_layout writes it (refused without one: the template does not show the text around
        it); the tool role as the template spells it; content as parts where it reads parts."""
        m = {k: v for k, v in m.items() if k not in _LOSS_KEYS}
        key = self.reasoning.key
        reasoning = m.get("reasoning_content")
        if reasoning is None and key and m["role"] == "assistant" and not self.reasoning.inline_native:
            split = inline_reasoning(m.get("content") or "")
            if split:  # an inline trace is given to a template that reads reasoning as reasoning
                m = {**m, "reasoning_content": split[0], "content": split[1]}
                reasoning = split[0]
        if reasoning is not None and key != "reasoning_content":
            m = {k: v for k, v in m.items() if k != "reasoning_content"}
            if key:
                m[key] = reasoning
            elif reasoning.strip():
                m["content"] = prepend_text(m["content"], self._user_layout(
                    "it reads no reasoning key for reasoning_content").around(reasoning.strip()))
        if m["role"] == "tool" and self.traits.tool_role not in (None, "tool"):
            m["role"] = self.traits.tool_role
        if self.traits.parts:  # a tool result's part also names its tool (MiniMax-M1 reads content[i]['name'])
            m["content"] = as_parts(m.get("content"), m.get("name") if m["role"] != "assistant" else None)
        return m

    def _user_layout(self, what: str) -> ReasoningLayout:
        """data.reasoning_layout, for a template that does not show how it lays out reasoning; a DataError
        without it."""
        if self.options.reasoning_layout:
            return user_layout(self.options.reasoning_layout)
        raise DataError(f"{self.place}: the chat template of {self.name} does not show how the model lays out "
                        f"reasoning ({what}), so that text cannot be read from the template. Set data.reasoning_layout "
                        "to the model's own layout (e.g. '<think>\\n{reasoning}\\n</think>\\n\\n' for DeepSeek-R1 and "
                        "QwQ), write the trace inline in the content as the model writes it (<think>...</think> before "
                        "the answer), or set data.ignore_fields: [reasoning_content] to train the answers alone.")

    def opened_turn(self, messages: list[Message], i: int, before: str, through: str) -> str | None:
        """Turn ``i`` as the model writes it after a generation prompt that opens a reasoning block the template's
        finished turn does not hold (GLM-4.7's '<think>' before '</think>answer', DeepSeek-R1's '<think>\\n' before
        an answer whose trace it drops): ``reasoning + between + answer`` in the layout read from the template (the
        turn rendered with a marker trace), else in the record's own inline block, else data.reasoning_layout;
        refused in one line where none gives it. None when ``before`` is not such a prompt."""
        message = messages[i]
        reasoning = (message.get("reasoning_content") or "").strip()
        split = inline_reasoning(message.get("content") or "") if not reasoning else None
        traced = reasoning or (split[0].strip() if split else "")
        if self.reasoning.key and self.reasoning.layout:  # the template's layout, around this very turn
            answer_only = {**message, "content": split[1]} if split else message
            marked = {**answer_only, "reasoning_content": _TRACE}
            shown = self.apply(messages[:i] + [marked], False)
            if shown.startswith(before) and _TRACE in shown[len(before):]:
                return before + shown[len(before):].replace(_TRACE, traced, 1)
        layout = data_layout(message["content"], split[0], split[1]) if split else None
        if layout is None:
            # No layout of the template's or the record's own: without data.reasoning_layout, refused where the
            # prompt opens a think block (the usual tag, only to choose which refusal explains it), else the
            # caller's refusal of a template whose prefixes render unstably.
            if not self.options.reasoning_layout and self._opens(before, through, None) is None:
                return None
            layout = self._user_layout(f"the think block its generation prompt opens before assistant turn {i}"
                                       f"{'' if traced else ', which has none'}")
        head = self._opens(before, through, layout)
        if head is None:
            return None
        answer, between = through[len(head):], layout.between
        close = between.strip()
        if close and answer.lstrip().startswith(close):
            # The template writes the close itself (DeepSeek-V3.1's thinking mode): its text from there on.
            between, answer = between[:between.index(close)], answer.lstrip()
        elif between[-1:].isspace():  # the separator is the layout's, not the answer's
            answer = answer.lstrip()
        pad, have = layout.lead[len(layout.lead.rstrip()):], before[len(before.rstrip()):]
        return before + (pad[len(have):] if pad.startswith(have) else "") + traced + between + answer

    def after_prompt_block(self, messages: list[Message], i: int, before: str, through: str) -> str | None:
        """Turn ``i`` after a generation prompt that ends in a block the finished turn does not hold, where the
        template itself drops that block from an answer written after it (Gemma-4's empty thought channel,
        '<|channel>thought\\n<channel|>', which its prompt writes with thinking off and its turns strip): the prompt,
        then what the finished turn writes after the text the two share, as the model writes it at inference. None
        otherwise (a block the template keeps in answers, or one it opens and leaves open: ``opened_turn``)."""
        at = next((k for k, (a, b) in enumerate(zip(before, through)) if a != b), min(len(before), len(through)))
        block, message = before[at:], messages[i]
        if not block.strip() or not isinstance(message.get("content"), (str, list)):
            return None
        shown = self.apply(messages[:i] + [{**message, "content": prepend_text(message["content"], block)}], False)
        return before + through[at:] if shown == through else None

    @staticmethod
    def _opens(before: str, through: str, layout: ReasoningLayout | None) -> str | None:
        """The text before the block ``before`` opens (its lead, e.g. '<think>\\n', ends it) when ``through`` (the
        finished turn) continues from there; None otherwise."""
        tags = [layout.lead.strip()] if layout else ["<think>", "<thinking>"]
        for tag in (t for t in tags if t):
            body = before.rstrip()
            if body.endswith(tag) and through.startswith(body[:-len(tag)]):
                return body[:-len(tag)]
        return None

    def check_rendered(self, messages: list[Message]) -> None:
        """A DataError when the template leaves out a tool result or a tool definition of the conversation."""
        if not self.tools and not any(m["role"] == "tool" for m in messages):
            return
        text = self.apply(messages, False)
        for j, m in enumerate(messages):
            if m["role"] == "tool" and any(part.strip() not in text for part in content_texts(m["content"])):
                raise DataError(f"{self.place}: message {j} has role 'tool', but the chat template of {self.name} does "
                                f"not render tool messages (its text is missing from the result; roles tried: "
                                f"{', '.join(TOOL_ROLES)}). Remove the tool turns, or set data.chat_template to a "
                                "template with a tool role.")
        if not self.tools:
            return
        names = [(tool.get("function") or tool).get("name") for tool in self.tools]
        # A template without tools renders the same text with and without them (a tool call can name a tool anyway).
        bare = ChatTemplate(self.tokenizer, self.place, options=self.options).apply(messages, False)
        missing = next((name for name in names if name and name not in text), None)
        if missing or bare == text:
            raise DataError(f"{self.place}: the chat template of {self.name} does not render the 'tools' column (the "
                            f"definition{f' of {missing!r}' if missing else 's'} would be missing). Set "
                            "data.chat_template to a template that takes tools, or data.ignore_fields: [tools] to "
                            "train without them.")

    def with_stop(self, messages: list[Message], i: int, before: str, turn: str) -> str:
        """Turn ``i`` with the token that stops it. A template that writes no end-of-turn token after an answer but
        opens the next turn with its header (GLM's '<|user|>', which the model's generation config stops at) would
        leave the turn without a stop to learn: the text the template writes after the turn when the conversation
        goes on (the next message, or a probe user message after the last), up to that header token, joins it."""
        answer_end, call_end = _end_tokens(self.tokenizer, self.source)
        ends = [t for t in (answer_end, call_end, self.tokenizer.eos_token) if t]
        if not ends or any(turn.endswith(t) for t in ends):
            return turn
        following = messages[i + 1:i + 2] or [{"role": "user", "content": "anyfit-probe-next"}]
        try:
            more = self.apply(messages[: i + 1] + following, False)
        except DataError:  # a template that takes no message here: nothing to learn from it
            return turn
        # Where the turn ends in the longer text: right after ``before + turn``, or, in a template that renders the
        # turn otherwise once the conversation goes on (its think block dropped), after the turn's last characters.
        if more.startswith(before + turn):
            at = len(before) + len(turn)
        else:
            tail = turn[-40:]
            at = more.rfind(tail, 0, more.rfind(str(following[0].get("content") or "")) if following[0].get(
                "content") else len(more))
            at = at + len(tail) if at >= 0 else -1
        found = re.match(r"\s*(?:" + "|".join(re.escape(t) for t in ends) + ")", more[at:]) if at >= 0 else None
        if not found:  # the template writes no stop there (a tool result follows an answer, say)
            return turn
        self.next_header_stop += 1
        return turn + (found.group() if more.startswith(before + turn) else found.group().lstrip())

    def check_turn(self, turn: str, message: Message, index: int) -> None:
        """A DataError when a trained turn's text lacks the reasoning or a tool call its message holds."""
        reasoning = (message.get("reasoning_content") or "").strip()
        inline = inline_reasoning(message.get("content") or "") if not reasoning else None
        if reasoning and reasoning not in turn:
            raise DataError(f"{self.place}: the chat template of {self.name} does not render the reasoning of "
                            f"assistant turn {index} (it would train the turn without it"
                            f"{', with an empty think block' if '<think>' in turn else ''}). Switch the template's "
                            "thinking mode on with data.chat_template_kwargs where it has one, set data.chat_template "
                            "to a template that renders reasoning_content, or set data.ignore_fields: "
                            "[reasoning_content] to train the answers alone.")
        if inline and inline[0].strip() and inline[0].strip() not in turn and not self.options.cut_reasoning_ok:
            raise DataError(f"{self.place}: the chat template of {self.name} cuts the reasoning written inline "
                            f"(<think>...</think>) from assistant turn {index} (it would train the answer without "
                            "it). Switch the template's thinking mode on with data.chat_template_kwargs where it has "
                            "one, set data.chat_template to a template that keeps it, or set data.ignore_fields: "
                            "[reasoning_content] to train the answers alone.")
        for call in message.get("tool_calls") or ():
            name = call["function"]["name"]
            if name not in turn:
                raise DataError(f"{self.place}: the chat template of {self.name} does not render the tool call "
                                f"{name!r} of assistant turn {index} (it would train the turn without the call). Set "
                                "data.chat_template to a template that renders tool_calls.")


def chat_parts(messages: list[Message], trained_turns: list[int], chat: ChatTemplate) -> list[list[Segment]]:
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
            through = (chat.opened_turn(messages, i, before, through)
                       or chat.after_prompt_block(messages, i, before, through) or through)
        if not through.startswith(before):
            at = next((k for k, (a, b) in enumerate(zip(before, through)) if a != b), len(before))
            raise DataError(
                f"{chat.place}: the chat template of {chat.name} renders the conversation before assistant turn {i} "
                f"differently once the turn is added ({before[max(0, at - 30):at + 30]!r} becomes "
                f"{through[max(0, at - 30):at + 30]!r}; some templates add e.g. '<think>' to the generation prompt "
                "only), so the trained span cannot be found. Use data.template=trl (TRL's rule: the loss starts where "
                "the token ids differ), or a tokenizer whose chat template renders prefixes stably.")
        if not before.startswith(done):  # earlier turns now render otherwise: this turn is an example of its own
            parts.append(segments)
            segments, done = [], ""
        turn = chat.with_stop(messages, i, before, through[len(before):].rstrip())
        chat.check_turn(turn, messages[i], i)
        segments.append(Segment(before[len(done):], trained=False))
        segments += _turn_segments(turn, messages[i], chat)
        done = before + turn
    if not trained_turns:  # nothing to learn; kept so the caller can count and report it
        segments.append(Segment(chat.apply(messages, False), trained=False))
    parts.append(segments)
    return parts


_END_TOKENS: dict[str, tuple[str | None, str | None]] = {}


def _end_tokens(tokenizer: PreTrainedTokenizerBase, source: str) -> tuple[str | None, str | None]:
    """(the token that ends an answer, the one that ends a tool-call turn) in this template
    (``anyfit.data.stopping.turn_ends``: GLM's next-turn header is one), probed once per template."""
    if source not in _END_TOKENS:
        _END_TOKENS[source] = turn_ends(tokenizer)
    return _END_TOKENS[source]


def _turn_segments(turn: str, message: Message, chat: ChatTemplate) -> list[Segment]:
    """The turn as one trained piece; without ``train_reasoning``, its reasoning and the text closing it (the
    layout's ``between``) masked. A turn without reasoning that starts with the empty block the layout writes
    (Qwen3's '<think>\\n\\n</think>\\n\\n', or GLM's '</think>' after a prompt that opened it) has that block masked
    unless data.train_empty_think: the data holds no reasoning to learn there, and training it teaches the model to
    skip thinking (``chat.empty_think`` counts these turns)."""
    reasoning = (message.get("reasoning_content") or "").strip()
    split = inline_reasoning(message.get("content") or "") if not reasoning else None
    reasoning = reasoning or (split[0].strip() if split else "")
    layout = chat.reasoning.layout or (user_layout(chat.options.reasoning_layout)
                                       if chat.options.reasoning_layout else None)
    if not reasoning:
        empty = next((e for e in (layout.empty, layout.between) if e.strip() and turn.startswith(e)), None) \
            if layout else None
        if empty and len(empty) < len(turn):
            chat.empty_think += 1
            if not chat.options.train_empty_think:
                return [Segment(turn[:len(empty)], trained=False), Segment(turn[len(empty):], trained=True)]
        return [Segment(turn, trained=True)]
    if chat.options.train_reasoning:
        return [Segment(turn, trained=True)]
    own = data_layout(message["content"], split[0], split[1]) if split else None
    end = next((e for e in ((lay.end_of(turn, reasoning) if lay else None) for lay in (layout, own)) if e), None)
    if end is None:
        return [Segment(turn, trained=True)]
    return [Segment(turn[:end], trained=False), Segment(turn[end:], trained=True)]


def _string_arguments(m: Message) -> Message:
    if not m.get("tool_calls"):
        return m
    calls = [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"],
                                                                          ensure_ascii=False)}}
             for c in m["tool_calls"]]
    return {**m, "tool_calls": calls}


def use_chat_template(tokenizer: PreTrainedTokenizerBase, given: str | None) -> None:
    """Put data.chat_template (a .jinja file, or the template text itself) in place of the tokenizer's own, so that
    training, eval, generate and the tokenizer saved with the run (and so the export) all render with it."""
    if not given:
        return
    if "{{" in given or "{%" in given:  # the template text itself
        text, name = given, "data.chat_template"
    else:
        path = Path(given).expanduser()
        if not path.is_file():
            raise DataError(f"data.chat_template={given!r} is neither a file nor template text (no '{{{{' or '{{%'): "
                            "give the path of a .jinja file or the template itself.")
        text, name = path.read_text(encoding="utf-8"), f"data.chat_template ({path.name})"
    if unbaked(getattr(tokenizer, "chat_template", None)) != text:
        tokenizer.chat_template = text
    tokenizer.anyfit_chat_template = name


# The run's template options written into the template as its defaults (``serve_as_trained``), between markers so
# that a template already carrying them (a run resumed from its own saved tokenizer) is not given them twice.
_DEFAULTS = "{#- anyfit: data.chat_template_kwargs, this run's options, as the template's defaults -#}\n"
_DEFAULTS_END = "{#- anyfit: end of the run's defaults -#}\n"


def serve_as_trained(tokenizer: PreTrainedTokenizerBase, given: str | None, options: dict[str, Any]) -> None:
    """data.chat_template in place (``use_chat_template``), and the run's template options (data.chat_template_kwargs)
    written into the template as the defaults of its variables, so that the tokenizer saved with every checkpoint,
    the final model and the export renders as training did for a server that passes nothing (transformers,
    vLLM, llama.cpp reading chat_template.jinja); one that passes an option still overrides it. Rendering with the
    options passed, as training does, is unchanged: each default is set only where the variable is not defined."""
    use_chat_template(tokenizer, given)
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return
    if isinstance(template, dict):  # named variants (a 'tool_use' one is picked when tools are passed): all of them
        tokenizer.chat_template = {n: with_defaults(t, options) for n, t in template.items()}
    else:
        tokenizer.chat_template = with_defaults(template, options)


def with_defaults(template: str, options: dict[str, Any]) -> str:
    """``template`` with ``options`` as the defaults of its variables (any earlier defaults of anyfit's replaced)."""
    template = unbaked(template)
    if not options:
        return template
    guards = []
    for key, value in sorted(options.items()):
        if not key.isidentifier():
            raise DataError(f"data.chat_template_kwargs: {key!r} is not a name a chat template can read; use the "
                            "variable's name as the template spells it.")
        guards.append(f"{{%- if {key} is not defined %}}{{%- set {key} = {_jinja_literal(value, key)} %}}{{%- endif %}}")
    return _DEFAULTS + "".join(guards) + "\n" + _DEFAULTS_END + template


def unbaked(template: Any) -> Any:
    """``template`` without the defaults ``with_defaults`` wrote into it (anything else as it is)."""
    if isinstance(template, str) and template.startswith(_DEFAULTS) and _DEFAULTS_END in template:
        return template.split(_DEFAULTS_END, 1)[1]
    return template


def _jinja_literal(value: Any, key: str) -> str:
    """``value`` as a Jinja literal (strings, numbers, booleans, none, lists and mappings of them)."""
    if value is None or isinstance(value, bool):
        return {None: "none", True: "true", False: "false"}[value]
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_jinja_literal(v, key) for v in value) + "]"
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return "{" + ", ".join(f"{json.dumps(k)}: {_jinja_literal(v, key)}" for k, v in value.items()) + "}"
    raise DataError(f"data.chat_template_kwargs: {key}={value!r} cannot be written into the chat template as a default "
                    "(strings, numbers, booleans, null, lists and mappings of them can).")


def template_name(tokenizer: PreTrainedTokenizerBase) -> str:
    """How errors name the chat template: data.chat_template's file (or 'data.chat_template'), else the tokenizer's
    name."""
    given = getattr(tokenizer, "anyfit_chat_template", None)
    if given:
        return given
    name = getattr(tokenizer, "name_or_path", "") or ""
    return repr(Path(name).name or name) if name else "the tokenizer"


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
