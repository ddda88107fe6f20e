"""Library messages a user cannot act on, kept out of a run's output: one place, each with why.

A first run should print anyfit's lines and progress only. PEFT imports bitsandbytes whenever it is installed, and
bitsandbytes then warns, on CPUs with AVX-512 BF16, that its 4-bit CPU kernel package is missing: a run that
quantizes nothing never calls that kernel (a QLoRA run still sees the warning, where installing it helps). PEFT
reads transformers' deprecated ``is_gradient_checkpointing`` when it wraps a model, and transformers warns about
that read on every LoRA run: PEFT's code, not the user's.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

_BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"


@contextlib.contextmanager
def quiet_peft(quantized: bool) -> Iterator[None]:
    """Import or call PEFT inside this block without the two messages above (bitsandbytes' only when the run
    quantizes nothing)."""
    logger = logging.getLogger(_BNB_CPU_LOGGER)
    level = logger.level
    if not quantized:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                    category=FutureWarning)
            yield
    finally:
        logger.setLevel(level)
