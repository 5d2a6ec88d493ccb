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


class _RecordedMethod:
    def __init__(self, name: str, calls: list, keywords: list) -> None:
        self.name, self.calls, self.keywords = name, calls, keywords

    def remote(self, *args, **kwargs):
        self.calls.append((self.name, args))
        self.keywords.append(kwargs)
        if self.name == "lookup":  # nothing to wait on (and no Ray started by a ray.get)
            raise ConnectionError("the stand-in store answers no lookup")


class RecordingStore:
    """Records every call a transport makes on the store actor (none answers: a lookup
    fails its fetch, which the tests would see)."""

    def __init__(self) -> None:
        self.calls: list = []
        self.keywords: list[dict] = []  # each call's keyword arguments, in the order of `calls`
        for name in ("register", "abandon", "release", "lookup"):
            setattr(self, name, _RecordedMethod(name, self.calls, self.keywords))

    def names(self) -> list[str]:
        return [name for name, _args in self.calls]
