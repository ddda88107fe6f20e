import json
import random
import re

import pytest

from anyfit.data.answers import extract_boxed
from anyfit.data.synthetic import (
    heldout_set,
    is_heldout,
    make_record,
    solution,
    solve_steps,
    train_set,
    write_jsonl,
)

_EQUATION = re.compile(r"^(\d+) ([+-]) (\d+)(:| = (\d+))$")


def _numbers(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def _check(record: dict) -> tuple[int, str, int]:
    """Recompute the record's answer from its prompt and its steps; return its (a, op, b)."""
    assert set(record) >= {"prompt", "completion", "answer"}
    first, *steps, last = record["completion"].split("\n")
    a, op, b, _, stated = _EQUATION.match(first).groups()
    a, b = int(a), int(b)
    result = a + b if op == "+" else a - b
    if stated is not None:  # the direct style: "a op b = result", no steps
        assert int(stated) == result and not steps
    assert record["answer"] == str(result)
    assert extract_boxed(record["completion"]) == record["answer"]
    assert last == f"\\boxed{{{result}}}"
    assert r"\boxed{}" in record["prompt"]
    # The operands appear in the prompt in order (the stories have no other numbers).
    assert _numbers(record["prompt"].replace(r"\boxed{}", ""))[:2] == [a, b]
    # Every step's arithmetic is right: "a+b(+1)=c" / "(1)a-b(-1)=c".
    for step in steps:
        lhs, rhs = step.split(",")[0].split("=")
        assert eval(lhs) == int(rhs), step  # digits and + - only
    # Reading the columns back (ones first) gives the result.
    if steps:
        written = [int(s.split(",")[0].split("=")[1]) for s in steps]
        digits = "".join(str(w % 10) for w in reversed(written[:-1]))
        assert int(str(written[-1]) + digits) == result
    return a, op, b


def test_deterministic():
    assert train_set(50, seed=3) == train_set(50, seed=3)
    # The solution style changes only the completions, never which problems are drawn.
    same = [(r["prompt"], r["answer"]) for r in train_set(50, seed=3)]
    assert [(r["prompt"], r["answer"]) for r in train_set(50, seed=3, solution_style="direct")] == same
    assert heldout_set(20, seed=5) == heldout_set(20, seed=5)
    assert train_set(50, seed=3) != train_set(50, seed=4)


def test_pinned_first_record():
    """A change to the generator changes every run's data: it should be deliberate."""
    assert train_set(1, seed=0) == [{
        "prompt": "Compute 365 - 75. Put the final answer in \\boxed{}.",
        "completion": "365 - 75:\n5-5=0\n16-7=9, borrow 1\n3-0-1=2\n\\boxed{290}",
        "answer": "290"}]


def test_answers_and_steps_are_correct():
    for r in train_set(500, seed=0) + heldout_set(100, ops=("+", "-"), digits=(2, 3), prompt_style="mixed"):
        _check(r)
        assert r["completion"].count("\n") >= 3  # the equation, two or more columns, the box
    for r in train_set(200, seed=0, solution_style="direct"):
        _check(r)


@pytest.mark.parametrize("a,op,b", [(59, "+", 63), (999, "+", 1), (45, "+", 978), (100, "-", 1),
                                    (305, "-", 298), (10, "-", 10), (500, "-", 499), (99, "+", 99)])
def test_edge_cases(a, op, b):
    for solution_style in ("steps", "direct"):
        _check(make_record(a, op, b, random.Random(0), prompt_style="what_is", solution_style=solution_style))


def test_solution_format():
    assert solution(59, "+", 63) == "59 + 63:\n9+3=12, carry 1\n5+6+1=12\n\\boxed{122}"
    assert solution(82, "-", 47) == "82 - 47:\n12-7=5, borrow 1\n8-4-1=3\n\\boxed{35}"
    assert solution(59, "+", 63, style="direct") == "59 + 63 = 122\n\\boxed{122}"
    assert solve_steps(123, "+", 45) == ["3+5=8", "2+4=6", "1+0=1"]
    with pytest.raises(ValueError, match="a >= b"):
        solve_steps(3, "-", 5)


def test_train_and_heldout_are_disjoint():
    key = lambda r: _check(r)  # noqa: E731
    train = {key(r) for r in train_set(3000, seed=0)}
    held = {key(r) for r in heldout_set(200, ops=("+", "-"), digits=(2, 3), prompt_style="mixed")}
    assert train and held and not train & held
    assert all(is_heldout(*k) for k in held) and not any(is_heldout(*k) for k in train)


def test_sets_are_distinct_and_sized():
    train = train_set(300, seed=1)
    assert len(train) == 300 and len({_check(r) for r in train}) == 300


def test_variety():
    train = train_set(400, seed=0)
    ops = {_check(r)[1] for r in train}
    digit_counts = {len(str(_check(r)[0])) for r in train}
    assert ops == {"+", "-"} and digit_counts == {2, 3}
    assert any(r["prompt"].startswith("What is") for r in train)
    assert any("apples" in r["prompt"] for r in train) and any("$" in r["prompt"] for r in train)
    assert any("km" in r["prompt"] for r in train)
    # Every evaluation problem of the quickstart is a two-digit addition asked the same way.
    for r in heldout_set(32):
        a, op, b = _check(r)
        assert op == "+" and 10 <= a <= 99 and 10 <= b <= 99
        assert r["prompt"] == f"What is {a} + {b}? Put the final answer in \\boxed{{}}."
    # The quickstart's two-digit additions are in the training distribution too.
    assert sum(1 for r in train if r["prompt"].startswith("What is") and _check(r)[1] == "+"
               and max(_check(r)[0], _check(r)[2]) < 100) > 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="prompt style"):
        train_set(2, prompt_style="poem")
    with pytest.raises(ValueError, match="solution style"):
        train_set(2, solution_style="essay")
    with pytest.raises(ValueError, match="ops"):
        train_set(2, ops=("*",))
    with pytest.raises(ValueError, match="cannot draw"):
        heldout_set(50, digits=(1,))  # only 100 one-digit additions exist, 1 in 8 of them held out


def test_write_jsonl(tmp_path):
    records = train_set(5, seed=0)
    path = write_jsonl(records, tmp_path / "sub" / "train.jsonl")
    assert [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] == records
