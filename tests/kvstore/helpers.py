"""What the KV-transfer tests share."""

from __future__ import annotations

import time


def finish_all(engine, rids: set[str], timeout_s: float = 120.0) -> dict:
    """Step `engine` until every request in `rids` finished (bounded); their final outputs."""
    finals, deadline = {}, time.monotonic() + timeout_s
    while set(finals) != rids:
        assert time.monotonic() < deadline, f"unfinished after {timeout_s} s: {sorted(rids - set(finals))}"
        finals.update({out.request_id: out for out in engine.step() if out.finished})
    return finals
