"""engine.load.EngineLoad: the ratios are derived from the counts, several cores add up to one
engine's figures, and the flat figures the metric tables read carry every metric's key."""

from __future__ import annotations

from engine.load import CoreFigures, EngineLoad, SpecDecodeCounts
from engine.metrics import names


def test_ratios_follow_the_counts():
    load = EngineLoad(free_blocks=3, total_blocks=12, prefix_cache_queries=40, prefix_cache_hits=10)
    assert load.kv_usage == 0.75 and load.prefix_cache_hit_rate == 0.25
    assert EngineLoad().kv_usage == 0.0 and EngineLoad().prefix_cache_hit_rate == 0.0  # nothing yet: not a division by zero


def test_the_router_score_weighs_a_waiting_request_as_four_running_ones():
    assert EngineLoad(waiting=2, running=3).score == 11


def test_cores_sum_to_one_engine_and_keep_their_own_figures():
    a = EngineLoad(waiting=1, running=2, free_blocks=4, total_blocks=8, prefix_cache_queries=10, prefix_cache_hits=5,
                   encoder_seconds=0.5, spec_decode=SpecDecodeCounts(1, 3, 2, (2, 0, 0)),
                   data_parallel=(CoreFigures(0, 1, 2, requests=3),))
    b = EngineLoad(running=1, free_blocks=8, total_blocks=8, prefix_cache_queries=30, prefix_cache_hits=5,
                   encoder_seconds=0.25, spec_decode=SpecDecodeCounts(2, 4, 1, (1, 0)),
                   data_parallel=(CoreFigures(1, 0, 1, requests=1, dummy_steps=7),))
    total = EngineLoad.summed([a, b])
    assert (total.waiting, total.running, total.free_blocks, total.total_blocks) == (1, 3, 12, 16)
    assert total.kv_usage == 0.25 and total.prefix_cache_hit_rate == 0.25  # from the sums, not averaged
    assert total.encoder_seconds == 0.75
    assert total.spec_decode == SpecDecodeCounts(3, 7, 3, (3, 0, 0))
    assert [c.rank for c in total.data_parallel] == [0, 1] and total.data_parallel[1].dummy_steps == 7
    assert EngineLoad.summed([EngineLoad(), EngineLoad()]).spec_decode is None  # neither speculates


def test_cores_report_their_engines_cpu_kernels_and_metrics_leave_them_out():
    total = EngineLoad.summed([EngineLoad(cpu_kernels="avx512"), EngineLoad(cpu_kernels="avx512")])
    assert total.cpu_kernels == "avx512"  # a name, not added up
    assert EngineLoad.summed([EngineLoad(), EngineLoad()]).cpu_kernels is None
    assert "cpu_kernels" not in total.figures()  # not a number: no metric


def test_flat_figures_name_every_metric_table_key():
    figures = EngineLoad(free_blocks=1, total_blocks=2, spec_decode=SpecDecodeCounts(1, 2, 1, (1,)),
                         data_parallel=(CoreFigures(0),)).figures()
    assert set(names.ENGINE_FIGURES) <= set(figures)
    assert set(names.SPEC_DECODE_FIGURES) <= set(figures) and figures[names.SPEC_DECODE_PER_POS_KEY] == [1]
    [core] = figures[names.DP_KEY]
    assert set(names.DP_FIGURES) | {"rank"} <= set(core)
    assert "spec_decode_num_drafts" not in EngineLoad().figures()  # a replica that does not speculate
