"""Typed configs from TOML/dicts: unknown keys and wrong types are rejected with the key's full path."""
from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from pathlib import Path

from core.errors import SmeltError


def _check_type(value, tp, where: str):
    origin = typing.get_origin(tp)
    if tp is typing.Any:
        return value
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _check_type(value, arg, where)
            except SmeltError:
                continue
        raise SmeltError(f"config {where}={value!r} has the wrong type (expected {tp})")
    if tp is type(None):
        if value is None:
            return None
        raise SmeltError(f"config {where}={value!r} has the wrong type (expected None)")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise SmeltError(f"config {where} must be a table, got {value!r}")
        return build(tp, value, where)
    base = origin or tp
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if base in (list, tuple) and isinstance(value, (list, tuple)):
        (arg, *_) = typing.get_args(tp) or (typing.Any,)
        return base(_check_type(v, arg, f"{where}[{i}]") for i, v in enumerate(value))
    if base is dict and isinstance(value, dict):
        return value
    if isinstance(base, type) and isinstance(value, base) and not (base is int and isinstance(value, bool)):
        return value
    raise SmeltError(f"config {where}={value!r} has the wrong type (expected {getattr(tp, '__name__', tp)})")


def build(cls, values: dict, where: str = ""):
    """Instantiate dataclass `cls` from a dict; every key must be a field (nested dataclasses too)."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in values.items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            raise SmeltError(f"unknown config key {path!r} (valid: {', '.join(sorted(names))})")
        kwargs[key] = _check_type(value, hints[key], path)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise SmeltError(f"config {where or cls.__name__}: {e}") from None


def read_toml(path: str | Path, what: str = "config file") -> dict:
    """A TOML file that must exist and parse; either failure is one line naming the file."""
    path = Path(path)
    if not path.is_file():
        raise SmeltError(f"{what} {path} does not exist")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise SmeltError(f"{what} {path}: {e}") from None


def load_toml(cls, path: str | Path, overrides: dict | None = None):
    values = read_toml(path)
    values.update(overrides or {})
    return build(cls, values)
