"""The mask audit: every tokenized example checked for what it teaches, over the whole data set.

Three findings per example, counted in the data report with the first few records named:

- ``no_stop``: a trained span that does not end with a token that ends generation (the tokenizer's EOS or the chat
  template's end-of-turn token, ``anyfit.data.stopping``): the model would not learn to stop there. Reported, not refused:
  pre-tokenized data and ``data.add_eos=false`` may mean it;
- ``trained_prompt``: the header of a user or tool turn inside a trained span, under ``data.train_on=completion``:
  the model would learn to write the user's part. anyfit's own renderings never train one (their masks are the
  assistant turns by construction), so it is looked for where the mask came from elsewhere: a chat template's
  ``{% generation %}`` spans (``data.template=trl``) or the data's own ``completion_mask``. It stops the run for a
  template's mask; for the data's own mask it is reported (the authors may mean it);
- ``stop_only``: every trained token ends generation (an empty completion: only its EOS or end-of-turn is trained).
  Reported; data whose every example is so is refused by ``anyfit.data.prepare`` unless ``data.allow_stop_only``.

A conversation with nothing to train is dropped and counted by the length policy (``anyfit.data.tokenization``); a
turn whose reasoning the template would leave out (an empty think block trained instead) is refused when rendered
(``anyfit.data.chat``).
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from anyfit.config import DataConfig
from anyfit.data.records import DataError
from anyfit.data.stopping import stop_token_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100
NAMED = 3  # records named per finding in the report
SCAN_BLOCK = 1024  # examples the audit flattens at once
FINDINGS = {
    "no_stop": "trained spans that do not end with an end-of-turn or EOS token (the model would not learn to stop "
               "there)",
    "trained_prompt": "user or tool turns inside the trained tokens (the model would learn to write the prompt)",
    "trained_prompt_data": "user or tool turns inside the tokens the data's completion_mask trains",
    "stop_only": "nothing trained but an end-of-turn or EOS token (an empty completion: the model would learn only "
                 "to stop)",
}
# What was done to some records, said in the data report (not findings: the run goes on, render --check passes).
NOTES = {
    "empty_think_masked": "an empty think block before an assistant turn without reasoning, kept as context "
                          "(data.train_empty_think: true trains it)",
    "empty_think_trained": "an empty think block before an assistant turn without reasoning, trained "
                           "(data.train_empty_think: true)",
    "next_header_stop": "assistant turns that the chat template ends with the next turn's header, not an end-of-turn "
                        "token (GLM's <|user|>): that header token is trained as the turn's stop, and generation "
                        "stops there (generation_config.json)",
}
# Probe contents: text no real conversation holds, so finding them in a rendering is unambiguous.
_USER, _ANSWER, _NEXT = "\x01anyfit-user\x01", "\x01anyfit-answer\x01", "\x01anyfit-next\x01"


def _turn_headers(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The text a chat template writes to open a user turn and a tool turn (``<|im_start|>user``), without the
    end-of-turn text before it: what follows the end of an answer up to the next turn's content."""
    headers = []
    for nxt in ({"role": "user", "content": _NEXT}, {"role": "tool", "content": _NEXT}):
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": _USER},
                                                  {"role": "assistant", "content": _ANSWER}, nxt], tokenize=False)
        except Exception:  # a template without tool turns
            continue
        if _ANSWER in text and _NEXT in text:
            between = text[text.index(_ANSWER) + len(_ANSWER):text.index(_NEXT)]
            for token in tokenizer.all_special_tokens:  # the end-of-turn text of the answer is not the header
                if between.startswith(token):
                    between = between[len(token):]
            if between.strip():
                headers.append(between.strip())
    return headers


@dataclass
class MaskAudit:
    """The checks of one data configuration and tokenizer (nothing to check when every token is trained)."""

    stops: frozenset[int] = frozenset()
    headers: tuple[tuple[int, ...], ...] = ()  # the token ids of each turn header
    active: bool = False

    @staticmethod
    def of(tokenizer: PreTrainedTokenizerBase, cfg: DataConfig) -> MaskAudit:
        if cfg.train_on == "all":
            return MaskAudit()
        headers = tuple(tuple(tokenizer(h, add_special_tokens=False)["input_ids"]) for h in _turn_headers(tokenizer))
        return MaskAudit(frozenset(stop_token_ids(tokenizer)), tuple(h for h in headers if h), True)

    def scan(self, pairs: list[tuple[list[int], list[int]]], foreign: list[bool],
             tokens: bool) -> dict[int, list[str]]:
        """The findings of each tokenized example ``(input_ids, labels)``, before the length policy. ``foreign``: its
        mask is not anyfit's own segments (a template's or the data's), so it is searched for turn headers;
        ``tokens``: the mask is the data's own (pre-tokenized). One vectorised pass over the batch; the examples
        with findings only (most have none)."""
        found: dict[int, list[str]] = {}
        if not self.active:
            return found
        for start in range(0, len(pairs), SCAN_BLOCK):  # bounded memory: a block's tokens at a time
            block = self._scan_block(pairs[start:start + SCAN_BLOCK], foreign[start:start + SCAN_BLOCK], tokens)
            found.update((start + k, names) for k, names in block.items())
        return found

    def _scan_block(self, pairs: list[tuple[list[int], list[int]]], foreign: list[bool],
                    tokens: bool) -> dict[int, list[str]]:
        found: dict[int, list[str]] = {}
        if not pairs:
            return found
        lengths = np.fromiter((len(ids) for ids, _ in pairs), dtype=np.int64, count=len(pairs))
        offsets = np.concatenate(([0], np.cumsum(lengths)))
        total = int(offsets[-1])
        ids = np.fromiter(itertools.chain.from_iterable(i for i, _ in pairs), dtype=np.int32, count=total)
        trained = np.fromiter(itertools.chain.from_iterable(lab for _, lab in pairs), dtype=np.int64,
                              count=total) != IGNORE_INDEX
        # A span ends where a trained token is followed by an untrained one or by the end of its example.
        last = trained.copy()
        last[:-1] &= ~trained[1:]
        last[offsets[1:][lengths > 0] - 1] = trained[offsets[1:][lengths > 0] - 1]
        ends = np.flatnonzero(last)
        stops = np.fromiter(self.stops, dtype=np.int64, count=len(self.stops))
        is_stop = np.isin(ids, stops)
        for k in np.unique(np.searchsorted(offsets, ends[~is_stop[ends]], side="right") - 1):
            found.setdefault(int(k), []).append("no_stop")
        # per example (the empty ones left out: reduceat's segments run from one start to the next)
        whole = np.flatnonzero(lengths > 0)
        if len(whole):
            n_trained = np.add.reduceat(trained.astype(np.int64), offsets[whole])
            n_content = np.add.reduceat((trained & ~is_stop).astype(np.int64), offsets[whole])
            for k in whole[(n_trained > 0) & (n_content == 0)]:
                found.setdefault(int(k), []).append("stop_only")
        name = "trained_prompt_data" if tokens else "trained_prompt"
        for k in self._with_trained_headers(ids, trained, offsets, np.asarray(foreign, dtype=bool)):
            found.setdefault(k, []).append(name)
        return found

    def _with_trained_headers(self, ids: np.ndarray, trained: np.ndarray, offsets: np.ndarray,
                              foreign: np.ndarray) -> set[int]:
        """The examples (of the ``foreign`` ones) in which a turn header's ids stand, all trained (searched by ids,
        not by decoding)."""
        hits: set[int] = set()
        if not self.headers or not foreign.any():
            return hits
        candidates = trained & np.repeat(foreign, np.diff(offsets))
        for header in self.headers:
            n = len(header)
            for at in np.flatnonzero((ids == header[0]) & candidates):
                k = int(np.searchsorted(offsets, at, side="right") - 1)
                if at + n <= offsets[k + 1] and trained[at:at + n].all() and \
                        tuple(ids[at:at + n].tolist()) == header:
                    hits.add(k)
        return hits


@dataclass
class Findings:
    """What a data set's records left unread and what the audit found, summed over its batches."""

    unused: Counter = field(default_factory=Counter)
    counts: Counter = field(default_factory=Counter)
    places: dict[str, list[str]] = field(default_factory=dict)
    split: int = 0  # records made into several examples
    stop_only: int = 0  # kept examples that train nothing but their stop (``stop_only``)

    def add(self, result: Any) -> None:
        """Count one record's result (``anyfit.data.tokenization.RecordResult``)."""
        self.unused.update(result.unused)
        self.split += len(result.parts) > 1
        self.stop_only += result.stop_only
        for name in result.findings:
            self.counts[name] += 1
            named = self.places.setdefault(name, [])
            if len(named) < NAMED:
                named.append(result.place)

    def merge(self, other: Findings) -> None:
        self.unused.update(other.unused)
        self.counts.update(other.counts)
        self.split += other.split
        self.stop_only += other.stop_only
        for name, named in other.places.items():
            mine = self.places.setdefault(name, [])
            mine += named[: NAMED - len(mine)]

    def as_report(self) -> dict[str, Any]:
        audit = {k: n for k, n in self.counts.items() if k not in NOTES}
        return {"unused": dict(self.unused), "audit": audit, "split_records": self.split,
                "stop_only_examples": self.stop_only,
                "audit_places": {k: v for k, v in self.places.items() if k in audit},
                "notes": {k: n for k, n in self.counts.items() if k in NOTES}}

    def check(self, cfg: DataConfig) -> None:
        """Refuse the data where the audit found what cannot be trained as meant (see the module docstring)."""
        if self.counts.get("trained_prompt"):
            raise DataError(f"The mask audit found {self.counts['trained_prompt']} records whose trained tokens "
                            f"include a user or tool turn (first: {', '.join(self.places['trained_prompt'])}): the "
                            "chat template's {% generation %} spans cover more than the assistant's turns. Use "
                            "data.template=chat (assistant turns found by rendering), or fix the template's markers.")


def audit_lines(report: dict[str, Any]) -> list[str]:
    """The data report's lines about unread fields, split records and audit findings (empty when there is nothing
    to say)."""
    lines = []
    if report.get("split_records"):
        lines.append(f"{report['split_records']} conversations were split into one example per assistant turn (or "
                     "per run of turns): the chat template renders earlier turns differently once the conversation "
                     "goes on (e.g. it drops their reasoning), so each turn is trained in the context it gets at "
                     "inference.")
    unused = report.get("unused") or {}
    if unused:
        fields = ", ".join(f"'{k}' ({n} records)" for k, n in sorted(unused.items(), key=lambda kv: -kv[1])[:8])
        lines.append(f"Not used for training (no format field reads them): {fields}"
                     f"{', ...' if len(unused) > 8 else ''}.")
    for name, count in (report.get("notes") or {}).items():
        lines.append(f"{count} records had {NOTES[name]}.")
    for name, count in (report.get("audit") or {}).items():
        places = ", ".join(report.get("audit_places", {}).get(name, []))
        lines.append(f"Mask audit: {count} records with {FINDINGS[name]}; first: {places}.")
    return lines
