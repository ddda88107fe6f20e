"""The bare minimum any SFT tool must do to prepare chat data, as one command: read the JSON Lines file, render each
conversation with the tokenizer's chat template (one ``apply_chat_template`` call, no tokenizing there) and tokenize
the texts in batches with the Rust tokenizer's fastest call (``encode_batch_fast``: no character offsets), on every
core, writing nothing. No masks, no checks, no store.

``benchmarks/data_scale.py --only floor,prepare`` runs it beside ``anyfit prepare`` on the same records (issue 55,
part 4: anyfit's whole command, start-up included, against this one's). It prints the records and tokens it saw.

    python benchmarks/prep_floor.py MODEL_DIR DATA.jsonl [WORKERS]
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys

BATCH = 1024  # lines per task, as anyfit's store builds (anyfit.data.store.BATCH_RECORDS)

_TOK = None


def _load(model: str) -> None:
    global _TOK
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the workers are the parallelism
    from transformers import AutoTokenizer

    _TOK = AutoTokenizer.from_pretrained(model)


def _work(lines: list[str]) -> tuple[int, int]:
    texts = [_TOK.apply_chat_template(json.loads(line)["messages"], tokenize=False) for line in lines]
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
    model, data = sys.argv[1], sys.argv[2]
    workers = int(sys.argv[3]) if len(sys.argv) > 3 else os.cpu_count() or 1
    # The tokenizer loaded once, here, and the workers forked with it: the cheapest start there is (datasets' map
    # workers fork from a parent holding the tokenizer too).
    _load(model)
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        records = tokens = 0
        for n, t in pool.imap(_work, _batches(data), chunksize=1):
            records, tokens = records + n, tokens + t
    print(f"[floor] {records} records, {tokens} tokens, {workers} workers")


if __name__ == "__main__":
    main()
