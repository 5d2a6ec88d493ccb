"""CUDA-graph size selection and decode padding (pure logic, checked on CPU), and decoding with
graphs against eager mode and transformers on the session's `device` (in the GPU subset)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.worker.cuda_graphs import capture_sizes, pad_decode_inputs, padded_size
from kernels import reference as ref
from tests.engine.hf_reference import hf_greedy, random_prompts


def test_capture_sizes_cover_small_batches_then_multiples_of_eight():
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(1000)[-1] == 256


@pytest.mark.parametrize("n, expected", [(1, 1), (3, 4), (5, 8), (9, 16), (40, 40), (41, None)])
def test_padded_size_is_smallest_captured_size_that_fits(n, expected):
    assert padded_size(n, capture_sizes(40)) == expected


def _buffers(size, width=4):
    return (np.full(size, 7), np.full(size, 9), np.full(size, 11), np.zeros(size + 1, dtype=np.int64),
            np.full(size, 13), np.full((size, width), 5))


def test_padding_rows_write_nothing_and_read_one_key():
    ids, pos, slots, qsl, seq_lens, table = _buffers(8)
    pad_decode_inputs(3, 8, ids, pos, slots, qsl, seq_lens, table)
    assert ids[:3].tolist() == [7] * 3 and slots[:3].tolist() == [11] * 3  # real rows untouched
    assert slots[3:].tolist() == [-1] * 5
    assert seq_lens[3:].tolist() == [1] * 5 and (table[3:] == 0).all()
    assert qsl.tolist() == list(range(9))


def test_padded_decode_batch_gives_the_same_outputs_for_real_rows():
    # The padded step, run through the reference kernels, must leave the real rows' outputs
    # and the KV cache exactly as the unpadded step does.
    g = torch.Generator().manual_seed(0)
    n, size, H, Hkv, D, page = 3, 8, 4, 2, 8, 4
    kc = torch.randn(10, page, Hkv, D, generator=g)
    vc = torch.randn(10, page, Hkv, D, generator=g)
    q = torch.randn(size, H, D, generator=g)
    k_new, v_new = torch.randn(size, Hkv, D, generator=g), torch.randn(size, Hkv, D, generator=g)
    ids, pos, slots, qsl, seq_lens, table = _buffers(size, width=3)
    slots[:n] = [9, 14, 22]
    seq_lens[:n] = [10, 3, 11]
    table[:n] = [[2, 5, 1], [3, 0, 0], [4, 8, 5]]
    qsl[: n + 1] = np.arange(n + 1)

    def run(rows, kc, vc):
        kc, vc = kc.clone(), vc.clone()
        ref.reshape_and_cache(k_new[:rows], v_new[:rows], kc, vc, torch.from_numpy(slots[:rows]))
        out = ref.paged_attention(q[:rows], kc, vc, torch.from_numpy(table[:rows]).int(),
                                  torch.from_numpy(qsl[: rows + 1]).int(),
                                  torch.from_numpy(seq_lens[:rows]).int(), 0.3)
        return out, kc, vc

    unpadded = run(n, kc, vc)
    pad_decode_inputs(n, size, ids, pos, slots, qsl, seq_lens, table)
    padded = run(size, kc, vc)
    # (batched differently, so equal up to float rounding)
    torch.testing.assert_close(padded[0][:n], unpadded[0], atol=1e-6, rtol=1e-6)
    assert torch.equal(padded[1], unpadded[1]) and torch.equal(padded[2], unpadded[2])


@pytest.mark.gpu
def test_decode_graphs_give_the_eager_tokens_and_transformers(tiny_model, device):
    """On CUDA, decode steps replay captured graphs unless enforce_eager; on CPU nothing is
    captured and both runs are eager. Either way the tokens are transformers' greedy ones."""
    prompts = random_prompts([3, 17, 40, 9, 26], 1000, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    tokens, replays = {}, {}
    for eager in (False, True):
        llm = LLM(tiny_model, max_model_len=128, max_num_seqs=8, device=device, enforce_eager=eager,
                  dtype="float32")  # exact parity (CUDA's `auto` is bf16)
        graphs = llm.engine.core.executor.worker.runner.decode_graphs
        assert (graphs is not None) == (device == "cuda" and not eager)
        replays[eager] = 0
        if graphs is not None:
            replay = graphs.run

            def counted(n, replay=replay, eager=eager):
                replays[eager] += 1
                return replay(n)

            graphs.run = counted
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens[eager] = [o.outputs[0].token_ids for o in outs]
        llm.shutdown()
    assert tokens[False] == tokens[True] == hf_greedy(tiny_model, prompts, 16)
    assert replays[True] == 0 and (replays[False] > 0) == (device == "cuda")
