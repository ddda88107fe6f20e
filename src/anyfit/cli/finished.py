"""What to do with a finished run: ``anyfit plot`` (its curves), ``anyfit report`` (the whole run on one page) and
``anyfit export`` (a standalone model, GGUF, the Hub)."""

from __future__ import annotations

import shlex


def cmd_plot(args) -> int:
    from anyfit.training.plot import plot_run  # start-up time: matplotlib

    print(f"wrote {plot_run(args.run, args.out)}")
    return 0


def cmd_report(args) -> int:
    from anyfit.training.report import write_report  # start-up time: not needed by the other sub-commands

    print(f"wrote {write_report(args.run, args.out)}")
    return 0


def cmd_export(args) -> int:
    from anyfit.export.folder import export  # start-up time: torch, transformers, gguf

    # The command as it would be typed again, recorded in the model card.
    words = ["anyfit", "export", args.run]
    words += ["--out", args.out] if args.out else []
    words += ["--dtype", args.dtype] if args.dtype else []
    words += [w for t in args.gguf for w in ("--gguf", t)]
    words += ["--eval-summary", args.eval_summary] if args.eval_summary else []
    words += ["--push", args.push] if args.push else []
    words += ["--private"] if args.private else []
    words += ["--overwrite"] if args.overwrite else []
    words += ["--last"] if args.last else []
    export(args.run, args.out, dtype=args.dtype, gguf=args.gguf, push=args.push, private=args.private,
           overwrite=args.overwrite, eval_summary=args.eval_summary, command=shlex.join(words), last=args.last)
    return 0


def register(sub) -> None:
    p = sub.add_parser("plot", help="Draw a run's training loss, validation loss and generation accuracy against the "
                                     "step (from its metrics.jsonl) into a PNG.")
    p.add_argument("run", help="The output folder of a training run (train.output_dir).")
    p.add_argument("--out", help="PNG file to write (default: RUN/loss.png).")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("report", help="The whole run on one self-contained HTML page: curves, generation accuracy "
                                       "before and after with example answers, speed and memory beside the plan, "
                                       "the data report, the config (every run also leaves report.html).")
    p.add_argument("run", help="The output folder of a training run (train.output_dir), finished or not.")
    p.add_argument("--out", help="HTML file to write (default: RUN/report.html).")
    p.set_defaults(func=cmd_report)

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
    p.add_argument("--last", action="store_true", help="Export the run's final model even when it kept a best "
                                                       "checkpoint (train.keep_best), which is exported by default.")
    p.set_defaults(func=cmd_export)
