"""``key=value`` settings of the fleet's ROS 2 commands and ``store import-rosbag``, typed
by a config dataclass's annotations (``robot=tabletop timeout=20 serve_policy=true``)."""

from __future__ import annotations

import typing
from dataclasses import MISSING
from dataclasses import fields as dataclass_fields
from typing import Any


def parse_config(cls: type, argv: list[str]) -> Any:
    """Build a config dataclass from ``key=value`` strings, typed by its annotations."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for arg in argv:
        key, sep, text = arg.partition("=")
        if not sep or key not in hints:
            raise ValueError(f"expected key=value with key in {sorted(hints)}, got {arg!r}")
        try:
            values[key] = _convert(text, hints[key])
        except ValueError as e:
            raise ValueError(f"{key}={text!r}: {e}") from None
    missing = [f.name for f in dataclass_fields(cls)
               if f.name not in values and f.default is MISSING and f.default_factory is MISSING]
    if missing:  # the dataclass would say "__init__() missing 1 required positional argument"
        raise ValueError(f"missing {', '.join(f'{k}=...' for k in missing)}")
    return cls(**values)


def _convert(text: str, tp: Any) -> Any:
    args = typing.get_args(tp)
    if args:  # `X | None`
        if text.lower() in ("null", "none", ""):
            return None
        tp = next(a for a in args if a is not type(None))
    if tp is bool:
        if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"not a boolean: {text!r}")
        return text.lower() in ("true", "1", "yes")
    return tp(text)
