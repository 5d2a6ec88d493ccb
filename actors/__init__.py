"""The Ray actors an engine spreads over: tensor-parallel ranks (`tp_rank.py`, placed by the
"ray" executor, `ray_executor.py`) and data-parallel cores (`dp_core.py`, placed by the "ray"
data-parallel backend, `dp_cores.py`). Importing those two backends registers them with the
engine's plugin registry (engine/plugins.py). The engine host that owns such an engine is
cluster/replica/host.py."""

import actors.dp_cores  # noqa: F401  (registers data_parallel_backend="ray")
import actors.ray_executor  # noqa: F401  (registers distributed_executor_backend="ray")
