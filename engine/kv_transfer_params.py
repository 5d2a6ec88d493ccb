"""Typed P/D state of one request (see engine.kv_connector for the contract around it)."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class KVTransferParams:
    """The P/D state of one request.

    A prefill (producer) request is submitted with `do_remote_decode=True` (and, when the
    requester wants to release it itself, a `transfer_id` of its choosing); its final output
    carries the params of the export: transfer_id, num_tokens, block_size, source, transport,
    tensor_parallel_size.
    A decode (consumer) request is submitted with those params plus
    `num_prior_output_tokens`: its prompt ends with that many tokens already generated on the
    producer, so detokenization and seeded sampling continue from them.
    """

    do_remote_decode: bool = False
    # Producer: its output goes on on the decode engine, so a character split at the end of
    # its text (or a possible stop-string prefix) is left for the decode side to emit.
    output_continues: bool = False
    transfer_id: str | None = None
    num_tokens: int = 0
    block_size: int = 0
    source: str | None = None
    transport: str | None = None
    num_prior_output_tokens: int = 0
    # Ranks of the producer: each exported the shard of its own heads (kvstore.shards); a
    # consumer of any size fetches the shards that hold its ranks' heads (kvstore.reshard).
    tensor_parallel_size: int = 1
    # The LoRA adapter the prompt's KV was computed with (None: the base model): a consumer
    # running another adapter must not load it (kvstore.connector recomputes instead).
    lora_name: str | None = None

    def computed_locally(self) -> KVTransferParams:
        """The same continuation with no transfer to load: the consumer computes the prompt
        itself (its last `num_prior_output_tokens` stay output for detokenization and seeded
        sampling). For a request sent to another consumer after the first may have loaded,
        and so released, the transfer."""
        return replace(self, transfer_id=None, num_tokens=0, source=None, transport=None)

    @property
    def loads_remote_kv(self) -> bool:
        """A consumer request: its prompt's KV is in a transfer."""
        return not self.do_remote_decode and self.transfer_id is not None and self.num_tokens > 0
