"""The worker side of pooling: each pooling request's prompt hidden states, chunk by chunk
as its prefill runs, reduced to one vector when the prompt's last position is computed.

State per request is O(hidden): a running sum (MEAN), the first position (CLS) or nothing
(LAST). A pooling request never has a prefix-cache hit (engine.kv_cache.manager), so every
position passes through here; a preempted one starts again from its first token.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from engine.pooling.config import PoolingModel
from engine.pooling.params import PoolingParams


class Pooler:
    def __init__(self, model: PoolingModel, dtype: torch.dtype, score_weight: torch.Tensor | None = None) -> None:
        self.model = model
        self.dtype = dtype  # the model's: an LM head (classifier "tokens") reads it
        self.score_weight = score_weight  # [num_labels, hidden] fp32 (classifier "score")
        self.params: dict[str, PoolingParams] = {}
        self.partial: dict[str, torch.Tensor] = {}  # [hidden] fp32: MEAN's sum, CLS's first

    @classmethod
    def load(cls, model: PoolingModel, model_dir: str, dtype: torch.dtype, device: torch.device) -> Pooler:
        """A classifier checkpoint's head (score.weight) is read here, beside the model."""
        weight = None
        if model.classifier == "score":
            weight = _checkpoint_tensor(model_dir, "score.weight").float().to(device)
            if weight.shape != (model.num_labels, model.hidden_size):
                raise ValueError(f"score.weight has shape {tuple(weight.shape)}, expected "
                                 f"({model.num_labels}, {model.hidden_size})")
        return cls(model, dtype, weight)

    def update(self, so) -> None:
        """The step's SchedulerOutput: finished and preempted requests drop their partial
        state (a resumed one starts over as a new request)."""
        for req_id in (*so.finished_req_ids, *so.preempted_req_ids):
            self.drop(req_id)
        for new in so.scheduled_new_reqs:
            if new.pooling_params is not None:
                self.add(new.req_id, new.pooling_params)

    def add(self, req_id: str, params: PoolingParams) -> None:
        self.params[req_id] = params
        self.partial.pop(req_id, None)

    def drop(self, req_id: str) -> None:
        self.params.pop(req_id, None)
        self.partial.pop(req_id, None)

    def mask(self, req_ids: list[str]) -> np.ndarray:
        """[R] which of the step's requests pool (they never sample)."""
        return np.fromiter((r in self.params for r in req_ids), dtype=bool, count=len(req_ids))

    def output_rows(self, req_ids: list[str], starts: np.ndarray, num_sched: np.ndarray,
                    num_prompt: np.ndarray, cu: np.ndarray) -> np.ndarray | None:
        """The step's tokens whose final hidden states this step pools ([N] ascending), when
        that is all the step needs: every request pools and the type reads one token (LAST:
        a prompt's last, CLS: its first). None: every token's (MEAN, or a request that does
        not pool). Empty is None too, so a step always computes some rows."""
        kind = self.model.pooling_type
        if kind == "MEAN" or not all(r in self.params for r in req_ids):
            return None
        if kind == "LAST":
            rows = (cu[1:len(req_ids) + 1] - 1)[starts + num_sched >= num_prompt]
        else:
            rows = cu[:len(req_ids)][starts == 0]
        return rows.astype(np.int64) if len(rows) else None

    def step(self, hidden: torch.Tensor, req_ids: list[str], starts: np.ndarray, num_sched: np.ndarray,
             num_prompt: np.ndarray, cu: np.ndarray, compute_logits,
             rows: np.ndarray | None = None) -> dict[str, torch.Tensor]:
        """Fold this step's positions in; returns the finished requests' outputs (fp32 on the
        CPU). hidden: [T, hidden], or with `rows` (output_rows) [N, hidden] of those tokens;
        the arrays are per request in step order, `starts` before this step's progress."""
        # Row of token t in `hidden`: itself, or its place among `rows`.
        at = None if rows is None else {int(t): j for j, t in enumerate(rows)}

        def row(t: int) -> torch.Tensor:  # [hidden] fp32
            return hidden[t if at is None else at[t]].float()

        done_ids, done_vecs = [], []
        kind = self.model.pooling_type
        for i, req_id in enumerate(req_ids):
            if req_id not in self.params:
                continue
            first, n = int(cu[i]), int(num_sched[i])
            if kind == "MEAN":  # every token (output_rows is None for MEAN)
                s = hidden[first:first + n].float().sum(dim=0)
                self.partial[req_id] = s if req_id not in self.partial else self.partial[req_id] + s
            elif kind == "CLS" and starts[i] == 0:
                self.partial[req_id] = row(first)
            if starts[i] + n < num_prompt[i]:
                continue  # a chunk before the prompt's end
            if kind == "LAST":
                vec = row(first + n - 1)
            elif kind == "MEAN":
                vec = self.partial.pop(req_id) / float(num_prompt[i])
            else:
                vec = self.partial.pop(req_id)
            done_ids.append(req_id)
            done_vecs.append(vec)
        if not done_ids:
            return {}
        out = self._finish(torch.stack(done_vecs), [self.params[r] for r in done_ids], compute_logits)
        return {r: out[j] for j, r in enumerate(done_ids)} if out is not None else {}

    def _finish(self, pooled: torch.Tensor, params: list[PoolingParams], compute_logits) -> torch.Tensor | list | None:
        """pooled [N, hidden] fp32 -> per request its embedding or scores (None off the
        driver rank under tensor parallelism, where compute_logits answers None)."""
        m = self.model
        if m.task == "classify":
            if m.classifier == "tokens":
                logits = compute_logits(pooled.to(self.dtype))  # [N, vocab]
                if logits is None:
                    return None
                logits = logits.float()[:, list(m.classifier_token_ids)]
                # Two tokens ("no", "yes"): the second's probability, softmax over the pair.
                logits = logits[:, 1:] - logits[:, :1] if logits.shape[1] == 2 else logits
            else:
                logits = pooled @ self.score_weight.t()
            scores = torch.sigmoid(logits) if logits.shape[1] == 1 else torch.softmax(logits, dim=-1)
            return scores.cpu()
        out = []
        for vec, p in zip(pooled, params):
            dims = p.dimensions or m.dimensions
            if dims is not None:
                vec = vec[:dims]
            if (p.normalize if p.normalize is not None else m.normalize):
                vec = F.normalize(vec, dim=-1)
            out.append(vec.cpu())
        return out


def _checkpoint_tensor(model_dir: str, name: str) -> torch.Tensor:
    from safetensors import safe_open

    from engine.models.loader import checkpoint_files

    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                if key == name or key.endswith("." + name):
                    return f.get_tensor(key)
    raise ValueError(f"checkpoint in {model_dir!r} has no {name} (a *ForSequenceClassification head)")
