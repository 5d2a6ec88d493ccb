"""Batch inference over Ray Datasets on local Ray: 200 rows over 2 engine actors; text equals
the offline engine's; invalid rows are reported in `error`, not fatal; every row once, in
order, with its other columns kept."""

from __future__ import annotations

import asyncio

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cluster.batch.pipeline import EnginePredictor
from engine import LLM, EngineArgs, SamplingParams

ENGINE = {"max_model_len": 128, "num_kv_blocks": 96}
WORDS = "river engineer village quietly measures before once upon time small sea help there".split()


def _rows(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        k = 3 + (i * 7) % 11
        rows.append({"id": i, "prompt": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(k)),
                     "max_tokens": None if i % 3 else 4 + i % 5, "temperature": None})
    rows[5]["prompt"] = ""  # empty
    rows[17]["prompt"] = "word " * 400  # longer than max_model_len
    rows[42]["temperature"] = -1.0  # an invalid per-row parameter
    rows[99]["max_tokens"] = 500  # prompt + max_tokens beyond the context
    return rows


BAD = {5: "prompt", 17: "max_model_len", 42: "temperature", 99: "max_tokens"}


def test_200_rows_over_two_engine_actors(ray_local, tiny_model, tmp_path):
    from cluster.batch.pipeline import run_batch

    rows = _rows(200)
    src = tmp_path / "in"
    src.mkdir()
    table = pa.Table.from_pylist(rows, schema=pa.schema([("id", pa.int64()), ("prompt", pa.string()),
                                                         ("max_tokens", pa.int64()), ("temperature", pa.float64())]))
    pq.write_table(table.slice(0, 120), src / "part-0.parquet")  # a directory of two files
    pq.write_table(table.slice(120), src / "part-1.parquet")
    out = tmp_path / "out.parquet"
    n = run_batch(str(src), str(out), EngineArgs(model=tiny_model, **ENGINE), concurrency=2, batch_size=25,
                  sampling=SamplingParams(max_tokens=8, temperature=0.0), num_cpus=0.25)
    result = pq.read_table(out).to_pylist()
    assert n == 200 and [r["id"] for r in result] == list(range(200))  # each row once, in order
    assert all(r["prompt"] == rows[r["id"]]["prompt"] for r in result)  # other columns kept

    for i, needle in BAD.items():
        r = result[i]
        assert r["error"] and needle in r["error"], (i, r["error"])
        assert r["generated_text"] is None and r["num_generated_tokens"] is None
    good = [r for r in result if r["id"] not in BAD]
    assert all(r["error"] is None for r in good)

    llm = LLM(tiny_model, **ENGINE)
    params = [SamplingParams(max_tokens=rows[r["id"]]["max_tokens"] or 8, temperature=0.0) for r in good]
    ref = llm.generate([rows[r["id"]]["prompt"] for r in good], params, use_tqdm=False)
    for r, o in zip(good, ref):
        assert r["generated_text"] == o.outputs[0].text
        assert r["generated_token_ids"] == list(o.outputs[0].token_ids)
        assert r["num_prompt_tokens"] == len(o.prompt_token_ids)
        assert r["num_generated_tokens"] == len(o.outputs[0].token_ids)
        assert r["finish_reason"] == o.outputs[0].finish_reason


def test_output_directory_and_cli(ray_local, tiny_model, tmp_path):
    from cluster.launch.cli import main

    pq.write_table(pa.Table.from_pylist([{"text": "hello there", "k": 1}, {"text": "once upon", "k": 2}]),
                   tmp_path / "in.parquet")
    rc = main(["batch", str(tmp_path / "in.parquet"), str(tmp_path / "out"), "--model", tiny_model,
               "--prompt-column", "text", "--max-tokens", "3", "--ignore-eos", "--concurrency", "1",
               "--max-model-len", "128", "--num-kv-blocks", "32", "--cpus-per-actor", "0.25"])
    assert rc == 0
    result = pq.read_table(tmp_path / "out").to_pylist()
    assert sorted(r["k"] for r in result) == [1, 2]
    assert all(r["num_generated_tokens"] == 3 and r["finish_reason"] == "length" for r in result)


@pytest.mark.parametrize("argv,needle", [(["--max-tokens", "0"], "max_tokens"),
                                         (["--temperature", "-1"], "temperature"),
                                         (["--top-k", "-5"], "top_k"),
                                         (["--block-size", "0"], "block_size")])
def test_bad_flags_exit_2_before_ray(tiny_model, tmp_path, capsys, argv, needle):
    from cluster.launch.cli import main

    assert main(["batch", str(tmp_path / "x.parquet"), str(tmp_path / "y"), "--model", tiny_model, *argv]) == 2
    assert needle in capsys.readouterr().err


def test_missing_prompt_column_is_a_clear_error(tiny_model):
    predictor = EnginePredictor(EngineArgs(model=tiny_model, **ENGINE), "prompt")
    with pytest.raises(ValueError, match="no 'prompt' column"):
        asyncio.run(predictor(pa.table({"text": ["x"]})))
    with pytest.raises(ValueError, match="no 'prompt' column"):
        predictor.generate_batch(pa.table({"text": ["x"]}))
    predictor.feeder.close(timeout=30)


def test_actor_resources_fit_the_cluster_or_are_refused_with_the_numbers():
    from cluster.batch.pipeline import fit_actors
    from engine.errors import ParameterError

    two = {"CPU": 2.0}
    assert fit_actors(1, None, 0, two) == 1.0  # one CPU for the engine, one for Ray Data's tasks
    assert fit_actors(2, None, 0, two) == 0.5  # shares of what the data tasks leave
    assert fit_actors(4, 0.25, 0, two) == 0.25
    assert fit_actors(2, None, 1, {"CPU": 2.0, "GPU": 2.0}) == 0.0
    with pytest.raises(ParameterError, match=r"concurrency 2 x 1 CPU per actor = 2 CPUs.*has 2.*at most 0.50"):
        fit_actors(2, 1.0, 0, two)
    with pytest.raises(ParameterError, match="needs 2 GPUs; the cluster has 1"):
        fit_actors(2, None, 1, {"CPU": 8.0, "GPU": 1.0})
    with pytest.raises(ParameterError, match="none left"):
        fit_actors(1, None, 0, {"CPU": 1.0})


def test_a_job_that_cannot_fit_is_refused_at_once_not_left_waiting(ray_local, tiny_model, tmp_path, capsys):
    from cluster.launch.cli import main

    pq.write_table(pa.Table.from_pylist([{"prompt": "hello"}]), tmp_path / "in.parquet")
    rc = main(["batch", str(tmp_path / "in.parquet"), str(tmp_path / "out"), "--model", tiny_model,
               "--concurrency", "2", "--cpus-per-actor", "1", "--max-model-len", "128"])
    assert rc == 2
    assert "concurrency 2 x 1 CPU per actor" in capsys.readouterr().err


class PeakPredictor(EnginePredictor):
    """EnginePredictor that adds, per row, the most rows its engine has held at once so far."""

    async def __call__(self, batch):
        out = await super().__call__(batch)
        return out.append_column("peak", pa.array([self.feeder.peak_in_flight] * out.num_rows, pa.int64()))


@pytest.mark.timeout(420)
def test_one_actor_keeps_rows_of_several_batches_in_its_engine(ray_local, tiny_model, tmp_path):
    """One block, batches of 10: the engine holds rows of several batches at once (not one
    batch, drained, then the next); outputs are still exactly the offline engine's, in order."""
    from concurrent.futures import ThreadPoolExecutor

    from cluster.batch.pipeline import run_batch

    prompts = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(3 + i % 9)) for i in range(60)]
    pq.write_table(pa.table({"id": list(range(60)), "prompt": prompts}), tmp_path / "in.parquet")
    sampling = SamplingParams(max_tokens=12, temperature=0.0)
    with ThreadPoolExecutor(1) as pool:  # bounded: a job that hangs fails here
        n = pool.submit(run_batch, str(tmp_path / "in.parquet"), str(tmp_path / "out.parquet"),
                        EngineArgs(model=tiny_model, **ENGINE), concurrency=1, batch_size=10, sampling=sampling,
                        num_cpus=0.25, predictor=PeakPredictor).result(timeout=360)
    result = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert n == 60 and [r["id"] for r in result] == list(range(60))
    assert max(r["peak"] for r in result) > 10
    ref = LLM(tiny_model, **ENGINE).generate(prompts, sampling, use_tqdm=False)
    for r, o in zip(result, ref):
        assert r["error"] is None
        assert r["generated_token_ids"] == list(o.outputs[0].token_ids)
        assert r["generated_text"] == o.outputs[0].text


def test_a_pooling_engine_fills_an_embedding_column(model_factory):
    from tests.engine.pooling_factory import cosine, hf_pooled

    model = model_factory("qwen3")
    predictor = EnginePredictor(EngineArgs(model=model, runner="pooling", **ENGINE), "prompt")
    rows = [{"id": 0, "prompt": [5, 6, 7, 8]}, {"id": 1, "prompt": []}, {"id": 2, "prompt": [9] * 40}]
    out = asyncio.run(predictor(pa.Table.from_pylist(rows))).to_pylist()
    predictor.feeder.close(timeout=30)
    assert [r["id"] for r in out] == [0, 1, 2] and "generated_text" not in out[0]
    for r in (out[0], out[2]):
        assert r["error"] is None and r["num_prompt_tokens"] == len(r["prompt"])
        assert cosine(r["embedding"], hf_pooled(model, r["prompt"], "LAST")) >= 0.9999
    assert out[1]["embedding"] is None and "empty" in out[1]["error"]
