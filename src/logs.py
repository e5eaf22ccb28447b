"""The one logging setup: structlog to stderr, human-readable or one JSON object per line."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

LOG_FORMATS = ("console", "json")


def configure_logging(log_format: str = "console", level: str | int = "info") -> None:
    """Set structlog up for the process (the CLI calls it once, before anything logs)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, not {log_format!r}")
    lvl = level if isinstance(level, int) else getattr(logging, level.upper(), logging.INFO)
    renderer: Any = (structlog.processors.JSONRenderer() if log_format == "json"
                     else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso"),
                    structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
    )
