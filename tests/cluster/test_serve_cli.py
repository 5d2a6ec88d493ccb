"""`pdserve serve` flags: mapped onto AppConfig (engine flags from EngineArgs.add_cli_args), and
bad ones rejected before Ray starts."""

from __future__ import annotations

import os

import pytest

from cluster.http.structured_config import StructuredOutputsConfig
from cluster.launch.app_config import LOCAL_PREFILL_QUEUE
from cluster.launch.cli import build_parser, main
from cluster.launch.serve_cli import _config
from engine.args import EngineArgs


@pytest.fixture(autouse=True)
def _environment_restored():
    """`main(["serve", ...])` chooses the HTTP proxy for a Ray it is about to start by setting
    Serve's switches in os.environ (cluster.launch.http_proxy) before it checks the flags; here it then
    exits, and those switches must not reach a Serve started later in this test session."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_defaults_are_one_prefill_one_decode_on_localhost(tiny_model):
    args = build_parser().parse_args(["serve", "--model", tiny_model])
    assert (args.host, args.port, args.mode) == ("127.0.0.1", 8000, "pd")
    cfg = _config(args)
    assert (cfg.prefill_replicas, cfg.decode_replicas, cfg.mode) == (1, 1, "pd")
    assert cfg.model_name == tiny_model.rstrip("/").rsplit("/", 1)[-1]
    assert cfg.engine_args == EngineArgs(model=tiny_model)  # engine defaults are EngineArgs' own


def test_without_model_the_packaged_smollm2_is_served_under_its_name(smollm2):
    cfg = _config(build_parser().parse_args(["serve"]))
    assert cfg.model == smollm2 and cfg.model_name == "SmolLM2-135M-Instruct"


def test_the_default_model_answers_agents_with_auto_tool_choice_unless_told_otherwise(smollm2, tiny_model):
    def tools(*flags):
        cfg = _config(build_parser().parse_args(["serve", *flags]))
        return cfg.enable_auto_tool_choice, cfg.tool_call_parser

    assert tools() == (True, "hermes")
    assert tools("--no-enable-auto-tool-choice") == (False, None)
    assert tools("--tool-call-parser", "mistral") == (False, "mistral")
    assert tools("--model", tiny_model) == (False, None)  # any --model: vLLM's flags rule
    assert tools("--model", tiny_model, "--enable-auto-tool-choice", "--tool-call-parser", "hermes") == (True, "hermes")


def test_a_gguf_file_is_served_under_its_file_name(tiny_model, tmp_path):
    from tests.engine.gguf_factory import write_gguf

    path = write_gguf(tiny_model, str(tmp_path / "tiny.Q8_0.gguf"), "Q8_0")
    assert _config(build_parser().parse_args(["serve", "--model", path])).model_name == "tiny.Q8_0"
    assert _config(build_parser().parse_args(["serve", "--model", str(tmp_path)])).model_name == tmp_path.name


def test_flags_reach_the_app_config(tiny_model):
    args = build_parser().parse_args([
        "serve", "--model", tiny_model, "--mode", "colocated", "--prefill-replicas", "2", "--decode-replicas",
        "3", "--dtype", "float32", "--num-kv-blocks", "77", "--served-model-name", "m", "--prefix-affinity",
        "--replica-gpus", "1"])
    cfg = _config(args)
    assert (cfg.mode, cfg.prefill_replicas, cfg.decode_replicas, cfg.model_name) == ("colocated", 2, 3, "m")
    assert cfg.engine_args.dtype == "float32" and cfg.engine_args.num_kv_blocks == 77
    assert cfg.prefix_affinity and cfg.num_gpus() == 1
    assert cfg.autoscale["look_back_period_s"] == 10.0
    lenient = _config(build_parser().parse_args(["serve", "--model", tiny_model, "--structured-outputs-config",
                                                 '{"backend": "guidance"}']))
    assert StructuredOutputsConfig.of(lenient.structured_outputs_config) == StructuredOutputsConfig("guidance")
    look = _config(build_parser().parse_args(["serve", "--model", tiny_model, "--look-back-period-s", "4"]))
    assert look.autoscale["look_back_period_s"] == 4.0
    assert not cfg.disable_access_log and cfg.api_server_count == 1
    assert _config(build_parser().parse_args(["serve", "--model", tiny_model, "--api-server-count", "2"])).api_server_count == 2
    assert _config(build_parser().parse_args(["serve", "--model", tiny_model])).migration_limit == 3  # Dynamo's
    assert _config(build_parser().parse_args(["serve", "--model", tiny_model, "--migration-limit", "0"])).migration_limit == 0
    assert _config(build_parser().parse_args(["serve", "--model", tiny_model, "--disable-access-log"])).disable_access_log
    assert cfg.replica_num_cpus is None  # sized from the cluster once Ray is up (cluster.control.capacity)
    given = _config(build_parser().parse_args(["serve", "--model", tiny_model, "--replica-cpus", "3"]))
    assert given.replica_num_cpus == 3.0
    threads = _config(build_parser().parse_args(["serve", "--model", tiny_model, "--replica-threads", "2"]))
    assert threads.replica_num_threads == 2 and cfg.replica_num_threads is None
    placement = _config(build_parser().parse_args(["serve", "--model", tiny_model, "--local-prefill-queue", "0",
                                                   "--max-local-prefill-length", "64"]))
    assert (placement.local_prefill_queue, placement.max_local_prefill_length) == (0, 64)
    direct = _config(build_parser().parse_args(["serve", "--model", tiny_model, "--mode", "colocated",
                                                "--direct-streaming", "--replicas", "2"]))
    assert direct.direct_streaming and direct.colocated_replicas == 2 and cfg.direct_streaming is None
    routed = _config(build_parser().parse_args(["serve", "--model", tiny_model, "--mode", "colocated",
                                                "--no-direct-streaming"]))
    assert routed.direct_streaming is False and not routed.direct
    assert (cfg.local_prefill_queue, cfg.max_local_prefill_length) == (LOCAL_PREFILL_QUEUE, 0)


def test_tensor_parallel_flags_reach_each_role(tiny_model):
    args = build_parser().parse_args([
        "serve", "--model", tiny_model, "--tensor-parallel-size", "2", "--prefill-tensor-parallel-size", "2",
        "--decode-tensor-parallel-size", "2"])
    cfg = _config(args)
    assert cfg.engine_args.tensor_parallel_size == 2
    assert [cfg.role_engine_args(r).tensor_parallel_size for r in ("prefill", "decode")] == [2, 2]


def test_every_engine_argument_is_a_serve_flag(tiny_model, capsys):
    args = build_parser().parse_args([
        "serve", "--model", tiny_model, "--block-size", "8", "--no-enable-prefix-caching",
        "--max-num-batched-tokens", "512", "--long-prefill-token-threshold", "64", "--kv-cache-memory-gb",
        "0.25", "--scheduling-policy", "priority", "--seed", "3", "--max-num-seqs", "4", "--enforce-eager"])
    assert _config(args).engine_args == EngineArgs(
        model=tiny_model, block_size=8, enable_prefix_caching=False, max_num_batched_tokens=512,
        long_prefill_token_threshold=64, kv_cache_memory_gb=0.25, scheduling_policy="priority", seed=3,
        max_num_seqs=4, enforce_eager=True)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    helptext = capsys.readouterr().out
    for name in EngineArgs.field_names():
        assert "--" + name.replace("_", "-") in helptext


def test_speculative_config_reaches_the_engine_args(tiny_model):
    args = build_parser().parse_args([
        "serve", "--model", tiny_model, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    engine_args = _config(args).engine_args
    assert engine_args.speculative_config == {"method": "ngram", "num_speculative_tokens": 4}
    assert engine_args.create_engine_config().speculative.num_speculative_tokens == 4


@pytest.mark.parametrize("argv,needle", [
    (["--prefill-replicas", "0"], "prefill_replicas"),
    (["--decode-replicas", "-1"], "decode_replicas"),
    (["--max-pending-requests", "0"], "max_pending_requests"),
    (["--replica-gpus", "-1"], "replica_num_gpus"),
    (["--local-prefill-queue", "-1"], "local_prefill_queue"),
    (["--block-size", "0"], "block_size"),
    (["--max-num-seqs", "0"], "max_num_seqs"),
    (["--shutdown-timeout-s", "0"], "shutdown_timeout_s"),
    (["--decode-tensor-parallel-size", "3"], "decode_tensor_parallel_size"),  # 3 does not divide 4 heads
    (["--engine-core-process", "--tensor-parallel-size", "2"], "engine_core_process"),  # P/D (the default)
    (["--mode", "colocated", "--engine-core-process", "--data-parallel-size", "2"], "engine_core_process"),
    (["--mode", "colocated", "--engine-core-process", "--tensor-parallel-size", "2"], "engine_core_process"),
    (["--direct-streaming", "--api-server-count", "2"], "direct_streaming"),  # P/D (the default mode)
    (["--mode", "colocated", "--direct-streaming", "--api-server-count", "2"], "direct_streaming"),
    (["--mode", "colocated", "--direct-streaming", "--prefix-affinity"], "direct_streaming"),
    (["--mode", "colocated", "--direct-streaming", "--tensor-parallel-size", "2"], "direct_streaming"),
    (["--mode", "colocated", "--direct-streaming", "--data-parallel-size", "2"], "direct_streaming"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'], "num_speculative_tokens"),
    (["--speculative-config", '{"method": "eagle"}'], "speculative_config.method"),
    (["--structured-outputs-config", '{"bakend": "guidance"}'], "structured_outputs_config has no field 'bakend'"),
])
def test_bad_values_exit_2_naming_the_field(tiny_model, capsys, argv, needle):
    assert main(["serve", "--model", tiny_model, *argv]) == 2
    assert needle in capsys.readouterr().err


def test_missing_model_dir_exits_2(tmp_path, capsys):
    assert main(["serve", "--model", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--mode", "both"], ["--scheduling-policy", "lifo"], ["--dtype", "int4"]])
def test_bad_choices_are_rejected_by_the_parser(argv):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", *argv])
    assert e.value.code == 2


def test_generate_has_sampling_seed_beside_the_engine_seed():
    args = build_parser().parse_args(["generate", "hi", "--seed", "5", "--sampling-seed", "9", "--block-size", "8"])
    assert (args.seed, args.sampling_seed, args.block_size) == (5, 9, 8)
