import pytest

from anyfit.data.answers import extract_boxed, extract_gsm8k, gold_answer, plain_number, split_unit
from anyfit.evaluation.answers import extract_answer, last_number, trailing_math


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
    ("<answer> The answer is 7 </answer>", "answer_tag", ("7", "answer_tag")),
    ("#### 2^10", "boxed", ("2^10", "gsm8k")),
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


@pytest.mark.parametrize("text, expected", [
    # The whole final expression, never its leading number.
    ("#### 2^10", "2^10"),
    ("#### 5/14", "5/14"),
    ("#### -5/2", "-5/2"),
    ("#### 3\\sqrt{2}", "3\\sqrt{2}"),
    ("#### $\\frac{5}{14}$", "\\frac{5}{14}"),
    ("#### 40 - 15 = 25", "40 - 15 = 25"),
    ("#### 25%", "25%"),
    ("#### 5 (five)", "5 (five)"),
    # Plain numbers: sign, decimals, currency, separators; unit words dropped.
    ("#### -3", "-3"),
    ("#### 3.75", "3.75"),
    ("#### .5", ".5"),
    ("#### $1,234", "1234"),
    ("#### \\$1,234.50", "1234.50"),
    ("#### -$5", "-5"),
    ("#### £45", "45"),
    ("#### 72 apples.", "72"),
    ("#### 18 dollars per hour", "18"),
    ("#### 90 km/h", "90"),
    ("#### 100 m", "100"),
    ("#### 1/2 cup", "1/2"),
    ("#### 2 x", "2 x"),  # one letter after a number is a product, not a unit
    ("#### **72**", "72"),
    ("#### The answer is 72", "72"),
    ("#### 6\n#### 8", "8"),
    ("no hashes", None),
])
def test_extract_gsm8k(text, expected):
    assert extract_gsm8k(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("So we get $(1,2)$.", "(1,2)"),
    ("Hence \\(x = 5\\).", "x = 5"),
    ("so $$\\frac{1}{2}$$", "\\frac{1}{2}"),
    ("The answer is 2^10.", "2^10"),
    ("The coordinates are (3, 4)", "(3, 4)"),
    ("The roots are 1, 2, 3", "1, 2, 3"),
    ("Total: 1,500", "1500"),
    ("The answer is (3, 4", None),  # unbalanced
    ("it is 5 apples", None),
    ("", None),
])
def test_trailing_math(text, expected):
    assert trailing_math(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("it is -3.5 degrees", "-3.5"),
    ("costs $5.", "5"),
    ("we need $x^2 + 3x$ terms", None),  # a coefficient
    ("the exponent in 2^10 matters", None),
    ("let f(2) be the value", None),  # a function argument
    ("the point (1,2) is on it", None),  # an entry of a tuple
    ("the roots 1, 2, 3 are real", None),  # an entry of a list
])
def test_last_number_is_never_a_fragment(text, expected):
    assert last_number(text) == expected


def test_fallback_does_not_take_a_fragment():
    assert extract_answer("So we get $(1,2)$.") == ("(1,2)", "last_number")
    assert extract_answer("The answer is 2^10.") == ("2^10", "last_number")
    assert extract_answer("we need $x^2 + 3x$ terms") == (None, "none")


@pytest.mark.parametrize("answer, expected", [
    ("72 apples", ("72", "apples")),
    ("$1,234.50", ("1234.50", None)),
    ("5 cm^2", ("5", "cm^2")),
    ("1/2 cup", ("1/2", "cup")),
    ("2^10", ("2^10", None)),
    ("3 or 5", ("3 or 5", None)),
    ("2\\pi r h", ("2\\pi r h", None)),
])
def test_split_unit(answer, expected):
    assert split_unit(answer) == expected


def test_plain_number():
    assert plain_number("-\\$1,000.5") == "-1000.5"
    assert plain_number("033") == "033"
    assert plain_number("2^10") is None and plain_number("1,23") is None and plain_number("25%") is None


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
    ("She saved 2,500 + 1,000 = <<2500+1000=3500>>3,500 dollars.\n#### 3,500", None, "3500"),
    ("C(10, 5), or equivalently 252", None, "C(10, 5), or equivalently 252"),  # free-form gold kept whole
    (None, "So the sum is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),  # MATH solution
    ("", "\\boxed{1} then \\boxed{2}", "2"),
    (None, "no final answer", None),
    (None, None, None),
])
def test_gold_answer(answer, solution, expected):
    assert gold_answer(answer, solution) == expected
