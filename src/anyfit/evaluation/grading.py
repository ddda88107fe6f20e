r"""Is a predicted answer equal to the reference? Mathematical equivalence through ``math-verify``.

``\frac12`` equals ``0.5``, ``2\sqrt2`` equals ``\sqrt8``, ``(1,2)`` differs from ``(1,3)``. Plain
integers (``1,234`` and ``1234``) are compared directly, without sympy. Anything that cannot be parsed,
or takes too long, counts as incorrect; grading never raises.

math-verify bounds its sympy work with ``signal.alarm``, which only works in the main thread. Off the
main thread (a data-loader thread, a web server) the timeout is switched off rather than letting every
answer fail with math-verify's "signal only works in main thread" error; answers are short extracted
strings, so sympy finishes quickly on them.
"""

from __future__ import annotations

import re
import threading

_INTEGER = re.compile(r"^[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)$")
_WRAPPERS = (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))


def normalize(answer: str) -> str:
    """Strip math delimiters, spacing commands and a final period: ``$ 1,234. $`` -> ``1,234``."""
    s = answer.strip()
    changed = True
    while changed:
        changed = False
        for left, right in _WRAPPERS:
            if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
                s = s[len(left):len(s) - len(right)].strip()
                changed = True
    for cmd in ("\\!", "\\,", "\\;", "\\ "):
        s = s.replace(cmd, "")
    return s.rstrip(".").strip()


def _as_int(s: str) -> int | None:
    return int(s.replace(",", "")) if _INTEGER.match(s) else None


def grade(predicted: str | None, gold: str | None, timeout_seconds: int = 5) -> bool:
    """Whether ``predicted`` is mathematically equal to ``gold``. Missing or unparsable input is incorrect."""
    if predicted is None or gold is None:
        return False
    try:
        p, g = normalize(str(predicted)), normalize(str(gold))
    except Exception:  # noqa: BLE001 - odd objects passed as answers are simply wrong
        return False
    if not p or not g:
        return False
    if p == g:
        return True
    p_int, g_int = _as_int(p), _as_int(g)
    if p_int is not None and g_int is not None:  # the fast path: no sympy for GSM8K-style answers
        return p_int == g_int
    return _math_verify(p, g, timeout_seconds)


def _math_verify(predicted: str, gold: str, timeout_seconds: int) -> bool:
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    # signal.alarm (math-verify's timeout) raises "signal only works in main thread" elsewhere.
    timeout = timeout_seconds if threading.current_thread() is threading.main_thread() else None
    try:
        # Wrapped in \boxed{} so math-verify's LaTeX extraction takes the whole answer as one expression.
        gold_parsed = parse("\\boxed{" + gold + "}", parsing_timeout=timeout)
        pred_parsed = parse("\\boxed{" + predicted + "}", parsing_timeout=timeout)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    except (Exception, TimeoutException):  # noqa: BLE001 - TimeoutException is a BaseException
        return False
