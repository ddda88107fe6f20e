r"""The gold answer of an example, and the answer forms it is read from.

One rule, used by everything that needs a reference answer: ``r1_zero`` training (the text between its
``<answer>`` tags), the held-out examples kept for generation accuracy (``anyfit.data.prepare``), and
``anyfit eval`` (what a prediction is graded against). So a model is graded against exactly what it was
trained to write.

``gold_answer(answer, solution)``, and ``example_gold(example)`` on an ``Example``:

- an ``answer`` field, reduced to its ``#### ...`` or its last ``\boxed{}`` when it is a whole solution
  (GSM8K's ``answer`` column is); a short free-form answer (``C(10, 5), or equivalently 252``) is kept whole;
- else the reference solution's ``#### ...`` (GSM8K mapped as ``completion``);
- else the solution's last ``\boxed{}`` (MATH);
- else none (``None``).

The forms themselves (``extract_boxed``, ``extract_gsm8k``, and the number clean-up they share with the
grading: ``split_unit``, ``plain_number``) live here too; reading a *model's* answer (``<answer>`` tags, the
last-number fallback) is ``anyfit.evaluation.answers``, built on these.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from anyfit.data.formats import Example

BOX_MARKERS = ("\\boxed", "\\fbox")
_GSM8K = re.compile(r"####\s*([^\n]*)")
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


def example_gold(example: Example) -> str | None:
    """The gold answer of an ``Example``: ``gold_answer`` of its ``answer`` field and its reference solution
    (the completion, else the final assistant turn)."""
    return gold_answer(example.answer, example.solution)


def gold_answer(answer: str | None = None, solution: str | None = None) -> str | None:
    r"""The reference answer of an example: an ``answer`` field (reduced to its ``#### ...`` or ``\boxed{}``
    when it is a whole solution, as GSM8K's ``answer`` column is), else the solution's ``#### ...``, else
    the solution's last ``\boxed{}`` (MATH)."""
    if answer is not None and answer.strip():
        answer = answer.strip()
        return extract_gsm8k(answer) or (extract_boxed(answer) if any(m in answer for m in BOX_MARKERS)
                                         else None) or answer
    if solution:
        return extract_gsm8k(solution) or extract_boxed(solution)
    return None


def extract_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (or ``\fbox{...}``), braces balanced:
    ``\boxed{\frac{1}{2}}`` -> ``\frac{1}{2}``.

    Also reads MATH's brace-less ``\boxed 5`` (a number). Written by hand because a regular expression
    cannot match nested braces. ``None`` if there is none, or the last one is cut off (unbalanced braces).
    """
    start, marker = max((text.rfind(m + c), m) for m in BOX_MARKERS for c in ("{", " "))
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


def extract_gsm8k(text: str) -> str | None:
    """The whole answer after the last ``####``, unit words dropped: ``#### 2^10`` -> ``2^10``,
    ``#### 1/2 cup`` -> ``1/2``; a plain number without its currency sign and separators (``#### $1,234`` ->
    ``1234``, ``#### 72 apples.`` -> ``72``)."""
    found = _GSM8K.findall(text)
    if not found:
        return None
    answer = strip_label(found[-1].strip().strip("*").strip()).strip("*").strip()  # "**Answer:** 72": markdown
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
    number = bare_number(m.group("number"))
    if m.group("sign") == "-":
        number = number[1:] if number.startswith("-") else "-" + number
    return number


def bare_number(s: str) -> str:
    """A number as written, without thousands separators, a leading ``+`` or a final ``.``:
    ``+1,234.`` -> ``1234``."""
    s = s.replace(",", "").lstrip("+")
    return s.rstrip(".")


def strip_label(s: str) -> str:
    """``s`` without a leading "The answer is" / "Final answer:" label (unless the label is all there is)."""
    m = _LABEL.match(s)
    return s[m.end():].strip() if m and m.end() < len(s) else s


def _strip_math_delimiters(s: str) -> str:
    for left, right in (("$$", "$$"), ("\\(", "\\)"), ("\\[", "\\]"), ("$", "$")):
        if len(s) > len(left) + len(right) and s.startswith(left) and s.endswith(right):
            return s[len(left):len(s) - len(right)].strip()
    return s
