"""Dataset formats: raw records in, one canonical ``Example`` out.

Four formats are understood (the taxonomy TRL uses too):

- ``messages``: a conversation, a list of ``{role, content}`` (ShareGPT's ``{from, value}`` is accepted);
- ``prompt_completion``: ``prompt`` (a string, or a list of messages) and ``completion`` (a string);
- ``text``: plain text, trained on as a whole;
- ``tokens``: already tokenized, ``input_ids`` (a list of token ids) and optionally ``completion_mask``
  (1 where the loss is taken, TRL's name and meaning); without a mask every token is trained on.

``data.fields`` maps anyfit's field names to the dataset's column names, e.g.
``{prompt: problem, completion: solution}`` for MATH. How an Example becomes tokens is decided later,
in ``anyfit.data.templates`` and ``anyfit.data.tokenization``.

Messages are checked here, record by record: each is ``{"role": str, "content": str}`` with a role in
``ROLES``. A role a chat template does not know would otherwise vanish from the rendered text without a word.
Every error names the record and, for records read from a file, its place (``data.jsonl:12``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from anyfit.config import DataConfig
from anyfit.data.sources import DataError, Records

Format = Literal["messages", "prompt_completion", "text", "tokens"]
Message = dict[str, str]

# The fields each format needs, in anyfit's names.
REQUIRED: dict[str, tuple[str, ...]] = {
    "messages": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
    "tokens": ("input_ids",),
}
OPTIONAL = ("system", "answer")
# The roles of the chat-template convention. 'tool' is accepted here; whether the tokenizer's chat template
# renders tool turns is checked when it is applied (anyfit.data.templates).
ROLES = ("system", "user", "assistant", "tool")

# ShareGPT-style conversations (``{"from": "human", "value": ...}``) are common on the hub.
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system", "tool": "tool"}


@dataclass(frozen=True)
class Example:
    """One training example in canonical form.

    ``kind`` says which fields are set: ``messages``; ``prompt`` + ``completion``; ``text``; or ``input_ids``.
    ``system`` and ``answer`` are optional extras (a system prompt, a short reference answer).
    ``index`` is the record's position in the loaded data and ``origin`` where it was read from
    (``data.jsonl:12``, when known), both for error messages.
    """

    kind: Format
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
    made on the data set's first record (format, mapped fields) are made in its first batch only, and later
    batches take the format found there (``cfg.format`` set to it)."""
    if not records:
        raise DataError("No records to read: the dataset is empty.")
    locate = records.locate if isinstance(records, Records) else None
    first = _place(start, locate and locate(0))
    fmt = detect_format(records[0], cfg, first.lower()) if cfg.format == "auto" else cfg.format
    columns = _columns(fmt, cfg.fields)
    if start == 0:
        _check_fields(records[0], fmt, columns, first)
        # An optional field mapped by name but absent from the data is most likely a typo in data.fields.
        absent = [f"{name}: {cfg.fields[name]}" for name in OPTIONAL
                  if name in cfg.fields and cfg.fields[name] not in records[0]]
        if absent:
            raise DataError(f"data.fields maps {', '.join(absent)}, but record 0 has no such field; its fields are "
                            f"{_field_list(records[0])}.")
    return [_to_example(record, start + i, locate and locate(i), fmt, columns) for i, record in enumerate(records)]


def _place(index: int, origin: str | None) -> str:
    return f"Record {index} ({origin})" if origin else f"Record {index}"


def detect_format(record: Mapping[str, Any], cfg: DataConfig, place: str = "record 0") -> Format:
    """The format whose fields (after the ``data.fields`` mapping) the record has: messages > prompt_completion >
    text > tokens. ``place`` names the record in the error."""
    if not isinstance(record, Mapping):
        raise DataError(f"{place} must be a mapping of fields, got {_short(record)}.")
    for fmt in ("messages", "prompt_completion", "text", "tokens"):
        columns = _columns(fmt, cfg.fields)
        if all(columns[name] in record for name in REQUIRED[fmt]):
            return fmt
    unmatched = [f"{name}: {column}" for name, column in cfg.fields.items() if column not in record]
    hint = f" (data.fields maps {', '.join(unmatched)}, but there is no such field)" if unmatched else ""
    raise DataError(
        f"Could not tell the data format from the fields of {place}: found {_field_list(record)}{hint}. anyfit "
        "reads 'messages' (a conversation), 'prompt' + 'completion', 'text', or 'input_ids' (pre-tokenized). "
        f"Map your columns to these names in the config, e.g. data.fields: {_suggest_mapping(record)}.")


def _columns(fmt: Format, fields: Mapping[str, str]) -> dict[str, str]:
    """anyfit field name -> the dataset's column name, for the format's fields and the optional extras.

    An optional field that is not mapped defaults to a column of its own name, unless that column is
    already used for another field (GSM8K maps completion: answer; its 'answer' is not a short answer).
    """
    columns = {name: fields.get(name, name) for name in REQUIRED[fmt]}
    for name in OPTIONAL:
        if name in fields:
            columns[name] = fields[name]
        elif name not in columns.values():
            columns[name] = name
    return columns


def _check_fields(record: Mapping[str, Any], fmt: Format, columns: Mapping[str, str], place: str) -> None:
    if not isinstance(record, Mapping):  # records handed over in code rather than read from a file
        raise DataError(f"{place} must be a mapping of fields, got {_short(record)}.")
    missing = [f"'{columns[name]}'" + (f" (for {name})" if columns[name] != name else "")
               for name in REQUIRED[fmt] if columns[name] not in record]
    if missing and fmt == "tokens":  # not mappable: the column names are TRL's
        raise DataError(f"{place} has no field 'input_ids' needed by format 'tokens' (pre-tokenized data: "
                        f"'input_ids' and optionally 'completion_mask'). Its fields are {_field_list(record)}; set "
                        "data.format to the format of the data, or auto.")
    if missing:
        raise DataError(
            f"{place} has no field {' or '.join(missing)} needed by format '{fmt}'. Its fields are "
            f"{_field_list(record)}. Map your column names in the config, e.g. data.fields: "
            f"{_suggest_mapping(record, fmt)}, or set data.format.")


def _to_example(record: Mapping[str, Any], index: int, origin: str | None, fmt: Format,
                columns: Mapping[str, str]) -> Example:
    place = _place(index, origin)
    _check_fields(record, fmt, columns, place)
    system = _optional_str(record, columns.get("system"), place)
    answer = _optional_str(record, columns.get("answer"), place)
    if fmt == "messages":
        messages = _messages(record[columns["messages"]], place, columns["messages"])
        return Example("messages", index, messages=messages, system=system, answer=answer, origin=origin)
    if fmt == "prompt_completion":
        prompt = record[columns["prompt"]]
        prompt = _messages(prompt, place, columns["prompt"]) if isinstance(prompt, list) else _string(
            prompt, place, columns["prompt"], "a string or a list of messages")
        completion = _completion(record[columns["completion"]], place, columns["completion"])
        return Example("prompt_completion", index, prompt=prompt, completion=completion, system=system, answer=answer,
                       origin=origin)
    if fmt == "tokens":
        input_ids = _ids(record[columns["input_ids"]], place, columns["input_ids"])
        mask = record.get("completion_mask")
        mask = None if mask is None else _ids(mask, place, "completion_mask")
        if mask is not None and (len(mask) != len(input_ids) or any(m not in (0, 1) for m in mask)):
            raise DataError(f"{place}: 'completion_mask' must be a list of 0/1, one per token of "
                            f"'{columns['input_ids']}' ({len(input_ids)} tokens), got {_short(mask)}.")
        return Example("tokens", index, input_ids=input_ids, completion_mask=mask, origin=origin)
    text = _string(record[columns["text"]], place, columns["text"], "a string")
    return Example("text", index, text=text, origin=origin)


def _ids(value: Any, place: str, column: str) -> list[int]:
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value
    raise DataError(f"{place}: '{column}' must be a non-empty list of integer token ids, got {_short(value)}.")


def _messages(value: Any, place: str, column: str) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{place}: '{column}' must be a non-empty list of {{\"role\": ..., \"content\": ...}} "
                        f"messages, got {_short(value)}.")
    messages = []
    for j, m in enumerate(value):
        where = f"{place}: message {j} of '{column}'"
        sharegpt = isinstance(m, Mapping) and "from" in m and "value" in m and "role" not in m
        if sharegpt:
            m = {"role": _SHAREGPT_ROLES.get(str(m["from"]).lower(), m["from"]), "content": m["value"]}
        if not isinstance(m, Mapping):
            raise DataError(f"{where} must be an object {{\"role\": ..., \"content\": ...}}, got {_short(m)}.")
        if "role" not in m or "content" not in m:
            absent = " and ".join(repr(k) for k in ("role", "content") if k not in m)
            raise DataError(f"{where} has no {absent}; each message needs both, got {_short(m)}.")
        role = m["role"]
        if role not in ROLES:
            hint = " (ShareGPT's human/gpt are mapped to user/assistant)" if sharegpt else ""
            raise DataError(f"{where} has role {_short(role)}; the roles are {', '.join(ROLES)}{hint}. Rename "
                            "the role in the data.")
        content = m["content"]
        if isinstance(content, list):
            raise DataError(f"{where} has a list of content parts; anyfit trains on text: join the text parts "
                            "into one string.")
        messages.append({"role": role, "content": _text(content, f"{where}: 'content'", "a string", numbers=False)})
    return messages


def _completion(value: Any, place: str, column: str) -> str:
    # TRL's conversational prompt-completion stores the completion as [{"role": "assistant", ...}].
    if isinstance(value, list) and len(value) == 1:
        (m,) = _messages(value, place, column)
        if m["role"] == "assistant":
            return m["content"]
    return _string(value, place, column, "a string")


def _string(value: Any, place: str, column: str, expected: str) -> str:
    return _text(value, f"{place}: '{column}'", expected)


def _text(value: Any, where: str, expected: str, numbers: bool = True) -> str:
    """``value`` as training text: a string, or (``numbers``) a finite number written out (GSM8K-style answers)."""
    if isinstance(value, str):
        # A JSON escape such as "\ud800" without its pair gives a string that is not text and that no
        # tokenizer accepts; caught here, where the record is known.
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise DataError(f"{where} holds an unpaired surrogate {value[e.start]!r} (a \\uXXXX escape in the "
                                "JSON without its pair), which is not text; fix or remove it.") from None
        return value
    if numbers and isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            raise DataError(f"{where} is {value!r}, not text: a missing value? Fill it in or drop the record.")
        return str(value)
    if value is None:
        raise DataError(f"{where} is null; it must be {expected}. Fill it in or drop the record.")
    raise DataError(f"{where} must be {expected}, got {_short(value)}.")


def _optional_str(record: Mapping[str, Any], column: str | None, place: str) -> str | None:
    value = record.get(column) if column else None
    return None if value is None else _string(value, place, column, "a string")


def _field_list(record: Mapping[str, Any]) -> str:
    return ", ".join(f"'{k}'" for k in record) or "(none)"


def _suggest_mapping(record: Mapping[str, Any], fmt: Format | None = None) -> str:
    """A ``data.fields`` example built from the record's own columns, to copy and adjust."""
    lists = [k for k, v in record.items() if isinstance(v, list) and v and isinstance(v[0], Mapping)]
    strings = [k for k, v in record.items() if isinstance(v, str)]
    if lists and fmt in (None, "messages"):
        return f"{{messages: {lists[0]}}}"
    if len(strings) >= 2 and fmt in (None, "prompt_completion"):
        return f"{{prompt: {strings[0]}, completion: {strings[1]}}}"
    if strings and fmt in (None, "text"):
        return f"{{text: {strings[0]}}}"
    return {"messages": "{messages: your_conversation_column}", "text": "{text: your_text_column}"}.get(
        fmt or "", "{prompt: your_question_column, completion: your_answer_column}")


def _short(value: Any, width: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width] + "..."
