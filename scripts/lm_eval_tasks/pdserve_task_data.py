"""The datasets of the pdserve lm-eval tasks: the JSONL files beside this file, read through
lm-eval's `custom_dataset` so that no hub and no working directory is involved."""

from __future__ import annotations

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def _test_split(filename: str):
    import datasets

    with open(os.path.join(HERE, filename), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def multiple_choice(**_metadata):
    """lm-eval passes the task's metadata as keyword arguments; the rows do not depend on it."""
    return _test_split("pdserve_mc.jsonl")


def generation(**_metadata):
    return _test_split("pdserve_gen.jsonl")
