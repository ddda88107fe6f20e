"""Rendered examples to ``input_ids`` and ``labels``, with the length policy and a report of what was kept.

``labels`` are aligned with ``input_ids`` (HF convention: the model shifts them by one inside its loss);
``IGNORE_INDEX`` (-100, from ``anyfit.data.audit``, which checks the masks) marks a position without loss. Position 0 is always
ignored because no token predicts it, so the count of other labels is exactly the number of tokens the
loss is taken over.

A chat template's rendering is tokenized whole, as inference tokenizes a rendered conversation, and the loss mask
comes from the characters each token covers (``_tokenize_whole`` states the rule at a boundary). A text template's
prompt is tokenized on its own, so its ids are the ones the model is given when it generates; the completion's ids
are those that follow them in the joined text (tokenized apart only where a token straddles the two, e.g. a prompt
ending with a space). ``data.template=trl`` renderings are tokenized whole, as TRL does (see ``anyfit.data.templates``).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from anyfit.config import DataConfig
from anyfit.data.audit import IGNORE_INDEX, Findings, MaskAudit, audit_lines
from anyfit.data.chat import template_name, use_chat_template
from anyfit.data.formats import Example, to_examples
from anyfit.data.image_tokens import ImageTokens, expand_image_records, rendered_text
from anyfit.data.stopping import stop_token_ids
from anyfit.data.sources import DataError
from anyfit.data.templates import (
    Joined,
    MissingAnswer,
    Rendered,
    Rendering,
    TemplateMasked,
    generation_template,
    render,
    render_prompt,
    uses_chat_template,
)
from anyfit.data.token_bytes import token_bytes

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase



# Why an example is dropped: the report's count, how the data line says it, and what to change when no example is
# left ({limit}: data.max_length).
DROPS = (
    ("dropped_overlong", "as longer than data.max_length={limit} (data.overlong=drop)",
     "longer than data.max_length={limit} (set data.overlong=truncate or raise data.max_length)"),
    ("dropped_nothing_to_train", "with nothing to train on (a conversation without an assistant turn, or an empty "
     "completion)", "with nothing to train on (conversations without an assistant turn, or empty completions: check "
     "the data, e.g. with anyfit render)"),
    ("dropped_no_target", "with no trainable tokens left within data.max_length={limit} (the prompt fills it)",
     "with no trainable tokens within data.max_length={limit} (the prompt alone fills it: raise data.max_length)"),
    ("dropped_no_answer", "for lack of an answer (no 'answer' field, no '#### N' or \\boxed{{}}) for the r1_zero "
     "template", "without an answer for r1_zero (map data.fields: {{answer: ...}} or use solutions ending in '#### N' "
     "or \\boxed{{}})"),
)


@dataclass
class DataReport:
    """What tokenization did to the data. ``loaded`` counts records; a record can make several examples (a
    conversation split per assistant turn), and the other counts are of examples. Lengths and token counts are over
    the kept examples. ``unused``, ``audit``, ``audit_places`` and ``split_records``: see ``anyfit.data.audit``."""

    loaded: int = 0
    truncated: int = 0
    truncated_tokens: int = 0  # the tokens the cut to data.max_length removed from those examples
    dropped_overlong: int = 0
    dropped_nothing_to_train: int = 0  # before any cut: a conversation without an assistant turn, ...
    dropped_no_target: int = 0  # the cut to max_length left no trained token
    dropped_no_answer: int = 0
    kept: int = 0
    total_tokens: int = 0
    trainable_tokens: int = 0
    max_length: int = 0
    mean_length: float = 0.0
    length_limit: int = 0  # data.max_length
    overlong: str = "truncate"  # data.overlong
    unused: dict[str, int] = field(default_factory=dict)  # record fields / message keys with content not read
    audit: dict[str, int] = field(default_factory=dict)  # mask audit finding -> records
    audit_places: dict[str, list[str]] = field(default_factory=dict)  # the first records of each finding
    split_records: int = 0  # records made into several examples
    stop_only_examples: int = 0  # kept examples that train nothing but their end-of-turn or EOS token
    notes: dict[str, int] = field(default_factory=dict)  # what was done to some records (anyfit.data.audit.NOTES)
    images: int = 0  # images of the kept examples, and the tokens the processor expands them into
    image_tokens: int = 0
    images_shrunk: int = 0  # images the processor shrinks to its size limit (it keeps fewer pixels than they have)

    def summary(self) -> str:
        made = f" ({self.split_records} split into several examples)" if self.split_records else ""
        parts = [f"Loaded {self.loaded} records{made}, kept {self.kept} examples."]
        if self.truncated:
            parts.append(f"{self.truncated} were cut to data.max_length={self.length_limit} tokens "
                         f"({self.truncated_tokens:,} tokens cut away).")
        parts += [f"{getattr(self, key)} were dropped {said.format(limit=self.length_limit)}."
                  for key, said, _ in DROPS if getattr(self, key)]
        if self.kept:
            share = 100.0 * self.trainable_tokens / max(self.total_tokens, 1)
            parts.append(f"{self.total_tokens:,} tokens, {self.trainable_tokens:,} trained on ({share:.0f}%); "
                         f"longest {self.max_length}, mean {self.mean_length:.1f} tokens per example.")
        if self.images:
            shrunk = f" ({self.images_shrunk:,} shrunk by the processor to its size limit)" if self.images_shrunk else ""
            parts.append(f"{self.images:,} images{shrunk}, {self.image_tokens:,} image tokens (never trained on).")
        # What was left unread and what the mask audit found: a line each, after the counts.
        return "\n  ".join([" ".join(parts), *audit_lines(dataclasses.asdict(self))])


TokenizedExample = dict[str, list[int]]  # {"input_ids": [...], "labels": [...]}


class Fate(enum.IntEnum):
    """What the length policy and the template did to one record (kept, or why it was dropped)."""

    KEPT = 0
    TRUNCATED = 1  # kept, cut to data.max_length
    DROPPED_OVERLONG = 2
    DROPPED_NOTHING_TO_TRAIN = 3
    DROPPED_NO_TARGET = 4
    DROPPED_NO_ANSWER = 5

    @property
    def kept(self) -> bool:
        return self in (Fate.KEPT, Fate.TRUNCATED)


_REPORT_FIELD = {Fate.TRUNCATED: "truncated", Fate.DROPPED_OVERLONG: "dropped_overlong",
                 Fate.DROPPED_NOTHING_TO_TRAIN: "dropped_nothing_to_train", Fate.DROPPED_NO_TARGET: "dropped_no_target",
                 Fate.DROPPED_NO_ANSWER: "dropped_no_answer"}


def tokenize_dataset(records_or_examples: Sequence[Mapping[str, Any]] | Sequence[Example],
                     tokenizer: PreTrainedTokenizerBase, cfg: DataConfig) -> tuple[list[TokenizedExample], DataReport]:
    """Tokenize raw records (normalised with ``cfg``) or Examples; apply ``cfg.max_length``/``cfg.overlong``.

    Returns ``[{"input_ids": [...], "labels": [...]}, ...]`` (unpadded; a record can make several, see
    ``anyfit.data.chat``) and the report. Raises DataError if no example is left, saying which filter removed them
    and which setting to change. ``cfg`` is taken as validated (``anyfit.config.validate`` checks ``data.template``).
    """
    if not records_or_examples:
        raise DataError("No examples to tokenize: the dataset is empty.")
    use_chat_template(tokenizer, cfg.chat_template)
    if isinstance(records_or_examples[0], Example):
        examples = list(records_or_examples)
    else:
        examples = to_examples(records_or_examples, cfg)
    results = tokenize_each(examples, tokenizer, cfg)
    parts = [part for result in results for part in result.parts]
    out = [{"input_ids": ids, "labels": labels} for fate, ids, labels, _ in parts if fate.kept]
    findings = Findings()
    for result in results:
        findings.add(result)
    report = report_of([fate for fate, *_ in parts], [len(e["input_ids"]) for e in out],
                       [_count_trained(e["labels"]) for e in out], cfg.max_length, cfg.overlong,
                       cut=[cut for *_, cut in parts], records=len(results), findings=findings)
    if not out:
        raise DataError(nothing_left(report))
    findings.check(cfg)
    return out, report


@dataclass
class RecordResult:
    """What one record became: its parts (``(fate, input_ids, labels, cut)`` of each example it makes, after the
    length policy; empty lists for a dropped one), the fields it left unread, and what the mask audit found."""

    parts: list[tuple[Fate, list[int], list[int], int]]
    unused: tuple[str, ...] = ()
    findings: tuple[str, ...] = ()
    place: str = ""
    stop_only: int = 0  # its kept examples that train nothing but their stop (the audit's ``stop_only``)
    vision: list[dict] = field(default_factory=list)  # an image record: each part's text and images (image_tokens)


def tokenize_each(examples: Sequence[Example], tokenizer: PreTrainedTokenizerBase, cfg: DataConfig,
                  images: ImageTokens | None = None) -> list[RecordResult]:
    """The result of every example, in order: the one rule behind ``tokenize_dataset`` and the token store
    (``anyfit.data.store``). Records with images take the ids of ``images``' processor
    (``anyfit.data.image_tokens``)."""
    if not examples:
        return []
    audit = MaskAudit.of(tokenizer, cfg)
    # laid_out: the mask is anyfit's own segments (assistant turns by construction), not a template's or the data's.
    laid_out = [False] * len(examples)
    notes: dict[int, list[str]] = {}  # what the data report says of a record (an empty think block kept out)
    texts: dict[int, list[str]] = {}  # image records: each part's rendered text
    if examples[0].kind == "tokens":  # pre-tokenized: no template, the mask says what is trained
        pairs = [[_pretokenized(e, cfg, len(tokenizer))] for e in examples]
    else:
        renderings: list[Rendered] = []
        owners: list[int] = []
        pairs = [[] for _ in examples]
        # Rendering (chat templates, one example at a time) is the slow part on large sets: a bar from 5k examples.
        for i, example in enumerate(tqdm(examples, desc="render", unit="example", leave=False,
                                         disable=len(examples) < 5000)):
            if example.images:  # before the template: a text-only model's template fails on image parts
                (images or ImageTokens()).check(example)
            try:
                parts = render(example, tokenizer, cfg)
            except MissingAnswer:
                continue
            renderings += parts
            owners += [i] * len(parts)
            if example.images:
                texts[i] = [rendered_text(r) for r in parts]
            laid_out[i] = all(isinstance(r, Rendering) for r in parts)
            for r in parts:
                if isinstance(r, Rendering) and r.notes:
                    notes.setdefault(i, []).extend(r.notes)
        for i, pair in zip(owners, _tokenize_renderings(renderings, tokenizer, cfg)):
            pairs[i].append(pair)
    visions = expand_image_records(examples, texts, pairs, images) if texts else {}
    # The audit scans the whole batch at once (vectorised: it runs on every token of a data set).
    owner = [i for i, example_pairs in enumerate(pairs) for _ in example_pairs]
    found = audit.scan([pair for example_pairs in pairs for pair in example_pairs], [not laid_out[i] for i in owner],
                       examples[0].kind == "tokens")
    findings = notes
    for k, names in found.items():
        findings.setdefault(owner[k], []).extend(names)
    results, k = [], 0  # k: the first of this record's pairs in the audit's numbering
    for i, (example, example_pairs) in enumerate(zip(examples, pairs)):
        parts = [_length_policy(pair, cfg, vision) for pair, vision in
                 zip(example_pairs, visions.get(i, [None] * len(example_pairs)))] or [_length_policy(None, cfg)]
        names = tuple(dict.fromkeys(findings[i])) if i in findings else ()
        stop_only = sum(part[0].kept and "stop_only" in found.get(k + j, ()) for j, part in
                        enumerate(parts[:len(example_pairs)]))
        results.append(RecordResult(parts, example.unused, names, example.place if names else "", stop_only,
                                    visions.get(i, [])))
        k += len(example_pairs)
    return results


def _length_policy(pair: tuple[list[int], list[int]] | None, cfg: DataConfig,
                   vision: dict | None = None) -> tuple[Fate, list[int], list[int], int]:
    """An example's fate under data.max_length / data.overlong; a cut that would take image tokens (``vision``'s
    last one) drops the example: its images cannot be cut with it."""
    if pair is None:
        return Fate.DROPPED_NO_ANSWER, [], [], 0
    input_ids, labels = pair
    if not _count_trained(labels):
        return Fate.DROPPED_NOTHING_TO_TRAIN, [], [], 0
    fate, cut = Fate.KEPT, 0
    if len(input_ids) > cfg.max_length:
        if cfg.overlong == "drop" or (vision and vision["last_image_token"] >= cfg.max_length):
            return Fate.DROPPED_OVERLONG, [], [], 0
        cut = len(input_ids) - cfg.max_length
        input_ids, labels = input_ids[: cfg.max_length], labels[: cfg.max_length]
        fate = Fate.TRUNCATED
    if _count_trained(labels) == 0:
        return Fate.DROPPED_NO_TARGET, [], [], 0
    return fate, input_ids, labels, cut


def report_of(fates: Sequence[Fate], lengths: Sequence[int], trainable: Sequence[int], max_length: int,
              overlong: str, cut: Sequence[int] = (), records: int | None = None,
              findings: Findings | None = None) -> DataReport:
    """The report of examples with these fates (``records``: of how many records, default one each); ``lengths`` /
    ``trainable``: of the kept ones; ``cut``: the tokens truncation removed, per example; ``findings``: what the
    records left unread and the mask audit found."""
    report = DataReport(loaded=len(fates) if records is None else records, length_limit=max_length,
                        overlong=overlong, truncated_tokens=int(sum(cut)),
                        **(findings.as_report() if findings is not None else {}))
    for fate in fates:
        if fate in _REPORT_FIELD:
            name = _REPORT_FIELD[fate]
            setattr(report, name, getattr(report, name) + 1)
    report.kept = len(lengths)
    report.total_tokens = int(sum(lengths))
    report.trainable_tokens = int(sum(trainable))
    report.max_length = int(max(lengths, default=0))
    report.mean_length = report.total_tokens / report.kept if report.kept else 0.0
    return report


def tokenize_example(example: Example, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig,
                     images: ImageTokens | None = None) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) of each example one record makes, before the length policy (for inspecting a record);
    an image record's with the ids of ``images``' processor."""
    if example.kind == "tokens":
        return [_pretokenized(example, cfg, len(tokenizer))]
    renderings = render(example, tokenizer, cfg)
    pairs = [_tokenize_renderings(renderings, tokenizer, cfg)]
    if example.images:
        expand_image_records([example], {0: [rendered_text(r) for r in renderings]}, pairs, images)
    return pairs[0]


def prompt_token_ids(example: Example, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig) -> list[int]:
    """The ids the model is given to generate this example's (last) answer: the same ids as in training."""
    # Chat templates write their own BOS; the text templates get the tokenizer's (as in `render`).
    prefix = [] if uses_chat_template(example, cfg) else _special_prefix(tokenizer)
    return prefix + _encode([render_prompt(example, tokenizer, cfg)], tokenizer)[0]


def _tokenize_renderings(renderings: Sequence[Rendered], tokenizer: PreTrainedTokenizerBase,
                         cfg: DataConfig) -> list[tuple[list[int], list[int]]]:
    if cfg.add_eos and tokenizer.eos_token_id is None:
        raise DataError("data.add_eos is on but the tokenizer has no EOS token; set data.add_eos=false or use a "
                        "tokenizer with one.")
    # Each kind in one pass (batched encoding where the kind allows it), then back in the original order.
    pairs: list[tuple[list[int], list[int]]] = [([], [])] * len(renderings)
    for kind, tokenize_kind in ((Rendering, _tokenize_segments), (Joined, _tokenize_joined),
                                (TemplateMasked, _tokenize_template_masked)):
        where = [i for i, r in enumerate(renderings) if isinstance(r, kind)]
        if where:
            for i, pair in zip(where, tokenize_kind([renderings[i] for i in where], tokenizer, cfg)):
                pairs[i] = pair
    results = []
    for input_ids, labels in pairs:
        if cfg.train_on == "all":
            labels = list(input_ids)
        if labels:
            labels[0] = IGNORE_INDEX  # nothing predicts the first token
        results.append((input_ids, labels))
    return results


def _tokenize_segments(renderings: Sequence[Rendering], tokenizer: PreTrainedTokenizerBase,
                       cfg: DataConfig) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) of segment renderings: a trained segment's ids are its labels, a masked one's are
    IGNORE_INDEX (built a segment at a time, not a token at a time: this runs on every token of a data set)."""
    eos = tokenizer.eos_token_id
    stops = set(stop_token_ids(tokenizer)) if any(not r.add_special_tokens for r in renderings) else set()
    prefix = _special_prefix(tokenizer)
    # One batched call each: the fast tokenizer encodes the whole list in parallel.
    encoded = iter(_encode([s.text for r in renderings if not r.whole for s in r.segments], tokenizer))
    wholes = iter(_tokenize_whole([r for r in renderings if r.whole], tokenizer))
    # A prompt and its completion: the completion's ids as they follow the prompt's in the joined text, where the
    # prompt's own ids start it (no token across the boundary). Tokenized apart, a SentencePiece tokenizer with a
    # dummy prefix would begin the completion with a '▁' that the joined text lacks.
    joined = iter(_encode([r.segments[0].text + r.segments[1].text for r in renderings if _prompt_completion(r)],
                          tokenizer))
    results = []
    for rendering in renderings:
        input_ids: list[int] = list(prefix) if rendering.add_special_tokens else []
        labels: list[int] = [IGNORE_INDEX] * len(input_ids)
        if rendering.whole:
            ids, ranges = next(wholes)
            masked = [IGNORE_INDEX] * len(ids)
            for a, b in ranges:
                masked[a:b] = ids[a:b]
            if input_ids:
                input_ids += ids
                labels += masked
            else:  # the lists taken as they are (``ids`` is this call's own), not copied: this runs on every token
                input_ids, labels = ids, masked
        together = next(joined) if _prompt_completion(rendering) else None
        for k, segment in enumerate(() if rendering.whole else rendering.segments):
            ids = next(encoded)
            if k == 1 and together is not None and together[:len(input_ids) - len(prefix)] == input_ids[len(prefix):]:
                ids = together[len(input_ids) - len(prefix):]
            input_ids += ids
            labels += ids if segment.trained else [IGNORE_INDEX] * len(ids)
        # The model must learn to stop: end the last trained segment with EOS unless it already ends with a token
        # that stops generation (the EOS, or the chat template's end of turn, which anyfit writes into every
        # model's generation config: a base model's <|endoftext|> after <|im_end|> would be a token the model never
        # writes at inference). The EOS goes at the very end, so earlier turns look exactly as the template renders.
        if cfg.add_eos and rendering.segments[-1].trained and input_ids[-1:] != [eos] and not (
                input_ids and not rendering.add_special_tokens and input_ids[-1] in stops):
            input_ids.append(eos)
            labels.append(eos)
        results.append((input_ids, labels))
    return results


def _prompt_completion(rendering: Rendering) -> bool:
    """A text template's rendering: a masked prompt, then the trained completion."""
    segments = rendering.segments
    return (not rendering.whole and len(segments) == 2 and not segments[0].trained and segments[1].trained
            and bool(segments[0].text) and bool(segments[1].text))


def _tokenize_whole(renderings: Sequence[Rendering],
                    tokenizer: PreTrainedTokenizerBase) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """(ids, trained token ranges) of each rendering's text tokenized once, as ``apply_chat_template(...,
    tokenize=True)`` does at inference (no special tokens added: the template writes its own). Tokenizing the pieces
    apart would train ids that inference never sees: a SentencePiece tokenizer with a dummy prefix (Mistral's,
    Llama-2's) starts every call with '▁', and pieces cannot merge across their boundaries.

    Which tokens are trained comes from the characters each token covers (a fast tokenizer's offsets). The rule at
    a boundary: a token that holds any character of a trained segment is trained, since the model must write that
    token to write those characters (TRL's first-difference rule says the same at a prompt's end); a token that
    covers no character (a dummy prefix) goes with the character after it."""
    if not renderings:
        return []
    texts = ["".join(s.text for s in r.segments) for r in renderings]
    spans = [_trained_spans(r) for r in renderings]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not _plain_backend(tokenizer, backend) or (table := token_bytes(tokenizer)) is None:
        return _offset_ranges(texts, spans, tokenizer)
    # Tokens that spell the text byte for byte: the ranges from the ids alone (anyfit.data.token_bytes), without
    # the character offsets; a text the table cannot place goes the offsets way.
    ids = [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    placed = table.ranges(ids, texts, spans)
    missed = [k for k, ranges in enumerate(placed) if ranges is None]
    redone = iter(_offset_ranges([texts[k] for k in missed], [spans[k] for k in missed], tokenizer) if missed else [])
    return [(i, ranges) if ranges is not None else next(redone) for i, ranges in zip(ids, placed)]


def _offset_ranges(texts: list[str], spans: list[list[tuple[int, int]]],
                   tokenizer: PreTrainedTokenizerBase) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """``_tokenize_whole``'s (ids, ranges) from the fast tokenizer's character offsets, or from prefixes."""
    encodings = _encodings(texts, tokenizer)
    if encodings is None:  # no character offsets (a slow tokenizer): the token boundaries found from prefixes
        return [_mask_by_prefixes(text, span, tokenizer) for text, span in zip(texts, spans)]
    # Only the tokens at each span's two ends are looked at: this runs on every example of a data set.
    # ``e.ids`` is a new list each time it is read: taken as it is, not copied.
    return [(e.ids, [r for a, b in span if (r := _token_range(e, a, b))]) for e, span in zip(encodings, spans)]


def _token_range(encoding, a: int, b: int) -> tuple[int, int] | None:
    """The tokens [start, end) that hold a character of text[a:b] (``_tokenize_whole``'s rule)."""
    first = next((t for c in range(a, b) if (t := encoding.char_to_token(c)) is not None), None)
    if first is None:  # characters no token covers (removed by the tokenizer's normaliser)
        return None
    last = next(t for c in range(b - 1, a - 1, -1) if (t := encoding.char_to_token(c)) is not None)
    n = len(encoding.ids)
    while first > 0:  # a token before that also holds the span's first character, or an empty one just there
        s, e = encoding.token_to_chars(first - 1) or (0, 0)
        if not (e > a or s == e == a):
            break
        first -= 1
    while last + 1 < n:  # a token after that also holds a character before b (tokens can share characters)
        s, e = encoding.token_to_chars(last + 1) or (b, b)
        if not (s < b and e > s):
            break
        last += 1
    return first, last + 1


def _trained_spans(rendering: Rendering) -> list[tuple[int, int]]:
    """The character spans of a rendering's trained segments in its joined text."""
    spans, at = [], 0
    for segment in rendering.segments:
        if segment.trained and segment.text:
            spans.append((at, at + len(segment.text)))
        at += len(segment.text)
    return spans


def _encodings(texts: list[str], tokenizer: PreTrainedTokenizerBase) -> list | None:
    """The fast tokenizer's encodings (ids and character offsets) of each text, without added special tokens;
    None for a tokenizer without them."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if _plain_backend(tokenizer, backend):
        return backend.encode_batch(texts, add_special_tokens=False)
    try:
        return tokenizer(texts, add_special_tokens=False).encodings
    except (NotImplementedError, AttributeError, ValueError):  # transformers' slow (Python) tokenizers have none
        return None


def _mask_by_prefixes(text: str, spans: list[tuple[int, int]],
                      tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[tuple[int, int]]]:
    """The same rule without offsets: the tokens before character p are those the ids of ``text[:p]`` share with
    the whole text's; a token that differs there straddles p, and holds characters of the span after it."""
    ids = _encode([text], tokenizer)[0]
    ranges = []
    for a, b in spans:
        start = _common_prefix(_encode([text[:a]], tokenizer)[0], ids) if a else 0
        upto = _encode([text[:b]], tokenizer)[0]
        end = len(upto) if ids[:len(upto)] == upto else _common_prefix(upto, ids) + 1
        ranges.append((start, min(end, len(ids))))
    return ids, ranges


def _tokenize_joined(renderings: Sequence[Joined], tokenizer: PreTrainedTokenizerBase,
                     cfg: DataConfig) -> list[tuple[list[int], list[int]]]:
    """TRL's rule: the text tokenized whole; the loss from the first token where it differs from the prompt's ids
    (not always the prompt's length: the prompt's last token can merge with the completion's first)."""
    texts = _encode_each([(r.text, r.add_special_tokens) for r in renderings], tokenizer)
    prompts = iter(_encode_each([(r.prompt, r.add_special_tokens) for r in renderings if r.prompt is not None],
                                tokenizer))
    results = []
    for rendering, ids in zip(renderings, texts):
        start = 0 if rendering.prompt is None else _common_prefix(next(prompts), ids)
        results.append((ids, [IGNORE_INDEX] * start + ids[start:]))
    return results


def _tokenize_template_masked(renderings: Sequence[TemplateMasked], tokenizer: PreTrainedTokenizerBase,
                              cfg: DataConfig) -> list[tuple[list[int], list[int]]]:
    template = generation_template(tokenizer)  # once: finding TRL's version of a template renders probes
    results = []
    for rendering in renderings:
        try:
            enc = tokenizer.apply_chat_template(rendering.messages, chat_template=template, tokenize=True,
                                                return_dict=True, return_assistant_tokens_mask=True,
                                                **(rendering.kwargs or {}),
                                                **({"tools": rendering.tools} if rendering.tools else {}))
        except Exception as e:  # jinja raises its own errors from template code
            roles = "/".join(m["role"] for m in rendering.messages)
            raise DataError(f"{rendering.place}: the chat template of {template_name(tokenizer)} (with TRL's "
                            f"{{% generation %}} marks) failed on this conversation (roles {roles}), saying: "
                            f"{' '.join(str(e).split())}. Change the record to what this template accepts, or use "
                            "data.template=chat.") from e
        ids = list(enc["input_ids"])
        results.append((ids, [t if m else IGNORE_INDEX for t, m in zip(ids, enc["assistant_masks"])]))
    return results


def _pretokenized(example: Example, cfg: DataConfig, vocab_size: int) -> tuple[list[int], list[int]]:
    ids = example.input_ids
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise DataError(f"{example.place}: token id {bad} is outside the tokenizer's vocabulary "
                        f"(0..{vocab_size - 1}); the data was tokenized with another tokenizer.")
    mask = example.completion_mask if example.completion_mask is not None and cfg.train_on != "all" \
        else [1] * len(ids)
    labels = [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
    labels[0] = IGNORE_INDEX  # nothing predicts the first token
    return list(ids), labels


def _encode(texts: list[str], tokenizer: PreTrainedTokenizerBase, add_special_tokens: bool = False) -> list[list[int]]:
    """The ids of each text, as ``tokenizer(texts)["input_ids"]`` gives them. Special tokens written in the text
    (a chat template's <|im_start|>) are still recognised as such."""
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if _plain_backend(tokenizer, backend):
        # The Rust tokenizer's batch call without the character offsets nothing here reads: faster, and tokenizing
        # is most of a token store's build (BENCHMARKS.md, 'Measurements that were quoted in code comments
        # (moved 2026-11-26)').
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]
    return tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]


def _plain_backend(tokenizer: PreTrainedTokenizerBase, backend) -> bool:
    """Whether the fast tokenizer's Rust backend, called as it is, gives what the transformers call gives: it has
    no truncation or padding set (the transformers call clears them) and splits special tokens as the tokenizer
    says. Otherwise the transformers call is used."""
    return (backend is not None and hasattr(backend, "encode_batch_fast") and backend.truncation is None
            and backend.padding is None
            and getattr(backend, "encode_special_tokens", False) == bool(getattr(tokenizer, "split_special_tokens",
                                                                                 False)))


def _encode_each(items: list[tuple[str, bool]], tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """The ids of each (text, add_special_tokens), in order, in one batched call per setting."""
    out: list[list[int]] = [[] for _ in items]
    for special in (False, True):
        where = [i for i, (_, s) in enumerate(items) if s == special]
        for i, ids in zip(where, _encode([items[i][0] for i in where], tokenizer, special)):
            out[i] = list(ids)
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _special_prefix(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids the tokenizer puts before a text with ``add_special_tokens=True`` (Llama's BOS; none for Qwen).

    Found by comparing both encodings of a probe text: only the leading part is kept, since a
    tokenizer that also appends EOS would put it after the prompt, where it does not belong.
    """
    probe = "Hello"
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    special = tokenizer(probe, add_special_tokens=True)["input_ids"]
    for start in range(len(special) - len(plain) + 1):
        if special[start:start + len(plain)] == plain:
            return special[:start]
    return []


def _count_trained(labels: list[int]) -> int:
    return len(labels) - labels.count(IGNORE_INDEX)  # list.count runs in C: this is called on every example


def only_stops(report: DataReport, cfg: DataConfig) -> str:
    """Why the data would teach nothing but stopping: every kept example trains only its end-of-turn or EOS token
    ('' when some example teaches more, or ``data.allow_stop_only`` says so)."""
    if cfg.allow_stop_only or not report.kept or report.stop_only_examples < report.kept:
        return ""
    first = ", ".join(report.audit_places.get("stop_only", []))
    return (f"Every one of the {report.kept} examples trains nothing but its end-of-turn or EOS token (empty "
            f"completions{'; first: ' + first if first else ''}): the model would learn only to stop. Check that "
            "data.fields maps the column holding the answers, or set data.allow_stop_only=true if that is the aim.")


def nothing_left(report: DataReport) -> str:
    """Why no example is left, with the setting to change for each reason."""
    reasons = [f"{getattr(report, key)} {fix.format(limit=report.length_limit)}"
               for key, _, fix in DROPS if getattr(report, key)]
    return (f"No training examples left out of {report.loaded}: " + "; ".join(reasons) + ".")
