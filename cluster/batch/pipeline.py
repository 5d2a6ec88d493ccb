"""Batch inference over Ray Datasets (docs/batch.md).

`EnginePredictor` is the callable class for `Dataset.map_batches`: one offline engine per
actor (`concurrency=N` actors), fed from several batches at once (async `__call__`, rows handed
to `cluster.batch.feeder.EngineFeeder`) so the engine's continuous batching stays full across
batch boundaries, as the offline engine's does over all rows. Every input row comes out exactly
once with its columns kept, plus `generated_text`, `generated_token_ids`, `num_prompt_tokens`,
`num_generated_tokens`, `finish_reason` and `error`: a row whose prompt or parameters are
invalid gets the message in `error` (and empty outputs) while the rest of the job goes on.
Optional per-row columns named like SamplingParams fields (`max_tokens`, `temperature`, ...)
override the job's defaults.

`run_batch` builds the whole pipeline: Parquet in (file or directory) -> map_batches -> Parquet
out (a `.parquet` path is one file, anything else a directory), in input order.
"""

from __future__ import annotations

import dataclasses
import os

import pyarrow as pa

from engine.args import EngineArgs
from engine.errors import ParameterError, check_int
from engine.models.default_model import require_model_dir
from engine.pooling.params import PoolingParams
from engine.sampling_params import SamplingParams

OUTPUT_COLUMNS = ("generated_text", "generated_token_ids", "num_prompt_tokens", "num_generated_tokens",
                  "finish_reason", "error")
# Per-row sampling columns a dataset may carry (None / null means: the job's default).
PARAM_COLUMNS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos",
                 "stop", "stop_token_ids")
# A pooling engine's rows (--runner pooling, docs/pooling.md): its vector per task instead.
POOLING_COLUMNS = {"embed": ("embedding", "num_prompt_tokens", "error"),
                   "classify": ("probs", "num_prompt_tokens", "error")}
_OUTPUT_SCHEMA = {"generated_text": pa.string(), "generated_token_ids": pa.list_(pa.int64()),
                  "num_prompt_tokens": pa.int64(), "num_generated_tokens": pa.int64(),
                  "finish_reason": pa.string(), "error": pa.string(),
                  "embedding": pa.list_(pa.float32()), "probs": pa.list_(pa.float32())}


def row_params(defaults: SamplingParams, row: dict) -> SamplingParams:
    """The job's defaults with the row's non-null parameter columns applied (validated)."""
    overrides = {k: row[k] for k in PARAM_COLUMNS if k in row and row[k] is not None}
    for k in ("max_tokens", "min_tokens", "top_k", "seed"):
        if k in overrides and isinstance(overrides[k], float) and overrides[k].is_integer():
            overrides[k] = int(overrides[k])  # Parquet int columns with nulls read back as floats
    return dataclasses.replace(defaults, **overrides) if overrides else defaults


class EnginePredictor:
    """`map_batches` callable class (batch_format="pyarrow"): one engine per actor.

    `__call__` is async: Ray Data keeps several batches of a block in flight on the actor (and
    the next block's call starts before the last one ends); their rows all go to the one engine
    (`EngineFeeder`), so it keeps a full running batch instead of draining at every batch's end.
    `generate_batch` is the same for a caller without an event loop."""

    def __init__(self, engine_args: EngineArgs, prompt_column: str = "prompt",
                 sampling: SamplingParams | None = None, torch_threads: int | None = None) -> None:
        from cluster.batch.feeder import EngineFeeder
        from engine import LLM

        if torch_threads:
            # Ray caps an actor's OMP threads at its CPU reservation; on CPU engines that is
            # often fewer threads than the cores the job may use.
            import torch

            torch.set_num_threads(torch_threads)
        self.llm = LLM.from_engine_args(engine_args)
        self.feeder = EngineFeeder(self.llm.engine)
        self.prompt_column = prompt_column
        self.defaults = sampling or SamplingParams()
        self.pooling = self.llm.engine.processor.pooling  # None: the engine generates
        self.columns = OUTPUT_COLUMNS if self.pooling is None else POOLING_COLUMNS[self.pooling.task]

    def _prepare(self, batch: pa.Table):
        """(outputs to fill, row indexes sent, their futures): rows that fail here (bad type,
        bad parameters, the input processor's checks) get their error now, once per row."""
        if self.prompt_column not in batch.column_names:
            raise ValueError(f"input has no {self.prompt_column!r} column (columns: {batch.column_names})")
        rows = batch.to_pylist()
        out = {c: [None] * len(rows) for c in self.columns}
        todo, requests = [], []
        for i, row in enumerate(rows):
            prompt = row[self.prompt_column]
            if not isinstance(prompt, (str, list)):
                out["error"][i] = (f"{self.prompt_column} must be a string or a list of token ids, "
                                   f"got {type(prompt).__name__}")
                continue
            try:
                prompt = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
                if self.pooling is not None:
                    request = self.llm.engine.process(prompt, SamplingParams(max_tokens=1), self.feeder.next_id(),
                                                      pooling_params=PoolingParams())
                else:
                    request = self.llm.engine.process(prompt, row_params(self.defaults, row), self.feeder.next_id())
            except (ValueError, TypeError) as e:
                out["error"][i] = str(e)
                continue
            todo.append(i)
            requests.append(request)
        return out, todo, self.feeder.submit(requests) if requests else []

    def _fill(self, out: dict, i: int, future) -> None:
        try:
            res = future.result()
        except ValueError as e:  # the row's prompt or parameters (ParameterError included)
            out["error"][i] = str(e)
            return
        out["num_prompt_tokens"][i] = len(res.prompt_token_ids)
        if self.pooling is not None:
            out[self.columns[0]][i] = res.pooled.tolist()
            return
        c = res.outputs[0]
        out["generated_text"][i] = c.text
        out["generated_token_ids"][i] = list(c.token_ids)
        out["num_generated_tokens"][i] = len(c.token_ids)
        out["finish_reason"][i] = c.finish_reason

    @staticmethod
    def _table(batch: pa.Table, out: dict) -> pa.Table:
        for name in out:
            column = pa.array(out[name], type=_OUTPUT_SCHEMA[name])
            if name in batch.column_names:  # re-running over an earlier output replaces it
                batch = batch.set_column(batch.column_names.index(name), name, column)
            else:
                batch = batch.append_column(name, column)
        return batch

    async def __call__(self, batch: pa.Table) -> pa.Table:
        import asyncio

        out, todo, futures = self._prepare(batch)
        if futures:
            await asyncio.wait([asyncio.wrap_future(f) for f in futures])
        for i, future in zip(todo, futures):
            self._fill(out, i, future)
        return self._table(batch, out)

    def generate_batch(self, batch: pa.Table) -> pa.Table:
        """`__call__` without an event loop (blocks until the batch is done)."""
        out, todo, futures = self._prepare(batch)
        for i, future in zip(todo, futures):
            self._fill(out, i, future)
        return self._table(batch, out)


# CPUs left to Ray Data's read and write tasks (one task takes one CPU): with none left, the
# engine actors would hold every CPU and the job would wait forever for its first block.
DATA_TASK_CPUS = 1.0


def fit_actors(concurrency: int, num_cpus: float | None, num_gpus: float, cluster: dict) -> float:
    """Each engine actor's CPU reservation, checked against the cluster so the job can run:
    unset, a CPU actor gets an equal share of the CPUs that Ray Data's tasks leave (at most 1);
    a request that cannot fit is refused at once with the numbers, never left to wait."""
    total_cpus, total_gpus = float(cluster.get("CPU", 0.0)), float(cluster.get("GPU", 0.0))
    if num_gpus and concurrency * num_gpus > total_gpus:
        raise ParameterError("concurrency", f"concurrency {concurrency} x {num_gpus:g} GPU per actor needs "
                             f"{concurrency * num_gpus:g} GPUs; the cluster has {total_gpus:g}")
    room = total_cpus - DATA_TASK_CPUS
    if num_cpus is None:
        if num_gpus:
            return 0.0
        if room <= 0:
            raise ParameterError("concurrency", f"the cluster has {total_cpus:g} CPUs: none left for engine actors "
                                 f"beside Ray Data's read/write tasks ({DATA_TASK_CPUS:g} CPU)")
        return min(1.0, room / concurrency)
    if num_cpus < 0:
        raise ParameterError("num_cpus", f"num_cpus per actor must be >= 0, got {num_cpus}")
    if concurrency * num_cpus > room:
        raise ParameterError("concurrency", f"concurrency {concurrency} x {num_cpus:g} CPU per actor = "
                             f"{concurrency * num_cpus:g} CPUs, but the cluster has {total_cpus:g} and Ray Data's "
                             f"read/write tasks need {DATA_TASK_CPUS:g}: lower the concurrency or the CPUs per "
                             f"actor (at most {max(room, 0) / concurrency:.2f} each)")
    return num_cpus


# Ray runs its workers at niceness +15 so its own daemons stay responsive; for a batch job the
# engine actor *is* the work, and at +15 it gets a fraction of a shared machine's CPU that the
# same engine run directly (`LLM.generate`) would get. `pdserve batch` starts its own local Ray
# with workers at the caller's niceness (a variable the raylet reads; joining a running
# cluster, it changes nothing).
LOCAL_RAY_ENV = {"RAY_worker_niceness": "0"}


def build_pipeline(ds, engine_args: EngineArgs, *, prompt_column: str = "prompt", concurrency: int = 1,
                   batch_size: int = 256, sampling: SamplingParams | None = None,
                   num_cpus: float | None = None, num_gpus: float | None = None,
                   torch_threads: int | None = None, predictor: type = EnginePredictor):
    """`ds.map_batches` with one engine per actor. `sampling` holds the job's defaults (rows
    may override them). Resources per actor default to one GPU when this machine has CUDA,
    else a share of the CPUs (`fit_actors`); a CPU actor's torch threads default to its CPU
    reservation (at least one). `predictor` may be a subclass of EnginePredictor (the bench
    times the engine's start-up with one)."""
    check_int("concurrency", concurrency)
    check_int("batch_size", batch_size)
    from ray.data import ActorPoolStrategy

    if num_gpus is None:
        import torch

        num_gpus = 1 if torch.cuda.is_available() else 0
    import ray

    num_cpus = fit_actors(concurrency, num_cpus, num_gpus, ray.cluster_resources())
    if torch_threads is None and not num_gpus:
        torch_threads = max(1, int(num_cpus))  # a CPU engine computes on the CPUs it reserved
    return ds.map_batches(
        predictor,
        fn_constructor_kwargs={"engine_args": engine_args, "prompt_column": prompt_column,
                               "sampling": sampling, "torch_threads": torch_threads},
        batch_format="pyarrow", batch_size=batch_size,
        # Two calls (blocks) at once per actor, each with up to Ray Data's async batch
        # concurrency in flight: the next block's rows reach the engine before the last drains.
        compute=ActorPoolStrategy(size=concurrency, max_concurrent_calls_per_actor=2),
        num_cpus=num_cpus, num_gpus=num_gpus,
    )


def run_batch(input_path: str, output_path: str, engine_args: EngineArgs, **kwargs) -> int:
    """Parquet in -> generation -> Parquet out, preserving row order. Returns the row count."""
    import pyarrow.parquet as pq
    import ray

    if not os.path.exists(input_path):
        raise ValueError(f"input {input_path!r} does not exist (a Parquet file or directory)")
    require_model_dir(engine_args.model)
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # rows come out in input order
    ds = build_pipeline(ray.data.read_parquet(input_path), engine_args, **kwargs)
    if output_path.endswith(".parquet"):
        table = pa.concat_tables([ray.get(ref) for ref in ds.to_arrow_refs()], promote_options="default")
        os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
        pq.write_table(table, output_path)
        return table.num_rows
    ds = ds.materialize()
    ds.write_parquet(output_path)
    return ds.count()
