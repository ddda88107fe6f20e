r"""Templates: how an ``Example`` is laid out as text, and which part of it carries loss.

``data.template`` is one of

- ``chat``: the tokenizer's chat template (or data.chat_template, with data.chat_template_kwargs); every assistant
  turn is trained (``data.train_on=last_turn``: the final one; a turn with weight 0 or loss/train false is context).
  A string prompt becomes a user message, the completion the assistant's answer.
- ``plain``: the prompt then the completion, exactly as written: the text is ``prompt + completion`` with
  nothing added between them (a separator, a space or a newline, belongs in the data or in a custom template);
- ``trl``: the records as TRL's ``SFTTrainer`` tokenizes them (its default settings; ``data.train_on`` picks its
  completion-only / assistant-only loss), for results comparable token for token (see below);
- ``r1_zero``: the R1-Zero prompt used for Qwen2.5-Math SFT on MATH; the completion becomes
  ``{solution} </think> <answer> {answer} </answer>`` with the example's gold answer
  (``anyfit.data.answers.example_gold``: the ``answer`` field, else the solution's ``#### N`` or last
  ``\boxed{...}``), the very answer ``anyfit eval`` grades against;
- any string containing ``{prompt}`` (the completion follows the filled-in string directly).

For all but ``trl`` the result is a ``Rendering``: text segments that ``anyfit.data.tokenization`` tokenizes
one by one, so the prompt's tokens are exactly those the model is given at generation time
(``render_prompt``), and a prompt/completion pair is ``tokens(prompt) + tokens(completion)``. Plain text
(the ``text`` format) is one trained segment under every template.

``trl`` gives a ``Joined`` text (or, for conversations trained on their assistant turns, a ``TemplateMasked``
conversation), tokenized whole as TRL does:

- prompt/completion strings: ``prompt + completion + EOS`` (the tokenizer's EOS text, unless the completion
  already ends with it) is tokenized with the tokenizer's special tokens (BOS); the loss starts at the first
  token where these ids differ from those of the prompt tokenized alone. Tokens can merge across the
  boundary (``"Answer: " + "Paris"``): the merged token is then trained and the prompt seen in training ends
  differently from the one given at generation, as in TRL;
- a prompt given as messages: the chat template applied to the prompt with the generation prompt, and to
  the prompt plus the assistant completion; the same first-difference rule; no EOS added (the template
  ends the turn);
- messages: the chat template applied to the whole conversation. ``data.train_on=all`` trains every token
  (TRL's default for conversations); ``completion`` trains the template's ``{% generation %}`` spans (TRL's
  ``assistant_only_loss``), with TRL's training version of the template when the tokenizer's has no such
  markers (that needs TRL installed);
- text: ``text + EOS``, tokenized with special tokens, every token trained.

``data.add_eos=false`` leaves the EOS text out; a system prompt (``data.system_prompt`` or a ``system`` field)
is put first in a conversation as with ``chat`` (TRL has no such setting).

Which ``data.template`` values exist is checked once, with the config (``anyfit.config.NAMED_TEMPLATES``, checked by
``anyfit.config.validate``), not per example.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from anyfit.config import DataConfig
from anyfit.data.answers import example_gold
from anyfit.data.chat import ChatTemplate, Segment, TemplateOptions, chat_parts, default_system_prompt, template_text
from anyfit.data.formats import Example, Message
from anyfit.data.sources import DataError

__all__ = ["Segment", "Rendering", "PromptLayout", "Joined", "TemplateMasked", "Rendered", "MissingAnswer", "render",
           "render_prompt", "uses_chat_template", "generation_template", "default_system_prompt", "R1_ZERO_PROMPT"]

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

R1_ZERO_PROMPT = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. "
    "The Assistant first thinks about the reasoning process in the mind and then provides the User with the "
    "answer. The reasoning process is enclosed within <think> </think> and answer is enclosed within <answer> "
    "</answer> tags, respectively, i.e., <think> reasoning process here </think> <answer> answer here </answer>.\n"
    "User: {prompt}\n"
    "Assistant: <think>"
)
R1_ZERO_COMPLETION = "{solution} </think> <answer> {answer} </answer>"
# {% generation %} ... {% endgeneration %} marks the assistant's tokens in a chat template (HF's assistant mask);
# the whitespace-trim variants ({%- generation -%}) count too.
_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


class MissingAnswer(DataError):
    """An r1_zero example without a gold answer: no ``answer`` field, and no ``#### N`` or ``\\boxed{}`` in its
    solution (dropped and counted)."""


@dataclass(frozen=True)
class Rendering:
    """An example as segments. ``add_special_tokens``: put the tokenizer's leading special tokens (BOS) first; false
    for chat templates, which write their own. ``whole``: the segments' text is tokenized once, as inference
    tokenizes a rendered conversation, and the loss mask comes from where the trained segments lie in it (chat
    templates); otherwise each segment is tokenized on its own (text templates: the prompt's ids are those the model
    is given when it generates)."""

    segments: list[Segment]
    add_special_tokens: bool
    whole: bool = False
    notes: tuple[str, ...] = ()  # what the data report says of it (``anyfit.data.audit.NOTES``)


@dataclass(frozen=True)
class Joined:
    """TRL's layout: ``text`` is tokenized whole (with the tokenizer's special tokens when ``add_special_tokens``);
    the loss starts where its ids stop matching those of ``prompt`` tokenized the same way, and covers every
    token when ``prompt`` is None."""

    text: str
    prompt: str | None
    add_special_tokens: bool


@dataclass(frozen=True)
class TemplateMasked:
    """A conversation tokenized by the chat template itself, the loss on the template's ``{% generation %}``
    spans (TRL's ``assistant_only_loss``); ``place`` names the record for errors."""

    messages: list[Message]
    place: str
    tools: list[dict] | None = None
    kwargs: dict | None = None  # data.chat_template_kwargs, the record's over them


Rendered = Union[Rendering, Joined, TemplateMasked]


def render(example: Example, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig) -> list[Rendered]:
    """The example laid out as ``cfg.template`` says (``cfg`` validated: ``anyfit.config.validate`` checks the
    template): one rendering, or several when a chat template renders a conversation's earlier turns differently
    later on (``anyfit.data.chat``), each then an example of its own."""
    if cfg.template == "trl":
        return [_render_trl(example, tokenizer, cfg)]
    if example.kind == "text":
        # Raw text is already laid out; templates only arrange prompts and completions.
        return [Rendering([Segment(example.text or "", trained=True)], add_special_tokens=True)]
    if cfg.template == "chat":
        messages, trained_turns = _chat_messages(example, cfg)
        chat = _chat(tokenizer, example, cfg)
        parts = chat_parts(messages, trained_turns, chat)
        empty = "empty_think_trained" if cfg.train_empty_think else "empty_think_masked"
        notes = (empty,) if chat.empty_think else ()
        notes += ("next_header_stop",) if chat.next_header_stop else ()
        return [Rendering(segments, add_special_tokens=False, whole=True, notes=notes) for segments in parts]
    prompt, completion = _single_turn(example, cfg)
    if cfg.template == "r1_zero":
        answer = example_gold(example)
        if answer is None:
            raise MissingAnswer(f"{example.place}: r1_zero needs an answer, but there is no 'answer' field and the "
                                "completion has no '#### N' or \\boxed{...}; map one with data.fields: {answer: ...}.")
        completion = R1_ZERO_COMPLETION.format(solution=completion.strip(), answer=answer)
    return [Rendering([Segment(_text_prompt(prompt, cfg, example), trained=False), Segment(completion, trained=True)],
                      add_special_tokens=True)]


def render_prompt(example: Example, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig) -> str:
    """The text the model is given to generate this example's (last) answer, as in training.

    When ``uses_chat_template`` the text already holds the template's special tokens: tokenize it with
    ``add_special_tokens=False``. ``anyfit.data.tokenization.prompt_token_ids`` gives the exact ids.
    """
    if example.kind in ("text", "tokens"):
        raise DataError(f"{example.place} is {'plain text' if example.kind == 'text' else 'pre-tokenized'}: it has "
                        "no prompt to generate from.")
    if uses_chat_template(example, cfg):
        messages, trained_turns = _chat_messages(example, cfg)
        if not trained_turns:
            raise DataError(f"{example.place} has no assistant turn to generate.")
        chat = _chat(tokenizer, example, cfg)
        return chat.apply(messages[: trained_turns[-1]], True)
    prompt, _ = _single_turn(example, cfg)
    return prompt if cfg.template == "trl" else _text_prompt(prompt, cfg, example)


@dataclass(frozen=True)
class PromptLayout:
    """How a prompt is laid out for the model, as a run laid out its training prompts: ``data.template``, the system
    prompt and what becomes of it where the chat template has no system role, and the chat template's options: what
    ``anyfit generate`` reproduces for a run (``PromptLayout.of`` the run's saved config). A new layout setting is a
    field here and in ``of``."""

    template: str = "chat"
    system_prompt: str | None = None
    system_fallback: str = "refuse"
    options: dict[str, Any] = field(default_factory=dict, hash=False)  # data.chat_template_kwargs

    @classmethod
    def of(cls, data: DataConfig, **changes: Any) -> PromptLayout:
        """The layout ``data`` trains with (``changes``: fields set otherwise, e.g. another system prompt)."""
        made = cls(data.template, data.system_prompt, data.system_fallback, dict(data.chat_template_kwargs))
        return dataclasses.replace(made, **changes)

    def data_config(self) -> DataConfig:
        """The data settings that render a prompt this way (``prompt_token_ids``)."""
        return DataConfig(template=self.template, system_prompt=self.system_prompt,
                          system_fallback=self.system_fallback, chat_template_kwargs=dict(self.options))


def template_options(example: Example, cfg: DataConfig) -> TemplateOptions:
    """How this example meets the chat template: data.chat_template_kwargs with the record's own over them, and the
    data.* settings ``anyfit.data.chat.TemplateOptions`` names."""
    return TemplateOptions({**cfg.chat_template_kwargs, **(example.chat_template_kwargs or {})}, cfg.system_fallback,
                           cfg.train_empty_think, cfg.train_reasoning, "reasoning_content" in cfg.ignore_fields,
                           cfg.reasoning_layout)


def _chat(tokenizer, example: Example, cfg: DataConfig) -> ChatTemplate:
    """The chat template as ``example`` is rendered: with its tools, and the run's and its own template options."""
    return ChatTemplate(tokenizer, example.place, example.tools, template_options(example, cfg))


def uses_chat_template(example: Example, cfg: DataConfig) -> bool:
    """Whether the example is rendered by the tokenizer's chat template (which writes its own BOS)."""
    conversational = example.kind == "messages" or isinstance(example.prompt, list)
    return cfg.template == "chat" or (cfg.template == "trl" and conversational)


def generation_template(tokenizer: PreTrainedTokenizerBase) -> str:
    """The chat template whose ``{% generation %}`` spans TRL's ``assistant_only_loss`` trains: the tokenizer's
    own if it has them, else TRL's training version of it (``trl.chat_template_utils``, for known models)."""
    own = template_text(tokenizer)
    if _GENERATION_MARKER.search(own):
        return own
    why = ("data.template=trl with data.train_on=completion on conversations is TRL's assistant_only_loss, which "
           "needs a chat template with {% generation %} markers; this tokenizer's has none")
    try:
        from trl.chat_template_utils import get_training_chat_template
    except ImportError:
        raise DataError(f"{why}, and TRL, which ships marked versions of common templates, is not installed. Set "
                        "data.train_on=all (TRL's default for conversations: every token trained) or use "
                        "data.template=chat (assistant turns found by rendering).") from None
    try:
        return get_training_chat_template(tokenizer) or own
    except ValueError:
        raise DataError(f"{why}, and TRL has no marked version of it. Set data.train_on=all (TRL's default for "
                        "conversations: every token trained), use data.template=chat (assistant turns found by "
                        "rendering), or give a tokenizer whose chat template has the markers.") from None


def _render_trl(example: Example, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig) -> Joined | TemplateMasked:
    """TRL's SFTTrainer layout (``_prepare_dataset`` in trl/trainer/sft_trainer.py, TRL 1.16): the record's
    ``tools`` and every message key go to the chat template as they are."""
    # TRL appends the EOS text to plain completions and texts that do not already end with it.
    eos = tokenizer.eos_token if cfg.add_eos else None
    if example.kind == "text":
        return Joined(_with_eos(example.text or "", eos), None, add_special_tokens=True)
    if not uses_chat_template(example, cfg):
        prompt, completion = _single_turn(example, cfg)
        return Joined(prompt + _with_eos(completion, eos), prompt if cfg.train_on == "completion" else None,
                      add_special_tokens=True)
    messages, _ = _chat_messages(example, cfg)
    unweighted = next((j for j, m in enumerate(messages) if m.get("weight") == 0), None)
    if unweighted is not None:
        raise DataError(f"{example.place}: message {unweighted} is marked as context (weight 0, or loss/train: false), "
                        "but TRL trains every assistant turn "
                        "(data.template=trl); use data.template=chat, which keeps it out of the loss.")
    chat = _chat(tokenizer, example, cfg)
    chat.check_rendered(messages)
    if example.kind == "messages":
        if cfg.train_on == "completion":
            return TemplateMasked(messages, example.place, example.tools, chat.options.kwargs)
        return Joined(chat.apply(messages, False), None, add_special_tokens=False)
    prompt = chat.apply(messages[:-1], True)
    full = chat.apply(messages, False)
    return Joined(full, prompt if cfg.train_on == "completion" else None, add_special_tokens=False)


def _with_eos(text: str, eos: str | None) -> str:
    return text + eos if eos and not text.endswith(eos) else text


def _text_prompt(prompt: str, cfg: DataConfig, example: Example) -> str:
    """The prompt laid out by a text template. A custom template may name record fields (``{instruction}``,
    ``{input}``) besides ``{prompt}``; a paragraph (text between blank lines) whose fields are all empty is left out,
    as Alpaca's prompt leaves out its '### Input:' paragraph for a record without input."""
    if cfg.template == "plain":
        return prompt
    template = R1_ZERO_PROMPT if cfg.template == "r1_zero" else cfg.template
    values = {"prompt": prompt, **example.values}
    if example.values:
        paragraphs = template.split("\n\n")
        template = "\n\n".join(p for p in paragraphs if not (
            (named := [v for k, v in values.items() if "{" + k + "}" in p]) and not any(v.strip() for v in named)))
    # str.replace, not str.format: custom templates and LaTeX prompts contain literal braces.
    for key, value in values.items():
        template = template.replace("{" + key + "}", value)
    return template


def _single_turn(example: Example, cfg: DataConfig) -> tuple[str, str]:
    """(prompt, completion) strings for the text templates, which have no notion of roles or turns."""
    system = example.system or cfg.system_prompt
    if example.tools:
        raise DataError(f"{example.place} has tool definitions ('tools'), which only a chat template renders; use "
                        "data.template=chat (or trl).")
    if example.kind == "messages":
        messages = example.messages or []
        roles = [m["role"] for m in messages]
        if roles and roles[0] == "system":
            system, roles = messages[0]["content"], roles[1:]
        if roles != ["user", "assistant"]:
            raise DataError(f"{example.place} is a conversation with roles {roles}; template {cfg.template!r} renders "
                            "a single user/assistant exchange. Use data.template=chat for multi-turn conversations.")
        last = messages[-1]
        if last.get("tool_calls") or last.get("reasoning_content"):
            what = "tool calls" if last.get("tool_calls") else "a reasoning trace"
            raise DataError(f"{example.place}: the assistant turn has {what}, which template {cfg.template!r} cannot "
                            "lay out; use data.template=chat.")
        prompt, completion = messages[-2]["content"], last["content"]
    else:
        if isinstance(example.prompt, list):
            raise DataError(f"{example.place}: the prompt is a list of messages, which template {cfg.template!r} "
                            "cannot lay out; use data.template=chat or a string prompt.")
        prompt, completion = example.prompt or "", example.completion or ""
        if example.input:
            prompt = prompt + "\n" + example.input
    if system:
        # Silently dropping a system prompt would change the task without a word; say so instead.
        raise DataError(f"{example.place} has a system prompt, which only data.template=chat renders (and trl, for "
                        "conversations). Unset data.system_prompt (or the 'system' field), or write it into a custom "
                        "template.")
    return prompt, completion


def _chat_messages(example: Example, cfg: DataConfig) -> tuple[list[Message], list[int]]:
    """The full conversation and the indices of the assistant turns that carry loss."""
    if example.kind == "messages":
        messages = list(example.messages or [])
        trained = [i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("weight", 1)]
        if cfg.train_on == "last_turn":  # the final assistant turn only (when its own weight lets it train)
            last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
            trained = [i for i in trained if i == last]
    else:
        prompt = example.prompt or ""
        if example.input and isinstance(prompt, str):
            prompt = prompt + "\n" + example.input  # LLaMA-Factory's join of an Alpaca input to its instruction
        messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        messages.append({"role": "assistant", "content": example.completion or ""})
        trained = [len(messages) - 1]  # earlier assistant turns inside a prompt are context
    system = example.system or cfg.system_prompt
    if system and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": system})
        trained = [i + 1 for i in trained]
    return messages, trained
