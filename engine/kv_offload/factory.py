"""Where the host tier joins an engine: the engine's KV connector factory, wrapped.

EngineCore wraps whatever factory it was given (none offline, the P/D connector's on a P/D
replica) when its config asks for a tier, so `LLM(model, kv_offloading_size=...)`, a core
process, data-parallel cores and every replica get one the same way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.errors import ParameterError
from engine.kv_cache.hybrid import kv_groups
from engine.kv_connector import KVConnectorBase, KVConnectorFactory, KVConnectorRole, spawn_safe
from engine.kv_offload.connector import STORE_BYTES_PER_STEP, OffloadConnector
from engine.kv_offload.multi import MultiConnector
from engine.models.arch import ModelArch


@dataclass(frozen=True)
class OffloadFactory:
    """Makes each side of the host tier, composed after `inner`'s connector when there is
    one. Plain data, so it pickles into rank processes and actors."""

    block_size: int
    capacity_blocks: int
    capacity_bytes: int
    store_blocks_per_step: int
    inner: KVConnectorFactory | None = None

    @property
    def spawn_safe(self) -> bool:
        return self.inner is None or spawn_safe(self.inner)

    def __call__(self, role: KVConnectorRole) -> KVConnectorBase:
        tier = OffloadConnector(role, self.block_size, self.capacity_blocks, self.capacity_bytes,
                                self.store_blocks_per_step)
        if self.inner is None:
            return tier
        # The inner connector first: a P/D transfer wins over the host tier for its prompt.
        return MultiConnector(role, [self.inner(role), tier])


def block_bytes(arch: ModelArch, dtype: torch.dtype, block_size: int) -> int:
    """Bytes of one block of every layer's K and V (what one host entry holds)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * itemsize


def with_offloading(config: EngineConfig, arch: ModelArch, dtype: torch.dtype,
                    factory: KVConnectorFactory | None) -> KVConnectorFactory | None:
    """`factory` with the host tier added when `config.kv_offload` asks for one."""
    offload = config.kv_offload
    if offload is None:
        return factory
    cc = config.cache
    spec = config.speculative
    groups = kv_groups(arch, disabled=cc.disable_hybrid_kv_cache_manager,
                       draft_model=bool(spec and spec.method == "draft_model"))
    if groups.main_window or groups.hybrid:
        raise ParameterError("kv_offloading_size", f"kv_offloading_size keeps whole prefixes; {arch.architecture} "
                             "has sliding-window layers, whose blocks out of the window are freed: pass "
                             "disable_hybrid_kv_cache_manager=True to keep them, or leave the tier off")
    per_block = block_bytes(arch, dtype, cc.block_size)
    capacity = offload.size_bytes // per_block
    if capacity < 1:
        raise ParameterError("kv_offloading_size", f"kv_offloading_size={offload.size_gb:g} GiB holds no KV "
                             f"block of this model ({per_block} bytes each); give at least "
                             f"{per_block / 2**30:.6f} GiB")
    host = OffloadFactory(cc.block_size, capacity, offload.size_bytes, max(1, STORE_BYTES_PER_STEP // per_block))
    # A factory whose own tier is slower than host memory (kvstore.shared_tier) places the host
    # tier before it, so a block both hold is loaded from host memory.
    compose = getattr(factory, "with_host_tier", None)
    if compose is not None:
        return compose(host)
    return dataclasses.replace(host, inner=factory)
