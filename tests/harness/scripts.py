"""Helpers the Lua script tests share: owner tokens, a plain rate limit's arguments, a
limit's verdict, what a key holds, Redis TIME, and a script called the way the filter calls
it (with a call tag of its own, its reply read only when it carries the tag back)."""

from __future__ import annotations

import functools
import hashlib
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

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


# A token of src/redis/scripts/mod.rs, as far as the scripts' recipe needs: a comment (dropped), a string
# literal, a char literal or lifetime (whole, so a quote in one opens no string), a word, or
# any other character.
_TOKEN = re.compile(r"""//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\])*"|'(?:\\.|[^\\'])'|'\w+|\w+|\S""", re.S)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "\\": "\\", '"': '"', "'": "'"}


def _unescape(literal: str) -> str:
    """A Rust string literal's value."""
    def one(m: re.Match) -> str:
        e = m.group(1)
        if e[0] in "\r\n":  # a line continuation: the newline and the blanks after it go
            return ""
        if e[0] == "x":
            return chr(int(e[1:], 16))
        if e[0] == "u":
            return chr(int(e[2:-1], 16))
        return _ESCAPES[e]
    return re.sub(r"\\(x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]+\}|\r?\n\s*|.)", one, literal[1:-1],
                  flags=re.S)


def _group(tokens: list[str], i: int) -> int:
    """The index just after the bracket group that opens at tokens[i]."""
    depth = 0
    for j in range(i, len(tokens)):
        depth += tokens[j] in ("(", "[", "{")
        depth -= tokens[j] in (")", "]", "}")
        if depth == 0:
            return j + 1
    raise ValueError("mod.rs: a bracket is not closed")


def sources(read: Callable[[str], str] | None = None) -> dict[str, str]:
    """Every script as the filter runs it, by name ("acquire", ..., "batch"), assembled by the
    recipe src/redis/scripts/mod.rs itself holds (Scripts::load), not by a copy of it: each
    `Script::new("<name>", <text>)`, where a text is a string literal, `include_str!("<file>")`,
    `concat!(<text>, ...)`, or `m!()` of a macro of mod.rs `macro_rules! m { () => { <text> }; }`.
    `read(file name)` reads a file of src/redis/scripts/: by default the working tree's (bench/scripts.py
    reads a git revision's)."""
    read = read or (lambda name: (LUA / name).read_text())
    tokens = [t for t in _TOKEN.findall(read("mod.rs")) if not t.startswith(("//", "/*"))]

    macros: dict[str, list[str]] = {}
    for i, tok in enumerate(tokens):
        if tok == "macro_rules" and tokens[i + 1] == "!":  # m { ( ) => { <text> } ; }
            if tokens[i + 4:i + 9] != ["(", ")", "=", ">", "{"]:
                raise ValueError(f"mod.rs: macro {tokens[i + 2]} is not () => {{ <text> }}")
            macros[tokens[i + 2]] = tokens[i + 9:_group(tokens, i + 8) - 1]

    def text(ts: list[str]) -> str:
        parts, i = [], 0
        while i < len(ts):
            tok = ts[i]
            if tok.startswith('"'):
                parts.append(_unescape(tok))
                i += 1
            elif tok == ",":
                i += 1
            elif ts[i + 1:i + 3] == ["!", "("]:
                end = _group(ts, i + 2)
                args = ts[i + 3:end - 1]
                if tok == "include_str" and len(args) == 1:
                    parts.append(read(_unescape(args[0])))
                elif tok == "concat":
                    parts.append(text(args))
                elif tok in macros and not args:
                    parts.append(text(macros[tok]))
                else:
                    raise ValueError(f"mod.rs: {tok}!({' '.join(args)}) in a script's text")
                i = end
            else:
                raise ValueError(f"mod.rs: {tok!r} in a script's text")
        return "".join(parts)

    out = {}
    for i in range(len(tokens)):
        if tokens[i:i + 5] == ["Script", ":", ":", "new", "("] and tokens[i + 5][0] == '"':
            call = tokens[i + 5:_group(tokens, i + 4) - 1]  # "<name>" , <text>
            out[_unescape(call[0])] = text(call[2:])
    if not out:
        raise ValueError('mod.rs: no Script::new("<name>", <text>)')
    return out


@functools.cache
def _working_tree() -> dict[str, str]:
    return sources()


def script_source(name: str) -> str:
    """The script `name` ("acquire" or "acquire.lua") as the filter runs it: `sources()`."""
    return _working_tree()[name.removesuffix(".lua")]


def batch_source() -> str:
    """batch.lua as the filter runs it."""
    return script_source("batch")


def clock_shifted(source: str, offset_us: int) -> str:
    """`source` as it runs when Redis TIME reads `offset_us` later (earlier when negative): a
    test-only first line shadows `redis` with a table whose `call('TIME')` adds the offset and
    that hands every other command to Redis. The script runs as the filter's text, unchanged,
    at any date a test picks, while keys expire on Redis's own clock, which moves at the same
    rate. The filter never runs it, so no request can move a script's clock."""
    shim = (
        "local redis = setmetatable({call = function(command, ...) "
        "if command ~= 'TIME' then return _G.redis.call(command, ...) end "
        "local t = _G.redis.call('TIME') "
        f"local us = tonumber(t[1]) * 1000000 + tonumber(t[2]) + ({int(offset_us)}) "
        "return {string.format('%d', math.floor(us / 1000000)), "
        "string.format('%d', us % 1000000)} end}, {__index = _G.redis})\n"
    )
    return shim + source


# The first line of src/redis/scripts/tagged_head.lua: every script as the filter sends it
# starts with it (its body between that file and tagged_tail.lua).
TAGGED_HEAD = "-- tagged_head.lua"


def takes_tag(source: str) -> bool:
    """Whether the script text `source` takes a call tag as its ARGV[1] and returns it first
    (src/redis/tag.rs): every script of the working tree does; a git revision's from before
    the tags did not (bench/scripts.py compares both)."""
    return source.startswith(TAGGED_HEAD)


def new_tag() -> str:
    """A call tag: 16 hex digits, as the filter's (a random prefix and a count)."""
    return uuid.uuid4().hex[:16]


def untag(reply, tag: str):
    """The body's reply in `reply`, the reply to a call tagged `tag` (as redis-py returns it):
    `[tag, n, v1..vn]` is the body's array `[v1..vn]`, `[tag, -2, v]` its integer `v`. A
    reply without that tag fails the test: it is no answer to the call."""
    assert isinstance(reply, list) and len(reply) >= 2, f"not a tagged reply: {reply!r}"
    got = reply[0].decode() if isinstance(reply[0], bytes) else reply[0]
    assert got == tag, f"the reply of another call: tag {got!r}, not {tag!r}"
    kind = int(reply[1])
    if kind == -2:
        assert len(reply) == 3, reply
        return reply[2]
    assert kind == len(reply) - 2, f"a tagged reply of {len(reply) - 2} values says {kind}"
    return reply[2:]


class Tagged:
    """A script called as redis-py's register_script calls it (EVALSHA, then EVAL after
    NOSCRIPT; `keys=`, `args=`, `client=`), with a new tag before its arguments at every call
    and the body's reply returned (untag)."""

    def __init__(self, client, source: str):
        self.script = client.register_script(source)
        self.sha = self.script.sha

    def __call__(self, keys=(), args=(), client=None):
        tag = new_tag()
        return untag(self.script(keys=list(keys), args=[tag, *args], client=client), tag)


def register(client, source: str) -> Tagged:
    """`client.register_script(source)` for a script as the filter sends it (see Tagged)."""
    return Tagged(client, source)


class Script:
    """A script called the way the filter calls it: EVAL, then EVALSHA once Redis has it (the
    gateway user may not run SCRIPT LOAD, which redis-py's register_script would), each call
    with a tag of its own and its reply read only when it carries that tag (untag)."""

    def __init__(self, client, name: str | None = None, source: str | None = None):
        self.client = client
        self.source = source if source is not None else script_source(name)
        self.sha = None

    def __call__(self, keys: list, args: list):
        tag = new_tag()
        if self.sha is None:
            reply = self.client.eval(self.source, len(keys), *keys, tag, *args)
            self.sha = hashlib.sha1(self.source.encode()).hexdigest()
            return untag(reply, tag)
        return untag(self.client.evalsha(self.sha, len(keys), *keys, tag, *args), tag)
