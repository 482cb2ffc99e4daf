"""Request fields that are not modelled in `protocol.py`: harmless metadata, and fields refused by name.

OpenAI's rule for unknown arguments is followed: a field is honoured, accepted as
metadata that cannot change the output, or refused with a 400 naming it. A
refused field is accepted when it carries its no-op value (``functions: []``,
``echo: false``), since clients often send defaults. Fields modelled in
`protocol.py` (for chat: ``tools``, ``tool_choice``, ``parallel_tool_calls``; for
both: ``n``, ``response_format``, ``guided_*``) never reach these lists.
The lists are documented in docs/worker-api.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pd_cluster.engine.errors import RequestRejected

HARMLESS_FIELDS: tuple[str, ...] = ("user", "store", "metadata", "service_tier", "prompt_cache_key",
                                    "safety_identifier", "parallel_tool_calls", "request_id")
"""Accepted and ignored: they label or bill a request and cannot change its output."""


def _none(v: Any) -> bool:
    return v is None


def _none_or_empty(v: Any) -> bool:
    return v is None or v == [] or v == {} or v == ""


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or any(v == x and type(v) is type(x) for x in values)


REFUSED_FIELDS: dict[str, Callable[[Any], bool]] = {
    # tools on /v1/completions (honoured on chat, where they are modelled), the legacy function-calling
    # fields, and the other spellings of structured outputs (``response_format`` and ``guided_*`` are honoured)
    "tools": _none_or_empty,
    "tool_choice": _is("none"),
    "functions": _none_or_empty,
    "function_call": _is("none"),
    "guided_decoding_backend": _none,
    "structured_outputs": _none,
    # other sampling and decoding controls
    "use_beam_search": _is(False),
    "length_penalty": _is(1.0, 1),
    "truncate_prompt_tokens": _none,
    "bad_words": _none_or_empty,
    "allowed_token_ids": _none,
    "spaces_between_special_tokens": _is(True),
    "reasoning_effort": _none,
    "modalities": _is(["text"]),
    "audio": _none,
    "prediction": _none,
    "web_search_options": _none,
    "continue_final_message": _is(False),
    "chat_template": _none,
    "chat_template_kwargs": _none_or_empty,
    "documents": _none,
    "echo": _is(False),
    "best_of": _is(1),
    "min_tokens_ratio": _none,
    "priority": _is(0),
}
"""Fields that would change the output (or what the server does), with the test for their no-op value."""


def check_extra_fields(extra: dict[str, Any], kind: str) -> None:
    """Refuse every field of `extra` (those not modelled for `kind`) that is not harmless metadata.

    Raises:
        RequestRejected: 400 naming the first refused or unknown field (code ``unsupported_parameter``
            or ``unknown_parameter``).
    """
    for name, value in extra.items():
        if name in HARMLESS_FIELDS:
            continue
        accepts = REFUSED_FIELDS.get(name)
        if accepts is None:
            raise RequestRejected(f"Unrecognized request argument supplied: {name}", param=name,
                                  code="unknown_parameter")
        if not accepts(value):
            raise RequestRejected(f"{name}: not supported by this server (only its default is accepted)",
                                  param=name, code="unsupported_parameter")
