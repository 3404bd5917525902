"""The `type` URIs of the filter's problem+json answers, as the tests expect them.

A `429` has the problem type draft-ietf-httpapi-ratelimit-headers registers (quota exceeded);
every other problem is `problem_type_base` (by default the project's docs/problems.md) followed
by the problem's name. The two kinds of `429` (a rate limit's, a concurrency limit's) share
the type and are told apart by their `detail`.
"""
from __future__ import annotations

DOCS = "https://github.com/coordination-guard/coordination-guard/blob/main/docs/problems.md#"
QUOTA_EXCEEDED = "https://iana.org/assignments/http-problem-types#quota-exceeded"
# The problems answered with the registered quota-exceeded type, and how their detail starts.
QUOTA_DETAIL = {"rate_limited": "rate limit ", "concurrency_limited": "concurrency limit "}


def problem_type(slug: str, base: str = DOCS) -> str:
    """The `type` of the problem called `slug` under the configuration's base."""
    return QUOTA_EXCEEDED if slug in QUOTA_DETAIL else base + slug


def is_problem(body: dict, slug: str, base: str = DOCS) -> bool:
    """Whether a problem body is the problem called `slug`: its type, and for a `429` the
    start of its detail."""
    if body.get("type") != problem_type(slug, base):
        return False
    start = QUOTA_DETAIL.get(slug)
    return start is None or str(body.get("detail", "")).startswith(start)
