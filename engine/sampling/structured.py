"""`StructuredOutput`: what a request's output must match (a JSON schema, any JSON, a regex, a choice, a grammar).

It covers OpenAI's ``response_format`` (``json_object``, ``json_schema``) and
vLLM's ``guided_json``, ``guided_regex``, ``guided_choice`` and ``guided_grammar``
(EBNF, xgrammar's dialect). A spec is validated when it is made, without the
tokenizer (the grammar is built by xgrammar's tokenizer-free `Grammar`
constructors); a bad spec raises `SamplingParamError` whose ``param`` names the
request field it came from. The engine compiles it against the tokenizer
(`pd_cluster.engine.sampling.grammar.GrammarManager`).

Why xgrammar (Dong et al. 2024, "XGrammar: Flexible and Efficient Structured
Generation Engine for Large Language Models") and not llguidance: it is the
default backend of both vLLM and SGLang, so a schema that works there works
here; its `GrammarCompiler` caches compiled grammars and precomputes the
context-independent part of each mask, its `GrammarMatcher` rolls back and
reports termination, and its bitmask kernels (`apply_token_bitmask_inplace`)
run on CPU torch tensors as well as CUDA, which the CPU test suite needs.
llguidance is as capable for lazy/large grammars but would be a second code
path for users coming from those servers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pd_cluster.engine.errors import SamplingParamError

MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar text, and all choices together
MAX_CHOICES = 1024

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
DEFAULT_PARAM = {"json_schema": "guided_json", "json_object": "response_format", "regex": "guided_regex",
                 "choice": "guided_choice", "grammar": "guided_grammar"}


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one constraint on a request's output.

    Attributes:
        json_schema: a JSON schema (a dict, or its JSON text): the output is one JSON value that validates
            (OpenAI ``response_format={"type": "json_schema", ...}``, vLLM ``guided_json``).
        json_object: any JSON object (OpenAI ``response_format={"type": "json_object"}``).
        regex: the output fully matches this regular expression (vLLM ``guided_regex``; xgrammar's syntax,
            ECMAScript-like, no lookaround or backreferences).
        choice: the output is exactly one of these strings (vLLM ``guided_choice``).
        grammar: an EBNF grammar whose start rule is ``root`` (vLLM ``guided_grammar``, xgrammar's EBNF).
        param: the request field the constraint came from (``response_format``, ``guided_json``, ...),
            named by errors; defaults per kind.
        any_whitespace: JSON kinds only: allow any whitespace between JSON tokens. False (the default) fixes
            the layout to ``", "`` and ``": "`` with no newlines, which keeps a model from spending its
            tokens on whitespace (vLLM's ``disable_any_whitespace`` turned on; xgrammar's ``any_whitespace``).

    Raises:
        SamplingParamError: none or several kinds given, a schema that is not a JSON object or that xgrammar
            cannot convert, a regex or grammar that does not parse, empty or too many choices, a spec over
            64 KiB.
    """

    json_schema: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    param: str | None = None
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if (getattr(self, k) is not None and k != "json_object") or
                 (k == "json_object" and self.json_object is not False)]
        param = self.param if isinstance(self.param, str) and self.param else \
            (DEFAULT_PARAM[given[0]] if len(given) == 1 else "structured_output")
        object.__setattr__(self, "param", param)
        if len(given) != 1:
            raise SamplingParamError(param, f"give exactly one of {', '.join(KINDS)}; got {given or 'none'}")
        kind = given[0]
        if not isinstance(self.any_whitespace, bool):
            raise SamplingParamError(param, f"any_whitespace must be a boolean, got {self.any_whitespace!r}")
        if kind == "json_schema":
            object.__setattr__(self, "json_schema", self._check_schema(self.json_schema, param))
        elif kind == "json_object":
            if self.json_object is not True:
                raise SamplingParamError(param, f"json_object must be true, got {self.json_object!r}")
        elif kind == "choice":
            object.__setattr__(self, "choice", self._check_choice(self.choice, param))
        else:
            text = getattr(self, kind)
            if not isinstance(text, str) or not text:
                raise SamplingParamError(param, f"the {kind} must be a non-empty string, got {text!r}")
            if len(text) > MAX_SPEC_CHARS:
                raise SamplingParamError(param, f"the {kind} has more than {MAX_SPEC_CHARS} characters")
        try:
            self.build_grammar()
        except (RuntimeError, ValueError) as e:
            raise SamplingParamError(param, f"invalid {kind}: {_first_line(e)}") from None

    # ---- validation -----------------------------------------------------------
    @staticmethod
    def _check_schema(schema: object, param: str) -> dict[str, Any]:
        if isinstance(schema, str):
            if len(schema) > MAX_SPEC_CHARS:
                raise SamplingParamError(param, f"the JSON schema has more than {MAX_SPEC_CHARS} characters")
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise SamplingParamError(param, f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise SamplingParamError(param, f"the JSON schema must be a JSON object, got {type(schema).__name__}")
        try:
            text = json.dumps(schema)
        except (TypeError, ValueError) as e:
            raise SamplingParamError(param, f"the JSON schema is not JSON-serialisable: {e}") from None
        if len(text) > MAX_SPEC_CHARS:
            raise SamplingParamError(param, f"the JSON schema has more than {MAX_SPEC_CHARS} characters")
        return schema

    @staticmethod
    def _check_choice(choice: object, param: str) -> tuple[str, ...]:
        if not isinstance(choice, (list, tuple)) or not choice or not all(isinstance(c, str) for c in choice):
            raise SamplingParamError(param, f"choices must be a non-empty list of strings, got {choice!r}")
        if len(choice) > MAX_CHOICES:
            raise SamplingParamError(param, f"at most {MAX_CHOICES} choices, got {len(choice)}")
        if any(c == "" for c in choice):
            raise SamplingParamError(param, "choices must not be empty strings")
        if sum(len(c) for c in choice) > MAX_SPEC_CHARS:
            raise SamplingParamError(param, f"the choices have more than {MAX_SPEC_CHARS} characters in all")
        return tuple(choice)

    # ---- identity and grammar ---------------------------------------------------
    @property
    def kind(self) -> str:
        return next(k for k in KINDS if (k == "json_object" and self.json_object) or
                    (k != "json_object" and getattr(self, k) is not None))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal for equal constraints."""
        kind = self.kind
        if kind == "json_schema":
            # key order kept: xgrammar generates the properties in the schema's order
            return kind, json.dumps(self.json_schema, separators=(",", ":"))
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, json.dumps(list(self.choice))
        return kind, getattr(self, kind)

    @property
    def cache_key(self) -> tuple[str, str, bool]:
        """`key` plus the whitespace rule: the compile cache's key."""
        return (*self.key, self.any_whitespace)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StructuredOutput) and self.cache_key == other.cache_key

    def __hash__(self) -> int:
        return hash(self.cache_key)

    @property
    def json_schema_text(self) -> str:
        """JSON kinds: the schema as JSON text (``{"type": "object"}`` for json_object: any JSON object)."""
        return self.key[1] if self.kind == "json_schema" else '{"type": "object"}'

    def choice_ebnf(self) -> str:
        """The choices as an EBNF grammar (each choice a JSON-escaped string literal)."""
        return "root ::= " + " | ".join(json.dumps(c) for c in self.choice)

    def build_grammar(self):
        """The tokenizer-free `xgrammar.Grammar` of this constraint.

        Raises:
            RuntimeError: xgrammar cannot convert the spec.
        """
        import xgrammar as xgr

        kind, text = self.key
        if kind in ("json_schema", "json_object"):
            return xgr.Grammar.from_json_schema(self.json_schema_text, any_whitespace=self.any_whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(self.choice_ebnf())
        return xgr.Grammar.from_ebnf(text)


def _first_line(e: Exception) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    msg = lines[0] if lines else type(e).__name__
    if msg.startswith("[") and "] " in msg:  # xgrammar prefixes "[hh:mm:ss] /path/file.cc:123: "
        msg = msg.split("] ", 1)[1]
        if ".cc:" in msg.split(" ", 1)[0]:
            msg = msg.split(": ", 1)[-1]
    return msg


GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def structured_output_from_request(response_format: dict | None = None, guided_json: dict | str | None = None,
                                   guided_regex: str | None = None, guided_choice: list[str] | None = None,
                                   guided_grammar: str | None = None,
                                   guided_whitespace_pattern: str | None = None) -> StructuredOutput | None:
    """The `StructuredOutput` of an OpenAI / vLLM request body, or None when it asks for none.

    Args:
        response_format: OpenAI's ``{"type": "text" | "json_object" | "json_schema", "json_schema":
            {"name": ..., "schema": {...}, "strict": ...}}``.
        guided_json, guided_regex, guided_choice, guided_grammar: vLLM's extra fields.
        guided_whitespace_pattern: vLLM's field; refused (xgrammar takes no pattern), never ignored.

    Raises:
        SamplingParamError: a malformed ``response_format``, two constraints at once (``param`` names the
            second), or an invalid spec (``param`` names its field).
    """
    given: list[tuple[str, dict]] = []
    if response_format is not None:
        if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
            raise SamplingParamError("response_format", "must be an object with a string 'type'")
        kind = response_format["type"]
        if kind == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            body = response_format.get("json_schema")
            if not isinstance(body, dict) or "schema" not in body:
                raise SamplingParamError("response_format", "type json_schema needs json_schema.schema")
            given.append(("response_format", {"json_schema": body["schema"]}))
        elif kind != "text":
            raise SamplingParamError("response_format", f"type must be text, json_object or json_schema, got {kind!r}")
    for name, value in zip(GUIDED_FIELDS, (guided_json, guided_regex, guided_choice, guided_grammar)):
        if value is not None:
            given.append((name, {name.removeprefix("guided_").replace("json", "json_schema"): value}))
    if guided_whitespace_pattern is not None:
        raise SamplingParamError("guided_whitespace_pattern", "is not supported (the JSON layout is fixed: "
                                                              "', ' and ': ', no newlines)")
    if not given:
        return None
    if len(given) > 1:
        raise SamplingParamError(given[1][0], f"only one structured output per request; {given[0][0]} is set too")
    param, kwargs = given[0]
    return StructuredOutput(param=param, **kwargs)
