"""Grammar-constrained decoding: compiled grammars (cached) and one matcher per request, with xgrammar.

`GrammarManager` (one per engine) owns the tokenizer's `xgrammar.TokenizerInfo`,
the `GrammarCompiler` and a cache of compiled grammars keyed by
`StructuredOutput.key`; it makes a `RequestGrammar` (one `GrammarMatcher`) for
each constrained request, which the request carries (`Request.grammar`).

Each step the sampler fills one int32 bitmask [rows, ceil(V / 32)] for all the
constrained rows and applies it once (`apply_grammar_bitmask`, xgrammar's
`apply_token_bitmask_inplace`): disallowed tokens get -inf after bans,
``logit_bias`` and penalties (none of which can lift a masked token) and before
temperature, top-k, top-p and min-p. The engine then
feeds every chosen token to the matcher (`RequestGrammar.accept`), including the
first token that a prefill worker sampled and a decode worker replays; when the
matcher terminates (the grammar is complete and a stop token was accepted) the
request finishes with ``stop``. Retraction keeps the request's tokens and its
matcher, so a recomputed request accepts no token twice. The masking scheme is
XGrammar's (Dong et al. 2024), as in vLLM's and SGLang's xgrammar backends.
"""

from __future__ import annotations

import logging
import threading
from typing import Sequence

import torch

from pd_cluster.engine.errors import SamplingParamError
from pd_cluster.engine.sampling.structured import StructuredOutput

logger = logging.getLogger("engine.sampling.grammar")

MAX_CACHED_GRAMMARS = 256


class RequestGrammar:
    """One request's matcher: which tokens may come next, and whether the grammar is complete.

    Args:
        matcher: a fresh `xgrammar.GrammarMatcher`.
        spec: the constraint it enforces.
    """

    def __init__(self, matcher, spec: StructuredOutput) -> None:
        self.matcher = matcher
        self.spec = spec
        self.num_accepted = 0

    def accept(self, token_id: int) -> bool:
        """Advance by one chosen token; False when the grammar does not allow it (the state is unchanged)."""
        ok = bool(self.matcher.accept_token(int(token_id)))
        self.num_accepted += ok
        return ok

    @property
    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of `bitmask` (int32 [rows, ceil(V / 32)])."""
        self.matcher.fill_next_token_bitmask(bitmask, row)


class GrammarManager:
    """Compiles structured-output specs for one tokenizer and makes per-request matchers.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the logits' width (the model's vocabulary; may exceed the tokenizer's, the rest is masked).
        stop_token_ids: the ids that end a request (the model's EOS ids); a complete grammar allows only these.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler = None
        self._cache: dict[tuple[str, str, bool], object] = {}
        self._lock = threading.Lock()
        self.num_compiled = 0

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids or None)
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=True)
        return self._compiler

    def compile(self, spec: StructuredOutput):
        """The compiled grammar of `spec` (cached by `spec.cache_key`).

        Raises:
            SamplingParamError: xgrammar cannot compile it (``param`` is `spec.param`).
        """
        key = spec.cache_key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                return compiled
            compiler = self._get_compiler()
            try:
                kind, text, _ = key
                if kind in ("json_schema", "json_object"):
                    compiled = compiler.compile_json_schema(spec.json_schema_text, any_whitespace=spec.any_whitespace)
                elif kind == "regex":
                    compiled = compiler.compile_regex(text)
                elif kind == "choice":
                    compiled = compiler.compile_grammar(spec.choice_ebnf())
                else:
                    compiled = compiler.compile_grammar(text)
            except (RuntimeError, ValueError) as e:
                raise SamplingParamError(spec.param, f"cannot compile the {key[0]}: {e}") from None
            if len(self._cache) >= MAX_CACHED_GRAMMARS:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = compiled
            self.num_compiled += 1
            return compiled

    def new_request_grammar(self, spec: StructuredOutput) -> RequestGrammar:
        """A fresh matcher for one request. Raises as `compile`."""
        import xgrammar as xgr

        return RequestGrammar(xgr.GrammarMatcher(self.compile(spec)), spec)


def apply_grammar_bitmask(x: torch.Tensor, grammars: Sequence[RequestGrammar | None],
                          errors: list[str | None]) -> None:
    """Mask, in place, the tokens each constrained row's grammar does not allow next.

    Args:
        x: [B, V] float32 logits of the step (one row per request).
        grammars: per row, the request's grammar or None (unconstrained).
        errors: per row; a row whose mask cannot be computed gets an error (its request fails alone).
    """
    rows = [i for i, g in enumerate(grammars) if g is not None and errors[i] is None]
    if not rows:
        return
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(x), x.shape[-1])
    filled = []
    for i in rows:
        try:
            grammars[i].fill(bitmask, i)
            filled.append(i)
        except Exception as e:  # noqa: BLE001 - one broken matcher fails one request
            errors[i] = f"structured output failed: {type(e).__name__}: {e}"
    if not filled:
        return
    xgr.apply_token_bitmask_inplace(x, bitmask.to(x.device), vocab_size=x.shape[-1], indices=filled)
