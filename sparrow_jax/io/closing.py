"""``Closing``: the context-manager protocol of an object with a ``close()`` (imports nothing)."""
from __future__ import annotations

from typing import Any


class Closing:
    """``with obj:`` closes ``obj`` on exit, whatever happened inside; subclasses define ``close``."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
