"""The trained token ranges of a rendered text from its ids alone, for tokenizers whose tokens spell the text byte for
byte: the same ranges ``anyfit.data.tokenization._token_range`` finds from the character offsets, without them.

A byte-level BPE tokenizer (GPT-2's scheme: Qwen2.5/3, Llama-3, DeepSeek, GLM-4) with no prefix space cuts the text's
UTF-8 bytes into tokens: token t holds bytes [end[t-1], end[t]), ``end`` the running sum of a per-id byte-length
table built once per tokenizer. The offsets path reports a token that ends or starts inside a multi-byte character
as holding that whole character (the byte-level pre-tokenizer aligns each byte to its character), so "a token holds a
character of the span" is "its bytes meet the span's bytes", which is two binary searches per span.

When that holds is decided once per tokenizer from its pieces (``_eligible``: the model, normaliser, pre-tokenizer,
post-processor and added tokens) and checked for every text: the normaliser must leave the text as it is (ASCII
always is; other text is normalised by the tokenizer's own normaliser and compared), and the tokens' byte lengths
must add up to the text's. A text that fails goes the offsets way (``None`` here): never an approximation.
tests/unit/data/test_token_bytes.py compares both paths over every tokenizer of the offline assets.
"""

from __future__ import annotations

import itertools
import json
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers.models import BPE
from tokenizers.pre_tokenizers import ByteLevel

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# The normalisers whose output, where it equals the input, aligns every character with itself (checked per text).
_NORMALIZERS = {"NFC", "NFKC"}
# Pre-tokenizers that only split (never drop or change a character), besides the byte-level one.
_SPLITS = {"Split", "Digits", "Punctuation"}
_NEVER = 1 << 40  # the byte length of an id whose bytes are unknown: a text holding it fails the length check


@dataclass(frozen=True)
class TokenBytes:
    """The byte length of every id of a tokenizer whose tokens spell their text byte for byte."""

    lengths: np.ndarray  # int64, one per id
    normalizer: Any  # the backend's normaliser (its ``normalize_str`` checks a non-ASCII text), or None
    size: int  # the vocabulary size (added tokens included) the table was built for

    def ranges(self, ids: list[list[int]], texts: list[str],
               spans: list[list[tuple[int, int]]]) -> list[list[tuple[int, int]] | None]:
        """Per text, the token ranges [start, end) that hold a character of each of its character ``spans`` (the
        ids' tokens meeting the span's bytes); None for a text the table cannot place (see the module docstring).
        The whole batch at once: this runs on every token of a data set."""
        n = len(ids)
        counts = np.fromiter(map(len, ids), dtype=np.int64, count=n)
        first = np.zeros(n + 1, dtype=np.int64)  # each text's first token in the batch's flat numbering
        np.cumsum(counts, out=first[1:])
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(first[-1]))
        ends = np.cumsum(self.lengths[flat])  # each token's end, in the batch's bytes end to end
        starts = np.concatenate(([0], ends))[first]  # each text's first byte, and the batch's end last
        sizes, owners, bounds = self._byte_spans(texts, spans)
        good = np.diff(starts) == sizes
        owner = np.asarray(owners, dtype=np.int64)
        at = np.asarray(bounds, dtype=np.int64).reshape(-1, 2) + starts[owner, None]
        # the first token ending after the span's first byte; the last one starting before its end
        lo = np.searchsorted(ends, at[:, 0], "right") - first[owner]
        hi = np.searchsorted(ends, at[:, 1], "left") + 1 - first[owner]
        out: list[list[tuple[int, int]] | None] = [[] for _ in range(n)]
        for k, a, b in zip(owners, lo.tolist(), hi.tolist()):
            out[k].append((a, b))
        for k in np.flatnonzero(~good).tolist():
            out[k] = None
        return out

    def _byte_spans(self, texts: list[str], spans: list[list[tuple[int, int]]]
                    ) -> tuple[np.ndarray, list[int], list[int]]:
        """Each text's byte length (-1 where the normaliser would change it, or it has no UTF-8 form), and each
        span's owner and byte bounds (flat: start, end, start, end...)."""
        sizes = np.empty(len(texts), dtype=np.int64)
        owners: list[int] = []
        bounds: list[int] = []
        for k, (text, text_spans) in enumerate(zip(texts, spans)):
            owners += [k] * len(text_spans)
            if text.isascii():  # a character is a byte, and no normaliser changes ASCII
                sizes[k] = len(text)
                bounds += itertools.chain.from_iterable(text_spans)
                continue
            try:
                sizes[k] = len(text.encode("utf-8"))
            except UnicodeEncodeError:  # a lone surrogate: the offsets path says what it says
                sizes[k] = -1
            if self.normalizer is not None and sizes[k] >= 0 and self.normalizer.normalize_str(text) != text:
                sizes[k] = -1
            bounds += (len(text[:c].encode("utf-8", "surrogatepass")) for span in text_spans for c in span)
        return sizes, owners, bounds


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def token_bytes(tokenizer: PreTrainedTokenizerBase) -> TokenBytes | None:
    """The tokenizer's byte-length table, built once; None where its tokens do not spell their text byte for byte
    (the offsets path is taken)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    size = backend.get_vocab_size(with_added_tokens=True)
    made = _TABLES.get(tokenizer, False)
    if made is False or (made is not None and made.size != size):  # built anew when tokens were added
        made = _TABLES[tokenizer] = _table(backend, size) if _eligible(backend) else None
    return made


def _state(component: Any) -> dict:
    return json.loads(component.__getstate__()) if component is not None else {}


def _flat(state: dict, key: str) -> list[dict]:
    """A component's parts: a Sequence's members (nested ones flattened), or the component itself."""
    if state.get("type") != "Sequence":
        return [state] if state else []
    return [part for member in state.get(key, []) for part in _flat(member, key)]


def _eligible(backend: Any) -> bool:
    """Whether every token of ``backend`` is the bytes of the text it covers, as the byte-length table counts
    them, and its offsets are those bytes' characters: byte-level BPE with nothing that adds, drops or moves a
    character (a prefix space, a removing split, trimmed offsets, whitespace-stripping added tokens)."""
    model = backend.model
    if not isinstance(model, BPE) or model.byte_fallback or model.continuing_subword_prefix \
            or model.end_of_word_suffix:
        return False
    if not all(p.get("type") in _NORMALIZERS for p in _flat(_state(backend.normalizer), "normalizers")):
        return False
    pre = _flat(_state(backend.pre_tokenizer), "pretokenizers")
    byte_level = [p for p in pre if p.get("type") == "ByteLevel"]
    if len(byte_level) != 1 or byte_level[0].get("add_prefix_space") or any(
            p.get("type") != "ByteLevel" and (p.get("type") not in _SPLITS or p.get("behavior") == "Removed")
            for p in pre):
        return False
    for p in _flat(_state(backend.post_processor), "processors"):
        if not (p.get("type") == "TemplateProcessing" or (p.get("type") == "ByteLevel" and not p.get("trim_offsets"))):
            return False
    return not any(t.lstrip or t.rstrip for t in backend.get_added_tokens_decoder().values())


def _table(backend: Any, size: int) -> TokenBytes | None:
    """Each id's byte length: a byte-level piece is one character per byte (the 256 characters of the byte-level
    pre-tokenizer's alphabet); an added token is its text's UTF-8."""
    alphabet = set(ByteLevel.alphabet())
    lengths = np.full(size, _NEVER, dtype=np.int64)
    for piece, i in backend.get_vocab(with_added_tokens=False).items():
        if i < size and piece and alphabet.issuperset(piece):
            lengths[i] = len(piece)
    for i, token in backend.get_added_tokens_decoder().items():
        spelled = len(token.content.encode("utf-8"))
        if i >= size or not spelled or (lengths[i] != _NEVER and lengths[i] != spelled):
            return None  # an added token the model's vocabulary spells otherwise: no single length
        lengths[i] = spelled
    normalizes = bool(_flat(_state(backend.normalizer), "normalizers"))  # DeepSeek's is an empty Sequence
    return TokenBytes(lengths, backend.normalizer if normalizes else None, size)
