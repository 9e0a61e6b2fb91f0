"""Typed reads of a request body's fields: a wrong type is an `APIError` naming the field."""

import json

from jpaged.serve.errors import APIError

_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
               list: "an array", dict: "an object"}


def body_field(body: dict, name: str, kinds: tuple, default=None, *, required: bool = False):
    """body[name] if present and of one of `kinds` (bool is never an int here); None -> default."""
    if name not in body or body[name] is None:
        if required:
            raise APIError(f"'{name}' is a required property", param=name)
        return default
    value = body[name]
    if not any(_is_kind(value, kind) for kind in kinds):
        wanted = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
        raise APIError(f"'{name}' must be {wanted}, got {json.dumps(value)[:80]}", param=name)
    return value


def _is_kind(value, kind) -> bool:
    if isinstance(value, bool):  # JSON true is not the integer 1
        return kind is bool
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)
