"""Batch inference over Ray Datasets: `build_pipeline` (a Dataset in, one out) and `run_batch`
(Parquet in, Parquet out), one engine per actor (`EnginePredictor`), fed across batches."""

from cluster.batch.pipeline import EnginePredictor, build_pipeline, run_batch

__all__ = ["EnginePredictor", "build_pipeline", "run_batch"]
