"""Helpers the Lua script tests share: owner tokens, a plain rate limit's arguments, a
limit's verdict, what a key holds, Redis TIME, and a script called the way the filter calls
it."""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from pathlib import Path

LUA = Path(__file__).resolve().parents[2] / "src" / "redis" / "scripts"


def owner() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Limit:
    """A limit without burst or shadow, as acquire.lua's six per-limit arguments."""

    algo: str
    limit: int
    window_ms: int

    def argv(self, cost: int = 1) -> list:
        return [self.algo, self.limit, self.window_ms, self.limit, "0", cost]


@dataclass(frozen=True)
class Verdict:
    """One limit's part of acquire.lua's reply."""

    allowed: bool
    remaining: int
    reset_ms: int
    retry_after_ms: int


def limits_argv(limits, cost: int = 1, nonce: str | None = None) -> list:
    """acquire.lua's ARGV up to the limits: n, nonce, then each limit's six values (anything
    with `argv(cost)`), every limit consuming `cost`."""
    argv: list = [len(limits), nonce or uuid.uuid4().hex]
    for lim in limits:
        argv += lim.argv(cost)
    return argv


def raw_state(r, key: str):
    """Everything a script stores under `key`, without the TTL."""
    kind = r.type(key).decode()
    if kind == "none":
        return None
    if kind == "string":
        return r.get(key)
    if kind == "hash":
        return r.hgetall(key)
    if kind == "zset":
        return r.zrange(key, 0, -1, withscores=True)
    raise AssertionError(f"unexpected type {kind} at {key}")


def redis_now_us(r) -> int:
    sec, usec = r.time()
    return sec * 1_000_000 + usec


# The scripts batch.lua runs, numbered from 1 in this order (a sub-call's first word).
BATCHED = ("acquire", "complete", "release", "lease_release", "slot_release", "charge")


def batch_source() -> str:
    """batch.lua as src/redis/scripts/mod.rs assembles it: the head, each script of BATCHED as a local
    function `<name>_one(KEYS, ARGV)`, the tail."""
    parts = [(LUA / "batch_head.lua").read_text()]
    for name in BATCHED:
        parts.append(f"local function {name}_one(KEYS, ARGV)\n{(LUA / f'{name}.lua').read_text()}end\n")
    parts.append((LUA / "batch_tail.lua").read_text())
    return "".join(parts)


class Script:
    """A script called the way the filter calls it: EVAL, then EVALSHA once Redis has it (the
    gateway user may not run SCRIPT LOAD, which redis-py's register_script would)."""

    def __init__(self, client, *names: str, source: str | None = None):
        self.client = client
        self.source = source if source is not None else "".join((LUA / n).read_text() for n in names)
        self.sha = None

    def __call__(self, keys: list, args: list):
        if self.sha is None:
            reply = self.client.eval(self.source, len(keys), *keys, *args)
            self.sha = hashlib.sha1(self.source.encode()).hexdigest()
            return reply
        return self.client.evalsha(self.sha, len(keys), *keys, *args)
