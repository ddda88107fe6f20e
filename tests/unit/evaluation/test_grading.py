import threading

import pytest

from anyfit.evaluation import grading
from anyfit.evaluation.grading import grade, normalize


@pytest.mark.parametrize("predicted, gold", [
    ("\\frac12", "0.5"),
    ("0.5", "\\frac{1}{2}"),
    ("2\\sqrt2", "\\sqrt8"),
    ("\\dfrac{3}{4}", "0.75"),
    ("(1,2)", "(1,2)"),
    ("x^2+2x+1", "(x+1)^2"),
    ("\\{1,2\\}", "\\{2,1\\}"),
    ("$5$", "5"),
    ("1,234", "1234"),
    ("3", "3.0"),
    ("2^10", "1024"),
    ("5/14", "\\frac{5}{14}"),
    ("x \\ge 2", "[2, \\infty)"),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}"),
    ("n!", "\\prod_{k=1}^{n} k"),  # sums and products are evaluated
    ("\\sum_{i=1}^{n} \\frac{1}{i}", "\\sum_{k=1}^{n} \\frac{1}{k}"),
])
def test_equivalent(predicted, gold):
    assert grade(predicted, gold)


@pytest.mark.parametrize("predicted, gold", [
    ("(1,2)", "(1,3)"),
    ("7", "8"),
    ("\\frac{1}{3}", "0.5"),
    ("[1,2]", "(1,2)"),
    ("2", "2^10"),  # the leading number of an expression
    ("5", "5/14"),
    ("\\begin{pmatrix} 2 \\\\ 1 \\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"),
    ("\\sum_{k=2}^{n} \\frac{1}{k}", "\\sum_{k=1}^{n} \\frac{1}{k}"),
])
def test_not_equivalent(predicted, gold):
    assert not grade(predicted, gold)


@pytest.mark.parametrize("predicted, gold, correct", [
    # Free-form gold answers: every phrasing counts, a remark does not, nothing else does.
    ("252", "C(10, 5), or equivalently 252", True),
    ("\\binom{10}{5}", "C(10, 5), or equivalently 252", True),
    ("C(10,5)", "C(10, 5), or equivalently 252", True),
    ("5", "C(10, 5), or equivalently 252", False),
    ("\\binom{10}{4}", "C(10, 5), or equivalently 252", False),
    ("100", "100 (i.e., all values)", True),
    ("10", "100 (i.e., all values)", False),
    ("7", "7 (the smallest such n)", True),
    ("0.5", "\\frac{1}{2} or 0.5", True),
    ("56", "C(8,3) = 56", True),
    ("8", "C(8,3) = 56", False),
    ("50\\%", "\\frac{1}{2} (\\text{or } 50\\%)", True),
    # "or" between different values lists several answers, all needed; a hedging prediction is wrong.
    ("3", "x = 3 or x = -3", False),
    ("\\pm 3", "x = 3 or x = -3", True),
    ("x = -3 \\text{ or } x = 3", "x = 3 or x = -3", True),
    ("3 \\text{ or } 5", "3", False),
    ("3, i.e., 5", "3", False),
    # The false positive of the issue: an unparsable expression is compared as a string, not as a stray number.
    ("sum_(k=2)^n 1/k", "sum_(k=1)^n 1/k", False),
    ("sum_(k=1)^n 1/k", "sum_(k=1)^n 1/k", True),
    ("\\sum_{k=1}^n \\frac{1}{k}", "sum_(k=1)^n 1/k", True),
    ("1", "sum_(k=1)^n 1/k", False),
    # Units, money, choices, AIME's leading zeros, percent.
    ("5", "5 cm", True),
    ("5\\text{ centimeters}", "5 cm", True),
    ("5\\text{ m}", "5 cm", False),
    ("12\\text{ units}^2", "12 \\text{ square units}", True),
    ("18.9", "\\$18.90", True),
    ("B", "\\text{(B)}", True),
    ("\\textbf{(B) }12", "B", True),
    ("C", "\\text{(B)}", False),
    ("(A) or (B)", "\\text{(A)}", False),
    ("33", "033", True),
    ("330", "033", False),
    ("12.5\\%", "12.5", True),
    ("50\\%", "5\\%", False),
    # Variables are not units; words are not products of symbols.
    ("3", "3ab", False),
    ("5", "5t", False),
    ("\\text{BAC}", "\\text{ABC}", False),
    ("\\text{No}", "no", True),
    ("Tuesday", "\\text{Tuesday}", True),
    ("x = 3", "3", True),
    ("y = 3", "x = 3", False),
])
def test_free_form_answers(predicted, gold, correct):
    assert grade(predicted, gold) is correct


@pytest.mark.parametrize("predicted", [None, "", "   ", "}{", "\\frac{", "\\boxed{", "$$", "\\left(", "a" * 2000,
                                       "\x00\x01", "}}}}{{{{", "\\sqrt{-}", "(((", "or or or", "= = =", "(i.e.)",
                                       "5 (", "C(", "sum_(", "\\text{", "#### $", "\\begin{pmatrix}", "1 (or)"])
def test_garbage_is_incorrect_not_an_error(predicted):
    assert grade(predicted, "5") is False


def test_missing_gold_is_incorrect():
    assert grade("5", None) is False
    assert grade("5", "") is False


def test_integers_skip_sympy(monkeypatch):
    def boom(*args):
        raise AssertionError("math-verify called for plain integers")

    monkeypatch.setattr(grading, "_math_verify", boom)
    assert grade("1,234", "1234")
    assert not grade("41", "42")
    assert grade("-3", "-3")


def test_normalize():
    assert normalize("$ 1,234. $") == "1,234"
    assert normalize("\\(\\frac{1}{2}\\)") == "\\frac{1}{2}"
    assert normalize("1\\!000") == "1000"
    assert normalize("1{,}000") == "1,000"
    assert normalize("a\\ b \\\\ c") == "ab \\\\ c"  # a "\\ " space goes, a matrix row break "\\\\" stays


def test_works_off_the_main_thread():
    """math-verify's signal-based timeout only works in the main thread; grading must still work elsewhere."""
    results = []
    t = threading.Thread(target=lambda: results.extend([grade("\\frac12", "0.5"), grade("(1,2)", "(1,3)"),
                                                        grade("n!", "\\prod_{k=1}^{n} k")]))
    t.start()
    t.join()
    assert results == [True, False, True]
