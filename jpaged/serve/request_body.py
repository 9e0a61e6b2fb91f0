"""A request's body read as JSON: everything a handler cannot take safely is an `APIError`
(a 400) before any field is looked at, so the field checks (`openai_api.py`) and every later walk
of the body see a JSON object of bounded depth holding only finite numbers and valid text."""
import json
import math

from jpaged.serve.errors import APIError

MAX_JSON_DEPTH = 64   # far beyond any real request; keeps every later walk of the body shallow


def parse_body(raw: bytes) -> dict:
    """The request body as a JSON object; anything a handler cannot take safely is an APIError:
    invalid JSON or UTF-8, NaN / Infinity / numbers out of float range, integers of more than
    Python's 4,300 digits, nesting deeper than MAX_JSON_DEPTH, and strings holding a lone UTF-16
    surrogate (legal as a JSON escape, "\\ud800", but not text: the tokenizer cannot take it)."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError as err:
        raise APIError(f"the request body is nested more than {MAX_JSON_DEPTH} levels "
                       "deep") from err
    except APIError:
        raise
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, too many digits
        raise APIError(f"the request body is not valid JSON: {err}") from err
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    _check_tree(body)
    return body


def _reject_constant(name: str):
    raise APIError(f"the request body has {name}, which is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise APIError(f"the request body has the number {text[:40]}, out of range")
    return value


def _check_tree(body: dict):
    """Depth and lone surrogates, walked with an explicit stack (no recursion on client input)."""
    stack = [(body, "", 1)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep")
        items = (value.items() if isinstance(value, dict) else enumerate(value)
                 if isinstance(value, list) else ())
        for key, item in items:
            path = f"{where}.{key}" if isinstance(key, str) else f"{where}[{key}]"
            path = path.lstrip(".")
            if isinstance(key, str):
                _check_text(key, path)
            if isinstance(item, str):
                _check_text(item, path)
            elif isinstance(item, (dict, list)):
                stack.append((item, path, depth + 1))


def _check_text(text: str, where: str):
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise APIError(f"'{where[:200]}' is not valid Unicode: it holds a lone UTF-16 surrogate "
                       f"at character {err.start}", param=where[:200]) from err
