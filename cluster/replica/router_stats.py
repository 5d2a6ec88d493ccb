"""What the request routers of this process decided, for the ingress's /metrics
(pdserve:router_decisions).

Its own module because Serve rebuilds a router's class in the calling process from a pickled
copy whose module-level values are copies too (measured: the ingress's metrics saw an empty
tally): a module is always pickled by reference, so the routers and the metrics meet here.
"""

from __future__ import annotations

from collections import Counter

# (deployment, reason) -> routing decisions: "kv_overlap" (the chosen replica holds part of the
# prompt), "load", "prefix_affinity", "lora", "round_robin".
DECISIONS: Counter[tuple[str, str]] = Counter()
