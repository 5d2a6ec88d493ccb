"""Transports move exported KV bytes from a producer to a consumer."""

from kvstore.transports.base import KVTransport, LocalTransport, TransferError

__all__ = ["KVTransport", "LocalTransport", "TransferError"]
