"""Dataset formats: raw records in, one canonical ``Example`` out.

Three formats are understood (the taxonomy TRL uses too):

- ``messages``: a conversation, a list of ``{role, content}`` (ShareGPT's ``{from, value}`` is accepted);
- ``prompt_completion``: ``prompt`` (a string, or a list of messages) and ``completion`` (a string);
- ``text``: plain text, trained on as a whole;
- ``tokens``: already tokenized, ``input_ids`` (a list of token ids) and optionally ``completion_mask``
  (1 where the loss is taken, TRL's name and meaning); without a mask every token is trained on.

``data.fields`` maps anyfit's field names to the dataset's column names, e.g.
``{prompt: problem, completion: solution}`` for MATH. How an Example becomes tokens is decided later,
in ``anyfit.data.templates`` and ``anyfit.data.tokenization``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from anyfit.config import DataConfig
from anyfit.data.sources import DataError

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

# ShareGPT-style conversations (``{"from": "human", "value": ...}``) are common on the hub.
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system", "tool": "tool"}


@dataclass(frozen=True)
class Example:
    """One training example in canonical form.

    ``kind`` says which fields are set: ``messages``; ``prompt`` + ``completion``; or ``text``.
    ``system`` and ``answer`` are optional extras (a system prompt, a short reference answer).
    ``index`` is the record's position in the loaded data, for error messages.
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


def to_examples(records: Sequence[Mapping[str, Any]], cfg: DataConfig) -> list[Example]:
    """Normalise every record to an Example, in ``cfg.format`` (detected from the first record for 'auto')."""
    if not records:
        raise DataError("No records to read: the dataset is empty.")
    fmt = detect_format(records[0], cfg) if cfg.format == "auto" else cfg.format
    columns = _columns(fmt, cfg.fields)
    _check_fields(records[0], fmt, columns, index=0)
    # An optional field mapped by name but absent from the data is most likely a typo in data.fields.
    absent = [f"{name}: {cfg.fields[name]}" for name in OPTIONAL
              if name in cfg.fields and cfg.fields[name] not in records[0]]
    if absent:
        raise DataError(f"data.fields maps {', '.join(absent)}, but record 0 has no such field; its fields are "
                        f"{_field_list(records[0])}.")
    return [_to_example(record, i, fmt, columns) for i, record in enumerate(records)]


def detect_format(record: Mapping[str, Any], cfg: DataConfig) -> Format:
    """The format whose fields (after the ``data.fields`` mapping) the record has: messages > prompt_completion > text."""
    for fmt in ("messages", "prompt_completion", "text", "tokens"):
        columns = _columns(fmt, cfg.fields)
        if all(columns[name] in record for name in REQUIRED[fmt]):
            return fmt
    unmatched = [f"{name}: {column}" for name, column in cfg.fields.items() if column not in record]
    hint = f" (data.fields maps {', '.join(unmatched)}, but there is no such field)" if unmatched else ""
    raise DataError(
        f"Could not tell the data format from the fields of record 0: found {_field_list(record)}{hint}. anyfit "
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


def _check_fields(record: Mapping[str, Any], fmt: Format, columns: Mapping[str, str], index: int) -> None:
    missing = [f"'{columns[name]}'" + (f" (for {name})" if columns[name] != name else "")
               for name in REQUIRED[fmt] if columns[name] not in record]
    if missing:
        raise DataError(
            f"Record {index} has no field {' or '.join(missing)} needed by format '{fmt}'. Its fields are "
            f"{_field_list(record)}. Map your column names in the config, e.g. data.fields: "
            f"{_suggest_mapping(record, fmt)}, or set data.format.")


def _to_example(record: Mapping[str, Any], index: int, fmt: Format, columns: Mapping[str, str]) -> Example:
    _check_fields(record, fmt, columns, index)
    system = _optional_str(record, columns.get("system"), index)
    answer = _optional_str(record, columns.get("answer"), index)
    if fmt == "messages":
        messages = _messages(record[columns["messages"]], index, columns["messages"])
        return Example("messages", index, messages=messages, system=system, answer=answer)
    if fmt == "prompt_completion":
        prompt = record[columns["prompt"]]
        prompt = _messages(prompt, index, columns["prompt"]) if isinstance(prompt, list) else _string(
            prompt, index, columns["prompt"], "a string or a list of messages")
        completion = _completion(record[columns["completion"]], index, columns["completion"])
        return Example("prompt_completion", index, prompt=prompt, completion=completion, system=system, answer=answer)
    if fmt == "tokens":
        input_ids = _ids(record[columns["input_ids"]], index, columns["input_ids"])
        mask = record.get("completion_mask")
        mask = None if mask is None else _ids(mask, index, "completion_mask")
        if mask is not None and (len(mask) != len(input_ids) or any(m not in (0, 1) for m in mask)):
            raise DataError(f"Record {index}: 'completion_mask' must be a list of 0/1, one per token of "
                            f"'{columns['input_ids']}' ({len(input_ids)} tokens), got {_short(mask)}.")
        return Example("tokens", index, input_ids=input_ids, completion_mask=mask)
    text = _string(record[columns["text"]], index, columns["text"], "a string")
    return Example("text", index, text=text)


def _ids(value: Any, index: int, column: str) -> list[int]:
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value
    raise DataError(f"Record {index}: '{column}' must be a non-empty list of integer token ids, got {_short(value)}.")


def _messages(value: Any, index: int, column: str) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise DataError(f"Record {index}: '{column}' must be a non-empty list of {{role, content}} messages, "
                        f"got {_short(value)}.")
    messages = []
    for j, m in enumerate(value):
        if isinstance(m, Mapping) and "from" in m and "value" in m and "role" not in m:
            role = _SHAREGPT_ROLES.get(str(m["from"]).lower(), str(m["from"]))
            m = {"role": role, "content": m["value"]}
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"Record {index}: message {j} of '{column}' must be {{\"role\": str, \"content\": str}}, "
                            f"got {_short(m)}.")
        messages.append({"role": m["role"], "content": m["content"]})
    return messages


def _completion(value: Any, index: int, column: str) -> str:
    # TRL's conversational prompt-completion stores the completion as [{"role": "assistant", ...}].
    if isinstance(value, list) and len(value) == 1:
        (m,) = _messages(value, index, column)
        if m["role"] == "assistant":
            return m["content"]
    return _string(value, index, column, "a string")


def _string(value: Any, index: int, column: str, expected: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # numeric answers (GSM8K-style) are fine as text
    raise DataError(f"Record {index}: '{column}' must be {expected}, got {_short(value)}.")


def _optional_str(record: Mapping[str, Any], column: str | None, index: int) -> str | None:
    value = record.get(column) if column else None
    return None if value is None else _string(value, index, column, "a string")


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
