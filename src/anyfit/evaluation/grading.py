r"""Is a predicted answer equal to the reference? Mathematical equivalence through ``math-verify``.

``\frac12`` equals ``0.5``, ``2\sqrt2`` equals ``\sqrt8``, ``(1,2)`` differs from ``(1,3)``. In order:

1. Both answers are normalised (math delimiters, spacing commands, final period); equal strings are equal.
2. A gold answer may give several phrasings of one answer: ``C(10, 5), or equivalently 252``,
   ``252, i.e. \binom{10}{5}``, ``100 (i.e., all values)``, ``\frac12 or 0.5``, ``C(8, 3) = 56``; the
   prediction is graded against each. A parenthetical remark (``7 (the smallest such n)``) is dropped.
   ``X or Y`` with different values (``x = 3 or x = -3``) lists several answers, all of which are needed.
   Every phrasing a prediction gives must be right, so hedging (``3 or 5``, ``3, i.e., 5``) is wrong.
3. Multiple-choice letters (``\text{(B)}``, ``(B)``, ``B``) compare by letter. Plain numbers compare exactly,
   without sympy: currency signs, thousands separators and leading zeros aside (``\$1,234`` = ``1234``,
   AIME's ``033`` = ``33``). A unit after the answer is dropped (``5 cm`` = ``5``) unless both answers name
   different units (``5 m`` is not ``5 cm``); so is a percent sign on one side only (``12.5\%`` = ``12.5``).
4. The rest goes to math-verify's ``parse``/``verify``, but only for real expressions: an answer holding a
   word (``\text{Tuesday}``, ``all values``) is compared as a normalised string, because sympy reads a word
   as a product of one-letter symbols (``\text{BAC}`` would equal ``\text{ABC}``). An answer math-verify
   cannot parse whole is incorrect unless its normalised string equals the other one: math-verify's own
   fallback would go on to pick a stray number out of it (``sum_(k=2)^n 1/k`` and ``sum_(k=1)^n 1/k`` both
   became ``1``). Plain-text notation it cannot read (``C(10, 5)``, ``sum_(k=1)^n``, ``pi``) is rewritten as
   LaTeX first, and sums and products are evaluated when they do not compare equal as written.

Anything that cannot be parsed, or takes too long, counts as incorrect; grading never raises.

math-verify bounds its sympy work with ``signal.alarm``, which only works in the main thread. Off the
main thread (a data-loader thread, a web server) the timeout is switched off rather than letting every
answer fail with math-verify's "signal only works in main thread" error; answers are short extracted
strings, so sympy finishes quickly on them.
"""

from __future__ import annotations

import functools
import re
import threading
from decimal import Decimal

from anyfit.data.answers import plain_number, split_unit

_WRAPPERS = (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
# \text{...} and its kin: prose (or a unit) inside math.
_TEXT = re.compile(r"\\(?:text|textrm|textnormal|textbf|textit|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
# Commands whose braced argument is a name, not prose: \begin{pmatrix}, \mathbb{R}, \operatorname{lcm}.
_NAME_ARGUMENT = re.compile(r"\\(?:begin|end|mathbb|mathcal|mathfrak|operatorname)\s*\{[^{}]*\}")
# Plain words that are math, not prose, when written without a backslash ("and", "or": math-verify reads
# "3 and 5" as the list 3, 5).
_MATH_WORDS = frozenset({
    "sin", "cos", "tan", "cot", "sec", "csc", "arcsin", "arccos", "arctan", "sinh", "cosh", "tanh", "log", "ln",
    "exp", "lim", "max", "min", "gcd", "lcm", "mod", "det", "sqrt", "abs", "floor", "ceil", "pi", "inf", "infty",
    "infinity", "sum", "prod", "binom", "choose", "and", "or"})
# Two-letter words that read as prose, not as a product of two symbols.
_SHORT_WORDS = frozenset({"no"})

# Connectors written inside \text{}: "x = 3 \text{ or } x = -3".
_TEXT_CONNECTOR = re.compile(
    r"\\(?:text|textrm|textnormal|mathrm|mbox)\s*\{\s*([,;]?\s*(?:or equivalently|equivalently|or|and|i\.e\.,?"
    r"|that is,?)\s*[,;]?)\s*\}")
# "X, or equivalently Y", "X, i.e., Y", "X, that is, Y": two phrasings of one answer.
_EQUIVALENTLY = re.compile(
    r"(?:\s*[,;]\s*|\s+)(?:(?:or\s+)?equivalently|i\.e\.)(?![A-Za-z])[,:]?\s*"
    r"|\s*[,;]\s*(?:that\s+is|namely)(?![A-Za-z])[,:]?\s*", re.IGNORECASE)
# The same markers at the start of a parenthetical: "100 (i.e., all values)", "252 (= \binom{10}{5})".
_EQUIVALENTLY_START = re.compile(r"(?:(?:or\s+)?equivalently|i\.e\.|that\s+is|namely|or|=)(?![A-Za-z])[,:]?\s*",
                                 re.IGNORECASE)
# "X or Y" and "X = Y" are two phrasings when X equals Y ("\frac12 or 0.5", "C(8, 3) = 56"); otherwise "or"
# lists several answers ("x = 3 or x = -3") and "=" is an equation ("x = 3"). Not the "=" of "<=", "\neq".
_OR_OR_EQUALS = re.compile(r"\s*,?\s+or\s+|\s*(?<![<>!\\])=(?!=)\s*")

# Multiple choice: (B), B, B), or "(B) 12" (the letter, then the option's value).
_CHOICE = re.compile(r"\(([A-E])\)(?:[\s\d].*)?|([A-E])\)?", re.DOTALL)
# A unit in \text{} after the answer: 5\text{ cm}, 12\text{ square units}, 2\pi\text{ cm}^2.
_TEXT_UNIT = re.compile(
    r"(?P<value>.*?\S)\s*\\(?:text|textrm|mathrm|mbox)\s*\{\s*(?P<unit>[A-Za-z][A-Za-z\s.]*?)\s*\}"
    r"\s*(?P<power>\^\s*\{?\d\}?)?", re.DOTALL)
# Spelled-out units and their usual abbreviations (singular: plurals are removed first).
_UNIT_NAMES = {
    "centimeter": "cm", "centimetre": "cm", "meter": "m", "metre": "m", "millimeter": "mm", "millimetre": "mm",
    "kilometer": "km", "kilometre": "km", "inch": "in", "foot": "ft", "feet": "ft", "yard": "yd", "mile": "mi",
    "gram": "g", "kilogram": "kg", "pound": "lb", "ounce": "oz", "second": "s", "sec": "s", "minute": "min",
    "hour": "h", "hr": "h", "liter": "l", "litre": "l", "milliliter": "ml", "millilitre": "ml", "dollar": "$",
    "degree": "°", "cent": "¢",
}
_PERCENT = re.compile(r"\s*\\?%$")
_NOT_UNITS = frozenset({"i", "e", "or", "and"})  # \mathrm{i} is the imaginary unit; connectors are no unit

# Plain-text notation that gold answers in the wild use, rewritten as the LaTeX math-verify parses:
# C(10, 5) and binom(10, 5) (binomials), sum_(k=1)^n and prod_(k=1)^n, a bare pi.
_PLAIN_BINOMIAL = re.compile(r"(?<![A-Za-z\\])(?:C|binom)\(\s*([^(),]+?)\s*,\s*([^(),]+?)\s*\)")
_PLAIN_BIG_OPERATOR = re.compile(r"(?<![A-Za-z\\])(sum|prod)_\(([^()]*)\)")
_PLAIN_NAME = re.compile(r"(?<![A-Za-z\\])(sum|prod|pi)(?![A-Za-z])")


def normalize(answer: str) -> str:
    """Strip math delimiters, spacing commands and a final period: ``$ 1,234. $`` -> ``1,234``; LaTeX's
    ``{,}`` thousands separator becomes a comma."""
    s = answer.strip()
    changed = True
    while changed:
        changed = False
        for left, right in _WRAPPERS:
            if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
                s = s[len(left):len(s) - len(right)].strip()
                changed = True
    for cmd in ("\\!", "\\,", "\\;"):
        s = s.replace(cmd, "")
    s = re.sub(r"(?<!\\)\\ ", "", s)  # a "\ " space, but not the "\\ " row break of a matrix
    s = s.replace("{,}", ",")
    return s.rstrip(".").strip()


def grade(predicted: str | None, gold: str | None, timeout_seconds: int = 5) -> bool:
    """Whether ``predicted`` is mathematically equal to ``gold``. Missing or unparsable input is incorrect."""
    if predicted is None or gold is None:
        return False
    try:
        p, g = normalize(str(predicted)), normalize(str(gold))
        if not p or not g:
            return False
        if _canonical(p) == _canonical(g):
            return True
        golds = _phrasings(g, timeout_seconds)
        return all(any(_equal(pp, gg, timeout_seconds) for gg in golds) for pp in _phrasings(p, timeout_seconds))
    except Exception:  # noqa: BLE001 - odd objects passed as answers are simply wrong
        return False


def _phrasings(answer: str, timeout_seconds: int) -> list[str]:
    r"""The phrasings of one answer: ``C(10, 5), or equivalently 252`` -> ``["C(10, 5)", "252"]``,
    ``7 (the smallest such n)`` -> ``["7"]``. ``X or Y`` and ``X = Y`` split only when X equals Y:
    ``x = 3 or x = -3`` stays whole (math-verify reads it as the set of both roots), and so does ``x = 3``."""
    s = _TEXT_CONNECTOR.sub(lambda m: " " + m.group(1).strip() + " ", answer)
    main, remark = _split_remark(s)
    parts = [main]
    if remark is not None:
        marker = _EQUIVALENTLY_START.match(remark)
        if marker:
            parts.append(remark[marker.end():])
    phrasings = []
    for part in (q.strip().strip(",;").strip() for p in parts for q in _EQUIVALENTLY.split(p)):
        if not part:
            continue
        options = _OR_OR_EQUALS.split(part)
        if len(options) > 1 and all(_equal(o, options[0], timeout_seconds) for o in options[1:]):
            phrasings.extend(options)
        else:
            phrasings.append(part)
    return phrasings or [answer]


def _split_remark(s: str) -> tuple[str, str | None]:
    """``100 (i.e., all values)`` -> ``("100", "i.e., all values")``: a final parenthetical after a space that
    holds prose or an "i.e."; ``(1, 2)``, ``f(x)`` and ``(x-1) (x+1)`` are the answer itself."""
    if not s.endswith(")"):
        return s, None
    depth = 0
    for start in range(len(s) - 1, -1, -1):
        depth += (s[start] == ")") - (s[start] == "(")
        if depth == 0:
            break
    else:
        return s, None
    inside = s[start + 1:-1].strip()
    if start == 0 or not s[start - 1].isspace() or not (_EQUIVALENTLY_START.match(inside) or _has_prose(inside)):
        return s, None
    return s[:start].rstrip(), inside


def _equal(predicted: str, gold: str, timeout_seconds: int) -> bool:
    """One phrasing against another (the steps 3 and 4 of the module docstring)."""
    if _canonical(predicted) == _canonical(gold):
        return True
    gold_choice = _choice(gold)
    if gold_choice:
        return _choice(predicted) == gold_choice
    p_bare, g_bare = _PERCENT.sub("", predicted), _PERCENT.sub("", gold)
    if (p_bare == predicted) != (g_bare == gold) and _equal(p_bare, g_bare, timeout_seconds):
        return True  # a percent sign on one side only: math-verify equates 25% with 25, but not 12.5% with 12.5
    predicted, predicted_unit = _without_unit(predicted)
    gold, gold_unit = _without_unit(gold)
    if predicted_unit and gold_unit and predicted_unit != gold_unit:
        return False
    p_number, g_number = _number(predicted), _number(gold)
    if p_number is not None and g_number is not None:  # the fast path: no sympy for GSM8K-style answers
        return p_number == g_number
    predicted = str(p_number) if p_number is not None else _as_latex(predicted)
    gold = str(g_number) if g_number is not None else _as_latex(gold)
    if _canonical(predicted) == _canonical(gold):
        return True
    if _has_prose(predicted) or _has_prose(gold):
        return False
    return _math_verify(predicted, gold, timeout_seconds)


def _canonical(s: str) -> str:
    r"""The strict string form: ``\text{}`` unwrapped, ``\left``/``\right`` and spaces dropped, ``\dfrac`` as
    ``\frac``; prose case-folded (``\text{No}`` = ``no``)."""
    prose = _has_prose(s)
    s = _TEXT.sub(r"\1", s)
    s = re.sub(r"\\(?:left|right|displaystyle)(?![A-Za-z])", "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\s+", "", s.replace("\\$", "")).rstrip(".")
    return s.casefold() if prose else s


def _has_prose(s: str) -> bool:
    r"""Whether the answer holds a word: ``\text{}`` with two letters or more, or a plain run of three letters
    or more (or "no") that is not a math name like ``sin`` or ``pi``. ``2xy`` holds none."""
    s = _NAME_ARGUMENT.sub(" ", s)
    for text in _TEXT.findall(s):
        if any(w.casefold() not in _MATH_WORDS for w in re.findall(r"[A-Za-z]{2,}", text)):
            return True
    s = re.sub(r"\\[A-Za-z]+", " ", _TEXT.sub(" ", s))
    return any((len(w) >= 3 or w.casefold() in _SHORT_WORDS) and w.casefold() not in _MATH_WORDS
               for w in re.findall(r"[A-Za-z]+", s))


def _choice(s: str) -> str | None:
    """The letter of a multiple-choice answer: ``\\text{(B)}``, ``(B)``, ``B``, ``(B) 12`` -> ``B``; ``None``
    for anything else, and for two letters (``(A) or (B)``)."""
    s = _TEXT.sub(r"\1", s).strip()
    m = _CHOICE.fullmatch(s)
    if not m or len(set(re.findall(r"\(([A-E])\)", s))) > 1:
        return None
    return m.group(1) or m.group(2)


def _without_unit(s: str) -> tuple[str, str | None]:
    r"""``(answer, unit)``: ``5\text{ cm}`` -> ``("5", "cm")``, ``$1,234`` -> ``("1234", None)``,
    ``72 apples`` -> ``("72", "apple")``. Hand-written rather than math-verify's unit stripping, which also
    strips one-letter "units" from expressions (``3ab`` and ``5t`` would equal ``3`` and ``5``)."""
    unit = None
    m = _TEXT_UNIT.fullmatch(s)
    if m and m.group("unit").strip().casefold() not in _NOT_UNITS and m.group("value")[-1] not in "+-*/^=(,":
        s, unit = m.group("value"), m.group("unit") + (m.group("power") or "")
    s, words = split_unit(s)
    unit = unit or words
    return s, _unit_key(unit) if unit else None


def _unit_key(unit: str) -> str | None:
    """A unit's comparable name: case, plural, spacing and common abbreviations aside, ``square centimeters``
    = ``cm^2``. ``None`` for the generic "units" (MATH's "square units"), which names no unit."""
    u, power = unit.casefold().strip().rstrip("."), ""
    m = re.search(r"\s*\^\s*\{?(\d)\}?$", u)
    if m:
        u, power = u[:m.start()], "^" + m.group(1)
    m = re.match(r"(square|sq\.?|cubic)\s+", u)
    if m:
        u, power = u[m.end():], "^3" if m.group(1) == "cubic" else "^2"
    words = [re.sub(r"(?<!s)s$", "", re.sub(r"(ch|sh|x)es$", r"\1", w)) for w in u.split()]
    u = "".join(_UNIT_NAMES.get(w, w) for w in words) + power
    return None if re.fullmatch(r"unit(?:\^\d)?", u) else u


def _number(s: str) -> Decimal | None:
    """A plain number's exact value (``1,234`` -> 1234, ``033`` -> 33, ``18.90`` -> 18.9), else ``None``."""
    number = plain_number(s)
    return Decimal(number) if number is not None else None


def _as_latex(s: str) -> str:
    """Plain-text notation as LaTeX: ``C(10, 5)`` -> ``\\binom{10}{5}``, ``sum_(k=1)^n`` -> ``\\sum_{k=1}^n``,
    ``pi`` -> ``\\pi``, ``x**2`` -> ``x^2``. math-verify's LaTeX parser reads none of them (it parses ``pi`` as
    ``p*i``)."""
    s = _PLAIN_BINOMIAL.sub(r"\\binom{\1}{\2}", s)
    s = _PLAIN_BIG_OPERATOR.sub(r"\\\1_{\2}", s)
    s = _PLAIN_NAME.sub(r"\\\1", s)
    return s.replace("**", "^").replace("\\varnothing", "\\emptyset")  # math-verify knows only \emptyset


def _math_verify(predicted: str, gold: str, timeout_seconds: int) -> bool:
    from math_verify import verify
    from math_verify.errors import TimeoutException
    from math_verify.utils import timeout as with_timeout

    # signal.alarm (math-verify's timeout) raises "signal only works in main thread" elsewhere.
    timeout = timeout_seconds if threading.current_thread() is threading.main_thread() else None
    try:
        gold_parsed, pred_parsed = list(_parse(gold, timeout)), list(_parse(predicted, timeout))
        if not gold_parsed or not pred_parsed:
            return False
        # allow_set_relation_comp: a prediction x \ge 2 also equals the gold [2, \infty), not only the reverse.
        if verify(gold_parsed, pred_parsed, allow_set_relation_comp=True, timeout_seconds=timeout):
            return True
        # math-verify leaves sums and products unevaluated, and sympy's simplify() does not see that
        # \sum_{k=1}^n k is n(n+1)/2 or that \prod_{k=1}^n k is n!: evaluate them and compare again.
        if not any(_has_big_operator(x) for x in (*gold_parsed, *pred_parsed)):
            return False
        gold_done, pred_done = with_timeout(timeout)(lambda: (_evaluate(gold_parsed), _evaluate(pred_parsed)))()
        return bool(verify(gold_done, pred_done, allow_set_relation_comp=True, timeout_seconds=timeout))
    except (Exception, TimeoutException):  # noqa: BLE001 - TimeoutException is a BaseException
        return False


@functools.lru_cache(maxsize=1024)
def _parse(answer: str, timeout: int | None) -> tuple:
    r"""math-verify's ``parse`` of the answer wrapped in ``\boxed{}``, read as LaTeX only. Cached: one answer
    is parsed again for every phrasing of the other, and one that timed out would time out again.

    The boxed answer is the one match: if it cannot be parsed, ``first_match`` stops there, where the
    default would go on to lower-priority patterns and take a stray number out of it (it reads
    ``sum_(k=2)^n 1/k`` as ``1``). math-verify's unit stripping is off (see ``_without_unit``)."""
    from latex2sympy2_extended.latex2sympy2 import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse

    config = LatexExtractionConfig(
        try_extract_without_anchor=False, boxed_match_priority=0,
        normalization_config=NormalizationConfig(basic_latex=True, units=False, malformed_operators=True,
                                                 nits=True, boxed="all", equations=False))
    return tuple(parse("\\boxed{" + answer + "}", [config], fallback_mode="no_fallback",
                       extraction_mode="first_match", parsing_timeout=timeout))


def _has_big_operator(expr) -> bool:
    from sympy import Basic, Product, Sum

    return isinstance(expr, Basic) and bool(expr.atoms(Sum, Product))


def _evaluate(parsed: list) -> list:
    """Sums and products evaluated, and every symbol made a plain one: math-verify makes symbols real unless
    the text mentions ``i``, so the ``n`` of ``\\sum_{i=1}^n 1/i`` and of ``\\sum_{k=1}^n 1/k`` would differ."""
    from sympy import Basic, Product, Sum, Symbol

    done = []
    for x in parsed:
        if isinstance(x, Basic):
            x = x.xreplace({s: s.doit() for s in x.atoms(Sum, Product)})
            x = x.xreplace({s: Symbol(s.name) for s in x.free_symbols if isinstance(s, Symbol)})
        done.append(x)
    return done
