"""Helpers the Lua script tests share: owner tokens and a plain rate limit's arguments."""

from __future__ import annotations

import uuid
from dataclasses import dataclass


def owner() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Limit:
    """A limit without burst or shadow, as acquire.lua's five per-limit arguments."""

    algo: str
    limit: int
    window_ms: int

    def argv(self) -> list:
        return [self.algo, self.limit, self.window_ms, self.limit, "0"]
