"""The bare minimum any SFT tool must do to prepare chat data, as one command: read the JSON Lines file, render each
conversation with the tokenizer's chat template (one ``apply_chat_template`` call, no tokenizing there) and tokenize
the texts in batches with the Rust tokenizer's fastest call (``encode_batch_fast``: no character offsets), on every
core, writing nothing. No masks, no checks, no store.

``benchmarks/data_scale.py --only floor,prepare`` runs it beside ``anyfit prepare`` on the same records (issue 55,
part 4: anyfit's whole command, start-up included, against this one's). It prints the records and tokens it saw.

    python benchmarks/prep_floor.py MODEL_DIR DATA.jsonl [WORKERS] [--with-prompt]

``--with-prompt``: also render each conversation's prompt (the messages before the last, with the generation prompt),
the one more render an exact assistant-only mask needs at least (where the trained turn starts); not the issue's floor.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys

BATCH = 1024  # lines per task, as anyfit's store builds (anyfit.data.store.BATCH_RECORDS)

_TOK = None
_PROMPT = False  # --with-prompt


def _load(model: str) -> None:
    global _TOK
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the workers are the parallelism
    from transformers import AutoTokenizer

    _TOK = AutoTokenizer.from_pretrained(model)


def _work(lines: list[str]) -> tuple[int, int]:
    conversations = [json.loads(line)["messages"] for line in lines]
    texts = [_TOK.apply_chat_template(messages, tokenize=False) for messages in conversations]
    if _PROMPT:
        for messages in conversations:
            _TOK.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    ids = _TOK.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    return len(texts), sum(len(e.ids) for e in ids)


def _batches(path: str):
    with open(path, encoding="utf-8") as f:
        batch = []
        for line in f:
            if line.strip():
                batch.append(line)
                if len(batch) == BATCH:
                    yield batch
                    batch = []
        if batch:
            yield batch


def main() -> None:
    global _PROMPT
    args = [a for a in sys.argv[1:] if a != "--with-prompt"]
    _PROMPT = len(args) < len(sys.argv) - 1
    model, data = args[0], args[1]
    workers = int(args[2]) if len(args) > 2 else os.cpu_count() or 1
    # The tokenizer loaded once, here, and the workers forked with it: the cheapest start there is (datasets' map
    # workers fork from a parent holding the tokenizer too).
    _load(model)
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        records = tokens = 0
        for n, t in pool.imap(_work, _batches(data), chunksize=1):
            records, tokens = records + n, tokens + t
    print(f"[floor] {records} records, {tokens} tokens, {workers} workers{', prompts rendered too' if _PROMPT else ''}")


if __name__ == "__main__":
    main()
