"""What a chat template accepts, found by rendering probe conversations once per template (and template options).

Templates differ in what they read, and fail or drop text without a word when given something else: some read a
message's content as a list of parts (MiniMax-M1's ``content[0]['text']``), some have no system role (Gemma-2's and
Mistral v0.2's raise; others leave the system message out), some spell the tool-result role otherwise (GLM-4-0414's
``observation``). The probes ask the template itself, so the rule holds for templates never seen here: a probe's
marker text either comes out of the rendering or it does not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Probe contents: text no real conversation holds, so finding them in a rendering is unambiguous.
_USER, _SYSTEM, _TOOL = "anyfit-probe-user", "anyfit-probe-system", "anyfit-probe-tool"
# Spellings of the tool-result role in chat templates, the convention's first.
TOOL_ROLES = ("tool", "observation", "ipython", "function", "tool_response")
_PROBE_CALL = {"type": "function", "function": {"name": "anyfit_probe", "arguments": {}}}


@dataclass(frozen=True)
class Traits:
    """What one template accepts: ``parts`` (it reads content as a list of text parts), ``system`` (it renders a
    system message), ``tool_role`` (the role its tool results take; None: it renders none)."""

    parts: bool
    system: bool
    tool_role: str | None


_CACHE: dict[tuple[str, str], Traits] = {}


def traits(tokenizer: PreTrainedTokenizerBase, source: str, kwargs: dict[str, Any]) -> Traits:
    """The traits of the template ``source`` under ``kwargs`` (probed once, then cached)."""
    key = (source, json.dumps(kwargs, sort_keys=True, default=str))
    if key not in _CACHE:
        _CACHE[key] = _probe(tokenizer, source, kwargs)
    return _CACHE[key]


def as_parts(content: Any, name: str | None = None) -> list[dict[str, str]]:
    """String content as one text part (OpenAI's multi-part form), with ``name`` when given; content that is a list
    of parts already (text and image parts, ``anyfit.data.images``) as it is, its text parts given ``name``."""
    if isinstance(content, list):
        return [{**p, "name": name} if name and p.get("type") == "text" else p for p in content]
    return [{"type": "text", "text": content or "", **({"name": name} if name else {})}]


def _render(tokenizer: PreTrainedTokenizerBase, source: str, kwargs: dict[str, Any], messages: list[dict]) -> str:
    try:
        return tokenizer.apply_chat_template(messages, chat_template=source, tokenize=False, **kwargs)
    except Exception:  # a probe the template refuses: that is the answer
        return ""


def _probe(tokenizer: PreTrainedTokenizerBase, source: str, kwargs: dict[str, Any]) -> Traits:
    def shown(content: str) -> Any:
        return as_parts(content) if parts else content

    parts = False
    if _USER not in _render(tokenizer, source, kwargs, [{"role": "user", "content": _USER}]):
        parts = _USER in _render(tokenizer, source, kwargs, [{"role": "user", "content": as_parts(_USER)}])
    user = {"role": "user", "content": shown(_USER)}
    system = _SYSTEM in _render(tokenizer, source, kwargs, [{"role": "system", "content": shown(_SYSTEM)}, user])
    tool_role = None
    # Another spelling only where the template names it (GLM's role == 'observation'): a template that writes any
    # role's name as it is would render each of them, and the model knows none but its own.
    for role in (r for r in TOOL_ROLES if r == "tool" or f"'{r}'" in source or f'"{r}"' in source):
        for calling in ({"role": "assistant", "content": shown(""), "tool_calls": [_PROBE_CALL]},
                        {"role": "assistant", "content": shown("anyfit-probe-answer")}):
            result = {"role": role, "content": shown(_TOOL), "name": "anyfit_probe"}
            if _TOOL in _render(tokenizer, source, kwargs, [user, calling, result]):
                tool_role = role
                break
        if tool_role:
            break
    return Traits(parts, system, tool_role)
