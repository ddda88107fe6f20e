"""Dataset formats: raw records in, one canonical ``Example`` out, and nothing of a record dropped in silence.

The formats (TRL's taxonomy, plus the instruction shape of Alpaca and its descendants):

- ``messages``: a conversation, a list of messages (``anyfit.data.messages``: OpenAI/TRL with tool calls and
  reasoning traces, ShareGPT's ``{from, value}``), in a ``messages`` or ``conversations`` column, with an optional
  ``tools`` column (function definitions, or their JSON string) handed to the chat template;
- ``prompt_completion``: ``prompt`` (a string, or a list of messages) and ``completion`` (a string);
- ``alpaca``: ``instruction``, optional ``input``, ``output``, optional ``system`` and ``history`` (earlier
  ``[instruction, response]`` pairs): the input is joined to the instruction with a newline (LLaMA-Factory's
  rule), and a record with a history becomes a conversation whose every answer is trained (LLaMA-Factory's default);
- ``text``: plain text, trained on as a whole;
- ``tokens``: already tokenized, ``input_ids`` and optionally ``completion_mask`` (1 where the loss is taken,
  TRL's name and meaning); without a mask every token is trained on.

``data.fields`` maps anyfit's field names to the dataset's column names, e.g. ``{prompt: problem, completion:
solution}`` for MATH; ``input`` can be mapped in every prompt format. How an Example becomes tokens is decided
later, in ``anyfit.data.templates`` and ``anyfit.data.tokenization``.

Every record field and message key the format does not read but that holds content is counted
(``Example.unused``, summed in the data report). One that carries training content (``CONTENT_FIELDS``: an
``input``, tool calls, a reasoning trace, ...) stops the run at the first record holding it, unless
``data.ignore_fields`` names it: training on the record without it would teach something else than its authors
meant. Every error names the record and, for records read from a file, its place (``data.jsonl:12``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from anyfit.config import DataConfig
from anyfit.data.images import IMAGE_TOKEN, ImageRef, column_images, place_images
from anyfit.data.messages import (
    ROLES,
    Message,
    has_content,
    normalize_message,
    parse_options,
    parse_tools,
    short,
    text,
)
from anyfit.data.sources import DataError, Records

__all__ = ["Example", "Format", "Message", "ROLES", "CONTENT_FIELDS", "to_examples", "detect_format",
           "resolve_fields"]

Format = Literal["messages", "prompt_completion", "alpaca", "text", "tokens"]  # FORMATS' keys (a test holds it)
# Columns that name a conversation when data.fields does not: TRL's and ShareGPT's.
CONVERSATION_COLUMNS = ("messages", "conversations")
# Record fields and message keys that carry what a model is trained to read or write: one left unread would change
# what the model learns, so it stops the run (data.ignore_fields lets it go). Other unread fields (ids, levels,
# sources) are only counted in the data report.
CONTENT_FIELDS = frozenset({
    "input", "context", "history", "instruction", "system", "system_prompt", "tools", "functions", "tool_calls",
    "function_call", "reasoning_content", "reasoning", "thinking", "labels", "images", "image", "audio", "videos",
    "video",
})
# Column pairs of well-known public data sets, for the data.fields a refusal suggests (GSM8K, MATH, Alpaca-likes,
# OpenAssistant-likes, ...), in order of preference.
KNOWN_PAIRS = (("question", "answer"), ("problem", "solution"), ("query", "response"), ("instruction", "output"),
               ("instruction", "response"), ("prompt", "response"), ("input", "output"), ("question", "response"),
               ("question", "solution"), ("problem", "answer"), ("prompt", "answer"), ("query", "answer"),
               ("input", "target"), ("source", "target"), ("prompt", "chosen"))


@dataclass(frozen=True)
class Example:
    """One training example in canonical form.

    ``kind`` says which fields are set: ``messages``; ``prompt`` + ``completion``; ``text``; or ``input_ids``.
    ``system``, ``answer``, ``tools`` and ``input`` are optional extras (a system prompt, a short reference
    answer, the function definitions of a tool-calling conversation, an Alpaca-style input the prompt templates
    join to the prompt). ``images``: where the record's images are, in the order of the ``{"type": "image"}``
    parts of its messages (then of its prompt); a message with images has a list of parts as content, one
    without keeps its string (``anyfit.data.images``). ``values``: the record's fields a custom ``data.template`` names (``{instruction}``).
    ``index`` is the record's position in the loaded data and ``origin`` where it was read from (``data.jsonl:12``,
    when known), both for error messages; ``unused``: the record's fields and message keys that hold content the
    format does not read (``messages[].id`` for a message key).
    """

    kind: Literal["messages", "prompt_completion", "text", "tokens"]
    index: int = 0
    messages: list[Message] | None = None
    prompt: str | list[Message] | None = None
    completion: str | None = None
    text: str | None = None
    system: str | None = None
    answer: str | None = None
    input_ids: list[int] | None = None
    completion_mask: list[int] | None = None
    origin: str | None = field(default=None, compare=False)
    tools: list[dict] | None = None
    input: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # the record's options for the chat template
    values: dict[str, str] = field(default_factory=dict, compare=False)
    unused: tuple[str, ...] = field(default=(), compare=False)
    images: tuple[ImageRef, ...] = ()

    @property
    def place(self) -> str:
        """The record as error messages name it: ``Record 3 (data.jsonl:5)``."""
        return _place(self.index, self.origin)

    @property
    def solution(self) -> str | None:
        """The reference solution: the completion, else the content of a final assistant turn (None if neither)."""
        if self.completion is not None:
            return self.completion
        if self.messages and self.messages[-1]["role"] == "assistant":
            return self.messages[-1]["content"]
        return None


def to_examples(records: Sequence[Mapping[str, Any]], cfg: DataConfig, start: int = 0) -> list[Example]:
    """Normalise every record to an Example, in ``cfg.format`` (detected from the first record for 'auto').

    ``start``: the index of ``records[0]`` in the whole data set, for a data set read in batches; the checks
    made on the data set's first record (format, mapped fields) are made in its first batch only; later batches
    are given ``resolve_fields``'s config (format and columns fixed)."""
    if not records:
        raise DataError("No records to read: the dataset is empty.")
    locate = records.locate if isinstance(records, Records) else None
    first = _place(start, locate and locate(0))
    fmt, columns = _format_and_columns(records[0], cfg, first)
    if start == 0:
        _check_fields(records[0], fmt, columns, first)
        # An optional field mapped by name but absent from the data is most likely a typo in data.fields.
        absent = [f"{name}: {cfg.fields[name]}" for name in FORMATS[fmt].optional + ("input",)
                  if name in cfg.fields and cfg.fields[name] not in records[0]]
        if absent:
            raise DataError(f"data.fields maps {', '.join(sorted(set(absent)))}, but record 0 has no such field; its "
                            f"fields are {_field_list(records[0])}.")
    named = _template_fields(cfg.template, records[0], cfg.fields)
    return [_to_example(record, start + i, locate and locate(i), fmt, columns, named, cfg)
            for i, record in enumerate(records)]


def resolve_fields(record: Mapping[str, Any], cfg: DataConfig) -> DataConfig:
    """``cfg`` with the format found on ``record`` (the data set's first) and every column it reads spelled out:
    what the later batches of a data set read in batches are given."""
    fmt, columns = _format_and_columns(record, cfg, "Record 0")
    named = {name: name for name in _template_fields(cfg.template, record, cfg.fields)}
    return dataclasses.replace(cfg, format=fmt, fields={**named, **columns})


def _place(index: int, origin: str | None) -> str:
    return f"Record {index} ({origin})" if origin else f"Record {index}"


def detect_format(record: Mapping[str, Any], cfg: DataConfig, place: str = "record 0") -> Format:
    """The format whose fields (after the ``data.fields`` mapping) the record has: messages > prompt_completion >
    alpaca > text > tokens. ``place`` names the record in the error."""
    if not isinstance(record, Mapping):
        raise DataError(f"{place} must be a mapping of fields, got {short(record)}.")
    for fmt, shape in FORMATS.items():
        columns = _columns(fmt, cfg.fields, record)
        if all(columns[name] in record for name in shape.required):
            return fmt
    unmatched = [f"{name}: {column}" for name, column in cfg.fields.items() if column not in record]
    hint = f" (data.fields maps {', '.join(unmatched)}, but there is no such field)" if unmatched else ""
    raise DataError(
        f"Could not tell the data format from the fields of {place}: found {_field_list(record)}{hint}. anyfit "
        "reads 'messages' or 'conversations' (a conversation), 'prompt' + 'completion', 'instruction' + 'output' "
        "(Alpaca), 'text', or 'input_ids' (pre-tokenized). Map your columns to these names in the config, e.g. "
        f"data.fields: {suggest_mapping(record)}.")


def _format_and_columns(record: Mapping[str, Any], cfg: DataConfig, place: str) -> tuple[Format, dict[str, str]]:
    fmt = detect_format(record, cfg, place[0].lower() + place[1:]) if cfg.format == "auto" else cfg.format
    return fmt, _columns(fmt, cfg.fields, record)


def _columns(fmt: Format, fields: Mapping[str, str], record: Mapping[str, Any]) -> dict[str, str]:
    """anyfit field name -> the dataset's column name, for the format's fields and the optional extras.

    An optional field that is not mapped defaults to a column of its own name, unless that column is already
    used for another field (GSM8K maps completion: answer; its 'answer' is not a short answer). A conversation
    is read from 'messages', else 'conversations' (ShareGPT)."""
    columns = {name: fields.get(name, name) for name in FORMATS[fmt].required}
    if fmt == "messages" and "messages" not in fields:
        columns["messages"] = next((c for c in CONVERSATION_COLUMNS if c in record), "messages")
    for name in FORMATS[fmt].optional:
        if name in fields:
            columns[name] = fields[name]
        elif name not in columns.values():
            columns[name] = name
    return columns


def _template_fields(template: str, record: Mapping[str, Any], fields: Mapping[str, str]) -> tuple[str, ...]:
    """The record fields a custom ``data.template`` names as ``{field}`` besides ``{prompt}``: those of the data
    set's first record (so the braces of LaTeX in a template are left alone), which ``resolve_fields`` hands on to
    later batches in ``data.fields``."""
    if "{" not in template:
        return ()
    known = [k for k in record if isinstance(k, str)] + list(fields.values())
    return tuple(dict.fromkeys(k for k in known if k != "prompt" and "{" + k + "}" in template))


def _check_fields(record: Mapping[str, Any], fmt: Format, columns: Mapping[str, str], place: str) -> None:
    if not isinstance(record, Mapping):  # records handed over in code rather than read from a file
        raise DataError(f"{place} must be a mapping of fields, got {short(record)}.")
    missing = [f"'{columns[name]}'" + (f" (for {name})" if columns[name] != name else "")
               for name in FORMATS[fmt].required if columns[name] not in record]
    if missing and fmt == "tokens":  # not mappable: the column names are TRL's
        raise DataError(f"{place} has no field 'input_ids' needed by format 'tokens' (pre-tokenized data: "
                        f"'input_ids' and optionally 'completion_mask'). Its fields are {_field_list(record)}; set "
                        "data.format to the format of the data, or auto.")
    if missing:
        raise DataError(
            f"{place} has no field {' or '.join(missing)} needed by format '{fmt}'. Its fields are "
            f"{_field_list(record)}. Map your column names in the config, e.g. data.fields: "
            f"{suggest_mapping(record, fmt)}, or set data.format.")


def _to_example(record: Mapping[str, Any], index: int, origin: str | None, fmt: Format, columns: Mapping[str, str],
                named: tuple[str, ...], cfg: DataConfig) -> Example:
    place = _place(index, origin)
    _check_fields(record, fmt, columns, place)
    # Ignored fields (data.ignore_fields) are left unread, and so counted in the report with the other unread ones.
    shape = FORMATS[fmt]
    read = ({columns[n] for n in (*shape.required, *shape.optional) if n in columns} | set(named)) \
        - set(cfg.ignore_fields)
    unused = [k for k, v in record.items() if k not in read and has_content(v)]
    system, answer = (_optional_str(record, columns.get(name), place) for name in ("system", "answer"))
    values = {k: _string(record[k], place, k, "a string") if has_content(record[k]) else "" for k in named
              if k in record}
    extras = dict(system=system, answer=answer, origin=origin, values=values)
    if "tools" in columns and columns["tools"] not in cfg.ignore_fields:
        extras["tools"] = parse_tools(record.get(columns["tools"]), f"{place}: '{columns['tools']}'")
    if "chat_template_kwargs" in columns and has_content(record.get(columns["chat_template_kwargs"])):
        extras["chat_template_kwargs"] = parse_options(record[columns["chat_template_kwargs"]],
                                                       f"{place}: '{columns['chat_template_kwargs']}'")
    example = shape.read(Reading(record, index, fmt, columns, place, extras, cfg.ignore_fields, unused))
    if example.kind in ("messages", "prompt_completion") and (
            any(columns.get(name) in record for name in _MEDIA) or _has_parts(example)):
        example = _with_images(example, record, columns, place, cfg.ignore_fields, getattr(origin, "folder", None))
    _refuse_content(unused, cfg, place, fmt)
    return example if not unused else _with_unused(example, unused)


def _with_images(example: Example, record: Mapping[str, Any], columns: Mapping[str, str], place: str,
                 ignore: Sequence[str], folder: str | None) -> Example:
    """The example with its images in canonical form (``anyfit.data.images.place_images``): from its image parts
    and its ``images`` / ``image`` column (``given``: None when the record has no such column); ``folder``: where
    the record's relative image paths are taken from (the data file's; None: the current directory)."""
    read = {name: columns[name] for name in ("images", "image", "videos", "video")
            if name in columns and columns[name] not in ignore and columns[name] in record}
    for name in ("videos", "video"):
        if has_content(record.get(read.get(name))):
            raise DataError(f"{place} has {read[name]!r}: video records are not trained yet; leave them out of the "
                            f"data, or set data.ignore_fields: [{read[name]}] to train on the text without them.")
    held = [read[n] for n in ("images", "image") if n in read and has_content(record[read[n]])]
    if len(held) > 1:
        raise DataError(f"{place} has images in both {held[0]!r} and {held[1]!r}; give them in one column.")
    column = held[0] if held else read.get("images", read.get("image"))
    given = None if column is None else column_images(record[column]) or []
    if example.kind == "messages":
        conversation, messages = columns.get("messages", "messages"), example.messages or []
    else:
        conversation = columns["prompt"] if "prompt" in columns else columns.get("instruction", "prompt")
        messages = example.prompt
        if isinstance(messages, str):
            if given is None or not (given or IMAGE_TOKEN in messages):
                return example
            # The prompt is the user's message, as chat templates are given it (with an Alpaca input joined).
            text = messages + "\n" + example.input if example.input else messages
            example, messages = dataclasses.replace(example, input=None), [{"role": "user", "content": text}]
    if given is None and not any(isinstance(m["content"], list) for m in messages):
        return example  # text only: the common case
    out, refs = place_images(messages, given, column or "images", conversation, place, folder)
    if not refs and out is messages:
        return example
    if example.kind == "messages":
        return dataclasses.replace(example, messages=out, images=refs)
    return dataclasses.replace(example, prompt=out, images=refs)


def _has_parts(example: Example) -> bool:
    """Whether a message of the example has content parts (an image part: text parts are joined when read)."""
    messages = example.messages if example.kind == "messages" else example.prompt
    return isinstance(messages, list) and any(type(m["content"]) is list for m in messages)


def _with_unused(example: Example, unused: list[str]) -> Example:
    return dataclasses.replace(example, unused=tuple(dict.fromkeys(unused)))


@dataclass(frozen=True)
class Reading:
    """One record on its way to an ``Example``: what every shape's reader is handed. ``extras``: the optional
    fields read the same way for every shape (system, answer, tools, ...); ``unused``: the record's unread content,
    to which a reader adds the unread keys of the messages it reads."""

    record: Mapping[str, Any]
    index: int
    fmt: str
    columns: Mapping[str, str]
    place: str
    extras: dict
    ignore: Sequence[str]
    unused: list[str]


def _text(r: Reading) -> Example:
    return Example("text", r.index, text=_string(r.record[r.columns["text"]], r.place, r.columns["text"], "a string"),
                   origin=r.extras["origin"], values=r.extras["values"])


def _conversation(r: Reading) -> Example:
    messages, keys = _messages(r.record[r.columns["messages"]], r.place, r.columns["messages"], r.ignore)
    r.unused.extend(keys)
    return Example("messages", r.index, messages=messages, **r.extras)


def _prompt_completion(r: Reading) -> Example:
    """The record's prompt and completion; the unread keys of messages given as a prompt or completion are added to
    ``unused``."""
    record, index, fmt, columns, place, extras, ignore, unused = (r.record, r.index, r.fmt, r.columns, r.place,
                                                                   r.extras, r.ignore, r.unused)
    prompt_col, completion_col = (columns["instruction"], columns["output"]) if fmt == "alpaca" else (
        columns["prompt"], columns["completion"])
    prompt = record[prompt_col]
    if isinstance(prompt, list):
        prompt, keys = _messages(prompt, place, prompt_col, ignore)
        unused += keys
    else:
        prompt = _string(prompt, place, prompt_col, "a string or a list of messages")
    completion = _completion(record[completion_col], place, completion_col, ignore, unused)
    # An input the custom template names is filled in there (Example.values), not joined to the prompt.
    user_input = None if columns.get("input") in extras["values"] else _optional_str(record, columns.get("input"),
                                                                                       place) or None
    history = record.get(columns.get("history", "")) if "history" in columns else None
    if not history:
        return Example("prompt_completion", index, prompt=prompt, completion=completion, input=user_input, **extras)
    # Alpaca's history: earlier exchanges, each trained as LLaMA-Factory trains them by default.
    if not isinstance(history, list) or not all(isinstance(h, (list, tuple)) and len(h) == 2 for h in history):
        raise DataError(f"{place}: '{columns['history']}' must be a list of [instruction, response] pairs, got "
                        f"{short(history)}.")
    messages = []
    for k, (query, response) in enumerate(history):
        messages += [{"role": "user", "content": _string(query, place, f"{columns['history']}[{k}][0]", "a string")},
                     {"role": "assistant", "content": _string(response, place, f"{columns['history']}[{k}][1]",
                                                              "a string")}]
    if isinstance(prompt, list):
        raise DataError(f"{place} has both a conversation as its prompt and a '{columns['history']}'; give one of them.")
    query = prompt + "\n" + user_input if user_input else prompt
    messages += [{"role": "user", "content": query}, {"role": "assistant", "content": completion}]
    return Example("messages", index, messages=messages, **extras)


def _tokens(r: Reading) -> Example:
    record, columns, place = r.record, r.columns, r.place
    input_ids = _ids(record[columns["input_ids"]], place, columns["input_ids"])
    mask_col = columns.get("completion_mask", "completion_mask")
    mask = record.get(mask_col)
    mask = None if mask is None else _ids(mask, place, mask_col)
    if mask is not None and (len(mask) != len(input_ids) or any(m not in (0, 1) for m in mask)):
        raise DataError(f"{place}: '{mask_col}' must be a list of 0/1, one per token of "
                        f"'{columns['input_ids']}' ({len(input_ids)} tokens), got {short(mask)}.")
    return Example("tokens", r.index, input_ids=input_ids, completion_mask=mask, origin=r.extras["origin"])


@dataclass(frozen=True)
class Shape:
    """One data shape: the fields it needs and the optional ones it reads (anyfit's names, which data.fields maps
    to a data set's columns), and its reader."""

    required: tuple[str, ...]
    optional: tuple[str, ...]
    read: Callable[[Reading], Example]


_EXTRAS = ("system", "answer", "tools", "chat_template_kwargs")
_MEDIA = ("images", "image", "videos", "video")  # read by _with_images
# Every data shape anyfit reads, in the order auto-detection tries them (messages > prompt_completion > alpaca >
# text > tokens). A new shape is one row here and its reader; config.schema's data.format takes these names.
FORMATS: dict[str, Shape] = {
    "messages": Shape(("messages",), (*_EXTRAS, *_MEDIA), _conversation),
    "prompt_completion": Shape(("prompt", "completion"), ("input", *_EXTRAS, *_MEDIA), _prompt_completion),
    "alpaca": Shape(("instruction", "output"), ("input", "system", "history", "answer", "tools",
                                                 "chat_template_kwargs", *_MEDIA), _prompt_completion),
    "text": Shape(("text",), (), _text),
    "tokens": Shape(("input_ids",), ("completion_mask",), _tokens),
}


def _refuse_content(unused: list[str], cfg: DataConfig, place: str, fmt: Format) -> None:
    """Stop at a field or message key that carries training content the format does not read (see module doc)."""
    ignored = set(cfg.ignore_fields)
    for name in unused:
        key = name.split("[].")[-1]  # a message key is named 'messages[].weight'
        if key in CONTENT_FIELDS and name not in ignored and key not in ignored:
            # input is the slot for text that goes with the prompt (Alpaca's input, Dolly's context).
            how = (f"map it with data.fields: {{input: {key}}}" if key in ("input", "context") else
                   "map it in data.fields, or give the data in a shape that holds it (see the README's data table)")
            raise DataError(f"{place} has {name!r}, which holds content that format {fmt!r} (with data.fields "
                            f"{dict(cfg.fields) or '{}'}) does not read: training without it would teach something "
                            f"else than the data says. {how[0].upper() + how[1:]}; or set data.ignore_fields: "
                            f"[{name}] to train without it.")


def _ids(value: Any, place: str, column: str) -> list[int]:
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value
    raise DataError(f"{place}: '{column}' must be a non-empty list of integer token ids, got {short(value)}.")


def _messages(value: Any, place: str, column: str, ignore: Sequence[str] = ()) -> tuple[list[Message], list[str]]:
    """The conversation in canonical form, and the message keys with content that were not read
    (``conversations[].weight``); ``ignore``: the keys (``data.ignore_fields``) left out."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{place}: '{column}' must be a non-empty list of {{\"role\": ..., \"content\": ...}} "
                        f"messages, got {short(value)}.")
    messages, unused = [], []
    for j, m in enumerate(value):
        message, keys = normalize_message(m, f"{place}: message {j} of '{column}'", frozenset(ignore))
        messages.append(message)
        unused += [f"{column}[].{k}" for k in keys]
    return messages, unused


def _completion(value: Any, place: str, column: str, ignore: Sequence[str], unused: list[str]) -> str:
    # TRL's conversational prompt-completion stores the completion as [{"role": "assistant", ...}].
    if isinstance(value, list) and len(value) == 1:
        (m,), keys = _messages(value, place, column, ignore)
        if isinstance(m["content"], list):
            raise DataError(f"{place}: '{column}' holds an image; a completion is text. Give the record as "
                            "'messages' (the prompt's turns, then the assistant's) to train a turn with an image.")
        if m["role"] == "assistant" and not m.get("tool_calls") and not m.get("reasoning_content"):
            unused += keys
            return m["content"]
    return _string(value, place, column, "a string")


def _string(value: Any, place: str, column: str, expected: str) -> str:
    return text(value, f"{place}: '{column}'", expected)


def _optional_str(record: Mapping[str, Any], column: str | None, place: str) -> str | None:
    value = record.get(column) if column else None
    return None if value is None else _string(value, place, column, "a string")


def _field_list(record: Mapping[str, Any]) -> str:
    return ", ".join(f"'{k}'" for k in record) or "(none)"


def suggest_mapping(record: Mapping[str, Any], fmt: Format | None = None) -> str:
    """A ``data.fields`` example built from the record's own columns, to copy and adjust: a conversation column;
    else a pair of well-known column names (question/answer, problem/solution, ...); else the two columns with the
    longest text."""
    lists = [k for k, v in record.items() if isinstance(v, list) and v and isinstance(v[0], Mapping)]
    strings = [k for k, v in record.items() if isinstance(v, str)]
    if lists and fmt in (None, "messages"):
        return f"{{messages: {lists[0]}}}"
    if len(strings) >= 2 and fmt in (None, "prompt_completion", "alpaca"):
        lower = {k.lower(): k for k in strings}
        pair = next(((lower[p], lower[c]) for p, c in KNOWN_PAIRS if p in lower and c in lower), None)
        if pair is None:  # the two longest texts, in the record's order
            longest = sorted(strings, key=lambda k: -len(record[k]))[:2]
            pair = tuple(k for k in strings if k in longest)
        context = next((lower[c] for c in ("input", "context") if c in lower and lower[c] not in pair), None)
        extra = f", input: {context}" if context else ""
        return f"{{prompt: {pair[0]}, completion: {pair[1]}{extra}}}"
    if strings and fmt in (None, "text"):
        return f"{{text: {strings[0]}}}"
    return {"messages": "{messages: your_conversation_column}", "text": "{text: your_text_column}"}.get(
        fmt or "", "{prompt: your_question_column, completion: your_answer_column}")
