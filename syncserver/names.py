"""What a run or peer may be called: one pattern, used by the routes, the dashboard and the settings.

Names travel in URL paths and data-dir paths, so they allow no ``/``, no leading ``.`` and
nothing a shell or a file system would read twice.
"""

from __future__ import annotations

import re

__all__ = ["NAME_PATTERN", "NAME_RULE", "is_name"]

#: Anchored both ends: pydantic and FastAPI search a ``pattern`` rather than match it whole.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
#: The pattern in words, for error messages and the OpenAPI descriptions.
NAME_RULE = "letters, digits, '.', '_', '-'"

_NAME = re.compile(NAME_PATTERN)


def is_name(value: str) -> bool:
    """Is ``value`` a valid run or peer name? (``fullmatch``: a trailing newline is no name.)"""
    return _NAME.fullmatch(value) is not None
