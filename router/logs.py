"""Structured logging: one JSON object per line (or plain text).

Every log call about a request passes ``extra={"request_id": ...}``; the
formatter copies such extras into the line, so each line about a request
carries its id, as ``docs/worker-api.md`` asks of workers too.
"""

from __future__ import annotations

import json
import logging
import sys
import time

_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "color_message"}


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", ...extras}`` per record."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """``time level logger msg key=value...``"""

    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        extras = " ".join(f"{k}={v}" for k, v in record.__dict__.items()
                          if k not in _STANDARD and not k.startswith("_"))
        return f"{base} {extras}" if extras else base


def setup_logging(level: str, fmt: str) -> None:
    """Configure the ``router`` logger (and uvicorn's) to write to stderr."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    for name in ("pd_cluster.router", "uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level.upper())
        logger.propagate = False
