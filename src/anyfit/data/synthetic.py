r"""Synthetic arithmetic word problems with short column-by-column solutions, for the quickstart.

Every problem adds or subtracts two 2- or 3-digit numbers. The prompt is either a bare question
("What is 59 + 63? Put the final answer in \boxed{}.") or a short story (apples, money, distances,
...); the completion restates the sum, works it column by column and ends in ``\boxed{answer}``::

    59 + 63:
    9+3=12, carry 1
    5+6+1=12
    \boxed{122}

The solutions are deliberately terse: on a CPU every token costs training time, and a small model
gets multi-digit arithmetic right far more often one column at a time than in one jump.

Train and held-out problems are disjoint by construction: a stable hash of ``(a, op, b)`` puts
every pair in exactly one of the two pools, whatever the sizes or seeds asked for.
"""

from __future__ import annotations

import json
import random
import zlib
from collections.abc import Iterable
from pathlib import Path

BOXED_INSTRUCTION = r"Put the final answer in \boxed{}."

# One in HELDOUT_MODULUS (a, op, b) pairs is reserved for evaluation.
HELDOUT_MODULUS = 8

# Story templates: {a} and {b} are the operands, {name} a person. Addition stories combine two
# amounts; subtraction stories take the second amount away from the first (a >= b).
_NAMES = ["Sam", "Mia", "Leo", "Ana", "Tom", "Zoe", "Ravi", "Lena", "Omar", "Kate", "Yuki", "Ben"]

_ADD_TEMPLATES = [
    "{name} has {a} apples and picks {b} more. How many apples does {name} have now?",
    "{name} saved ${a} in May and ${b} in June. How many dollars did {name} save in total?",
    "{name} drove {a} km on Monday and {b} km on Tuesday. How many km is that altogether?",
    "A library has {a} novels and {b} comics. How many books is that in all?",
    "{name} read {a} pages yesterday and {b} pages today. How many pages did {name} read in the two days?",
    "A farm has {a} sheep and {b} goats. How many animals are there?",
    "A train carries {a} passengers, and {b} more get on. How many passengers are on the train now?",
    "{name} scored {a} points in the first game and {b} in the second. What is the total score?",
]

_SUB_TEMPLATES = [
    "{name} has {a} apples and gives away {b}. How many apples are left?",
    "{name} had ${a} and spent ${b}. How many dollars does {name} have left?",
    "A road is {a} km long. {name} has driven {b} km of it. How many km are left to drive?",
    "A library has {a} books and lends out {b}. How many books are still on the shelves?",
    "A book has {a} pages. {name} has read {b}. How many pages are left?",
    "A baker made {a} rolls and sold {b}. How many rolls are left?",
    "A train carries {a} passengers, and {b} get off. How many passengers stay on?",
    "{name} scored {a} points and {name}'s friend scored {b}. How many more points did {name} score?",
]

PROMPT_STYLES = ("what_is", "question", "word", "mixed")
SOLUTION_STYLES = ("steps", "direct")

_QUESTION_TEMPLATES = [
    "What is {a} {op} {b}?",
    "Compute {a} {op} {b}.",
    "Calculate {a} {op} {b}.",
]


def solve_steps(a: int, op: str, b: int) -> list[str]:
    """Column-by-column working of ``a op b``, ones first: ``["9+3=12, carry 1", "5+6+1=12"]``.

    A missing digit of the shorter number counts as 0, so every column reads the same way.
    Addition: the column's digits plus the incoming carry; the last column's sum is written whole.
    Subtraction (``a >= b``): when the top digit (less the incoming borrow) is too small, the column
    borrows 10 (``12-7=5, borrow 1``) and the next column subtracts it (``8-4-1=3``).
    """
    if op not in ("+", "-"):
        raise ValueError(f"op must be '+' or '-', got {op!r}")
    if op == "-" and a < b:
        raise ValueError(f"subtraction needs a >= b, got {a} - {b}")
    if a < 0 or b < 0:
        raise ValueError(f"operands must be non-negative, got {a} and {b}")
    width = max(len(str(a)), len(str(b)))
    xs, ys = str(a).zfill(width)[::-1], str(b).zfill(width)[::-1]
    steps: list[str] = []
    carry = 0  # carry (addition) or borrow (subtraction) coming into this column
    for i, (x, y) in enumerate(zip(map(int, xs), map(int, ys))):
        last = i == width - 1
        if op == "+":
            total = x + y + carry
            line = f"{x}+{y}" + ("+1" if carry else "") + f"={total}"
            carry = total // 10
            steps.append(line + (", carry 1" if carry and not last else ""))
        else:
            borrow = int(x - carry < y)
            line = f"{'1' if borrow else ''}{x}-{y}" + ("-1" if carry else "") + f"={10 * borrow + x - y - carry}"
            carry = borrow
            steps.append(line + (", borrow 1" if borrow else ""))
    return steps


def solution(a: int, op: str, b: int, style: str = "steps") -> str:
    r"""The completion for ``a op b``, ending in ``\boxed{result}``.

    ``style="steps"``: the equation, then the column steps (``"59 + 63:\n9+3=12, carry 1\n5+6+1=12\n\boxed{122}"``).
    ``style="direct"``: the equation with its result (``"59 + 63 = 122\n\boxed{122}"``): a third of the
    tokens, and what the model already half knows, so it learns it in fewer steps.
    """
    if style not in SOLUTION_STYLES:
        raise ValueError(f"solution style must be one of {', '.join(SOLUTION_STYLES)}; got {style!r}")
    result = a + b if op == "+" else a - b
    if style == "direct":
        solve_steps(a, op, b)  # the same checks on the operands
        return f"{a} {op} {b} = {result}\n\\boxed{{{result}}}"
    return f"{a} {op} {b}:\n" + "\n".join(solve_steps(a, op, b)) + f"\n\\boxed{{{result}}}"


def is_heldout(a: int, op: str, b: int) -> bool:
    """Whether ``(a, op, b)`` belongs to the held-out pool (stable across runs and Python versions)."""
    return zlib.crc32(f"{a}{op}{b}".encode()) % HELDOUT_MODULUS == 0


def make_record(a: int, op: str, b: int, rng: random.Random, prompt_style: str = "mixed",
                solution_style: str = "steps") -> dict:
    """One problem as ``{"prompt", "completion", "answer"}``.

    ``prompt_style``: ``"what_is"`` ("What is a + b?", the quickstart's yardstick), ``"question"`` (a bare
    arithmetic question in one of a few phrasings), ``"word"`` (a story) or ``"mixed"`` (questions
    and stories half and half, drawn from ``rng``). ``solution_style``: see :func:`solution`.
    """
    style = prompt_style
    if style not in PROMPT_STYLES:
        raise ValueError(f"prompt style must be one of {', '.join(PROMPT_STYLES)}; got {style!r}")
    if style == "mixed":
        style = "question" if rng.random() < 0.5 else "word"
    if style == "what_is":
        text = _QUESTION_TEMPLATES[0].format(a=a, op=op, b=b)
    elif style == "question":
        text = rng.choice(_QUESTION_TEMPLATES).format(a=a, op=op, b=b)
    else:
        templates = _ADD_TEMPLATES if op == "+" else _SUB_TEMPLATES
        text = rng.choice(templates).format(a=a, b=b, name=rng.choice(_NAMES))
    result = a + b if op == "+" else a - b
    return {"prompt": f"{text} {BOXED_INSTRUCTION}", "completion": solution(a, op, b, solution_style),
            "answer": str(result)}


def _draw_operands(rng: random.Random, digits: tuple[int, ...], op: str) -> tuple[int, int]:
    da, db = rng.choice(digits), rng.choice(digits)
    a = rng.randint(10 ** (da - 1), 10 ** da - 1)
    b = rng.randint(10 ** (db - 1), 10 ** db - 1)
    if op == "-" and a < b:  # stories take the smaller amount from the larger
        a, b = b, a
    return a, b


def _generate(n: int, seed: int, heldout: bool, ops: tuple[str, ...], digits: tuple[int, ...],
              prompt_style: str, solution_style: str) -> list[dict]:
    for op in ops:
        if op not in ("+", "-"):
            raise ValueError(f"ops must be '+' and/or '-', got {op!r}")
    for d in digits:
        if d < 1 or d > 6:
            raise ValueError(f"digits must be between 1 and 6, got {d}")
    rng = random.Random(seed)
    seen: set[tuple[int, str, int]] = set()
    records: list[dict] = []
    attempts = 0
    while len(records) < n:
        attempts += 1
        if attempts > 1000 * n + 10_000:
            raise ValueError(f"cannot draw {n} distinct problems with digits={digits}, ops={ops}")
        op = rng.choice(ops)
        a, b = _draw_operands(rng, digits, op)
        key = (a, op, b)
        if key in seen or is_heldout(*key) != heldout:
            continue
        seen.add(key)
        records.append(make_record(a, op, b, rng, prompt_style, solution_style))
    return records


def train_set(n: int, seed: int = 0, ops: tuple[str, ...] = ("+", "-"), digits: tuple[int, ...] = (2, 3),
              prompt_style: str = "mixed", solution_style: str = "steps") -> list[dict]:
    """``n`` distinct training problems (never a held-out ``(a, op, b)``), the same for the same arguments.

    Each operand's digit count is drawn from ``digits`` on its own, so ``(2, 3)`` mixes 2+2, 2+3
    and 3+3-digit problems; ``op`` is drawn from ``ops``.
    """
    return _generate(n, seed, heldout=False, ops=ops, digits=digits, prompt_style=prompt_style,
                     solution_style=solution_style)


def heldout_set(n: int, seed: int = 1, ops: tuple[str, ...] = ("+",), digits: tuple[int, ...] = (2,),
                prompt_style: str = "what_is", solution_style: str = "steps") -> list[dict]:
    r"""``n`` distinct evaluation problems, disjoint from every :func:`train_set`.

    The defaults give the quickstart's yardstick: two-digit additions asked as
    "What is 59 + 63? Put the final answer in \boxed{}."-style questions.
    """
    return _generate(n, seed, heldout=True, ops=ops, digits=digits, prompt_style=prompt_style,
                     solution_style=solution_style)


def write_jsonl(records: Iterable[dict], path: str | Path) -> Path:
    """Write one JSON object per line (UTF-8) and return the path; parent folders are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path
