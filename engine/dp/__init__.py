"""Data parallelism (docs/parallel.md#data-parallel): N engine cores, each with its own scheduler and KV cache,
behind one front end.

- `coordinator.DPCoordinator` (front end): which core takes a new request (least
  4 * waiting + running, from the figures each core sends with its steps) and the request
  waves of lockstep groups.
- `core_loop.DPCoreLoop` (one per core): the core's busy loop; under expert parallelism it
  keeps stepping while any core has work (a forward pass on no tokens when it has none of its
  own) and ends a wave when an all-reduce over the cores finds no unfinished request.
- `client.DPEngineClient` (front end): what the LLMEngine drives instead of one EngineCore.
- Cores run as processes (`mp_cores`, "mp") or as Ray actors (registered from `actors`, "ray":
  the engine never imports Ray).
"""
