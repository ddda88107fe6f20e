r"""Templates: how an ``Example`` is laid out as text, and which part of it carries loss.

``data.template`` is one of

- ``chat``: the tokenizer's chat template; every assistant turn is trained. A string prompt becomes a user
  message, the completion the assistant's answer.
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

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from anyfit.config import DataConfig
from anyfit.data.answers import example_gold
from anyfit.data.formats import Example, Message
from anyfit.data.sources import DataError

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
class Segment:
    """A piece of the rendered text; ``trained`` pieces carry loss under ``train_on: completion``."""

    text: str
    trained: bool


@dataclass(frozen=True)
class Rendering:
    """An example as segments, each tokenized on its own. ``add_special_tokens``: put the tokenizer's leading
    special tokens (BOS) first; false for chat templates, which write their own."""

    segments: list[Segment]
    add_special_tokens: bool


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


Rendered = Union[Rendering, Joined, TemplateMasked]


def render(example: Example, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig) -> Rendered:
    """The example laid out as ``cfg.template`` says (``cfg`` validated: ``anyfit.config.validate`` checks the template)."""
    if cfg.template == "trl":
        return _render_trl(example, tokenizer, cfg)
    if example.kind == "text":
        # Raw text is already laid out; templates only arrange prompts and completions.
        return Rendering([Segment(example.text or "", trained=True)], add_special_tokens=True)
    if cfg.template == "chat":
        messages, trained_turns = _chat_messages(example, cfg)
        _check_tool_turns(messages, tokenizer, example)
        return Rendering(_chat_segments(messages, trained_turns, tokenizer, example), add_special_tokens=False)
    prompt, completion = _single_turn(example, cfg)
    if cfg.template == "r1_zero":
        answer = example_gold(example)
        if answer is None:
            raise MissingAnswer(f"{example.place}: r1_zero needs an answer, but there is no 'answer' field and the "
                                "completion has no '#### N' or \\boxed{...}; map one with data.fields: {answer: ...}.")
        completion = R1_ZERO_COMPLETION.format(solution=completion.strip(), answer=answer)
    return Rendering([Segment(_text_prompt(prompt, cfg), trained=False), Segment(completion, trained=True)],
                     add_special_tokens=True)


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
        return _apply_chat_template(tokenizer, messages[: trained_turns[-1]], True, example)
    prompt, _ = _single_turn(example, cfg)
    return prompt if cfg.template == "trl" else _text_prompt(prompt, cfg)


def uses_chat_template(example: Example, cfg: DataConfig) -> bool:
    """Whether the example is rendered by the tokenizer's chat template (which writes its own BOS)."""
    conversational = example.kind == "messages" or isinstance(example.prompt, list)
    return cfg.template == "chat" or (cfg.template == "trl" and conversational)


def generation_template(tokenizer: PreTrainedTokenizerBase) -> str:
    """The chat template whose ``{% generation %}`` spans TRL's ``assistant_only_loss`` trains: the tokenizer's
    own if it has them, else TRL's training version of it (``trl.chat_template_utils``, for known models)."""
    own = _chat_template_text(tokenizer)
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
    """TRL's SFTTrainer layout (``_prepare_dataset`` in trl/trainer/sft_trainer.py, TRL 1.16)."""
    # TRL appends the EOS text to plain completions and texts that do not already end with it.
    eos = tokenizer.eos_token if cfg.add_eos else None
    if example.kind == "text":
        return Joined(_with_eos(example.text or "", eos), None, add_special_tokens=True)
    if not uses_chat_template(example, cfg):
        prompt, completion = _single_turn(example, cfg)
        return Joined(prompt + _with_eos(completion, eos), prompt if cfg.train_on == "completion" else None,
                      add_special_tokens=True)
    messages, _ = _chat_messages(example, cfg)
    _check_tool_turns(messages, tokenizer, example)
    if example.kind == "messages":
        if cfg.train_on == "completion":
            return TemplateMasked(messages, example.place)
        return Joined(_apply_chat_template(tokenizer, messages, False, example), None, add_special_tokens=False)
    prompt = _apply_chat_template(tokenizer, messages[:-1], True, example)
    full = _apply_chat_template(tokenizer, messages, False, example)
    return Joined(full, prompt if cfg.train_on == "completion" else None, add_special_tokens=False)


def _with_eos(text: str, eos: str | None) -> str:
    return text + eos if eos and not text.endswith(eos) else text


def _text_prompt(prompt: str, cfg: DataConfig) -> str:
    if cfg.template == "plain":
        return prompt
    template = R1_ZERO_PROMPT if cfg.template == "r1_zero" else cfg.template
    # str.replace, not str.format: custom templates and LaTeX prompts contain literal braces.
    return template.replace("{prompt}", prompt)


def _single_turn(example: Example, cfg: DataConfig) -> tuple[str, str]:
    """(prompt, completion) strings for the text templates, which have no notion of roles or turns."""
    system = example.system or cfg.system_prompt
    if example.kind == "messages":
        roles = [m["role"] for m in example.messages or []]
        if roles and roles[0] == "system":
            system, roles = example.messages[0]["content"], roles[1:]
        if roles != ["user", "assistant"]:
            raise DataError(f"{example.place} is a conversation with roles {roles}; template {cfg.template!r} renders "
                            "a single user/assistant exchange. Use data.template=chat for multi-turn conversations.")
        prompt, completion = example.messages[-2]["content"], example.messages[-1]["content"]
    else:
        if isinstance(example.prompt, list):
            raise DataError(f"{example.place}: the prompt is a list of messages, which template {cfg.template!r} "
                            "cannot lay out; use data.template=chat or a string prompt.")
        prompt, completion = example.prompt or "", example.completion or ""
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
        trained = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    else:
        prompt = example.prompt or ""
        messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        messages.append({"role": "assistant", "content": example.completion or ""})
        trained = [len(messages) - 1]  # earlier assistant turns inside a prompt are context
    system = example.system or cfg.system_prompt
    if system and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": system})
        trained = [i + 1 for i in trained]
    return messages, trained


def _check_tool_turns(messages: list[Message], tokenizer: PreTrainedTokenizerBase, example: Example) -> None:
    """Fail when the chat template leaves a 'tool' message out: templates without a tool role drop them silently."""
    if not any(m["role"] == "tool" for m in messages):
        return
    text = _apply_chat_template(tokenizer, messages, False, example)
    for j, m in enumerate(messages):
        if m["role"] == "tool" and m["content"].strip() not in text:
            raise DataError(f"{example.place}: message {j} has role 'tool', but the tokenizer's chat template does "
                            "not render tool messages (its text is missing from the result). Remove the tool turns "
                            "or use a tokenizer whose chat template has a tool role.")


def _chat_segments(messages: list[Message], trained_turns: list[int], tokenizer: PreTrainedTokenizerBase,
                   example: Example) -> list[Segment]:
    """Split a chat-templated conversation into masked and trained text by rendering it incrementally.

    For assistant turn i, the text up to it is the template applied to ``messages[:i]`` with the
    generation prompt (what the model is given at inference), and the turn itself is what
    ``messages[:i+1]`` adds. Whitespace after a turn's end token (Qwen's newline after <|im_end|>) is
    formatting between turns, so it goes to the next masked segment; after the last trained turn it is
    dropped (the model stops before it). Messages after the last assistant turn carry no loss and are
    left out. HF's ``return_assistant_tokens_mask`` is not used: it needs {% generation %} markers
    that most chat templates lack.
    """
    segments: list[Segment] = []
    done = ""  # the conversation text covered by the segments so far
    for i in trained_turns:
        before = _apply_chat_template(tokenizer, messages[:i], True, example)
        through = _apply_chat_template(tokenizer, messages[: i + 1], False, example)
        if not before.startswith(done) or not through.startswith(before):
            shorter, longer = (done, before) if not before.startswith(done) else (before, through)
            at = next((k for k, (a, b) in enumerate(zip(shorter, longer)) if a != b), len(shorter))
            raise DataError(
                f"{example.place}: the tokenizer's chat template does not render this conversation incrementally: "
                f"the text before assistant turn {i} changes once the turn is added ({shorter[max(0, at - 30):at + 30]!r} "
                f"becomes {longer[max(0, at - 30):at + 30]!r}; some templates add e.g. '<think>' to the generation "
                "prompt only). The trained spans cannot be found. Use data.template=trl (TRL's rule: the loss "
                "starts where the token ids differ), a custom data.template with {prompt} that writes the template's "
                "prompt text, or a tokenizer whose chat template renders prefixes stably.")
        segments.append(Segment(before[len(done):], trained=False))
        turn = through[len(before):].rstrip()
        segments.append(Segment(turn, trained=True))
        done = before + turn
    if not trained_turns:  # nothing to learn; kept so the caller can count and report it
        segments.append(Segment(_apply_chat_template(tokenizer, messages, False, example), trained=False))
    return segments


def _chat_template_text(tokenizer: PreTrainedTokenizerBase) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named variants: 'default' is the one apply_chat_template uses
        template = template.get("default")
    if not template:
        raise DataError("The tokenizer has no chat template, so this data cannot be rendered with data.template=chat "
                        "(or trl, for conversations). Choose data.template=plain, r1_zero or a custom string with "
                        "{prompt}, or set model.tokenizer to one that has a chat template.")
    return template


def _apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[Message], generation_prompt: bool,
                         example: Example) -> str:
    _chat_template_text(tokenizer)
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:  # jinja raises its own errors (e.g. "roles must alternate") from template code
        raise DataError(f"{example.place}: the chat template failed on this conversation: "
                        f"{' '.join(str(e).split())}") from e


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
