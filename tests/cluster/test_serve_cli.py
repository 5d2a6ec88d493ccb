"""`pdserve serve` flags: mapped onto AppConfig, and bad ones rejected before Ray starts."""

from __future__ import annotations

import pytest

from cluster.cli import build_parser, main
from cluster.serve_cli import _config


def test_defaults_are_one_prefill_one_decode_on_localhost(tiny_model):
    args = build_parser().parse_args(["serve", "--model", tiny_model])
    assert (args.host, args.port, args.mode) == ("127.0.0.1", 8000, "pd")
    cfg = _config(args)
    assert (cfg.prefill_replicas, cfg.decode_replicas, cfg.mode) == (1, 1, "pd")
    assert cfg.model_name == tiny_model.rstrip("/").rsplit("/", 1)[-1]


def test_flags_reach_the_app_config(tiny_model):
    args = build_parser().parse_args([
        "serve", "--model", tiny_model, "--mode", "colocated", "--prefill-replicas", "2", "--decode-replicas",
        "3", "--dtype", "float32", "--num-kv-blocks", "77", "--served-model-name", "m", "--prefix-affinity",
        "--replica-gpus", "1"])
    cfg = _config(args)
    assert (cfg.mode, cfg.prefill_replicas, cfg.decode_replicas, cfg.model_name) == ("colocated", 2, 3, "m")
    kw = cfg.engine_kwargs()
    assert kw["dtype"] == "float32" and kw["num_kv_blocks"] == 77
    assert cfg.prefix_affinity and cfg.num_gpus() == 1


@pytest.mark.parametrize("argv,needle", [
    (["--prefill-replicas", "0"], "prefill_replicas"),
    (["--decode-replicas", "-1"], "decode_replicas"),
    (["--max-pending-requests", "0"], "max_pending_requests"),
    (["--replica-gpus", "-1"], "replica_num_gpus"),
])
def test_bad_values_exit_2_naming_the_field(tiny_model, capsys, argv, needle):
    assert main(["serve", "--model", tiny_model, *argv]) == 2
    assert needle in capsys.readouterr().err


def test_missing_model_dir_exits_2(tmp_path, capsys):
    assert main(["serve", "--model", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_bad_mode_is_rejected_by_the_parser():
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--mode", "both"])
    assert e.value.code == 2
