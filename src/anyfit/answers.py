"""Finding the final answer in a model's (or a reference solution's) text."""

from __future__ import annotations


def extract_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (or ``\fbox{...}``), braces balanced: ``\boxed{\frac{1}{2}}`` -> ``\frac{1}{2}``.

    Written by hand because a regular expression cannot match nested braces.
    """
    for marker in ("\\boxed", "\\fbox"):
        start = text.rfind(marker + "{")
        if start < 0:
            continue
        i = start + len(marker) + 1
        depth = 1
        for j in range(i, len(text)):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    return text[i:j].strip()
        return None  # unbalanced: the answer was cut off
    return None
