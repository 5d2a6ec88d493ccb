"""cluster.launch.app.AppConfig / build argument checks (no Ray, no Serve app) and the pure helpers
of cluster.http.openai_format."""

from __future__ import annotations

import json
import os

import pytest

from cluster.http.openai_format import TokenText, chat_logprobs, completion_logprobs, joined, sse
from cluster.http.openai_models import ChatCompletionChunk, ErrorResponse, Usage
from cluster.launch.app import build
from cluster.launch.app_config import AppConfig
from engine.args import EngineArgs
from engine.errors import ParameterError

# --- AppConfig --------------------------------------------------------------------------------


def _cfg(model: str, **kw) -> AppConfig:
    return AppConfig(engine_args=EngineArgs(model=model), **kw)


@pytest.mark.parametrize("kw, field", [
    ({"mode": "x"}, "mode"),
    ({"prefill_replicas": 0}, "prefill_replicas"),
    ({"decode_replicas": True}, "decode_replicas"),
    ({"colocated_replicas": -1}, "colocated_replicas"),
    ({"prefill_replicas": 1.5}, "prefill_replicas"),
    ({"max_pending_requests": 0}, "max_pending_requests"),
    ({"api_server_count": 0}, "api_server_count"),
    ({"api_server_count": 1.5}, "api_server_count"),
    ({"max_ongoing_requests": 0}, "max_ongoing_requests"),
    ({"load_failure_policy": "x"}, "load_failure_policy"),
    ({"migration_limit": -1}, "migration_limit"),
    ({"migration_limit": 101}, "migration_limit"),
    ({"migration_limit": 1.5}, "migration_limit"),
    ({"replica_num_cpus": -1}, "replica_num_cpus"),
    ({"replica_num_cpus": -0.5}, "replica_num_cpus"),
    ({"replica_num_threads": 0}, "replica_num_threads"),
    ({"replica_num_threads": 1.5}, "replica_num_threads"),
    ({"replica_num_gpus": -1}, "replica_num_gpus"),
    ({"prefill_replicas": 9}, "prefill_replicas"),  # above max_replicas (8)
    ({"local_prefill_queue": -1}, "local_prefill_queue"),
    ({"local_prefill_queue": 1.5}, "local_prefill_queue"),
    ({"max_local_prefill_length": -1}, "max_local_prefill_length"),
    ({"stream_interval_ms": -1}, "stream_interval_ms"),
    ({"stream_interval_ms": 5000}, "stream_interval_ms"),
    ({"health_check_period_s": 0}, "health_check_period_s"),
    ({"graceful_shutdown_wait_loop_s": 0}, "graceful_shutdown_wait_loop_s"),
    ({"graceful_shutdown_wait_loop_s": 61}, "graceful_shutdown_wait_loop_s"),
    ({"scale_timeout_s": 0}, "scale_timeout_s"),
    ({"api_keys": ("",)}, "api_keys"),
])
def test_invalid_fields_name_the_field(tiny_model, kw, field):
    with pytest.raises(ParameterError, match=field) as exc:
        _cfg(tiny_model, **kw)
    assert exc.value.field == field


@pytest.mark.parametrize("kw, field", [
    ({"block_size": 0}, "block_size"),
    ({"dtype": "int4"}, "dtype"),
    ({"scheduling_policy": "lifo"}, "scheduling_policy"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"kv_shared_tier_size": 0}, "kv_shared_tier_size"),
    ({"kv_shared_tier_size": 1, "enable_prefix_caching": False}, "kv_shared_tier_size"),
    ({"kv_shared_tier_size": 1, "data_parallel_size": 2}, "kv_shared_tier_size"),
])
def test_invalid_engine_arguments_fail_in_the_config(tiny_model, kw, field):
    """Engine fields are checked by the engine's own configs, before any replica starts."""
    with pytest.raises(ParameterError) as exc:
        AppConfig(engine_args=EngineArgs(model=tiny_model, **kw))
    assert exc.value.field == field


def test_engine_args_must_be_engine_args(tiny_model):
    with pytest.raises(ParameterError, match="engine_args"):
        AppConfig(engine_args={"model": tiny_model})


def test_missing_model_dir(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ParameterError, match="model") as exc:
        _cfg(missing)
    assert missing in str(exc.value) and exc.value.field == "model"


def test_model_must_be_a_directory(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"")
    with pytest.raises(ValueError, match="model"):
        _cfg(str(f))


@pytest.mark.parametrize("kw, engine_kw, needle", [
    ({"mode": "pd", "api_server_count": 2}, {}, "decode_replicas"),
    ({"mode": "pd", "decode_data_parallel_size": 2}, {}, "decode replica"),
    ({"mode": "colocated", "api_server_count": 2}, {}, "colocated_replicas"),
    ({"mode": "colocated", "prefix_affinity": True}, {}, "prefix_affinity"),
    ({"mode": "colocated"}, {"tensor_parallel_size": 2}, "tensor_parallel_size=2"),
    ({"mode": "colocated"}, {"data_parallel_size": 2}, "data_parallel_size=2"),
    ({"mode": "colocated"}, {"kv_shared_tier_size": 1}, "kv_shared_tier_size"),
])
def test_direct_streaming_refuses_what_it_cannot_serve(tiny_model, kw, engine_kw, needle):
    with pytest.raises(ParameterError, match=needle) as e:
        AppConfig(engine_args=EngineArgs(model=tiny_model, **engine_kw), direct_streaming=True, **kw)
    assert e.value.field == "direct_streaming"


def test_direct_streaming_runs_the_engine_core_in_a_process_of_its_own(tiny_model):
    cfg = _cfg(tiny_model, mode="colocated", direct_streaming=True, colocated_replicas=2, replica_num_cpus=1)
    assert cfg.direct and cfg.role_engine_args("colocated").engine_core_process
    routed = _cfg(tiny_model, mode="colocated", direct_streaming=False)
    assert not routed.direct and not routed.role_engine_args("colocated").engine_core_process
    assert cfg.targets() == {"colocated": 2}
    # In P/D the ingress runs the decode engines; the prefill replicas keep theirs in process.
    pd = _cfg(tiny_model, mode="pd", direct_streaming=True, decode_replicas=2, replica_num_cpus=1)
    assert pd.direct_role == "decode" and pd.role_engine_args("decode").engine_core_process
    assert not pd.role_engine_args("prefill").engine_core_process


@pytest.mark.parametrize("kw, engine_kw, direct", [
    ({"mode": "colocated"}, {}, True),  # the default of colocated mode
    ({"mode": "pd"}, {}, True),  # the decode engines: the default of P/D too
    ({"mode": "pd", "prefill_data_parallel_size": 2}, {}, True),  # prefill replicas are apart
    ({"mode": "pd", "decode_data_parallel_size": 2}, {}, False),
    ({"mode": "colocated", "api_server_count": 2}, {}, False),  # HTTP scaled apart from engines
    ({"mode": "colocated", "prefix_affinity": True}, {}, False),  # needs pdserve's router
    ({"mode": "pd", "prefix_affinity": True}, {}, True),  # the prefills keep pdserve's router
    ({"mode": "colocated"}, {"tensor_parallel_size": 2}, False),
    ({"mode": "colocated"}, {"data_parallel_size": 2}, False),
    ({"mode": "colocated"}, {"distributed_executor_backend": "ray"}, False),  # ranks as Ray actors
    ({"mode": "colocated"}, {"kv_shared_tier_size": 1}, False),  # the tier's connector is in a replica
    ({"mode": "pd"}, {"kv_shared_tier_size": 1}, False),
])
def test_direct_streaming_by_default_wherever_nothing_needs_an_engine_deployment(tiny_model, kw, engine_kw, direct):
    cfg = AppConfig(engine_args=EngineArgs(model=tiny_model, **engine_kw), **kw)
    assert cfg.direct_streaming is None and cfg.direct is direct
    assert cfg.role_engine_args(cfg.direct_role).engine_core_process is direct


def test_direct_streaming_takes_only_a_boolean_or_null(tiny_model):
    with pytest.raises(ParameterError, match="true, false or null") as e:
        _cfg(tiny_model, mode="colocated", direct_streaming="yes")
    assert e.value.field == "direct_streaming"


def test_valid_config(tiny_model):
    cfg = _cfg(tiny_model, mode="colocated", prefill_replicas=2, decode_replicas=3,
               load_failure_policy="recompute", replica_num_cpus=0)
    assert cfg.mode == "colocated"
    assert cfg.decode_replicas == 3
    assert cfg.load_failure_policy == "recompute"
    assert cfg.model == tiny_model


def test_model_name_defaults_to_dir_basename(tiny_model):
    expected = os.path.basename(tiny_model.rstrip(os.sep))
    assert expected
    assert _cfg(tiny_model).model_name == expected
    assert _cfg(tiny_model.rstrip(os.sep) + os.sep).model_name == expected


def test_served_model_name_overrides(tiny_model):
    assert _cfg(tiny_model, served_model_name="my-model").model_name == "my-model"


def test_replica_num_gpus_explicit(tiny_model):
    assert _cfg(tiny_model, replica_num_gpus=0.5).num_gpus() == 0.5
    assert _cfg(tiny_model, replica_num_gpus=0).num_gpus() == 0


def test_from_flat_splits_every_engine_argument_from_the_app_fields(tiny_model):
    """Every EngineArgs field is accepted flat, next to the AppConfig fields, with no list
    of engine names in cluster/ (a new EngineArgs field needs no change there)."""
    engine_values = {"dtype": "float32", "num_kv_blocks": 96, "max_model_len": 512, "max_logprobs": 7, "max_num_seqs": 16,
                     "block_size": 8, "enable_prefix_caching": False, "seed": 7, "kv_cache_memory_gb": 0.5,
                     "max_num_batched_tokens": 256, "gpu_memory_utilization": 0.5, "enforce_eager": True,
                     "long_prefill_token_threshold": 64, "scheduling_policy": "priority",
                     "kernel_block_size": 4, "kernel_backend": "torch", "device": "cpu",
                     "disable_hybrid_kv_cache_manager": True, "quantization": "none",
                     "kv_events_config": {"enable_kv_cache_events": True}, "kv_offloading_size": None,
                     "kv_offloading_backend": "native", "kv_shared_tier_size": None,
                     "tensor_parallel_size": 2, "distributed_executor_backend": "mp",
                     "data_parallel_size": 2, "data_parallel_backend": "ray", "enable_expert_parallel": False,
                     "engine_core_process": False, "kv_load_failure_policy": "fail", "engine_step_timeout_s": 30.0,
                     "enable_lora": False, "max_loras": 3, "max_lora_rank": 32, "max_cpu_loras": 5,
                     "limit_mm_per_prompt": '{"image": 2}', "encoder_cache_size": 64,
                     "max_num_encoder_input_tokens": 32, "allowed_local_media_path": "/srv/media",
                     "speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
                     "runner": "pooling", "convert": "embed", "pooler_config": {"pooling_type": "MEAN"},
                     "hf_overrides": {"is_matryoshka": True}}
    assert set(engine_values) | {"model"} == set(EngineArgs.field_names())  # the test covers them all
    cfg = AppConfig.from_flat({"model": tiny_model, "mode": "colocated", "max_replicas": 3, **engine_values})
    assert cfg.engine_args == EngineArgs(model=tiny_model, **engine_values)
    assert (cfg.mode, cfg.max_replicas) == ("colocated", 3)


def test_from_flat_defaults_are_engine_args_defaults(tiny_model):
    assert AppConfig.from_flat({"model": tiny_model}).engine_args == EngineArgs(model=tiny_model)


def test_build_rejects_unknown_arguments_listing_the_allowed_ones(tiny_model):
    with pytest.raises(ValueError) as exc:
        build({"model": tiny_model, "bogus": 1, "also_bogus": 2})
    msg = str(exc.value)
    assert "unknown" in msg and "'also_bogus', 'bogus'" in msg
    allowed = msg.split("allowed:", 1)[1]
    for name in ("block_size", "scheduling_policy", "mode", "prefill_replicas", "autoscale"):
        assert repr(name) in allowed
    assert "engine_args" not in allowed  # an implementation detail, not a config key


def test_build_checks_config_fields(tiny_model):
    with pytest.raises(ValueError, match="mode"):
        build({"model": tiny_model, "mode": "x"})
    with pytest.raises(ValueError, match="block_size"):
        build({"model": tiny_model, "block_size": -4})


# --- openai_format ----------------------------------------------------------------------------


class FakeTokenizer:
    def __init__(self, vocab: dict[int, str]):
        self.vocab = vocab
        self.calls: list[list[int]] = []

    def decode(self, ids: list[int]) -> str:
        self.calls.append(list(ids))
        return "".join(self.vocab[i] for i in ids)


VOCAB = {1: "Hello", 2: ",", 3: " wörld", 4: "!", 5: "€", 6: " x", 7: ""}


def test_token_text_decodes_each_token_once():
    tok = FakeTokenizer(VOCAB)
    text_of = TokenText(tok)
    assert [text_of(t) for t in (1, 3, 1, 3, 1)] == ["Hello", " wörld", "Hello", " wörld", "Hello"]
    assert tok.calls == [[1], [3]]


def test_completion_logprobs():
    text_of = TokenText(FakeTokenizer(VOCAB))
    ids = [1, 2, 3, 4]
    positions = [
        {1: -0.1, 6: -2.5, 2: -3.0},
        {2: -0.5, 4: -0.25, 6: -4.0},
        {3: -1.0, 5: -0.5, 4: -2.0, 1: -0.75},
        {4: -0.05},
    ]
    out = completion_logprobs(text_of, ids, positions, n=2, offset=10).model_dump()
    assert out["tokens"] == ["Hello", ",", " wörld", "!"]
    assert out["token_logprobs"] == [-0.1, -0.5, -1.0, -0.05]
    # offsets: each token starts where the previous one's text (in characters) ends
    assert out["text_offset"] == [10, 10 + 5, 10 + 5 + 1, 10 + 5 + 1 + 6]
    tops = out["top_logprobs"]
    assert [list(t.items()) for t in tops] == [
        [("Hello", -0.1), (" x", -2.5)],
        [("!", -0.25), (",", -0.5)],
        [("€", -0.5), ("Hello", -0.75), (" wörld", -1.0)],  # the sampled token is always there
        [("!", -0.05)],
    ]
    assert set(out) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}


def test_completion_logprobs_without_top_and_sampled_token_missing():
    text_of = TokenText(FakeTokenizer(VOCAB))
    out = completion_logprobs(text_of, [5, 7, 6], [{5: -0.2}, {}, {1: -0.3}], n=0, offset=0).model_dump()
    # logprobs=0: only the sampled token, when its logprob is known
    assert out["top_logprobs"] == [{text_of(5): -0.2}, None, None]
    assert out["token_logprobs"] == [-0.2, None, None]
    assert out["text_offset"] == [0, 1, 1]


def test_completion_logprobs_empty():
    out = completion_logprobs(TokenText(FakeTokenizer(VOCAB)), [], [], n=3, offset=4)
    assert out.model_dump() == {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def test_joined_completion_logprobs_are_the_first_tokens_then_the_others():
    text_of = TokenText(FakeTokenizer(VOCAB))
    prompt = completion_logprobs(text_of, [1, 2], [None, {2: -0.5}], n=1, offset=0)
    rest = completion_logprobs(text_of, [3], [{3: -1.0}], n=1, offset=6)
    assert joined(prompt, rest).model_dump() == {
        "tokens": ["Hello", ",", " wörld"], "token_logprobs": [None, -0.5, -1.0],
        "top_logprobs": [None, {",": -0.5}, {" wörld": -1.0}], "text_offset": [0, 5, 6]}


def test_chat_logprobs():
    text_of = TokenText(FakeTokenizer(VOCAB))
    out = chat_logprobs(text_of, [3, 5], [{3: -0.5, 1: -1.5, 5: -0.25}, {5: -0.01, 4: -5.0}], n=2)
    content = out.model_dump()["content"]
    assert len(content) == 2
    assert content[0]["token"] == " wörld"
    assert content[0]["logprob"] == -0.5
    assert content[0]["bytes"] == [0x20, 0x77, 0xC3, 0xB6, 0x72, 0x6C, 0x64]
    assert content[0]["top_logprobs"] == [
        {"token": "€", "logprob": -0.25, "bytes": [0xE2, 0x82, 0xAC]},
        {"token": " wörld", "logprob": -0.5, "bytes": [0x20, 0x77, 0xC3, 0xB6, 0x72, 0x6C, 0x64]},
    ]
    assert content[1]["token"] == "€"
    assert content[1]["bytes"] == [0xE2, 0x82, 0xAC]
    assert bytes(content[1]["bytes"]).decode("utf-8") == "€"
    assert [t["token"] for t in content[1]["top_logprobs"]] == ["€", "!"]


def test_chat_logprobs_no_top():
    out = chat_logprobs(TokenText(FakeTokenizer(VOCAB)), [1], [{1: -0.3, 2: -0.1}], n=0)
    assert out.model_dump() == {"content": [{"token": "Hello", "logprob": -0.3, "bytes": list(b"Hello"), "top_logprobs": []}]}


def test_sse_framing():
    assert sse("[DONE]") == "data: [DONE]\n\n"
    obj = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
           "choices": [{"index": 0, "delta": {"content": "a\nb"}, "logprobs": None, "finish_reason": None}]}
    frame = sse(ChatCompletionChunk.model_validate(obj))
    assert frame.startswith("data: ")
    assert frame.endswith("\n\n")
    payload = frame[len("data: "):-2]
    assert "\n" not in payload  # one event per frame: the payload is a single line
    assert json.loads(payload) == obj  # no `usage` key: a chunk without one leaves it out


def test_usage_totals():
    assert Usage.of(3, 4).model_dump() == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert Usage.of(0, 0).model_dump() == {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


def test_error_body():
    assert ErrorResponse.of("bad", "invalid_request_error", "n", 400).model_dump() == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": 400}}
    assert ErrorResponse.of("oops", "server_error").model_dump()["error"]["param"] is None


@pytest.mark.parametrize("flat", [
    {"prefill_tensor_parallel_size": 2},  # decode falls back to tensor_parallel_size=1
    {"tensor_parallel_size": 2, "decode_tensor_parallel_size": 1},
    {"decode_tensor_parallel_size": 2},
])
def test_pd_takes_unequal_tensor_parallel_sizes(tiny_model, flat):
    cfg = AppConfig.from_flat({"model": tiny_model, "mode": "pd", **flat})
    assert cfg.tensor_parallel_size("prefill") != cfg.tensor_parallel_size("decode")


def test_pd_sizes_that_do_not_split_the_heads_are_refused_naming_both_and_the_head_count(smollm2):
    with pytest.raises(ParameterError, match="prefill_tensor_parallel_size=2 and decode_tensor_parallel_size=1: "
                                             "prefill_tensor_parallel_size=2 does not divide "
                                             "num_attention_heads=9") as exc:
        AppConfig.from_flat({"model": smollm2, "mode": "pd", "prefill_tensor_parallel_size": 2})
    assert exc.value.field == "prefill_tensor_parallel_size"


def test_pd_roles_take_their_tensor_parallel_size_and_rank_actors_by_default(tiny_model):
    cfg = AppConfig.from_flat({"model": tiny_model, "mode": "pd", "prefill_tensor_parallel_size": 2,
                               "decode_tensor_parallel_size": 2, "replica_num_cpus": 1})
    for role in ("prefill", "decode"):
        args = cfg.role_engine_args(role)
        assert (args.tensor_parallel_size, args.distributed_executor_backend) == (2, "ray")
        assert cfg.placement_bundles(role) == [{"CPU": 1.01}, {"CPU": 0.01}]  # replica + rank 0, rank 1
    assert cfg.engine_args.tensor_parallel_size == 1  # the ingress's copy is untouched
    assert AppConfig.from_flat({"model": tiny_model, "mode": "pd"}).placement_bundles("decode") is None


def test_a_tensor_parallel_replica_reserves_one_gpu_per_rank(tiny_model, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = AppConfig.from_flat({"model": tiny_model, "mode": "colocated", "tensor_parallel_size": 2})
    # Rank actors hold the GPUs, in the replica's placement group; the replica actor none.
    assert cfg.num_gpus("colocated") == 0.0
    assert cfg.placement_bundles("colocated") == [{"GPU": 1.0, "CPU": 1.0}, {"GPU": 1.0}]
    assert cfg.replica_resources() == {"CPU": 1.0, "GPU": 2.0}
    # "mp" ranks are child processes of the replica: it reserves their GPUs itself.
    mp = AppConfig.from_flat({"model": tiny_model, "mode": "colocated", "tensor_parallel_size": 2,
                              "distributed_executor_backend": "mp"})
    assert mp.num_gpus("colocated") == 2.0 and mp.placement_bundles("colocated") is None


def test_a_data_parallel_replica_is_one_placement_group_of_dp_times_tp_bundles(tiny_model, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = AppConfig.from_flat({"model": tiny_model, "mode": "pd", "decode_data_parallel_size": 2,
                               "tensor_parallel_size": 2})
    decode = cfg.role_engine_args("decode")
    assert (decode.data_parallel_size, decode.data_parallel_backend) == (2, "ray")  # cores are actors
    assert cfg.role_engine_args("prefill").data_parallel_size == 1
    # Core d's rank r in bundle 2d + r; the replica actor (no GPU of its own) in bundle 0.
    assert cfg.num_gpus("decode") == 0.0
    assert cfg.placement_bundles("decode") == [{"GPU": 1.0, "CPU": 1.0}, {"GPU": 1.0}, {"GPU": 1.0}, {"GPU": 1.0}]
    assert cfg.replica_resources() == {"CPU": 1.0, "GPU": 4.0}


def test_data_parallel_sizes_are_checked_with_their_names(tiny_model):
    for name in ("prefill_data_parallel_size", "decode_data_parallel_size", "data_parallel_size"):
        with pytest.raises(ParameterError) as exc:
            AppConfig.from_flat({"model": tiny_model, "mode": "pd", name: 0})
        assert exc.value.field == name


# --- CPUs of engine replicas --------------------------------------------------------------------


@pytest.mark.parametrize("node_cpus, replicas, expected", [
    ([2.0], 1, 2.0),                # a lone colocated replica takes its node
    ([2.0], 2, 1.0),                # P/D on one node: a core each
    ([16.0], 3, 5.0),               # floor of an even share
    ([1.0], 2, 1.0),                # never below one
    ([16.0, 16.0, 16.0], 2, 16.0),  # no more than one node holds
    ([16.0, 16.0, 16.0], 6, 8.0),
    ([0.0, 8.0], 1, 8.0),           # a node without CPUs counts for nothing
    ([], 1, 1.0),
])
def test_auto_replica_cpus_shares_the_cluster_among_replicas(node_cpus, replicas, expected):
    from cluster.control.capacity import auto_replica_cpus

    assert auto_replica_cpus(node_cpus, replicas) == expected


def test_auto_replica_cpus_refuses_no_replicas():
    from cluster.control.capacity import auto_replica_cpus

    with pytest.raises(ValueError, match="engine_replicas"):
        auto_replica_cpus([4.0], 0)


def test_cpu_replicas_are_sized_from_the_cluster_when_not_given(tiny_model):
    colocated = _cfg(tiny_model, mode="colocated")
    assert colocated.replica_num_cpus is None
    with pytest.raises(RuntimeError, match="sized_for"):
        colocated.replica_cpus()  # on CPU there is no answer before the cluster is known
    sized = colocated.sized_for([2.0])
    assert sized.replica_cpus() == 2.0 and sized.replica_resources() == {"CPU": 2.0, "GPU": 0.0}
    assert sized.sized_for([64.0]) is sized  # decided once
    pd = _cfg(tiny_model, mode="pd", prefill_replicas=1, decode_replicas=2)
    assert pd.sized_for([6.0]).replica_cpus() == 2.0  # three engine replicas
    # Given: kept whatever the cluster, 0 included.
    assert _cfg(tiny_model, mode="colocated", replica_num_cpus=0).sized_for([8.0]).replica_cpus() == 0.0
    assert _cfg(tiny_model, mode="colocated", replica_num_cpus=3).sized_for([8.0]).replica_cpus() == 3.0


def test_an_autoscaling_app_shares_cpus_among_its_largest_replica_counts(tiny_model):
    """Sized for the initial replicas, a scaled-up replica would find no CPU left."""
    cfg = _cfg(tiny_model, mode="pd", max_replicas=4, autoscale={"enabled": True})
    assert cfg.sized_for([16.0]).replica_cpus() == 2.0  # 16 CPUs over 4 + 4 replicas
    assert _cfg(tiny_model, mode="pd", max_replicas=4).sized_for([16.0]).replica_cpus() == 8.0


def test_gpu_replicas_reserve_one_cpu_by_default(tiny_model, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = _cfg(tiny_model, mode="colocated")
    assert cfg.replica_cpus() == 1.0 and cfg.sized_for([64.0]) is cfg


def test_replicas_given_gpus_reserve_one_cpu_from_a_cpu_only_head(tiny_model):
    """ray up: the head (which builds the app) has no GPU, the workers do."""
    cfg = _cfg(tiny_model, mode="pd", replica_num_gpus=1)
    assert cfg.replica_cpus() == 1.0 and cfg.sized_for([64.0, 8.0]) is cfg


def test_cpu_engine_replicas_let_idle_openmp_threads_sleep(tiny_model, monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cfg = _cfg(tiny_model, mode="pd").sized_for([2.0])
    for role in ("prefill", "decode"):
        assert cfg.engine_actor_options(role) == {
            "num_cpus": 1.0, "num_gpus": 0.0, "runtime_env": {"env_vars": {"OMP_WAIT_POLICY": "PASSIVE"}}}
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the operator's choice wins
    assert cfg.engine_actor_options("decode")["runtime_env"] == {"env_vars": {"OMP_WAIT_POLICY": "ACTIVE"}}


def test_gpu_engine_replicas_keep_their_environment(tiny_model, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _cfg(tiny_model, mode="colocated").engine_actor_options("colocated") == {"num_cpus": 1.0, "num_gpus": 1.0}


def test_replica_threads_given_reach_the_engine_processes_environment(tiny_model, monkeypatch):
    """Ray keeps an OMP_NUM_THREADS already in a worker's environment (it sets one only when
    none is), and the replica's rank and core actors inherit its runtime_env."""
    import torch

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cfg = _cfg(tiny_model, mode="pd", replica_num_threads=2).sized_for([2.0])
    assert cfg.engine_actor_options("prefill") == {
        "num_cpus": 1.0, "num_gpus": 0.0,
        "runtime_env": {"env_vars": {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "2"}}}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = _cfg(tiny_model, mode="colocated", replica_num_threads=4)
    assert gpu.engine_actor_options("colocated")["runtime_env"] == {"env_vars": {"OMP_NUM_THREADS": "4"}}


@pytest.mark.parametrize("disable", [False, True])
def test_only_the_ingress_writes_access_lines_unless_disabled(tiny_model, monkeypatch, disable):
    """Serve's access log: the ingress's per HTTP request (on by default, as uvicorn's in
    vLLM); never the calls between pdserve's deployments."""
    import cluster.launch.app

    monkeypatch.setattr(cluster.launch.app, "node_cpus", lambda: [2.0])
    ingress = cluster.launch.app.build_app(_cfg(tiny_model, mode="pd", disable_access_log=disable,
                                         api_server_count=3))._bound_deployment
    assert ingress.logging_config["enable_access_log"] is not disable
    assert ingress.num_replicas == 3  # api_server_count
    internal = {d._bound_deployment.name: d._bound_deployment.logging_config["enable_access_log"]
                for d in ingress.init_args[:3]}
    assert internal == {"Prefill": False, "Decode": False, "Coordinator": False}


def test_every_deployment_stops_with_the_configured_wait_loop(tiny_model, monkeypatch):
    import cluster.launch.app

    monkeypatch.setattr(cluster.launch.app, "node_cpus", lambda: [2.0])
    ingress = cluster.launch.app.build_app(_cfg(tiny_model, mode="pd", direct_streaming=False,
                                                graceful_shutdown_wait_loop_s=0.25))._bound_deployment
    deployments = [ingress] + [d._bound_deployment for d in ingress.init_args[:3]]
    assert {d.name: d._deployment_config.graceful_shutdown_wait_loop_s for d in deployments} == {
        "Ingress": 0.25, "Prefill": 0.25, "Decode": 0.25, "Coordinator": 0.25}


@pytest.mark.parametrize("autoscale, window", [(None, 10.0), ({"enabled": True, "look_back_period_s": 2.5}, 2.5)])
def test_the_replicas_latency_windows_are_the_autoscalers_look_back_period(tiny_model, monkeypatch, autoscale,
                                                                          window):
    import cluster.launch.app

    monkeypatch.setattr(cluster.launch.app, "node_cpus", lambda: [2.0])
    ingress = cluster.launch.app.build_app(_cfg(tiny_model, mode="pd", autoscale=autoscale))._bound_deployment
    prefill, _, _, settings = ingress.init_args  # the decode engines are the ingress's own (direct)
    assert prefill._bound_deployment.init_kwargs["latency_window_s"] == window
    assert settings.direct.server_kwargs["latency_window_s"] == window
    routed = cluster.launch.app.build_app(_cfg(tiny_model, mode="pd", autoscale=autoscale, direct_streaming=False))
    engines = [d._bound_deployment for d in routed._bound_deployment.init_args[:2]]
    assert [e.init_kwargs["latency_window_s"] for e in engines] == [window, window]


def test_a_direct_streaming_app_has_no_engine_deployment_and_its_ingress_is_the_engine_replica(
        tiny_model, monkeypatch):
    import cluster.launch.app

    monkeypatch.setattr(cluster.launch.app, "node_cpus", lambda: [4.0])
    cfg = _cfg(tiny_model, mode="colocated", colocated_replicas=2, health_check_period_s=2.0)
    ingress = cluster.launch.app.build_app(cfg)._bound_deployment
    prefill, decode, coordinator, settings = ingress.init_args
    assert prefill is None and decode is None  # no engine deployment behind it
    assert ingress.num_replicas == 2 and ingress._deployment_config.health_check_period_s == 2.0
    assert ingress.ray_actor_options["num_cpus"] == 2.0  # an engine replica's share of the 4 CPUs
    assert ingress.ray_actor_options["runtime_env"]["env_vars"]["OMP_WAIT_POLICY"] == "PASSIVE"
    server = settings.direct.server_kwargs
    assert server["role"] == "colocated" and server["engine_args"].engine_core_process
    assert settings.direct.report_period_s == cfg.routing_stats_period_s
    assert coordinator._bound_deployment.init_kwargs["deployments"]["colocated"] == "Ingress"
    routed = cluster.launch.app.build_app(_cfg(tiny_model, mode="colocated", direct_streaming=False))._bound_deployment
    assert routed.init_args[0]._bound_deployment.name == "Colocated" and routed.init_args[3].direct is None
    assert routed.ray_actor_options["num_cpus"] == 0


def test_a_direct_streaming_pd_app_keeps_its_prefill_deployment_and_its_ingress_is_the_decode_replica(
        tiny_model, monkeypatch):
    import cluster.launch.app

    monkeypatch.setattr(cluster.launch.app, "node_cpus", lambda: [6.0])
    cfg = _cfg(tiny_model, mode="pd", prefill_replicas=1, decode_replicas=2)
    ingress = cluster.launch.app.build_app(cfg)._bound_deployment
    prefill, decode, coordinator, settings = ingress.init_args
    assert prefill._bound_deployment.name == "Prefill" and decode is None
    assert not prefill._bound_deployment.init_kwargs["engine_args"].engine_core_process
    assert ingress.num_replicas == 2 and ingress.ray_actor_options["num_cpus"] == 2.0  # 6 CPUs, 3 engines
    server = settings.direct.server_kwargs
    assert server["role"] == "decode" and server["engine_args"].engine_core_process
    assert coordinator._bound_deployment.init_kwargs["deployments"] == {
        "prefill": "Prefill", "decode": "Ingress", "colocated": "Colocated"}
    routed = cluster.launch.app.build_app(_cfg(tiny_model, mode="pd", direct_streaming=False))._bound_deployment
    assert routed.init_args[1]._bound_deployment.name == "Decode" and routed.init_args[3].direct is None


def test_pd_on_one_gpu_is_refused_at_start_up_with_how_to_share_it(tiny_model, monkeypatch):
    """Two P/D replicas of one GPU each on a one-GPU Ray: Serve would wait for ever on the
    second; start-up refuses instead, saying how to share the GPU, and the shared settings
    fit."""
    import torch

    from cluster.control.capacity import startup_refusal

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    one_gpu = {"CPU": 16.0, "GPU": 1.0}
    cfg = _cfg(tiny_model, mode="pd")
    assert _initial(cfg) == {"CPU": 2.0, "GPU": 2.0}
    refusal = startup_refusal(_initial(cfg), one_gpu, cfg.mode)
    assert refusal is not None and "need CPU 2, GPU 2 in all; this Ray has CPU 16, GPU 1" in refusal
    assert "--replica-gpus 0.5 --gpu-memory-utilization 0.45" in refusal
    shared = _cfg(tiny_model, mode="pd", replica_num_gpus=0.5)
    assert startup_refusal(_initial(shared), one_gpu, shared.mode) is None
    # Replica counts multiply; a tensor-parallel replica counts its ranks' bundles.
    tp = AppConfig.from_flat({"model": tiny_model, "mode": "colocated", "tensor_parallel_size": 2,
                              "colocated_replicas": 2})
    assert _initial(tp) == {"CPU": 2.0, "GPU": 4.0}
    assert "lower the replica counts or --replica-gpus" in startup_refusal(_initial(tp), one_gpu, "colocated")


def test_cpu_replicas_that_do_not_fit_are_refused_naming_the_cpus(tiny_model):
    from cluster.control.capacity import startup_refusal

    cfg = _cfg(tiny_model, mode="pd", replica_num_cpus=3)
    assert _initial(cfg) == {"CPU": 6.0}
    assert startup_refusal(_initial(cfg), {"CPU": 4.0, "GPU": 0.0}, "pd") == (
        "the engine replicas need CPU 6 in all; this Ray has CPU 4; lower the replica counts or --replica-cpus")
    assert startup_refusal(_initial(cfg), {"CPU": 6.0, "GPU": 0.0}, "pd") is None


def _initial(cfg: AppConfig) -> dict[str, float]:
    """What `cfg`'s engine replicas reserve at start-up, as `pdserve serve` asks before Ray starts them."""
    from cluster.control.capacity import initial_resources

    targets = cfg.targets()
    return initial_resources(targets, {role: cfg.role_resources(role) for role in targets})


@pytest.mark.parametrize("kw, field", [
    ({"tool_call_parser": "nonsense"}, "tool_call_parser"),
    ({"enable_auto_tool_choice": True}, "enable_auto_tool_choice"),
])
def test_tool_flags_are_checked_before_ray_starts(tiny_model, kw, field):
    from cluster.launch.app_config import AppConfig
    from engine.errors import ParameterError

    with pytest.raises(ParameterError) as e:
        AppConfig(engine_args=EngineArgs(model=tiny_model), **kw)
    assert e.value.field == field
    assert AppConfig(engine_args=EngineArgs(model=tiny_model), enable_auto_tool_choice=True,
                     tool_call_parser="hermes").tool_call_parser == "hermes"
