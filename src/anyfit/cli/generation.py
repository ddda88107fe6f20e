"""``anyfit generate`` (completions from a model, a training output or an adapter) and ``anyfit eval`` (answer
accuracy by generation, graded)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from anyfit.cli.common import config_and_overrides, config_args
from anyfit.config import ConfigError, load_config, set_by_user
from anyfit.runfolder import run_config_path


def batch_size_arg(text: str):
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


def read_prompts(path: str) -> list[str]:
    """Prompts from a file: one per line, or JSON lines with a 'prompt' field."""
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


def generation_args(p: argparse.ArgumentParser, max_new_tokens: int | None) -> None:
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
    p.add_argument("--batch-size", type=batch_size_arg, default=None if from_config else "auto",
                   help="Prompts per generation batch (transformers backend): a number, or auto (from free memory)"
                   + (" (default: eval.batch_size)." if from_config else "."))
    p.add_argument("--merge-lora", action="store_true",
                   help="Merge a LoRA adapter into the base weights before generating.")


def cmd_generate(args) -> int:
    from anyfit.data.templates import PromptLayout  # start-up time: transformers
    from anyfit.evaluation.inference import GenerationParams, make_backend  # start-up time: torch, transformers

    prompts = list(args.prompt) + (read_prompts(args.file) if args.file else [])
    if not prompts:
        raise ConfigError("No prompts: give --prompt TEXT (repeatable) or --file FILE (one per line, or JSONL "
                          "with a 'prompt' field).")
    layout = PromptLayout(system_prompt=args.system_prompt)
    run_config = run_config_path(args.model) if Path(args.model).is_dir() else None
    if run_config is not None and not args.raw:  # prompts laid out as the run laid out its training prompts
        trained = load_config(None, [], base=run_config, echo=lambda line: print(line, file=sys.stderr)).data
        layout = PromptLayout.of(trained, system_prompt=args.system_prompt or trained.system_prompt)
        options = layout.options
        print(f"[anyfit] generate: data.template={layout.template!r}"
              f"{f' with data.chat_template_kwargs={options}' if options else ''} as in the training run",
              file=sys.stderr)
    try:
        params = GenerationParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                  seed=args.seed, stop=tuple(args.stop), chat=not args.raw, layout=layout)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    backend = make_backend(args.model, args.backend, args.device, args.batch_size, merge_lora=args.merge_lora,
                           seed=args.seed)
    asked = [with_images(p, args.image, backend, layout) for p in prompts] if args.image else prompts
    for i, (prompt, c) in enumerate(zip(prompts, backend.generate(asked, params))):
        if args.jsonl:
            print(json.dumps({"prompt": prompt, "completion": c.text, "num_tokens": c.num_tokens,
                              "finish_reason": c.finish_reason}, ensure_ascii=False))
        else:
            print(f"### prompt {i + 1}: {prompt}\n{c.text}\n[{c.num_tokens} tokens, {c.finish_reason}]\n")
    return 0


def with_images(prompt: str, images: list[str], backend, layout):
    """``prompt`` as a user message with ``images`` before its text, laid out as training lays out an image record
    (the chat template, then the model's processor)."""
    # start-up time: the data pipeline and the image processor load only when images are given
    from anyfit.data.formats import Example
    from anyfit.data.images import image_ref
    from anyfit.evaluation.image_prompts import example_prompt

    refs = tuple(image_ref(path, f"--image {path}", None) for path in images)  # relative: the current directory
    parts = [{"type": "image"} for _ in refs] + [{"type": "text", "text": prompt}]
    example = Example("prompt_completion", prompt=[{"role": "user", "content": parts}], completion="", images=refs,
                      origin="--prompt")
    return example_prompt(example, backend.tokenizer, layout.data_config(), backend.images)


def trained_on_a_mix(run_config: Path) -> bool:
    """Whether a training run's config.yaml drew on several sources (``data.mix``). The one key is read as the run
    wrote it, so the config ``anyfit eval`` uses is loaded once, with the run's as its base."""
    try:
        saved = yaml.safe_load(run_config.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False  # loading it as the base says what is wrong with it
    data = saved.get("data") if isinstance(saved, dict) else None
    return isinstance(data, dict) and bool(data.get("mix"))


def cmd_eval(args) -> int:
    # A training output folder is evaluated with its run's settings (prompt layout, tokenizer, ...) as the
    # base, so the model sees the prompts it was trained on; the file and the overrides come on top.
    base = run_config_path(args.model) if args.model and Path(args.model).is_dir() else None
    config, overrides = config_and_overrides(args)
    if base is not None and trained_on_a_mix(base):  # trained on several sources: eval reads one data.path
        overrides = ["data.mix=[]", *overrides]
    cfg = load_config(config, overrides, base=base, echo=print if base else None)
    model = args.model or cfg.model.name_or_path
    if not model:
        raise ConfigError("No model to evaluate: give --model MODEL_OR_OUTPUT_DIR (or model.name_or_path=...).")
    if base is not None and not set_by_user(config, [o for o in overrides if o != "data.mix=[]"], "data.path"):
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
    # start-up time: torch, transformers, math-verify
    from anyfit.evaluation.evaluate import default_params, evaluate
    from anyfit.evaluation.inference import BackendSettings

    name = Path(model).name if Path(model).exists() else model.replace("/", "__")  # hub ids: one folder level
    out = args.out or str(Path("runs") / "eval" / name)
    try:
        params = default_params(cfg, temperature=args.temperature, top_p=args.top_p, seed=args.seed, stop=args.stop)
    except ValueError as e:  # a flag GenerationParams refuses (--max-new-tokens 0, --temperature -1): one line
        raise ConfigError(str(e)) from None
    backend = BackendSettings.from_config(cfg, backend=args.backend, merge_lora=args.merge_lora, seed=args.seed)
    evaluate(model, cfg, params, backend, out_dir=out)
    return 0


def register(sub) -> None:
    p = sub.add_parser("generate", help="Generate completions: anyfit generate --model M --prompt TEXT [--prompt ...]")
    p.add_argument("--model", required=True, help="Hub id, model folder, or a training output folder (full or LoRA).")
    p.add_argument("--prompt", action="append", default=[], help="A prompt (repeatable).")
    p.add_argument("--file", help="Prompts, one per line, or JSON lines with a 'prompt' field.")
    p.add_argument("--image", action="append", default=[],
                   help="An image (path or URL; repeatable) shown before each prompt's text, for a vision-language "
                        "model (its chat template and processor, as in training).")
    p.add_argument("--raw", action="store_true", help="Give the prompts as raw text, without the chat template.")
    p.add_argument("--system-prompt", help="System message for the chat template.")
    p.add_argument("--device", choices=("auto", "cuda", "mps", "cpu"), default="auto", help="auto: cuda > mps > cpu.")
    p.add_argument("--jsonl", action="store_true", help="Print one JSON object per completion.")
    generation_args(p, max_new_tokens=256)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("eval", help="Answer accuracy by generation: anyfit eval [CONFIG] [key=value ...] --model M")
    config_args(p)
    p.add_argument("--model", help="Hub id, model folder, or a training output folder (default: model.name_or_path).")
    p.add_argument("--out", help="Folder for predictions.jsonl and summary.json (default: runs/eval/<model name>).")
    generation_args(p, max_new_tokens=None)  # --max-new-tokens, --batch-size: the config's eval.* by default
    p.set_defaults(func=cmd_eval)
