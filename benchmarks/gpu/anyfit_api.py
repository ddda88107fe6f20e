"""Every anyfit internal the GPU kit uses, imported here and nowhere else in benchmarks/gpu/.

The kit drives anyfit through its command line (``python -m anyfit train|plan|export``) and its run folder; these
names are for the checks that need to reach inside a run: forcing a non-finite step to see fused AdamW skip it on
the device, comparing ``anyfit_varlen`` attention with padded attention on one batch, forcing out-of-memory errors
for ``micro_batch: auto``'s back-off, validating the kit's overrides, and (part 6) a hybrid's state layers
run on packed rows one way or the other, with the packing self-test's verdict.

When anyfit's modules move (issue 18), only the imports below change. Importing this module fails loudly if one of
them breaks; ``run_all.sh --dry-run`` imports it first.
"""

from __future__ import annotations

from anyfit.backends.base import guarded_step, is_finite_step, skips_on_device  # noqa: F401  (the guarded update)
from anyfit.config import ConfigError, load_config  # noqa: F401  (the typed config and its validation)
from anyfit.data.batching import collate  # noqa: F401  (a micro-batch: padded, or packed with example boundaries)
from anyfit.model.attention import register as register_varlen_attention  # noqa: F401  ("anyfit_varlen")
from anyfit.model.state_layers import KERNELS, PER_EXAMPLE, Boundaries  # noqa: F401  (state layers in packed rows)
from anyfit.training.loop import train  # noqa: F401  (train(cfg, loss_fn=...): a run in this process)
from anyfit.training.loss import token_loss_sum  # noqa: F401  (the summed token loss of a collated batch)
from anyfit.training.optim import build_optimizer  # noqa: F401  (fused AdamW, 8-bit AdamW, Adafactor)
from anyfit.training.packing_check import choose_packing  # noqa: F401  (the packing self-test's verdict)

# The ways state layers take a packed row's boundaries (Boundaries' ``how``): constants, not in NAMES.
WAYS = {"per_example": PER_EXAMPLE, "kernels": KERNELS}

# The names above with the module each comes from, for the dry run's report and the README.
NAMES = {
    "ConfigError": "anyfit.config", "load_config": "anyfit.config",
    "collate": "anyfit.data.batching",
    "register_varlen_attention": "anyfit.model.attention.register",
    "Boundaries": "anyfit.model.state_layers",
    "train": "anyfit.training.loop",
    "token_loss_sum": "anyfit.training.loss",
    "build_optimizer": "anyfit.training.optim",
    "choose_packing": "anyfit.training.packing_check",
    "guarded_step": "anyfit.backends.base", "is_finite_step": "anyfit.backends.base",
    "skips_on_device": "anyfit.backends.base",
}


def validate(overrides: list[str]):
    """The config that ``python -m anyfit train <overrides>`` would run (raises ConfigError as the CLI would)."""
    return load_config(None, list(overrides))


if __name__ == "__main__":
    for name, module in NAMES.items():
        assert callable(globals()[name]) or isinstance(globals()[name], type), name
        print(f"{name:28s} from {module}")
    print(f"anyfit_api: all {len(NAMES)} names import")
