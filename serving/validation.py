"""Pydantic validation errors as OpenAI 400s that name the field (``param``).

Pydantic's error locations include the names of union members (``('prompt', 'str')``)
and of type checks; `param_of` keeps only the part of a location that exists in the
request body, written as ``messages[0].content``.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from pd_cluster.serving.errors import HTTPError

M = TypeVar("M", bound=BaseModel)


def validate_body(model: type[M], data: dict[str, Any]) -> M:
    """``model.model_validate(data)``.

    Raises:
        HTTPError: 400 ``invalid_value`` (``missing_required_parameter`` for a missing field) naming
            the field of the first error.
    """
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        first = _most_specific(errors, data)
        param = param_of(first.get("loc", ()), data)
        code = "missing_required_parameter" if first.get("type") == "missing" else "invalid_value"
        msg = first.get("msg", "invalid value")
        if first.get("type") == "missing":
            msg = "a required field is missing"
        elif first.get("type") == "extra_forbidden":
            msg = "Unrecognized request argument supplied"
            code = "unknown_parameter"
        raise HTTPError(400, f"{param or 'body'}: {msg}", param, code) from None


def _most_specific(errors: list[dict[str, Any]], data: Any) -> dict[str, Any]:
    """The first error whose location reaches furthest into the body (a union's members each report one)."""
    best, depth = errors[0], -1
    for err in errors:
        d = len(_path(err.get("loc", ()), data))
        if d > depth and err.get("loc", ())[:1] == errors[0].get("loc", ())[:1]:
            best, depth = err, d
    return best


def _path(loc: tuple, data: Any) -> list[str | int]:
    path: list[str | int] = []
    node = data
    for part in loc:
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif not path and isinstance(part, str):  # a missing top-level field
            path.append(part)
            break
        else:
            continue  # a union member's or a check's name: not a place in the body
        path.append(part)
    return path


def param_of(loc: tuple, data: Any) -> str | None:
    """The body path of a pydantic error location: ``messages[0].content``; None for the whole body."""
    text = ""
    for part in _path(loc, data):
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text or None
