"""The run configuration: the typed schema (``schema``), reading YAML files and overrides (``loading``), the
answers for foreign keys (``keys``) and the generated key reference (``reference``).

The names every layer uses are re-exported here, so ``from anyfit.config import Config, load_config`` works.
"""

from anyfit.config.loading import build_config, config_file, load_config, set_by_user
from anyfit.config.reference import field_help, help_text, reference_markdown
from anyfit.config.schema import (
    BEST_METRICS,
    DATA_FIELDS,
    NAMED_TEMPLATES,
    SECTIONS,
    TRACKERS,
    Config,
    ConfigError,
    DataConfig,
    EvalConfig,
    LoraConfig,
    ModelConfig,
    RuntimeConfig,
    TrainConfig,
    all_keys,
    best_metric,
    keys_of,
    validate,
)

__all__ = [
    "BEST_METRICS", "DATA_FIELDS", "NAMED_TEMPLATES", "SECTIONS", "TRACKERS", "Config", "ConfigError", "DataConfig", "EvalConfig",
    "LoraConfig", "ModelConfig", "RuntimeConfig", "TrainConfig", "all_keys", "best_metric", "build_config", "config_file",
    "field_help", "help_text", "keys_of", "load_config", "reference_markdown", "set_by_user", "validate",
]
