"""One message of a conversation, as the data's authors wrote it, in the canonical form chat templates read.

The shapes found on the hub, all read without a mapping:

- OpenAI / TRL: ``{"role", "content"}``; an assistant turn may call tools, ``"tool_calls": [{"type": "function",
  "function": {"name", "arguments"}}]`` (the flat ``{"name", "arguments"}`` too, and the legacy ``function_call``),
  with ``content`` missing, null or empty; ``tool`` turns carry ``tool_call_id`` / ``name``; content may be a list
  of text parts, and of image parts (``anyfit.data.images``: such content stays a list of parts);
- reasoning: ``reasoning_content`` (Qwen3, DeepSeek), ``thinking`` (gpt-oss) or ``reasoning`` on assistant turns;
- ShareGPT: ``{"from", "value"}`` with human/gpt/system, and the tool spellings of LLaMA-Factory and Glaive:
  ``function_call`` (a JSON ``{"name", "arguments"}``: an assistant tool call) and ``observation`` (a tool result).

The canonical message is ``{"role", "content"}`` plus, where present, ``tool_calls`` (always the OpenAI form, the
arguments a JSON object: chat templates such as Qwen2.5's write them with ``tojson``, so a JSON string would be
quoted twice), ``reasoning_content``, ``name``, ``tool_call_id`` and ``weight`` (OpenAI's 0 or 1 on an assistant
turn: 0 keeps it out of the loss). Keys that hold content but that no template
reads are returned as ``unused``, so nothing disappears without being counted (``anyfit.data.fields``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from anyfit.data.records import DataError

Message = dict[str, Any]

# The roles of the chat-template convention. Whether the tokenizer's template renders tool turns is checked
# when it is applied (anyfit.data.templates).
ROLES = ("system", "user", "assistant", "tool")
# Spellings of the roles in public data sets: ShareGPT (human/gpt), LLaMA-Factory (observation, function_call),
# OpenAI's legacy 'function' role (a tool result), Gemini's 'model'.
ROLE_ALIASES = {"human": "user", "gpt": "assistant", "model": "assistant", "observation": "tool",
                "function": "tool", "function_response": "tool", "ipython": "tool", "tool_response": "tool"}
# Where a reasoning trace is kept, in order of preference; the canonical key is the first.
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
# Per-message switches that keep an assistant turn out of the loss when false (ms-swift's `loss`, and `train`).
LOSS_FLAGS = ("loss", "train")
# Message keys read here (besides the reasoning keys); the rest are reported as unused when they hold content.
_READ = {"role", "content", "from", "value", "tool_calls", "function_call", "name", "tool_call_id", "weight",
         *LOSS_FLAGS, *REASONING_KEYS}
# Content parts that hold an image (transformers' and OpenAI's) and a video; anyfit.data.images reads the first.
IMAGE_PARTS = ("image", "image_url")
VIDEO_PARTS = ("video", "video_url")
# A reasoning trace written inline at the start of an answer (DeepSeek-R1's and Qwen3's distilled traces).
_INLINE_THINK = re.compile(r"\s*<think>(.*?)</think>(.*)", re.DOTALL)


def normalize_message(m: Any, where: str, ignore: frozenset[str] = frozenset()) -> tuple[Message, list[str]]:
    """``m`` in canonical form and the names of its keys that hold content but are not read. ``where`` names the
    message in errors (``Record 3 (data.jsonl:5): message 2 of 'messages'``); ``ignore``: keys to train without
    (``data.ignore_fields``), as if absent."""
    if not isinstance(m, Mapping):
        raise DataError(f"{where} must be an object {{\"role\": ..., \"content\": ...}}, got {short(m)}.")
    if len(m) == 2 and m.get("role") in ROLES and isinstance(m.get("content"), str) and m["content"].isascii():
        return {"role": m["role"], "content": m["content"]}, []  # the common case, read on every message of a data set
    ignored = [k for k, v in m.items() if k in ignore and has_content(v)]  # counted as unread, as they are
    if ignored:
        m = {k: v for k, v in m.items() if k not in ignore}
    sharegpt = "from" in m and "role" not in m
    raw_role = m.get("from") if sharegpt else m.get("role")
    if raw_role is None:
        raise DataError(f"{where} has no 'role' (or ShareGPT 'from'); each message needs one, got {short(m)}.")
    content = m.get("value") if sharegpt else m.get("content")
    role = str(raw_role).lower() if isinstance(raw_role, str) else raw_role
    out: Message = {}
    if role == "function_call":  # LLaMA-Factory / Glaive: the value is the call itself, as JSON
        out = {"role": "assistant", "content": "", "tool_calls": _calls(_json(content, f"{where}: 'value'"), where)}
    else:
        role = ROLE_ALIASES.get(role, role)
        if role not in ROLES:
            raise DataError(f"{where} has role {short(raw_role)}; the roles are {', '.join(ROLES)} (ShareGPT's human/gpt/"
                            "observation/function_call are mapped). Rename the role in the data.")
        calls = m.get("tool_calls") or (m.get("function_call") and [m["function_call"]])
        if calls and role != "assistant":
            raise DataError(f"{where} has tool calls on a {role!r} message; only assistant turns call tools.")
        if content is None and not calls and "content" not in m and not sharegpt:
            raise DataError(f"{where} has no 'content'; each message needs one, got {short(m)}.")
        out = {"role": role, "content": _content(content, f"{where}: 'content'", empty_ok=bool(calls))}
        if calls:
            out["tool_calls"] = _calls(calls, where)
    reasoning = next((_reasoning(m[k], f"{where}: {k!r}") for k in REASONING_KEYS if has_content(m.get(k))), None)
    if reasoning is not None and reasoning.strip():
        if out["role"] != "assistant":
            raise DataError(f"{where} has a reasoning trace on a {out['role']!r} message; only assistant turns reason.")
        out["reasoning_content"] = text(reasoning, f"{where}: reasoning")
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None:
            out[key] = str(m[key])
    if m.get("weight") is not None:  # OpenAI's fine-tuning format: weight 0 keeps an assistant turn out of the loss
        if m["weight"] not in (0, 1) or isinstance(m["weight"], bool) or out["role"] != "assistant":
            raise DataError(f"{where} has weight {short(m['weight'])}; a weight is 0 or 1, on assistant turns (0: the "
                            "turn is context, not trained).")
        out["weight"] = int(m["weight"])
    for key in LOSS_FLAGS:  # ms-swift's `loss`, and `train`: false keeps an assistant turn as context
        if m.get(key) is not None:
            if not isinstance(m[key], bool) or (m[key] and out["role"] != "assistant"):
                raise DataError(f"{where} has {key}: {short(m[key])}; it is true or false, and only assistant turns "
                                "are trained (false: the turn is context).")
            if out["role"] == "assistant":
                out["weight"] = min(out.get("weight", 1), int(m[key]))
    unused = [k for k, v in m.items() if k not in _READ and has_content(v)]
    return out, ignored + unused


def inline_reasoning(content: Any) -> tuple[str, str] | None:
    """(reasoning, answer) of content that starts with a ``<think>...</think>`` block; None otherwise. The answer
    loses the whitespace after the block, as templates that split it off write it (Qwen3's ``lstrip('\\n')``)."""
    found = _INLINE_THINK.match(content) if isinstance(content, str) else None
    return (found.group(1).strip("\n"), found.group(2).lstrip("\n")) if found else None


def _reasoning(value: Any, where: str) -> str:
    """A reasoning trace as text: a string; a number written out; a list of strings (steps) joined by newlines.
    Anything else is refused: dropping it would train the answer without its reasoning."""
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(v for v in value if v.strip())
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return text(value, where)
    raise DataError(f"{where} must be text (a string, or a list of strings joined by newlines), got {short(value)}; "
                    "write the trace as text, or set data.ignore_fields to train without it.")


def parse_tools(value: Any, where: str) -> list[dict] | None:
    """A record's ``tools``: a list of JSON-schema function definitions, or that list as a JSON string (as TRL
    documents it, since Arrow cannot type free-form schemas); None when absent or empty."""
    if isinstance(value, str):
        value = _json(value, where) if value.strip() else None
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(isinstance(t, Mapping) for t in value):
        raise DataError(f"{where} must be a list of function definitions ({{\"type\": \"function\", \"function\": "
                        f"{{\"name\", \"description\", \"parameters\"}}}}), or that list as a JSON string; got "
                        f"{short(value)}.")
    return [dict(t) for t in value]


def parse_options(value: Any, where: str) -> dict[str, Any]:
    """A record's ``chat_template_kwargs``: an object of options for the chat template, or its JSON string."""
    value = _json(value, where)
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise DataError(f"{where} must be an object of chat template options (e.g. {{\"enable_thinking\": false}}) "
                        f"or its JSON string, got {short(value)}.")
    return dict(value)


def _calls(value: Any, where: str) -> list[dict]:
    calls = value if isinstance(value, list) else [value]
    out = []
    for k, call in enumerate(calls):
        at = f"{where}: tool call {k}"
        if not isinstance(call, Mapping):
            raise DataError(f"{at} must be an object {{\"type\": \"function\", \"function\": {{\"name\", "
                            f"\"arguments\"}}}}, got {short(call)}.")
        function = call.get("function") if isinstance(call.get("function"), Mapping) else call
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise DataError(f"{at} has no function name, got {short(call)}.")
        arguments = function.get("arguments", function.get("parameters", {}))
        if isinstance(arguments, str):
            arguments = _json(arguments, f"{at}: 'arguments'") if arguments.strip() else {}
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, Mapping):
            raise DataError(f"{at}: 'arguments' must be a JSON object (or its JSON string), got {short(arguments)}.")
        normal: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": dict(arguments)}}
        if call.get("id") is not None:
            normal["id"] = str(call["id"])
        out.append(normal)
    return out


def _json(value: Any, where: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as e:
        raise DataError(f"{where} is not valid JSON ({e}): {short(value)}.") from None


def _content(value: Any, where: str, empty_ok: bool) -> str | list[dict[str, Any]]:
    """Message content: a string; a list of text parts joined (OpenAI's multi-part form); '' for a tool call's
    missing or null content. A list with image parts stays a list: its text parts (adjacent ones joined) and its
    image parts as written, whose payloads ``anyfit.data.images.place_images`` takes out."""
    if value is None and empty_ok:
        return ""
    if isinstance(value, list):
        parts: list[dict[str, Any]] = []
        for p in value:
            kind = p.get("type", "text") if isinstance(p, Mapping) else None
            if kind == "text" and isinstance(p.get("text"), str):
                if parts and parts[-1]["type"] == "text":
                    parts[-1] = {"type": "text", "text": parts[-1]["text"] + p["text"]}
                else:
                    parts.append({"type": "text", "text": p["text"]})
            elif kind in IMAGE_PARTS:
                parts.append(dict(p))
            elif kind in VIDEO_PARTS:
                raise DataError(f"{where} holds a {kind!r} part: video records are not trained yet; leave the video "
                                "records out of the data (or give the frames as images).")
            else:
                raise DataError(f"{where} holds non-text parts ({short(value)}); anyfit reads text and image parts "
                                f"({', '.join(IMAGE_PARTS)}): keep those only.")
        if all(p["type"] == "text" for p in parts):
            return "".join(p["text"] for p in parts)
        return parts
    return text(value, where, numbers=False)


def prepend_text(content: str | list[dict[str, Any]], prefix: str) -> str | list[dict[str, Any]]:
    """``prefix`` written before the content, string or parts (joined to a leading text part)."""
    if isinstance(content, str):
        return prefix + content
    if content and content[0].get("type") == "text":
        return [{**content[0], "text": prefix + content[0]["text"]}, *content[1:]]
    return [{"type": "text", "text": prefix}, *content]


def content_texts(content: Any) -> list[str]:
    """The texts of message content: the string, or its text parts."""
    if isinstance(content, list):
        return [p["text"] for p in content if isinstance(p, Mapping) and p.get("type") == "text"]
    return [content] if isinstance(content, str) else []


def text(value: Any, where: str, expected: str = "a string", numbers: bool = True) -> str:
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
        if value != value or value in (float("inf"), float("-inf")):
            raise DataError(f"{where} is {value!r}, not text: a missing value? Fill it in or drop the record.")
        return str(value)
    if value is None:
        raise DataError(f"{where} is null; it must be {expected}. Fill it in or drop the record.")
    raise DataError(f"{where} must be {expected}, got {short(value)}.")


def has_content(value: Any) -> bool:
    """Whether a field holds something (Arrow fills absent keys with None; empty strings and lists hold nothing)."""
    if value is None:
        return False
    if isinstance(value, (str, list, tuple, dict)):
        return bool(value.strip() if isinstance(value, str) else value)
    return True


def short(value: Any, width: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width] + "..."
