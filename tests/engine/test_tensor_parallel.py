"""Tensor parallel over torch.distributed (gloo on CPU): a sharded engine generates exactly what
one rank and Hugging Face do, reads only its slices of the checkpoint, and a dead rank fails
the engine at once without leaving a process behind. One TP=2 engine for the module (each
start spawns processes that import torch)."""

from __future__ import annotations

import argparse
import os
import signal

import pytest
import torch

import kernels
from engine import LLM, EngineArgs, ParameterError, SamplingParams
from engine.config import ParallelConfig
from engine.core import check_parallel
from engine.distributed import TPGroup
from engine.errors import EngineDeadError
from engine.models import loader
from engine.models.arch import load_arch
from engine.models.parallel import ShardLayout
from tests.engine.hf_reference import hf_greedy, random_prompts

LENGTHS = [3, 17, 40, 64, 5]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
# Prompts over 16 tokens are chunked; a second pass hits the prefix cache.
ENGINE = dict(max_model_len=256, long_prefill_token_threshold=16)


@pytest.fixture(scope="module")
def tp2(tiny_model):
    """The module's one "mp" TP=2 engine (Llama shapes: 2 kv heads split over the ranks, untied
    head); other families' shapes: test_tensor_parallel_shapes.py. The last test kills it."""
    llm = LLM(tiny_model, tensor_parallel_size=2, **ENGINE)
    yield llm
    llm.shutdown()


def _generate(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_tp2_greedy_equals_tp1_and_transformers_with_chunks_and_prefix_hits(tp2, tiny_model):
    prompts = random_prompts(LENGTHS, 900, seed=5)
    one = LLM(tiny_model, **ENGINE)
    expected = _generate(one, prompts)
    one.shutdown()
    assert _generate(tp2, prompts) == expected
    again = tp2.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in again) > 0
    assert [o.outputs[0].token_ids for o in again] == expected
    assert expected == hf_greedy(tiny_model, prompts, GREEDY.max_tokens)


def test_each_rank_reads_only_its_slice_of_the_checkpoint(model_factory, monkeypatch):
    model_dir = model_factory("mistral", num_key_value_heads=1)
    arch = load_arch(model_dir)
    whole_reads: list[str] = []
    real_open = loader.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.f = real_open(*args, **kwargs)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, name):
            return self.inner.get_slice(name)

        def get_tensor(self, name):
            whole_reads.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(loader, "safe_open", Recording)
    ops = kernels.get_ops("torch", "cpu")
    rank1 = loader.load_model(model_dir, arch, ops, torch.device("cpu"), torch.float32, 64, TPGroup(1, 2))
    # Only the replicated tensors (norms) are read whole.
    assert whole_reads and all(n.endswith("norm.weight") for n in whole_reads)
    monkeypatch.undo()
    full = loader.load_model(model_dir, arch, ops, torch.device("cpu"), torch.float32, 64)
    h, d, inter = arch.num_heads, arch.head_dim, arch.intermediate_size
    layer, full_layer = rank1.layers[0], full.layers[0]
    qkv, full_qkv = layer.self_attn.qkv_proj.weight, full_layer.self_attn.qkv_proj.weight
    # [q heads 2..3 | the one kv head, replicated]
    assert qkv.shape == ((h // 2 + 2) * d, arch.hidden_size)
    assert torch.equal(qkv[: h // 2 * d], full_qkv[h // 2 * d : h * d])
    assert torch.equal(qkv[h // 2 * d :], full_qkv[h * d :])
    assert torch.equal(layer.self_attn.o_proj.weight, full_layer.self_attn.o_proj.weight[:, h // 2 * d :])
    assert torch.equal(layer.mlp.down_proj.weight, full_layer.mlp.down_proj.weight[:, inter // 2 :])
    vocab = arch.vocab_size // 2
    assert torch.equal(rank1.embed_tokens.weight, full.embed_tokens.weight[vocab:])
    assert torch.equal(rank1.lm_head.weight, full.lm_head.weight[vocab:])


def test_shard_layout_splits_or_replicates_kv_heads(tiny_model):
    arch = load_arch(tiny_model)  # 4 heads, 2 kv heads
    assert [ShardLayout(arch, r, 2).kv_head_start for r in range(2)] == [0, 1]
    assert [ShardLayout(arch, r, 4).kv_head_start for r in range(4)] == [0, 0, 1, 1]
    assert ShardLayout(arch, 3, 4).num_kv_heads == 1 and ShardLayout(arch, 3, 4).num_heads == 1


@pytest.mark.parametrize("kwargs, field", [
    (dict(tensor_parallel_size=3), "tensor_parallel_size"),  # 4 heads
    (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "distributed_executor_backend"),
    (dict(distributed_executor_backend="threads"), "distributed_executor_backend"),
])
def test_bad_parallel_arguments_name_their_field(tiny_model, kwargs, field):
    with pytest.raises(ParameterError) as e:
        LLM(tiny_model, **kwargs)
    assert e.value.field == field and field in str(e.value)


def test_more_ranks_than_gpus_is_refused(tiny_model, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ParameterError, match="one GPU per rank; 1 visible") as e:
        check_parallel(load_arch(tiny_model), torch.device("cuda"), ParallelConfig(tensor_parallel_size=2))
    assert e.value.field == "tensor_parallel_size"


def test_cli_flags_reach_the_engine_args():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"])
    args = EngineArgs.from_cli_args(ns, model="m")
    assert (args.tensor_parallel_size, args.distributed_executor_backend) == (2, "mp")
    assert args.create_engine_config().parallel.executor_backend == "mp"


# Last: it kills the module's engine.
def test_a_killed_rank_fails_the_engine_at_once_and_leaves_no_process(tp2):
    executor = tp2.engine.core.executor
    pids = executor.pids
    os.kill(pids[1], signal.SIGKILL)
    executor.procs[1].join(10)
    with pytest.raises(EngineDeadError, match="rank 1"):  # seen while idle (health check)
        tp2.engine.core.check_health()
    # Seen through the rank's pipe or process sentinel, not after a call timeout.
    with pytest.raises(EngineDeadError, match=r"rank 1 \(pid \d+\) (is gone|exited)"):
        _generate(tp2, random_prompts([20], 900))
    assert all(_gone(pid) for pid in pids), "a rank outlived the failed engine"
    with pytest.raises(EngineDeadError):  # and it stays dead
        _generate(tp2, random_prompts([5], 900))
