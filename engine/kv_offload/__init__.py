"""The host KV tier (vLLM's --kv-offloading-size, --kv-offloading-backend native): prefix
blocks copied to a bounded host pool and loaded back instead of recomputed
(docs/kv_cache.md#host-offload-tier)."""

from engine.kv_offload.connector import OffloadConnector
from engine.kv_offload.factory import OffloadFactory, with_offloading
from engine.kv_offload.multi import MultiConnector

__all__ = ["MultiConnector", "OffloadConnector", "OffloadFactory", "with_offloading"]
