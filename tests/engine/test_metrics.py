"""Offline metrics: the StatsRecorder over hand-made outputs (an injected clock, so exact
latencies), and `LLM.get_metrics()` on a real tiny model, whose counts must equal what the
requests actually produced."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.metrics import Counter, Gauge, Histogram, StatsRecorder, names
from engine.outputs import CompletionOutput, RequestOutput


def _out(rid, prompt_len, token_ids, new, finish=None, metrics=None) -> RequestOutput:
    return RequestOutput(
        request_id=rid, prompt=None, prompt_token_ids=[7] * prompt_len,
        outputs=[CompletionOutput(0, "", list(token_ids), finish_reason=finish)],
        finished=finish is not None, delta_token_ids=list(new), metrics=metrics or {},
    )


def _one(metrics, name, **labels):
    found = [m for m in metrics if m.name == name and all(m.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


# ---- recorder ---------------------------------------------------------------------------------
def test_recorder_latencies_follow_the_clock_it_is_given():
    rec = StatsRecorder("m", max_model_len=64)
    rec.request_added("a", arrival_time=100.0)
    rec.record([_out("a", 5, [1], [1], metrics={"queue_time_s": 0.25})], now=100.5)
    rec.record([_out("a", 5, [1, 2], [2])], now=100.7)
    rec.record([_out("a", 5, [1, 2, 3], [3], finish="length")], now=103.0)
    snap = rec.snapshot({})

    ttft = _one(snap, names.TIME_TO_FIRST_TOKEN.name, model_name="m")
    assert (ttft.count, ttft.sum) == (1, pytest.approx(0.5))
    assert ttft.buckets["0.25"] == 0 and ttft.buckets["0.5"] == 1  # a bound includes its value
    itl = _one(snap, names.INTER_TOKEN_LATENCY.name)
    assert itl.count == 2 and itl.sum == pytest.approx(0.2 + 2.3)
    e2e = _one(snap, names.E2E_REQUEST_LATENCY.name)
    assert (e2e.count, e2e.sum) == (1, pytest.approx(3.0))
    queue = _one(snap, names.REQUEST_QUEUE_TIME.name)
    assert (queue.count, queue.sum) == (1, pytest.approx(0.25))
    assert _one(snap, "vllm:prompt_tokens").value == 5
    assert _one(snap, "vllm:generation_tokens").value == 3
    assert _one(snap, "vllm:request_success", finished_reason="length").value == 1


def test_histogram_buckets_are_cumulative_and_end_at_inf():
    rec = StatsRecorder("m", max_model_len=64)
    for i, generated in enumerate([1, 3, 3, 60]):
        rid = f"r{i}"
        rec.request_added(rid, arrival_time=0.0)
        rec.record([_out(rid, 4, [9] * generated, [9] * generated, finish="stop")], now=1.0)
    h = _one(rec.snapshot({}), "vllm:request_generation_tokens")
    assert isinstance(h, Histogram)
    assert list(h.buckets) == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "+Inf"]
    assert list(h.buckets.values()) == [1, 1, 3, 3, 3, 3, 4]
    assert (h.count, h.sum) == (4, 67)


def test_aborted_and_unknown_requests_are_not_counted():
    rec = StatsRecorder("m", max_model_len=64)
    rec.request_added("a", arrival_time=0.0)
    rec.record([_out("a", 3, [1], [1])], now=1.0)
    rec.request_aborted("a")
    rec.record([_out("a", 3, [1, 2], [2], finish="stop"), _out("ghost", 3, [5], [5], finish="stop")], now=2.0)
    snap = rec.snapshot({})
    assert _one(snap, "vllm:generation_tokens").value == 1
    assert not [m for m in snap if m.name == "vllm:request_success"]
    assert _one(snap, names.E2E_REQUEST_LATENCY.name).count == 0


def test_engine_figures_become_gauges_and_counters_by_their_definition():
    figures = {"running": 2, "waiting": 1, "kv_usage": 0.5, "prefix_cache_queries": 40,
               "prefix_cache_hits": 16, "num_preemptions": 3, "free_blocks": 7}
    snap = StatsRecorder("m", max_model_len=64).snapshot(figures)
    for key, value in figures.items():
        definition = names.ENGINE_FIGURES[key]
        metric = _one(snap, definition.name, model_name="m")
        assert isinstance(metric, Counter if definition.kind == "counter" else Gauge), key
        assert metric.value == value
    assert not [m for m in snap if m.name == names.ENGINE_FIGURES["total_blocks"].name]  # absent: left out


def test_token_count_buckets_follow_1_2_5_up_to_the_context():
    assert names.token_count_buckets(1) == (1.0,)
    assert names.token_count_buckets(128) == (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)
    assert names.token_count_buckets(500)[-1] == 500.0


# ---- LLM.get_metrics on a real model ---------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, max_model_len=128, block_size=16, enable_prefix_caching=True)


def test_get_metrics_counts_what_generate_produced(llm, tiny_model):
    before = {(m.name, tuple(sorted(m.labels.items()))): m for m in llm.get_metrics()}
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    shared = list(range(3, 3 + 40))  # two full blocks shared by the last two prompts
    prompts = [{"prompt_token_ids": list(range(50, 61))}, {"prompt_token_ids": shared + [90, 91]},
               {"prompt_token_ids": shared + [92]}]
    first = llm.generate(prompts[:1], greedy, use_tqdm=False)[0]
    # Stopping on the token greedy decoding produces first finishes that request with "stop".
    stop_first = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[first.outputs[0].token_ids[0]])
    rest = llm.generate(prompts, [stop_first, greedy, greedy], use_tqdm=False)
    outs = [first, *rest]
    snap = llm.get_metrics()

    def delta(name, **labels):
        metric = _one(snap, name, **labels)
        old = before.get((metric.name, tuple(sorted(metric.labels.items()))))
        if isinstance(metric, Histogram):
            return metric.count - (old.count if old else 0), metric.sum - (old.sum if old else 0)
        return metric.value - (old.value if old else 0)

    generated = [len(o.outputs[0].token_ids) for o in outs]
    assert _one(snap, "vllm:generation_tokens").labels == {"model_name": tiny_model}
    assert delta("vllm:generation_tokens") == sum(generated)
    assert delta("vllm:prompt_tokens") == sum(len(o.prompt_token_ids) for o in outs)
    reasons = [o.outputs[0].finish_reason for o in outs]
    assert reasons.count("stop") == 1
    assert delta("vllm:request_success", finished_reason="length") == reasons.count("length") == 3
    assert delta("vllm:request_success", finished_reason="stop") == 1
    for name in (names.TIME_TO_FIRST_TOKEN.name, names.E2E_REQUEST_LATENCY.name, names.REQUEST_QUEUE_TIME.name):
        assert delta(name)[0] == len(outs), name
    # One token per step per request: a request's inter-token gaps are its tokens less one.
    assert delta(names.INTER_TOKEN_LATENCY.name)[0] == sum(n - 1 for n in generated)
    assert delta("vllm:request_generation_tokens") == (len(outs), sum(generated))
    # Every prompt is looked up once; hits are what the outputs report as cached.
    assert delta("vllm:prefix_cache_queries") == sum(len(o.prompt_token_ids) for o in outs)
    assert delta("vllm:prefix_cache_hits") == sum(o.num_cached_tokens for o in outs) >= 32
    assert _one(snap, "vllm:num_requests_running").value == 0
    assert _one(snap, "vllm:num_requests_waiting").value == 0
    assert _one(snap, "vllm:kv_cache_usage_perc").value == 0.0


def test_get_metrics_has_every_engine_metric_once_with_its_kind(llm):
    kinds = {Counter: "counter", Gauge: "gauge", Histogram: "histogram"}
    snap = [m for m in llm.get_metrics() if m.name != "vllm:request_success"]
    expected = {d.name: d.kind for d in names.ENGINE_FIGURES.values()}
    expected.update({d.name: d.kind for d in (
        names.TIME_TO_FIRST_TOKEN, names.INTER_TOKEN_LATENCY, names.E2E_REQUEST_LATENCY,
        names.REQUEST_QUEUE_TIME, names.PROMPT_TOKENS, names.GENERATION_TOKENS)})
    expected.update({"vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram"})
    assert {m.name: kinds[type(m)] for m in snap} == expected
    assert len(snap) == len(expected)


def test_spec_decode_figures_become_counters_per_position():
    from engine.metrics import StatsRecorder

    figures = {"spec_decode_num_drafts": 4, "spec_decode_num_draft_tokens": 12,
               "spec_decode_num_accepted_tokens": 5, "spec_decode_num_accepted_tokens_per_pos": [3, 2, 0]}
    snap = StatsRecorder("m", 64).snapshot(figures)
    assert _one(snap, "vllm:spec_decode_num_drafts").value == 4
    assert _one(snap, "vllm:spec_decode_num_draft_tokens").value == 12
    assert _one(snap, "vllm:spec_decode_num_accepted_tokens").value == 5
    per_pos = {m.labels["position"]: m.value for m in snap if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos"}
    assert per_pos == {"0": 3, "1": 2, "2": 0}
    assert not [m for m in StatsRecorder("m", 64).snapshot({}) if m.name.startswith("vllm:spec_decode")]


def test_engine_steps_and_their_tokens_count_what_ran(llm):
    """pdserve:engine_steps / engine_step_tokens: one request alone runs a step for its prompt
    (giving the first token), then one step per further token, each running the token before."""
    names_ = (names.ENGINE_FIGURES["num_steps"].name, names.ENGINE_FIGURES["num_scheduled_tokens"].name)
    before = [_one(llm.get_metrics(), n).value for n in names_]
    ids = list(range(200, 237))
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0]
    after = [_one(llm.get_metrics(), n).value for n in names_]
    assert len(out.outputs[0].token_ids) == 5
    assert after[0] - before[0] == 5
    assert after[1] - before[1] == (len(ids) - out.num_cached_tokens) + 4
