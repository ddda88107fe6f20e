import pytest

from anyfit.evaluation.answers import (
    extract_answer,
    extract_boxed,
    gold_answer,
    last_number,
)


@pytest.mark.parametrize("text, expected", [
    ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("\\boxed{\\left\\{ x \\mid x^{2} > 1 \\right\\}}", "\\left\\{ x \\mid x^{2} > 1 \\right\\}"),
    ("first \\boxed{1}, then \\boxed{2}", "2"),
    ("\\fbox{7}", "7"),
    ("\\boxed{3} and finally \\fbox{4}", "4"),
    ("MATH writes \\boxed 5.", "5"),
    ("\\boxed {12}", "12"),
    ("use \\boxed to mark it", None),
    ("cut off: \\boxed{\\frac{1}{", None),
    ("no answer here", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("text, style, expected", [
    ("The answer is \\boxed{\\sqrt{2}}.", "boxed", ("\\sqrt{2}", "boxed")),
    ("a \\boxed{1} b \\boxed{\\{1, 2\\}}", "boxed", ("\\{1, 2\\}", "boxed")),
    ("<think> 3+4 </think> <answer> 7 </answer>", "answer_tag", ("7", "answer_tag")),
    ("<answer> x </answer> then <answer>\\boxed{\\frac{3}{4}}</answer>", "answer_tag", ("\\frac{3}{4}", "answer_tag")),
    ("She has 1000 + 234 = 1,234.\n#### 1,234", "boxed", ("1234", "gsm8k")),
    ("#### $72 apples", "boxed", ("72", "gsm8k")),
    # The form the template asks for wins; another structured form is still an answer, with its own name.
    ("\\boxed{5} <answer> 6 </answer>", "answer_tag", ("6", "answer_tag")),
    ("no tags, but \\boxed{9}", "answer_tag", ("9", "boxed")),
    # The last number is a fallback, flagged as such.
    ("I think it is 12, no, 1,500 apples.", "boxed", ("1500", "last_number")),
    ("it is -3.5 degrees", "boxed", ("-3.5", "last_number")),
    ("答案是5", "boxed", ("5", "last_number")),
    ("Put the answer in \\boxed{} please", "boxed", (None, "none")),
    ("<answer></answer>", "answer_tag", (None, "none")),
    ("nothing numeric", "boxed", (None, "none")),
    ("", "boxed", (None, "none")),
])
def test_extract_answer(text, style, expected):
    assert extract_answer(text, style) == expected


def test_unknown_style():
    with pytest.raises(ValueError, match="style"):
        extract_answer("1", "latex")


def test_last_number_ignores_identifiers():
    assert last_number("x2 and v1.5 but 3") == "3"
    assert last_number("x2") is None


@pytest.mark.parametrize("answer, solution, expected", [
    ("72", None, "72"),  # a short answer field
    ("Natalia sold 48/2 = 24 clips.\n#### 72", None, "72"),  # GSM8K's 'answer' column is a whole solution
    (None, "48+24=72 clips.\n#### 72", "72"),  # GSM8K mapped as completion
    (None, "So the sum is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),  # MATH solution
    ("", "\\boxed{1} then \\boxed{2}", "2"),
    (None, "no final answer", None),
    (None, None, None),
])
def test_gold_answer(answer, solution, expected):
    assert gold_answer(answer, solution) == expected
