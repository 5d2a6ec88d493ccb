"""KV transfer for disaggregated prefill/decode: the connector the engine calls, the transfer
directory (and its Ray actor), and the transports that move the bytes."""
