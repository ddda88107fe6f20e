r"""Finding the final answer in a model's (or a reference solution's) text.

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

AnswerHow = Literal["boxed", "answer_tag", "gsm8k", "last_number", "none"]
AnswerStyle = Literal["boxed", "answer_tag", "gsm8k"]
STYLES: tuple[AnswerStyle, ...] = ("boxed", "answer_tag", "gsm8k")

_BOX_MARKERS = ("\\boxed", "\\fbox")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_GSM8K = re.compile(r"####\s*([^\n]*)")
# 1,234,567 | 1234 | 3.5 | .5, with an optional sign; a thousands group must have exactly three digits.
# ASCII look-arounds: in "x2" or "v1.5" the digits are not a number, but in "答案是5" (CJK letters are \w) they are.
_NUMBER = re.compile(r"(?<![A-Za-z0-9_.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?!\d)")
# A whole answer that is one number: an optional sign and currency sign ($, \$ in LaTeX, £, €, ¥), the number.
_QUANTITY = re.compile(
    r"(?P<sign>[-+]?)\s*(?:\\?\$|£|€|¥)?\s*(?P<number>[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+))")
# Unit words after an answer that ends in a digit or a bracket: "72 apples", "18 dollars per hour", "90 km/h",
# "1/2 cup", "5 cm^2". Not "pi", nor "or" and "and" ("x = 3 or 5" lists answers). A one-letter unit (m, g, s,
# h, l) only follows a plain number: "2 x" or "\pi r h" is a product.
_UNIT_WORDS = re.compile(
    r"(?P<answer>.*?[\d)\]}])\s+(?P<unit>(?!(?:pi|or|and)\b)[A-Za-z]{2,}(?:[\s/-]+[A-Za-z]+)*(?:\^\{?\d\}?)?)\.?",
    re.DOTALL)
_ONE_LETTER_UNIT = re.compile(r"(?P<answer>[^\s]*\d)\s+(?P<unit>[mgshlL](?:\^\{?\d\}?)?)\.?")
# "The answer is 72", "Final answer: 72": a label some models write before the answer itself.
_LABEL = re.compile(r"(?:the\s+)?(?:final\s+)?answer\b\s*(?:is\b)?\s*:?\s*", re.IGNORECASE)
# The expression a text ends with, written without math delimiters: digits, operators, brackets and commas,
# starting after a space, "=" or ":" ("The answer is 2^10.", "The coordinates are (3, 4)").
_TRAILING_EXPRESSION = re.compile(r"(?:^|(?<=[\s=:]))([-+(\[]*\d[\d\s.,+\-*/^()\[\]]*?)[\s.]*$")
_TRAILING_CHARS = 200
# What a number that is a piece of something larger touches: an operator or an opening bracket before it,
# an operator or closing bracket after it.
_GLUE_BEFORE = set("^_/*+-×÷([{\\")
_GLUE_AFTER = set("^_/*+-×÷=)]}")


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
    r"""Content of the last ``<answer> ... </answer>``; if it holds a ``\boxed{}``, that box's content,
    else the text without a leading label (``The answer is 7`` -> ``7``)."""
    found = _ANSWER_TAG.findall(text)
    if not found:
        return None
    inner = found[-1].strip()
    boxed = extract_boxed(inner)
    return boxed if boxed else _strip_label(inner)


def extract_gsm8k(text: str) -> str | None:
    """The whole answer after the last ``####``, unit words dropped: ``#### 2^10`` -> ``2^10``,
    ``#### 1/2 cup`` -> ``1/2``; a plain number without its currency sign and separators (``#### $1,234`` ->
    ``1234``, ``#### 72 apples.`` -> ``72``)."""
    found = _GSM8K.findall(text)
    if not found:
        return None
    answer = _strip_label(found[-1].strip().strip("*").strip()).strip("*").strip()  # "**Answer:** 72": markdown
    answer, _ = split_unit(_strip_math_delimiters(answer.rstrip(".").strip()).rstrip(".").strip())
    return answer or None


def split_unit(answer: str) -> tuple[str, str | None]:
    r"""``(answer, unit words)``, a plain number without its currency sign and thousands separators:
    ``72 apples`` -> ``("72", "apples")``, ``$1,234.50`` -> ``("1234.50", None)``, ``1/2 cup`` ->
    ``("1/2", "cup")``, ``2^10`` -> ``("2^10", None)``. An expression is never cut down to its leading number."""
    answer = answer.strip()
    m = _UNIT_WORDS.fullmatch(answer) or _ONE_LETTER_UNIT.fullmatch(answer)
    if m and (m.re is _UNIT_WORDS or plain_number(m.group("answer")) is not None):
        answer, unit = m.group("answer").strip(), m.group("unit")
    else:
        unit = None
    number = plain_number(answer)
    return (number if number is not None else answer), unit


def plain_number(answer: str) -> str | None:
    r"""An answer that is one number, written plainly: ``$1,234.50`` -> ``1234.50``, ``-\$5`` -> ``-5``,
    ``033`` -> ``033``; ``None`` for anything else (``2^10``, ``5/14``, ``25%``)."""
    m = _QUANTITY.fullmatch(answer.strip())
    if not m:
        return None
    number = _plain_number(m.group("number"))
    if m.group("sign") == "-":
        number = number[1:] if number.startswith("-") else "-" + number
    return number


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
    return _plain_number(m.group(0))


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


def _strip_label(s: str) -> str:
    m = _LABEL.match(s)
    return s[m.end():].strip() if m and m.end() < len(s) else s


def _strip_math_delimiters(s: str) -> str:
    for left, right in (("$$", "$$"), ("\\(", "\\)"), ("\\[", "\\]"), ("$", "$")):
        if len(s) > len(left) + len(right) and s.startswith(left) and s.endswith(right):
            return s[len(left):len(s) - len(right)].strip()
    return s


def _plain_number(s: str) -> str:
    s = s.replace(",", "").lstrip("+")
    return s.rstrip(".")


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


def gold_answer(answer: str | None = None, solution: str | None = None) -> str | None:
    r"""The reference answer of an example: an ``answer`` field (reduced to its ``#### ...`` or ``\boxed{}``
    when it is a whole solution, as GSM8K's ``answer`` column is), else the solution's ``#### ...``, else
    the solution's last ``\boxed{}`` (MATH)."""
    if answer is not None and answer.strip():
        answer = answer.strip()
        return extract_gsm8k(answer) or (extract_boxed(answer) if "\\boxed" in answer or "\\fbox" in answer
                                         else None) or answer
    if solution:
        return extract_gsm8k(solution) or extract_boxed(solution)
    return None
