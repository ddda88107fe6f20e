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
])
def test_equivalent(predicted, gold):
    assert grade(predicted, gold)


@pytest.mark.parametrize("predicted, gold", [
    ("(1,2)", "(1,3)"),
    ("7", "8"),
    ("\\frac{1}{3}", "0.5"),
    ("[1,2]", "(1,2)"),
])
def test_not_equivalent(predicted, gold):
    assert not grade(predicted, gold)


@pytest.mark.parametrize("predicted", [None, "", "   ", "}{", "\\frac{", "\\boxed{", "$$", "\\left(", "a" * 2000,
                                       "\x00\x01", "}}}}{{{{", "\\sqrt{-}"])
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


def test_works_off_the_main_thread():
    """math-verify's signal-based timeout only works in the main thread; grading must still work elsewhere."""
    results = []
    t = threading.Thread(target=lambda: results.extend([grade("\\frac12", "0.5"), grade("(1,2)", "(1,3)")]))
    t.start()
    t.join()
    assert results == [True, False]
