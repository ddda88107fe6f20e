"""A new user's first LoRA run prints anyfit's lines and progress only: no library warning they cannot act on
(transformers' is_gradient_checkpointing FutureWarning that PEFT triggers, bitsandbytes' missing CPU kernel package,
imported by PEFT in a run that quantizes nothing), and DeepSpeed and the trackers are not imported by a run that does
not use them."""

from __future__ import annotations

import subprocess
import sys

from tiny_runs import ENV, HANG_S, write_dataset

# What a run may print: anyfit's lines (and their indented detail), its progress bars, transformers' weight-loading
# progress bar.
ALLOWED = ("[anyfit]", "  - ", "train:", "Loading weights", "IMPORTED")
UNUSED = ("deepspeed", "wandb", "mlflow", "trackio", "tensorboard", "comet_ml", "swanlab", "aim")
SCRIPT = ("import sys\nfrom anyfit.cli import main\nrc = main(sys.argv[1:])\n"
          f"print('IMPORTED', sorted({{m.split('.')[0] for m in sys.modules}} & {set(UNUSED)!r}))\nsys.exit(rc)\n")


def test_a_first_lora_run_prints_only_anyfits_lines(tiny_qwen2_dir, tmp_path):
    data = write_dataset(tmp_path / "d.jsonl", n=8)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, "train", f"model.name_or_path={tiny_qwen2_dir}",
                           f"data.path={data}", "data.template=plain", f"train.output_dir={tmp_path / 'out'}",
                           "train.max_steps=2", "train.effective_batch=4", "train.micro_batch=2", "lora.enabled=true"],
                          env=ENV, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in (proc.stdout + proc.stderr).replace("\r", "\n").splitlines() if line.strip()]
    strange = [line for line in lines if not line.startswith(ALLOWED)]
    assert not strange, "\n".join(strange)
    assert "IMPORTED []" in proc.stdout
