"""Expert parallelism: the experts of every MoE layer partitioned whole over data-parallel x
tensor-parallel ranks. Engines are threads (tests/engine/tp_threads.py), each data-parallel
rank with its own batch; greedy tokens equal Hugging Face `generate` (which test_moe.py shows
the EP=1 engine equals). One gloo test runs the real EPGroup over two processes."""

from __future__ import annotations

import dataclasses
import multiprocessing
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

import kernels
from engine import EngineArgs, SamplingParams
from engine.distributed import EPGroup, TPGroup
from engine.errors import ParameterError
from engine.models import loader
from engine.models.arch import arch_from_dict, load_arch
from engine.models.moe import SparseMoE
from engine.models.parallel import ShardLayout, check_ep_size, check_tp_size
from engine.request import Request
from engine.tokenizer import eos_token_ids, load_tokenizer
from tests.engine.hf_reference import hf_greedy, random_prompts
from tests.engine.tp_threads import ThreadDPGroup

MAX_NEW = 10
# Prompts over 16 tokens are chunked, so ranks prefill and decode in different steps.
ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, long_prefill_token_threshold=16)
VARIANTS = {
    "qwen3_moe": ("qwen3_moe", {}),
    "mixtral": ("mixtral", {}),
    # Plain top-k weights and a dense layer between the sparse ones.
    "qwen3_moe-unnormalised-dense-layer": ("qwen3_moe", dict(norm_topk_prob=False, mlp_only_layers=[1])),
}


@pytest.fixture(scope="module")
def dp_group(model_factory):
    """group(variant, dp, tp) -> (model dir, ThreadDPGroup), one per shape for the module."""
    groups: dict[tuple, ThreadDPGroup] = {}

    def make(variant: str, dp: int, tp: int = 1):
        family, overrides = VARIANTS[variant]
        model = model_factory(family, **overrides)
        key = (model, dp, tp)
        if key not in groups:
            config = EngineArgs(model=model, tensor_parallel_size=tp, **ENGINE).create_engine_config()
            groups[key] = ThreadDPGroup(config, dp)
        return model, groups[key]

    yield make
    for group in groups.values():
        group.shutdown()


def _requests(model: str, rank: int, prompts: list[list[int]]) -> list[Request]:
    eos = tuple(eos_token_ids(model, load_tokenizer(model)))
    params = dataclasses.replace(SamplingParams(temperature=0.0, max_tokens=MAX_NEW), _eos_token_ids=eos)
    return [Request(f"{rank}-{i}", p, params, MAX_NEW) for i, p in enumerate(prompts)]


def _run(model: str, group: ThreadDPGroup, per_rank: list[list[list[int]]]) -> list[list[list[int]]]:
    out = group.generate([_requests(model, r, prompts) for r, prompts in enumerate(per_rank)])
    return [[out[f"{r}-{i}"] for i in range(len(prompts))] for r, prompts in enumerate(per_rank)]


def _free_blocks_are_back(group: ThreadDPGroup) -> bool:
    return all(c.kv_cache_manager.get_num_free_blocks() == c.num_kv_blocks for c in group.cores)


@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral"])
def test_ep2_each_rank_its_own_batch_greedy_equals_transformers(dp_group, variant):
    model, group = dp_group(variant, dp=2)
    moe = [c.executor.workers[0].runner.model.layers[0].mlp for c in group.cores]
    assert [m.w13.shape[0] for m in moe] == [4, 4] and [m.expert_start for m in moe] == [0, 4]
    per_rank = [random_prompts([3, 21, 40], 900, seed=1), random_prompts([9, 30], 900, seed=2)]
    got = _run(model, group, per_rank)
    assert got == [hf_greedy(model, prompts, MAX_NEW) for prompts in per_rank]
    assert _free_blocks_are_back(group)


def test_an_idle_rank_runs_the_model_on_no_tokens_while_the_other_decodes(dp_group):
    model, group = dp_group("mixtral", dp=2)
    before = list(group.dummy_steps)
    prompts = random_prompts([5, 25], 900, seed=3)
    assert _run(model, group, [prompts, []]) == [hf_greedy(model, prompts, MAX_NEW), []]
    # Two chunks for the 25-token prompt, then one step per new token: every step of rank 0
    # is a dummy step of rank 1 (ran on zero tokens, joining each layer's collectives).
    idle = group.dummy_steps[1] - before[1]
    assert idle >= MAX_NEW + 1 and group.dummy_steps[0] == before[0]
    assert _free_blocks_are_back(group)


def test_ep4_over_dp2_tp2_counts_each_expert_once_per_token(dp_group):
    # The two TP ranks of a DP rank hold the same tokens; each sends half into the exchange.
    model, group = dp_group("qwen3_moe-unnormalised-dense-layer", dp=2, tp=2)
    runners = [w.runner for c in group.cores for w in c.executor.workers]
    assert [r.model.layers[0].mlp.expert_start for r in runners] == [0, 2, 4, 6]
    per_rank = [random_prompts([17, 1, 6], 900, seed=4), random_prompts([33], 900, seed=5)]
    assert _run(model, group, per_rank) == [hf_greedy(model, prompts, MAX_NEW) for prompts in per_rank]


def test_a_rank_reads_only_its_own_experts_whole(model_factory, monkeypatch):
    model_dir = model_factory("qwen3_moe")
    arch = load_arch(model_dir)
    read: list[str] = []
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
            read.append(name)
            return self.inner.get_slice(name)

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(loader, "safe_open", Recording)
    ops = kernels.get_ops("torch", "cpu")
    # TP rank 1 of 2 is EP rank 3 of 4: experts 6 and 7, whole; attention still TP-sliced.
    rank = loader.load_model(model_dir, arch, ops, torch.device("cpu"), torch.float32, 64,
                             TPGroup(1, 2), EPGroup(3, 4))
    monkeypatch.undo()
    experts_read = {int(n.split(".experts.")[1].split(".")[0]) for n in read if ".experts." in n}
    assert experts_read == {6, 7}
    full = loader.load_model(model_dir, arch, ops, torch.device("cpu"), torch.float32, 64)
    inter = arch.moe_intermediate_size
    for layer, full_layer in zip(rank.layers, full.layers):
        moe, full_moe = layer.mlp, full_layer.mlp
        assert moe.w13.shape == (2, 2 * inter, arch.hidden_size) and moe.w2.shape == (2, arch.hidden_size, inter)
        assert torch.equal(moe.w13, full_moe.w13[6:8]) and torch.equal(moe.w2, full_moe.w2[6:8])
        assert torch.equal(moe.gate.weight, full_moe.gate.weight)  # the router is replicated
    h = arch.num_heads // 2 * arch.head_dim
    assert torch.equal(rank.layers[0].self_attn.o_proj.weight, full.layers[0].self_attn.o_proj.weight[:, h:])
    with safe_open(f"{model_dir}/model.safetensors", "pt") as f:
        assert torch.equal(rank.layers[1].mlp.w2[0], f.get_tensor("model.layers.1.mlp.experts.6.down_proj.weight"))


BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=128, num_experts_per_tok=2, moe_intermediate_size=18)


def test_expert_parallel_size_must_divide_the_number_of_experts():
    arch = arch_from_dict({**BASE, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8})
    for size in (1, 2, 4, 8):
        check_ep_size(arch, size)
    with pytest.raises(ParameterError, match=r"8 experts .* = 3 ranks.*\[1, 2, 4, 8\]") as e:
        check_ep_size(arch, 3)
    assert e.value.field == "enable_expert_parallel"
    dense = arch_from_dict({**BASE, "architectures": ["Qwen3ForCausalLM"]})
    with pytest.raises(ParameterError, match="needs a mixture-of-experts model") as e:
        check_ep_size(dense, 2)
    assert e.value.field == "enable_expert_parallel"
    # Whole experts under EP: their intermediate size (18) need not split over TP=4.
    check_tp_size(arch, 4, expert_parallel=True)
    with pytest.raises(ParameterError, match="experts' intermediate size 18"):
        check_tp_size(arch, 4)


def _moe_layer(ep: EPGroup) -> SparseMoE:
    """A Qwen3-MoE block with 4 experts, the same random weights in every process."""
    arch = arch_from_dict({**BASE, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
                           "norm_topk_prob": True})
    g = torch.Generator().manual_seed(0)
    layout = ShardLayout(arch, ep_rank=ep.rank, ep_size=ep.size)
    moe = SparseMoE(layout, kernels.get_ops("torch"), ep=ep)
    w13 = torch.randn(4, 2 * 18, 64, generator=g) / 8
    w2 = torch.randn(4, 64, 18, generator=g) / 4
    lo, n = layout.expert_start, layout.num_local_experts
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(4, 64, generator=g))
        moe.w13.copy_(w13[lo:lo + n])
        moe.w2.copy_(w2[lo:lo + n])
    return moe


# Tokens per rank at each step: both busy, rank 1 idle, both idle (a wave's last dummy step).
_STEPS = [(5, 3), (4, 0), (0, 0)]


def _step_inputs(step: int, rank: int) -> torch.Tensor:
    return torch.randn(_STEPS[step][rank], 64, generator=torch.Generator().manual_seed(10 * step + rank))


def _gloo_rank(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    moe = _moe_layer(EPGroup(rank, 2))
    with torch.inference_mode():
        outs = [moe(_step_inputs(step, rank)) for step in range(len(_STEPS))]
    torch.save(outs, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def test_gloo_ep2_sparse_moe_equals_one_rank_including_idle_ranks(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_gloo_rank, args=(r, str(tmp_path / "init"), str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(60)
    finally:
        for p in procs:  # a rank stuck in a collective must not outlive the test
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0, 0]
    single = _moe_layer(EPGroup())
    for rank in range(2):
        outs = torch.load(tmp_path / f"rank{rank}.pt")
        for step, out in enumerate(outs):
            with torch.inference_mode():
                expected = single(_step_inputs(step, rank))
            assert out.shape == (_STEPS[step][rank], 64)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
