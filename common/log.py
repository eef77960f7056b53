"""JSON-lines logging: one object per line with time, level, process and the request id."""

from __future__ import annotations

import logging
import sys
import time

import orjson

_EXTRA_KEYS = ("request_id", "step_id", "num_reqs", "count", "error", "addr", "access")


class JsonFormatter(logging.Formatter):
    def __init__(self, proc: str) -> None:
        super().__init__()
        self.proc = proc

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "proc": self.proc,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in _EXTRA_KEYS:
            if (value := record.__dict__.get(key)) is not None:
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(line).decode()


def setup_logging(proc: str, level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(proc))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("uvicorn.access", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def now() -> float:
    return time.time()
