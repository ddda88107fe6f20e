"""``show_example`` prints one tokenized example with its loss mask visible (``anyfit render``): seeing exactly which
tokens carry loss is the quickest check that a template and mask are right."""

from __future__ import annotations

from itertools import groupby

from anyfit.data.audit import IGNORE_INDEX

GREEN = "\033[32m"
GREY = "\033[90m"
RESET = "\033[0m"
OPEN, CLOSE = "\u27e6", "\u27e7"  # ⟦ ⟧: rarely found in training text, so the marks stay unambiguous
RUN = 8  # an untrained token repeated this often or more (an image's tokens) is shown once, with its count


def show_example(input_ids: list[int], labels: list[int], tokenizer, color: bool) -> str:
    """The decoded example, trained tokens green and masked ones grey (``color``), or trained spans
    wrapped in ⟦ ⟧ (no color); then a line with the token counts. A run of one untrained token repeated (an image's
    tokens) is shown once with its count: ``<|image_pad|>×47``."""
    if len(input_ids) != len(labels):
        raise ValueError(f"input_ids ({len(input_ids)}) and labels ({len(labels)}) differ in length.")
    pieces = []
    # Decoding whole spans (not token by token) keeps multi-byte characters intact inside a span.
    for trained, group in groupby(zip(input_ids, labels), key=lambda pair: pair[1] != IGNORE_INDEX):
        text = _collapsed([tok for tok, _ in group], tokenizer) if not trained else \
            tokenizer.decode([tok for tok, _ in group], skip_special_tokens=False)
        if color:
            pieces.append(f"{GREEN if trained else GREY}{text}{RESET}")
        else:
            pieces.append(f"{OPEN}{text}{CLOSE}" if trained else text)
    n_trained = sum(label != IGNORE_INDEX for label in labels)
    share = 100.0 * n_trained / max(len(input_ids), 1)
    return "".join(pieces) + f"\n{len(input_ids)} tokens, {n_trained} trained ({share:.0f}%)"


def _collapsed(ids: list[int], tokenizer) -> str:
    """Masked tokens decoded, each run of RUN or more equal tokens as the token and its count."""
    pieces, start = [], 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or ids[k] != ids[start]:
            if k - start >= RUN:
                pieces.append((None, f"{tokenizer.decode([ids[start]], skip_special_tokens=False)}\u00d7{k - start}"))
            else:
                pieces.append((ids[start:k], None))
            start = k
    out, pending = [], []
    for run, text in pieces:  # neighbouring short runs decoded together (multi-byte characters stay whole)
        if run is not None:
            pending += run
            continue
        if pending:
            out.append(tokenizer.decode(pending, skip_special_tokens=False))
            pending = []
        out.append(text)
    if pending:
        out.append(tokenizer.decode(pending, skip_special_tokens=False))
    return "".join(out)
