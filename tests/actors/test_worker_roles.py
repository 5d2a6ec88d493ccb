"""Which engine config each P/D role runs: decode workers speculate, prefill workers do not."""

from __future__ import annotations

from actors.worker import engine_config_for_role
from engine.args import EngineArgs

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def test_prefill_workers_do_not_speculate_and_decode_workers_do():
    args = EngineArgs(model="m", speculative_config=NGRAM)
    assert engine_config_for_role(args, "prefill").speculative is None
    for role in ("decode", "colocated"):
        assert engine_config_for_role(args, role).speculative.num_speculative_tokens == 3
