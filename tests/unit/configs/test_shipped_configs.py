"""The example configs shipped in the package (src/anyfit/configs/): each loads, and every hub dataset and model it names was checked by hand.

A name goes into VERIFIED_DATASETS / VERIFIED_MODELS only after reading its hub card (subsets, splits,
columns), with the date. A config pointing at anything else fails here, so a renamed or removed
dataset (hendrycks/competition_math, taken down in January 2025) is caught by review, not by a user's
first run.
"""

from __future__ import annotations

import pytest

from anyfit.config import load_config
from anyfit.configs import shipped
from anyfit.hub import DATA_SUFFIXES as LOCAL_SUFFIXES

CONFIGS = [p for name, p in shipped().items() if not name.startswith("accelerate/")]

# dataset id -> {subset (None: the hub's default config) -> splits}, columns, where it was checked and when.
VERIFIED_DATASETS = {
    "openai/gsm8k": {
        "subsets": {"main": ("train", "test"), "socratic": ("train", "test")},
        "columns": ("question", "answer"),
        "checked": "2026-11-23, dataset card YAML: configs main and socratic, train 7,473 / test 1,319",
    },
    "DigitalLearningGmbH/MATH-lighteval": {
        # 'default' holds all subjects (load_dataset picks it when no subset is named); one config per subject too
        "subsets": {None: ("train", "test"), "default": ("train", "test"),
                    **{s: ("train", "test") for s in ("algebra", "counting_and_probability", "geometry",
                                                      "intermediate_algebra", "number_theory", "prealgebra",
                                                      "precalculus")}},
        "columns": ("problem", "level", "solution", "type"),
        "checked": "2026-11-23, dataset card YAML: default config train 7,500 / test 5,000; a copy of "
                   "hendrycks/competition_math (its source_datasets)",
    },
    "HuggingFaceH4/llava-instruct-mix-vsft": {
        "subsets": {None: ("train", "test"), "default": ("train", "test")},
        "columns": ("messages", "images"),
        "checked": "2026-11-28, dataset files (parquet, default/train and default/test, about 273k rows): messages "
                   "with image parts ({index, text, type}) and an images column of the hub Image feature (TRL's "
                   "vision SFT example set)",
    },
    "HuggingFaceH4/MATH-500": {
        "subsets": {None: ("test",)},
        "columns": ("problem", "solution", "answer", "subject", "level", "unique_id"),
        "checked": "2026-11-23, dataset files (test.jsonl, 500 rows) and the cards of its copies; the "
                   "problems are OpenAI's PRM800K selection from MATH's test split",
    },
}

VERIFIED_MODELS = {
    "Qwen/Qwen2.5-0.5B-Instruct": "2026-11-23, model page: config.json, model.safetensors",
    "Qwen/Qwen2.5-Math-1.5B": "2026-11-23, model page: config.json, model.safetensors",
    "HuggingFaceTB/SmolLM2-135M-Instruct": "2026-11-23, model page: config.json, model.safetensors",
    "HuggingFaceTB/SmolVLM-256M-Instruct": "2026-11-28, model page: config.json (Idefics3ForConditionalGeneration), "
                                           "model.safetensors, preprocessor_config.json, processor_config.json, "
                                           "chat_template.json",
}

# Names that once worked and must not come back.
GONE = {
    "hendrycks/competition_math": "taken down from the hub (DMCA notice, January 2025)",
    "competition_math": "the old alias of hendrycks/competition_math",
    "lighteval/MATH": "taken down with it",
    "gsm8k": "the old alias; the dataset is openai/gsm8k (subset main)",
}

# The columns each data format reads (after data.fields), as anyfit.data.formats looks for them.
FORMAT_FIELDS = {"messages": ("messages",), "prompt_completion": ("prompt", "completion"), "text": ("text",)}


def is_hub_name(path: str) -> bool:
    return not path.lower().endswith(LOCAL_SUFFIXES) and not path.startswith((".", "/", "~")) and path.count("/") <= 1


def split_name(split: str) -> str:
    return split.split("[", 1)[0].strip()


def test_every_entry_says_when_it_was_checked():
    assert all(entry["checked"][:4].isdigit() for entry in VERIFIED_DATASETS.values())
    assert all(note[:4].isdigit() for note in VERIFIED_MODELS.values())
    assert not set(GONE) & (set(VERIFIED_DATASETS) | set(VERIFIED_MODELS))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_names_only_verified_hub_sources(path):
    cfg = load_config(path)
    model = cfg.model.name_or_path
    assert model not in GONE, f"{path.name}: model {model}: {GONE.get(model)}"
    if is_hub_name(model):
        assert model in VERIFIED_MODELS, f"{path.name}: model {model} is not in VERIFIED_MODELS: check it on the hub"

    sources = [("data", cfg.data.path, cfg.data.split)]
    if cfg.eval.path or cfg.eval.split:  # held-out data is read with the data.* settings (subset, fields)
        sources.append(("eval", cfg.eval.path or cfg.data.path, cfg.eval.split or cfg.data.split))
    for section, name, split in sources:
        assert name not in GONE, f"{path.name}: {section} dataset {name}: {GONE.get(name)}"
        if not is_hub_name(name):
            continue  # a local file the user provides
        assert name in VERIFIED_DATASETS, (f"{path.name}: {section} dataset {name} is not in VERIFIED_DATASETS: "
                                           "check its card (subsets, splits, columns) and add it")
        entry = VERIFIED_DATASETS[name]
        assert cfg.data.subset in entry["subsets"], f"{path.name}: {name} has no subset {cfg.data.subset!r}"
        assert split_name(split) in entry["subsets"][cfg.data.subset], f"{path.name}: {name} has no split {split!r}"
        columns = set(entry["columns"])
        unmapped = {field: column for field, column in cfg.data.fields.items() if column not in columns}
        assert not unmapped, f"{path.name}: data.fields maps {unmapped}, but {name} has columns {sorted(columns)}"
        formats = [fmt for fmt, fields in FORMAT_FIELDS.items()
                   if all(cfg.data.fields.get(f, f) in columns for f in fields)]
        if cfg.data.format != "auto":
            assert cfg.data.format in formats, f"{path.name}: {name} lacks the columns of data.format"
        assert formats, f"{path.name}: no data format fits the columns of {name}: map them with data.fields"
