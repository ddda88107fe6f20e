"""Reading a config: a YAML file (or a shipped config's name) plus dotted ``key=value`` overrides, on top of
the defaults and, for eval/generate/export of a run's output, the run's own ``config.yaml``.

Every value is checked against its field's annotation here: an unknown key names the closest valid one (or
anyfit's name for a TRL/Axolotl key), a bad value names the key, the file and line, and what is allowed.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from anyfit import configs
from anyfit.config.keys import suggest
from anyfit.config.schema import SECTIONS, Config, ConfigError, all_keys, keys_of, validate


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "|".join(str(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", str(tp))


def _expected(tp: Any) -> str:
    """A type in words, for error messages."""
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return "a list"
    if typing.get_origin(tp) is dict:
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, type_name(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; convert only what is lossless (int -> float)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{where}: {value!r} is not allowed; use one of {', '.join(map(str, allowed))}.")
        return value
    if origin in (Union, types.UnionType):
        errors = []
        for arg in typing.get_args(tp):
            if arg is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        wanted = " or ".join(_expected(a) for a in typing.get_args(tp) if a is not type(None))
        raise ConfigError(f"{where}: expected {wanted}, got {value!r}.")
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}.")
        return [_coerce(v, item, where) for v in value]
    if origin is dict:
        k_tp, v_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping such as {{prompt: problem}}, got {value!r}.")
        return {_coerce(k, k_tp, where): _coerce(v, v_tp, where) for k, v in value.items()}
    if tp is Any:  # an open mapping (a data.mix entry): its keys are checked by the schema, its values below
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}.")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}.")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}.")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return str(value)
            raise ConfigError(f"{where}: expected a string, got {value!r}.")
        return value
    raise ConfigError(f"{where}: unsupported type {tp}")  # pragma: no cover - programming error


def _key_lines(text: str) -> dict[str, int]:
    """Line number (1-based) of every dotted key in a YAML text, for error messages."""
    lines: dict[str, int] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = f"{prefix}{k.value}"
                lines[key] = k.start_mark.line + 1
                walk(v, key + ".")

    try:
        walk(yaml.compose(text), "")
    except yaml.YAMLError:
        pass
    return lines


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"Override {item!r} must look like key=value, e.g. train.learning_rate=1e-4.")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    # YAML 1.1 reads '1e-4' as a string; users mean a number.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else value
        except ValueError:
            pass
    return key.strip(), value


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if not prefix and k in SECTIONS and isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def build_config(values: dict[str, Any], source: dict[str, str] | None = None) -> Config:
    """Validate flat dotted ``values`` and build a Config. ``source`` says where each key came from."""
    source = source or {}
    keys = all_keys()
    cfg = Config()
    hints = {s: typing.get_type_hints(cls) for s, cls in SECTIONS.items()}
    for key, value in values.items():
        where = f"{source.get(key, 'config')}: '{key}'"
        if key in SECTIONS:
            raise ConfigError(f"{where} must be a mapping of keys (e.g. {keys_of(key)[0]}: ...).")
        if key not in keys:
            raise ConfigError(f"{where} is not a known key.{suggest(key, keys)} "
                              f"Run 'anyfit train --help-config' for the full list.")
        section, name = key.split(".", 1)
        if isinstance(value, str) and hints[section][name] in (float, int):
            try:
                value = hints[section][name](float(value)) if hints[section][name] is int else float(value)
            except ValueError:
                pass
        if isinstance(value, float) and hints[section][name] is int and value.is_integer():
            value = int(value)
        setattr(getattr(cfg, section), name, _coerce(value, hints[section][name], where))
    cfg.data.mix = [_mix_entry(entry, hints["data"], source.get("data.mix", "config"), i)
                    for i, entry in enumerate(cfg.data.mix)]
    validate(cfg)
    return cfg


def config_file(path: str | Path) -> Path:
    """``path`` if it is a file, else the shipped config of that name (``anyfit configs`` lists them)."""
    if Path(path).is_file():
        return Path(path)
    if Path(path).is_dir():
        raise ConfigError(f"Config file {path} is a folder, not a YAML file: give the config file inside it (e.g. "
                          f"{Path(path) / 'config.yaml'}).")
    found = configs.find(str(path))
    if found is not None and not Path(path).parent.name:  # a bare name, never a missing path
        return found
    names = ", ".join(n for n in configs.shipped() if not n.startswith("accelerate/"))
    raise ConfigError(f"Config file {path} does not exist (shipped configs, usable by name: {names}; "
                      "`anyfit configs NAME` prints one to copy and edit).")


def _file_values(path: str | Path) -> tuple[dict[str, Any], dict[str, str]]:
    """Flat dotted values of a YAML config file, and the file:line each came from."""
    path = config_file(path)
    text = path.read_text()
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        what = " ".join(str(getattr(e, "problem", None) or e).split())  # one line: the CLI prints one
        raise ConfigError(f"{where}: not valid YAML ({what}); check the indentation and brackets there.") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model:, data:, train:, ...).")
    lines = _key_lines(text)
    values = _flatten(raw)
    return values, {key: f"{path}:{lines.get(key, '?')}" for key in values}


def load_config(path: str | Path | None, overrides: list[str] = (), base: str | Path | None = None,
                echo=None) -> Config:
    """The config, in layers: the defaults, then ``base`` (a training run's config.yaml, for eval/generate
    of its output), then the YAML file ``path``, then ``key=value`` overrides; all validated.

    With ``echo`` and a ``base``, says how many settings were inherited from the run and which of them
    the file or the overrides changed.
    """
    values: dict[str, Any] = {}
    source: dict[str, str] = {}
    inherited: dict[str, Any] = {}
    if base is not None:
        inherited, where = _file_values(base)
        values.update(inherited)
        source.update(where)
    if path is not None:
        file_values, where = _file_values(path)
        values.update(file_values)
        source.update(where)
    for item in overrides:
        key, value = _parse_override(item)
        values[key] = value
        source[key] = f"override {item!r}"
    cfg = build_config(values, source)
    if echo is not None and base is not None:
        changed = sorted(k for k in inherited if not source[k].startswith(f"{base}:"))
        echo(f"[anyfit] settings of the training run ({base}) are the base"
             + (f"; set here instead: {', '.join(changed)}" if changed else ""))
    return cfg


def set_by_user(cfg_path: str | Path | None, overrides: list[str], key: str) -> bool:
    """Whether the YAML file or the overrides (not a run's config.yaml) set the dotted ``key``."""
    if any(o.split("=", 1)[0].strip() == key for o in overrides):
        return True
    return cfg_path is not None and key in _file_values(cfg_path)[0]


def _mix_entry(entry: dict[str, Any], data_hints: dict[str, Any], origin: str, i: int) -> dict[str, Any]:
    """A data.mix entry's values checked as the data.* keys they stand for (unknown keys: the schema says)."""
    return {key: _coerce(value, data_hints[key], f"{origin}: 'data.mix[{i}].{key}'")
            if key in data_hints and key != "mix" else value for key, value in entry.items()}
