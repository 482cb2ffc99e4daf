"""Which upstream failures are retried, and how long to wait between tries.

Before the first token a worker answers a failure with an HTTP status
(``docs/worker-api.md``): 502, 503 and 504 are retriable, 4xx are not.
Connection errors and timeouts before the response are retriable too.
Exponential backoff with jitter as in SGLang router's ``--retry-*`` flags.
"""

from __future__ import annotations

import random

from pd_cluster.router.config import RetryConfig

RETRIABLE_STATUSES = frozenset({502, 503, 504})


def is_retriable_status(status: int) -> bool:
    """True for the statuses a worker uses for failures another pair may not have."""
    return status in RETRIABLE_STATUSES


def backoff_seconds(config: RetryConfig, retry_number: int, rng: random.Random) -> float:
    """Delay before the ``retry_number``-th retry (1-based), in seconds.

    ``min(max_backoff, initial * multiplier**(n-1))`` times a uniform factor in
    ``[1 - jitter, 1 + jitter]``. Raises ``ValueError`` for ``retry_number < 1``.
    """
    if retry_number < 1:
        raise ValueError("retry_number is 1-based")
    base_ms = min(config.max_backoff_ms,
                  config.initial_backoff_ms * config.backoff_multiplier ** (retry_number - 1))
    jitter = config.jitter_factor
    factor = 1.0 + rng.uniform(-jitter, jitter) if jitter else 1.0
    return max(0.0, base_ms * factor) / 1e3
