"""``--log-file PATH`` and ``--log-format text|json``: where the log goes, and how.

The text format is the one on stderr. The JSON format writes one object per
record and line, with ``time`` (ISO 8601, UTC), ``level``, ``logger`` and
``message``, the structured fields a record carries (``extra={"fields":
{...}}``, e.g. the dashboard's per-step figures) at the top level, and
``exception`` with the traceback when there is one. A field may not replace
one of the four: it is then written under ``field_<name>``.

With ``--log-file`` the log goes to the file (appended to) in
``--log-format`` as well as to stderr in text; without it, ``--log-format
json`` makes stderr JSON lines.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ._errors import ConfigError

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_RESERVED = ("time", "level", "logger", "message", "exception")


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            for key, value in fields.items():
                name = f"field_{key}" if key in _RESERVED else str(key)
                entry[name] = _plain(value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, separators=(",", ":"))


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN or Inf
    return value


def formatter(log_format: str) -> logging.Formatter:
    """The formatter of ``--log-format``; ``ConfigError`` for an unknown one."""
    if log_format == "json":
        return JsonFormatter()
    if log_format == "text":
        return logging.Formatter(TEXT_FORMAT)
    raise ConfigError(f"--log-format {log_format!r} must be one of {', '.join(LOG_FORMATS)}")


def configure_log_output(log_file: str | None, log_format: str) -> logging.Handler | None:
    """Add the ``--log-file`` handler to the root logger (or, with none, switch
    stderr to ``log_format``); returns the file's handler, if any.

    The file is opened (appending) here, so an unwritable path is found at
    start: ``ConfigError`` naming it.
    """
    chosen = formatter(log_format)
    root = logging.getLogger()
    if log_file is None:
        for handler in root.handlers:
            if getattr(handler, "stream", None) is sys.stderr:
                handler.setFormatter(chosen)
        return None
    path = Path(log_file)
    try:
        handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"--log-file {path}: cannot write it: {e.strerror or e}") from e
    handler.setFormatter(chosen)
    root.addHandler(handler)
    return handler
