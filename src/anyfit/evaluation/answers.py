r"""Finding the final answer in a model's text (the prediction side of grading).

The answer forms a reference solution uses too (``\boxed{}``, ``#### N``) and the gold-answer rule are
``anyfit.data.answers``; this module adds what only a prediction needs: ``<answer>`` tags and the
last-number fallback, tried in a set order.

``extract_answer(text, style)`` says *how* it found the answer as well as what it found:

- ``boxed``: the last ``\boxed{...}`` (or ``\fbox{...}``), nested braces included (MATH, chat/plain templates);
- ``answer_tag``: the last ``<answer> ... </answer>`` (the R1-Zero template), its ``\boxed{}`` if it holds one,
  else its text without a leading "The answer is" / "Answer:";
- ``gsm8k``: the whole final expression on the last ``#### ...`` line (GSM8K solutions): ``#### 2^10`` ->
  ``2^10``, ``#### 5/14`` -> ``5/14``; a plain number loses its currency sign, thousands separators and
  trailing unit words (``#### $1,234`` -> ``1234``, ``#### 72 apples.`` -> ``72``), but an expression is never
  cut down to its leading number;
- ``last_number``: a fallback kept apart from the forms above, so a model that never learned the answer
  format is not scored as if it had: the math span (``$...$``, ``\(...\)``, ``\[...\]``) or plain
  expression (``2^10``, ``(1, 2)``) the text ends with, else the last number in the text unless that number
  is a piece of something larger (an entry of a tuple, an exponent, a coefficient): then nothing;
- ``none``: nothing found.
"""

from __future__ import annotations

import re
from typing import Literal

from anyfit.data.answers import bare_number, extract_boxed, extract_gsm8k, plain_number, strip_label

AnswerHow = Literal["boxed", "answer_tag", "gsm8k", "last_number", "none"]
AnswerStyle = Literal["boxed", "answer_tag", "gsm8k"]
STYLES: tuple[AnswerStyle, ...] = ("boxed", "answer_tag", "gsm8k")

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# 1,234,567 | 1234 | 3.5 | .5, with an optional sign; a thousands group must have exactly three digits.
# ASCII look-arounds: in "x2" or "v1.5" the digits are not a number, but in "答案是5" (CJK letters are \w) they are.
_NUMBER = re.compile(r"(?<![A-Za-z0-9_.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?!\d)")
# The expression a text ends with, written without math delimiters: digits, operators, brackets and commas,
# starting after a space, "=" or ":" ("The answer is 2^10.", "The coordinates are (3, 4)").
_TRAILING_EXPRESSION = re.compile(r"(?:^|(?<=[\s=:]))([-+(\[]*\d[\d\s.,+\-*/^()\[\]]*?)[\s.]*$")
_TRAILING_CHARS = 200
# What a number that is a piece of something larger touches: an operator or an opening bracket before it,
# an operator or closing bracket after it.
_GLUE_BEFORE = set("^_/*+-×÷([{\\")
_GLUE_AFTER = set("^_/*+-×÷=)]}")


def extract_answer_tag(text: str) -> str | None:
    r"""Content of the last ``<answer> ... </answer>``; if it holds a ``\boxed{}``, that box's content,
    else the text without a leading label (``The answer is 7`` -> ``7``)."""
    found = _ANSWER_TAG.findall(text)
    if not found:
        return None
    inner = found[-1].strip()
    boxed = extract_boxed(inner)
    return boxed if boxed else strip_label(inner)


def last_number(text: str) -> str | None:
    """The last number in the text, thousands separators removed: ``... so 1,234 apples.`` -> ``1234``.

    ``None`` when that number is a piece of something larger: glued to an operator or bracket (``2^10``,
    ``f(2)``, ``3x``), or an entry of a list (``1, 2, 3``): such a piece is not an answer."""
    numbers = [m for m in _NUMBER.finditer(text) if any(c.isdigit() for c in m.group(0))]
    if not numbers:
        return None
    m = numbers[-1]
    before, after = text[:m.start()].rstrip(), text[m.end():]
    if after[:1].isascii() and (after[:1].isalpha() or after[:1] == "\\"):  # 3x, 2\pi: a coefficient
        return None
    after = after.lstrip()
    if before[-1:] in _GLUE_BEFORE or after[:1] in _GLUE_AFTER:
        return None
    if before.endswith(",") and before[:-1].rstrip()[-1:].isdigit():  # "1, 2, 3": an entry of a list
        return None
    return bare_number(m.group(0))


def trailing_math(text: str) -> str | None:
    r"""The math the text ends with, final punctuation aside: the content of a closing ``$...$``,
    ``$$...$$``, ``\(...\)`` or ``\[...\]`` span (``So we get $(1,2)$.`` -> ``(1,2)``), or a plain expression
    of digits, operators and brackets (``The answer is 2^10.`` -> ``2^10``). ``None`` if it ends otherwise."""
    s = text.rstrip().rstrip(".!?;,").rstrip()
    for left, right in (("$$", "$$"), ("\\(", "\\)"), ("\\[", "\\]"), ("$", "$")):
        if s.endswith(right) and not s.endswith("\\" + right):
            start = s.rfind(left, 0, len(s) - len(right))
            if start >= 0 and not (left == "$" and s[start - 1:start] in ("$", "\\")):
                inner = s[start + len(left):len(s) - len(right)].strip()
                return inner or None
            return None
    # Only the end of the text is searched: a regular-expression search over a long run of digits and spaces
    # (a model repeating itself) would take quadratic time. An expression running past that end is no answer.
    tail = s[-_TRAILING_CHARS:]
    m = _TRAILING_EXPRESSION.search(tail)
    if not m or (m.start(1) == 0 and len(tail) < len(s)):
        return None
    expression = m.group(1).strip().rstrip(",")
    if not _balanced(expression) or expression[-1:] in "+-*/^":
        return None
    number = plain_number(expression)
    return number if number is not None else expression


def _balanced(s: str) -> bool:
    depth = 0
    for c in s:
        depth += c in "(["
        depth -= c in ")]"
        if depth < 0:
            return False
    return depth == 0


_EXTRACTORS = {"boxed": extract_boxed, "answer_tag": extract_answer_tag, "gsm8k": extract_gsm8k}


def extract_answer(text: str, style: AnswerStyle = "boxed") -> tuple[str | None, AnswerHow]:
    """``(answer, how)``: the form ``style`` asks for first, then the other structured forms, then the
    fallback (``how == "last_number"``: the math the text ends with, else its last number; reported apart),
    else ``(None, "none")``.

    An empty form (``\\boxed{}``, ``<answer></answer>``) does not count as an answer.
    """
    if style not in _EXTRACTORS:
        raise ValueError(f"unknown answer style {style!r}; use one of {', '.join(STYLES)}")
    for how in (style, *(s for s in STYLES if s != style)):
        answer = _EXTRACTORS[how](text)
        if answer:
            return answer, how
    guess = trailing_math(text) or last_number(text)
    return (guess, "last_number") if guess is not None else (None, "none")
