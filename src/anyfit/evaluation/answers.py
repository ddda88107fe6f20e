r"""Finding the final answer in a model's (or a reference solution's) text.

``extract_answer(text, style)`` says *how* it found the answer as well as what it found:

- ``boxed``: the last ``\boxed{...}`` (or ``\fbox{...}``), nested braces included (MATH, chat/plain templates);
- ``answer_tag``: the last ``<answer> ... </answer>`` (the R1-Zero template), its ``\boxed{}`` if it holds one;
- ``gsm8k``: the last ``#### N`` line (GSM8K solutions), thousands separators removed;
- ``last_number``: the last number anywhere in the text, a guess kept apart from the forms above so a
  model that never learned the answer format is not scored as if it had;
- ``none``: nothing found.
"""

from __future__ import annotations

import re
from typing import Literal

AnswerHow = Literal["boxed", "answer_tag", "gsm8k", "last_number", "none"]
AnswerStyle = Literal["boxed", "answer_tag", "gsm8k"]
STYLES: tuple[AnswerStyle, ...] = ("boxed", "answer_tag", "gsm8k")

_BOX_MARKERS = ("\\boxed", "\\fbox")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_GSM8K = re.compile(r"####\s*([^\n]*)")
# 1,234,567 | 1234 | 3.5 | .5, with an optional sign; a thousands group must have exactly three digits.
# ASCII look-arounds: in "x2" or "v1.5" the digits are not a number, but in "答案是5" (CJK letters are \w) they are.
_NUMBER = re.compile(r"(?<![A-Za-z0-9_.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?!\d)")
_LEADING_NUMBER = re.compile(r"^\$?\s*([-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)")


def extract_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (or ``\fbox{...}``), braces balanced:
    ``\boxed{\frac{1}{2}}`` -> ``\frac{1}{2}``.

    Also reads MATH's brace-less ``\boxed 5`` (a number). Written by hand because a regular expression
    cannot match nested braces. ``None`` if there is none, or the last one is cut off (unbalanced braces).
    """
    start, marker = max((text.rfind(m + c), m) for m in _BOX_MARKERS for c in ("{", " "))
    if start < 0:
        return None
    i = start + len(marker)
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] == "{":
        depth = 1
        for j in range(i + 1, len(text)):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    return text[i + 1:j].strip()
        return None  # unbalanced: the answer was cut off
    # MATH's \boxed 5: a number, running to the next space or $ ("use \boxed to ..." is not an answer).
    m = re.match(r"[-+]?\d[^\s$]*", text[i:])
    return m.group(0).rstrip(".,") if m else None


def extract_answer_tag(text: str) -> str | None:
    r"""Content of the last ``<answer> ... </answer>``; if it holds a ``\boxed{}``, that box's content."""
    found = _ANSWER_TAG.findall(text)
    if not found:
        return None
    inner = found[-1].strip()
    boxed = extract_boxed(inner)
    return boxed if boxed else inner


def extract_gsm8k(text: str) -> str | None:
    """The answer after the last ``####``: ``#### 1,234`` -> ``1234``; a leading number is kept alone
    (``#### 72 apples`` -> ``72``)."""
    found = _GSM8K.findall(text)
    if not found:
        return None
    answer = found[-1].strip()
    m = _LEADING_NUMBER.match(answer)
    if m:
        return _plain_number(m.group(1))
    return answer.rstrip(".").strip() or None


def last_number(text: str) -> str | None:
    """The last number in the text, thousands separators removed: ``... so 1,234 apples.`` -> ``1234``."""
    numbers = [m.group(0) for m in _NUMBER.finditer(text) if any(c.isdigit() for c in m.group(0))]
    return _plain_number(numbers[-1]) if numbers else None


def _plain_number(s: str) -> str:
    s = s.replace(",", "").lstrip("+")
    return s.rstrip(".")


_EXTRACTORS = {"boxed": extract_boxed, "answer_tag": extract_answer_tag, "gsm8k": extract_gsm8k}


def extract_answer(text: str, style: AnswerStyle = "boxed") -> tuple[str | None, AnswerHow]:
    """``(answer, how)``: the form ``style`` asks for first, then the other structured forms, then the
    last number (``how == "last_number"``: a fallback, reported apart), else ``(None, "none")``.

    An empty form (``\\boxed{}``, ``<answer></answer>``) does not count as an answer.
    """
    if style not in _EXTRACTORS:
        raise ValueError(f"unknown answer style {style!r}; use one of {', '.join(STYLES)}")
    for how in (style, *(s for s in STYLES if s != style)):
        answer = _EXTRACTORS[how](text)
        if answer:
            return answer, how
    number = last_number(text)
    return (number, "last_number") if number is not None else (None, "none")


def gold_answer(answer: str | None = None, solution: str | None = None) -> str | None:
    r"""The reference answer of an example: an ``answer`` field (reduced to its ``#### N`` or ``\boxed{}``
    when it is a whole solution, as GSM8K's ``answer`` column is), else the solution's ``#### N``, else
    the solution's last ``\boxed{}`` (MATH)."""
    if answer is not None and answer.strip():
        answer = answer.strip()
        return extract_gsm8k(answer) or (extract_boxed(answer) if "\\boxed" in answer or "\\fbox" in answer
                                         else None) or answer
    if solution:
        return extract_gsm8k(solution) or extract_boxed(solution)
    return None
