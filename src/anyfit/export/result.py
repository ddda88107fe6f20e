"""What an export produced: the folder, its dtype, and for each GGUF file how the model read back from it
compares with the merged model (``GGUFAgreement``, judged against ``CONVERSION_TOLERANCE``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# How far the model transformers reads from a GGUF file may be from the merged model with its weights rounded
# to the file's types: max |logit difference| at a position, as a share of the spread (max - min) of the
# logits there. The weights are then the same numbers, so only the order of float operations differs
# (measured: exactly 0 for every type); a conversion error (a q/k permutation missing, a wrong tensor, norm or rope
# setting) lands at 0.3 and above at every width, which is why the check is not against the unrounded model:
# at 4 bits on a small model honest rounding alone moves the logits that far (see the README).
CONVERSION_TOLERANCE = 1e-3


@dataclass
class GGUFAgreement:
    """How a GGUF file, read back by transformers, compares with the merged model on the check prompts."""

    type: str
    conversion_diff: float  # max |logit diff| / logit spread against the merged model with rounded weights
    max_abs_diff: float  # against the merged model itself: largest |logit difference| over prompts and positions
    max_rel_diff: float  # the same, as a share of the merged model's logit spread at that position
    top1_agreement: float  # share of positions where both pick the same next token
    greedy_match: int  # prompts whose greedy continuation (VERIFY_NEW_TOKENS tokens) is identical
    prompts: int

    @property
    def ok(self) -> bool:
        return self.conversion_diff <= CONVERSION_TOLERANCE

    def describe(self) -> str:
        return (f"{self.type}: equal to the merged model with {self.type}-rounded weights within "
                f"{self.conversion_diff:.1e} of the logit spread (allowed {CONVERSION_TOLERANCE:.0e}); against the "
                f"merged model itself max |logit diff| {self.max_abs_diff:.3g} ({self.max_rel_diff:.1%} of the "
                f"spread), same top token at {self.top1_agreement:.1%} of positions, same greedy continuation "
                f"for {self.greedy_match}/{self.prompts} prompts")


@dataclass
class ExportResult:
    out: Path
    dtype: str
    merged_adapter: bool
    gguf: dict[str, Path] = field(default_factory=dict)
    agreement: dict[str, GGUFAgreement] = field(default_factory=dict)
    pushed: str | None = None
