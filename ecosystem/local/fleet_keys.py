"""The keys a live fleet keeps without a TTL, and the check that every other key has one
(docs/reliability.md, "Keys and their lifetimes"). Shared by the hostile-input tests and
`fleet soak`.

Without a TTL while the fleet runs: sets of names, RQ's registrations, and keys that empty
themselves (queues as jobs are claimed, in-flight lists as jobs end, RQ's registries as their
entries' expiry scores pass: tests/test_defects_keys.py). Everything else written for a job, a
tenant, a batch or a file ends with a TTL or is removed.
"""

from __future__ import annotations

import re

from redis import Redis

LIVE_FLEET = re.compile(rb"^(fleet:workers|fleet:owners|fleet:pools|rq:queues|rq:workers(:.*)?|rq:worker:.*|"
                        rb"fleet:inflight:.*|rq:queue:.*|fleet:wake:.*|rq:(finished|failed|canceled|wip):.*)$")


def keys_without_ttl(redis: Redis, limit: int = 100) -> list[str]:
    """Up to `limit` keys that have no TTL and are not the live fleet's own (LIVE_FLEET)."""
    forever: list[str] = []
    for key in redis.scan_iter(count=1000):
        raw = key if isinstance(key, bytes) else str(key).encode()
        if not LIVE_FLEET.match(raw) and redis.ttl(key) == -1:
            forever.append(raw.decode(errors="replace"))
            if len(forever) >= limit:
                break
    return forever
