r"""Templates: how an ``Example`` is laid out as text, split into masked and trained segments.

``data.template`` is one of

- ``chat``: the tokenizer's chat template; every assistant turn is trained;
- ``plain``: the prompt, a newline (unless the prompt already ends in whitespace), then the completion;
- ``r1_zero``: the R1-Zero prompt used for Qwen2.5-Math SFT on MATH; the completion becomes
  ``{solution} </think> <answer> {answer} </answer>`` with the answer from the ``answer`` field or the
  solution's last ``\boxed{...}``;
- any string containing ``{prompt}`` (the completion follows the filled-in string directly).

Segments stay text here; ``anyfit.data.tokenization`` tokenizes each one separately, so the prompt tokens
are exactly those the model is given at generation time (``render_prompt``).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from anyfit.evaluation.answers import extract_boxed
from anyfit.config import DataConfig
from anyfit.data.sources import DataError
from anyfit.data.formats import Example, Message

R1_ZERO_PROMPT = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. "
    "The Assistant first thinks about the reasoning process in the mind and then provides the User with the "
    "answer. The reasoning process is enclosed within <think> </think> and answer is enclosed within <answer> "
    "</answer> tags, respectively, i.e., <think> reasoning process here </think> <answer> answer here </answer>.\n"
    "User: {prompt}\n"
    "Assistant: <think>"
)
R1_ZERO_COMPLETION = "{solution} </think> <answer> {answer} </answer>"
NAMED_TEMPLATES = ("chat", "plain", "r1_zero")


class MissingAnswer(DataError):
    """An r1_zero example with neither an ``answer`` field nor a ``\\boxed{}`` answer (dropped and counted)."""


@dataclass(frozen=True)
class Segment:
    """A piece of the rendered text; ``trained`` pieces carry loss under ``train_on: completion``."""

    text: str
    trained: bool


@dataclass(frozen=True)
class Rendering:
    """An example as segments. ``add_special_tokens``: put the tokenizer's leading special tokens (BOS)
    first; false for chat templates, which write their own."""

    segments: list[Segment]
    add_special_tokens: bool


def check_template(cfg: DataConfig) -> None:
    """Fail early on a template that is neither a known name nor a string with ``{prompt}``."""
    if cfg.template not in NAMED_TEMPLATES and "{prompt}" not in cfg.template:
        raise DataError(f"data.template={cfg.template!r} is not one of {', '.join(NAMED_TEMPLATES)} and has no "
                        "'{prompt}' placeholder; a custom template looks like 'Question: {prompt}\\nAnswer: '.")


def render(example: Example, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig) -> Rendering:
    """The example as masked/trained text segments, following ``cfg.template``."""
    check_template(cfg)
    if example.kind == "text":
        # Raw text is already laid out; templates only arrange prompts and completions.
        return Rendering([Segment(example.text or "", trained=True)], add_special_tokens=True)
    if cfg.template == "chat":
        messages, trained_turns = _chat_messages(example, cfg)
        return Rendering(_chat_segments(messages, trained_turns, tokenizer, example.index), add_special_tokens=False)
    prompt, completion = _single_turn(example, cfg)
    if cfg.template == "r1_zero":
        answer = reference_answer(example)
        if answer is None:
            raise MissingAnswer(f"Record {example.index}: r1_zero needs an answer, but there is no 'answer' field "
                                "and the completion has no \\boxed{...}; map one with data.fields: {answer: ...}.")
        completion = R1_ZERO_COMPLETION.format(solution=completion.strip(), answer=answer)
    return Rendering([Segment(_text_prompt(prompt, cfg), trained=False), Segment(completion, trained=True)],
                     add_special_tokens=True)


def render_prompt(example: Example, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig) -> str:
    """The text the model is given to generate this example's (last) answer, as in training.

    For chat templates the text already holds the template's special tokens: tokenize it with
    ``add_special_tokens=False``. ``anyfit.data.tokenization.prompt_token_ids`` gives the exact ids.
    """
    check_template(cfg)
    if example.kind == "text":
        raise DataError(f"Record {example.index} is plain text: it has no prompt to generate from.")
    if cfg.template == "chat":
        messages, trained_turns = _chat_messages(example, cfg)
        if not trained_turns:
            raise DataError(f"Record {example.index} has no assistant turn to generate.")
        return _apply_chat_template(tokenizer, messages[: trained_turns[-1]], True, example.index)
    prompt, _ = _single_turn(example, cfg)
    return _text_prompt(prompt, cfg)


def reference_answer(example: Example) -> str | None:
    r"""The short answer of an example: its ``answer`` field, else the completion's last ``\boxed{...}``."""
    if example.answer is not None and example.answer.strip():
        return example.answer.strip()
    completion = example.completion
    if completion is None and example.messages and example.messages[-1]["role"] == "assistant":
        completion = example.messages[-1]["content"]
    return extract_boxed(completion) if completion else None


def _text_prompt(prompt: str, cfg: DataConfig) -> str:
    if cfg.template == "plain":
        # A newline keeps question and answer apart ("2+2?\n4", not "2+2?4") unless the data has one.
        return prompt if not prompt or prompt[-1].isspace() else prompt + "\n"
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
            raise DataError(f"Record {example.index} is a conversation with roles {roles}; template "
                            f"{cfg.template!r} renders a single user/assistant exchange. Use data.template=chat "
                            "for multi-turn conversations.")
        prompt, completion = example.messages[-2]["content"], example.messages[-1]["content"]
    else:
        if isinstance(example.prompt, list):
            raise DataError(f"Record {example.index}: the prompt is a list of messages, which template "
                            f"{cfg.template!r} cannot lay out; use data.template=chat or a string prompt.")
        prompt, completion = example.prompt or "", example.completion or ""
    if system:
        # Silently dropping a system prompt would change the task without a word; say so instead.
        raise DataError(f"Record {example.index} has a system prompt, which only data.template=chat renders. "
                        "Unset data.system_prompt (or the 'system' field), or write it into a custom template.")
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


def _chat_segments(messages: list[Message], trained_turns: list[int], tokenizer: PreTrainedTokenizerBase,
                   index: int) -> list[Segment]:
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
        before = _apply_chat_template(tokenizer, messages[:i], True, index)
        through = _apply_chat_template(tokenizer, messages[: i + 1], False, index)
        if not before.startswith(done) or not through.startswith(before):
            shorter, longer = (done, before) if not before.startswith(done) else (before, through)
            at = next((k for k, (a, b) in enumerate(zip(shorter, longer)) if a != b), len(shorter))
            raise DataError(
                f"Record {index}: the tokenizer's chat template does not render this conversation incrementally: "
                f"the text before assistant turn {i} changes once the turn is added ({shorter[max(0, at - 30):at + 30]!r} "
                f"becomes {longer[max(0, at - 30):at + 30]!r}; some templates add e.g. '<think>' to the generation "
                "prompt only). The trained spans cannot be found. Use a custom data.template with {prompt} that "
                "writes the template's prompt text, or a tokenizer whose chat template renders prefixes stably.")
        segments.append(Segment(before[len(done):], trained=False))
        turn = through[len(before):].rstrip()
        segments.append(Segment(turn, trained=True))
        done = before + turn
    if not trained_turns:  # nothing to learn; kept so the caller can count and report it
        segments.append(Segment(_apply_chat_template(tokenizer, messages, False, index), trained=False))
    return segments


def _apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[Message], generation_prompt: bool,
                         index: int) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("The tokenizer has no chat template, so data.template=chat cannot be used. Choose "
                        "data.template=plain, r1_zero or a custom string with {prompt}, or set model.tokenizer "
                        "to one that has a chat template.")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:  # jinja raises its own errors (e.g. "roles must alternate") from template code
        raise DataError(f"Record {index}: the chat template failed on this conversation: {e}") from e
