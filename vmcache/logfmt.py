"""Log lines as event names with key=value fields (``pin.apply regions=3 bytes=1048576``)."""

from __future__ import annotations

import logging

__all__ = ["event", "domain_logger"]


def _quote(value: object) -> str:
    text = str(value)
    if text == "" or any(c.isspace() or c in '"=' or not c.isprintable() for c in text):
        text = text.replace("\\", "\\\\").replace('"', '\\"')
        # One event, one line: newlines and other control characters (a domain name may hold them) escaped.
        text = "".join(c if c.isprintable() or c == " " else c.encode("unicode_escape").decode("ascii") for c in text)
        return '"' + text + '"'
    return text


def event(name: str, **fields: object) -> str:
    """Format one log message: the event name, then ``key=value`` pairs in order."""
    parts = [name]
    parts.extend(f"{key}={_quote(value)}" for key, value in fields.items())
    return " ".join(parts)


def domain_logger(base: str, domain: str) -> logging.Logger:
    """A child logger of ``base`` for one domain (dots in the name are kept out)."""
    return logging.getLogger(base).getChild(domain.replace(".", "_"))
