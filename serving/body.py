"""Reading a JSON request body safely: size, encoding, depth, numbers and strings.

Every malformed body becomes an `HTTPError` 400 (413 when too large) in OpenAI's format,
never a 500: Python's ``json`` accepts ``NaN``/``Infinity`` and lone UTF-16 surrogates
(``"\\ud800"``) and raises `RecursionError` on deep nesting; all three are refused here,
naming the offending field (``param``) where there is one.
"""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.requests import Request

from pd_cluster.serving.errors import HTTPError

MAX_BODY_BYTES = 32 * 1024 * 1024
"""Largest request body a worker reads (bytes); the router's default limit is the same."""

MAX_JSON_DEPTH = 32
"""Deepest nesting of objects and arrays accepted in a body (OpenAI bodies need fewer than 10)."""


class _BadNumber(ValueError):
    pass


def _reject_constant(name: str) -> Any:
    raise _BadNumber(f"{name} is not a valid JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _BadNumber(f"{text[:32]} is out of range for a 64-bit float")
    return value


async def read_body(request: Request, max_bytes: int = MAX_BODY_BYTES) -> bytes:
    """The raw body, refused with 413 past `max_bytes` (checked on Content-Length, then while reading)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise HTTPError(413, f"the request body is {declared} bytes; the limit is {max_bytes}", None,
                        "request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise HTTPError(413, f"the request body is over the limit of {max_bytes} bytes", None,
                            "request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json_object(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """Decode a request body that must be one JSON object.

    Raises:
        HTTPError: 400 (code ``invalid_json``) for bytes that are not UTF-8, invalid JSON, NaN or
            Infinity or a number out of float range, nesting deeper than `max_depth`, a string with a
            lone surrogate, or a top level that is not an object.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HTTPError(400, f"the request body is not valid UTF-8: {e}", None, "invalid_json") from e
    try:
        data = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError as e:
        raise HTTPError(400, f"the JSON body is nested too deeply (the limit is {max_depth} levels)", None,
                        "invalid_json") from e
    except json.JSONDecodeError as e:
        raise HTTPError(400, f"malformed JSON body: {e}", None, "invalid_json") from e
    except ValueError as e:  # NaN/Infinity, float overflow, integers past Python's digit limit
        raise HTTPError(400, f"malformed JSON body: {e}", None, "invalid_json") from e
    if not isinstance(data, dict):
        raise HTTPError(400, "the request body must be a JSON object", None, "invalid_json")
    check_tree(data, max_depth)
    return data


def check_tree(data: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Walk a decoded body without recursion: refuse deep nesting and strings that are not valid Unicode.

    Raises:
        HTTPError: 400 naming the path of the first offending value (``messages[0].content``).
    """
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, str):
            _check_string(node, path)
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth >= max_depth:
            top = path.split(".")[0].split("[")[0] or None  # the body field that holds it
            raise HTTPError(400, f"{top or 'body'}: nested deeper than {max_depth} levels", top, "invalid_json")
        if isinstance(node, dict):
            for key, value in node.items():
                _check_string(key, path or "body")
                stack.append((value, f"{path}.{key}" if path else key, depth + 1))
        else:
            for i, value in enumerate(node):
                stack.append((value, f"{path}[{i}]", depth + 1))


def _check_string(s: str, path: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise HTTPError(400, f"{path}: the string holds a lone UTF-16 surrogate (U+{ord(s[e.start]):04X}) at "
                             f"character {e.start}, which is not valid Unicode", path or None,
                        "invalid_unicode") from e
