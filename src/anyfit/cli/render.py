"""``anyfit render``: one record as the model sees it, trained tokens highlighted, and what the length policy
does to the whole data set."""

from __future__ import annotations

import sys

from anyfit.cli.common import config_args, load
from anyfit.config import ConfigError


def cmd_render(args) -> int:
    cfg = load(args)
    # start-up time: tokenizers and data readers load only when the command runs
    from anyfit.data.formats import resolve_fields, to_examples
    from anyfit.data.mixture import sources_of
    from anyfit.data.sources import iter_records
    from anyfit.data.store import open_or_build
    from anyfit.data.showing import show_example
    from anyfit.data.tokenization import tokenize_example
    from anyfit.data.image_tokens import ImageTokens
    from anyfit.model.processor import load_processor
    from anyfit.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    images = ImageTokens(*load_processor(cfg.model, tokenizer))  # image records: the model's processor
    sources = sources_of(cfg.data)
    if not 0 <= args.source < len(sources):
        raise ConfigError(f"--source {args.source} is out of range: the config has {len(sources)} data source(s).")
    data = sources[args.source][0]  # data.path, or one data.mix entry with its own settings
    # The whole data set's report comes from its token store (built once, as training would build it).
    store = open_or_build(data, tokenizer, echo=lambda line: print(line, file=sys.stderr), images=images)
    if not 0 <= args.index < store.records:
        raise ConfigError(f"--index {args.index} is out of range: the data has {store.records} records.")
    start, first = 0, None
    for batch in iter_records(data):  # read up to record N only
        first = batch[0] if first is None else first
        if args.index < start + len(batch):
            record = batch[args.index - start:args.index - start + 1]
            break
        start += len(batch)
    # Show record N itself (even one the length policy would cut or drop), then what the policy does overall.
    # Record N read as the build reads it: the format and columns found on record 0 (checked there).
    resolved = data if args.index == 0 else resolve_fields(first, data)
    parts = tokenize_example(to_examples(record, resolved, start=args.index)[0], tokenizer, data, images)
    color = sys.stdout.isatty() and not args.no_color
    print(f"record {args.index} of {data.path}:\n")
    for k, (ids, labels) in enumerate(parts):
        if len(parts) > 1:  # a conversation the chat template makes into one example per assistant turn
            print(f"{'' if k == 0 else chr(10)}example {k + 1} of {len(parts)} this record makes:")
        print(show_example(ids, labels, tokenizer, color=color))
        if len(ids) > data.max_length:
            print(f"\n(this example has {len(ids)} tokens, over data.max_length={data.max_length}: "
                  f"it is {'cut' if data.overlong == 'truncate' else 'dropped'} in training)")
    print(f"\nwhole dataset: {store.report.summary()}")
    # --check: the mask audit over every record decides the exit status.
    return 1 if args.check and store.report.audit else 0


def register(sub) -> None:
    p = sub.add_parser("render", help="Show one training example with the tokens that carry loss highlighted.")
    config_args(p)
    p.add_argument("--index", type=int, default=0, help="Which example (after filtering).")
    p.add_argument("--no-color", action="store_true", help="Mark trained tokens with brackets instead of colour.")
    p.add_argument("--check", action="store_true", help="Exit with status 1 when the mask audit of the whole data "
                   "set finds something (trained spans without an end-of-turn token, trained prompt turns); the "
                   "report names the first records of each finding.")
    p.add_argument("--source", type=int, default=0, help="With data.mix: which source (0 is the first entry).")
    p.set_defaults(func=cmd_render)
