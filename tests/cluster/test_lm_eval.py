"""lm-evaluation-harness against the Serve app, in P/D and colocated mode, as a vLLM server is
evaluated: `local-completions` with token-id prompts in batches of 4, two requests in flight,
and the server's tokenizer routes (`tokenizer_backend=remote`), on the task set the repo ships
(scripts/lm_eval_tasks: multiple choice by loglikelihood, generate_until with stop strings).

Oracle: lm-eval's own `hf` backend on the same weights in fp32, run once for the module. The
comparison is scripts/lm_eval_parity.py's, so the script and the test judge alike.
"""

from __future__ import annotations

import pytest

from scripts.lm_eval_parity import (
    TOLERANCE,
    compare,
    evaluate,
    hf_model_args,
    report,
    served_model,
    served_model_args,
)
from tests.cluster.helpers import assert_no_leaks

# The shipped tasks: 12 four-way questions (one loglikelihood request per choice), 6 answers.
CHOICES, GENERATIONS = 48, 6


@pytest.fixture(scope="module")
def hf_results(tiny_model):
    return evaluate("hf", hf_model_args(tiny_model))


def test_local_completions_loglikelihoods_and_generations_equal_the_hf_backend(app, mode, hf_results, shared_app):
    served = evaluate("local-completions", served_model_args(app, served_model(app), num_concurrent=2),
                      batch_size=4)
    parity = compare(served, hf_results)
    summary = report(parity)
    assert not parity.missing, summary
    assert (len(parity.loglikelihoods), len(parity.generations)) == (CHOICES, GENERATIONS), summary
    assert parity.max_abs_diff <= TOLERANCE, summary
    assert not parity.generation_mismatches, summary
    for task, values in parity.metrics.items():
        for metric, (s, r) in values.items():
            assert s == pytest.approx(r), (task, metric, summary)
    assert_no_leaks(app, shared_app.name, shared_app.roles)


def test_the_generation_task_stops_some_answers_at_a_stop_string(tiny_model, hf_results):
    """Guards the test above: on this model, greedy decoding without stop strings runs past one
    of the task's stop strings for at least one question, so a server that ignored `stop` would
    differ from the oracle there."""
    from transformers import AutoTokenizer

    from tests.engine.hf_reference import hf_greedy

    kwargs = hf_results["configs"]["pdserve_gen"]["generation_kwargs"]
    tok = AutoTokenizer.from_pretrained(tiny_model)
    contexts = [s["arguments"][0][0] for s in hf_results["samples"]["pdserve_gen"]]
    uncut = hf_greedy(tiny_model, [tok.encode(c) for c in contexts], kwargs["max_gen_toks"])
    assert any(stop in tok.decode(ids) for ids in uncut for stop in kwargs["until"])


def test_the_comparison_fails_past_the_tolerance_and_on_a_changed_generation(hf_results):
    """The judge itself, on the oracle's own results: identical passes; one choice moved by
    1.5x the tolerance, or one generation with a character more, fails; a request the served
    run lacks fails."""
    import copy

    assert compare(hf_results, hf_results).ok() and compare(hf_results, hf_results).max_abs_diff == 0.0

    moved = copy.deepcopy(hf_results)
    sample = moved["samples"]["pdserve_mc"][3]
    ll, greedy = sample["resps"][2][0]
    sample["resps"][2] = [(ll + 1.5 * TOLERANCE, greedy)]
    parity = compare(moved, hf_results)
    assert not parity.ok() and parity.max_abs_diff == pytest.approx(1.5 * TOLERANCE)

    changed = copy.deepcopy(hf_results)
    changed["samples"]["pdserve_gen"][1]["resps"][0] = [changed["samples"]["pdserve_gen"][1]["resps"][0][0] + "x"]
    parity = compare(changed, hf_results)
    assert not parity.ok() and [g[0] for g in parity.generation_mismatches] == [("pdserve_gen", 1, 0)]

    fewer = copy.deepcopy(hf_results)
    fewer["samples"]["pdserve_mc"].pop()
    parity = compare(fewer, hf_results)
    assert not parity.ok() and len(parity.missing) == 4
