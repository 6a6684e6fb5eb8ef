"""structlog setup: JSON lines on stderr, with contextvars (request_id, service, worker_id)."""

from __future__ import annotations

import logging
import sys

import structlog

from kvmesh import env


def configure_logging(service: str = "kvmesh", level: str | None = None) -> None:
    level_no = getattr(logging, (level or env.log_level()), logging.WARNING)
    renderer = (
        structlog.processors.JSONRenderer(sort_keys=True)
        if env.log_json()
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=lambda *_: _Stderr(),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)


class _Stderr:
    """Writes each line to the sys.stderr of the moment (not the one when logging was set up:
    pytest swaps it per test and closes the old one; a caller may redirect it)."""

    def msg(self, message: str) -> None:
        stream = sys.stderr
        stream.write(message + "\n")
        stream.flush()

    log = debug = info = warn = warning = error = critical = exception = fatal = msg
