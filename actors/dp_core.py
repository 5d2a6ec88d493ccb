"""One data-parallel engine core as a Ray actor ("ray" data-parallel backend): an EngineCore
and its DPCoreLoop on a thread of the actor. With one rank its worker (and so the worker side
of a P/D connector) is in this actor too, which then answers the KV store's pulls.

The front end posts inputs with a sequence number (`post`), and the actor applies them in that
order whatever order Ray runs the calls in (a threaded actor does not promise it); the core's
messages go back on one streaming call (`messages`), read by a thread of the front end."""

from __future__ import annotations

import heapq
import queue
import socket
import threading
from collections.abc import Iterator
from datetime import timedelta

import ray
import torch

from actors.kv_exports import ServesKVExports
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.core_client.core_proc import WAKE
from engine.core_client.messages import CoreReady, Shutdown
from engine.distributed import DPPlacement
from engine.dp.control import DPControlGroup
from engine.dp.core_loop import DPCoreLoop
from engine.kv_connector import KVConnectorFactory

# The streaming call re-checks that the loop is alive this often while the core is quiet.
_QUIET_POLL_S = 1.0
_END = object()


def free_tcp_address() -> str:
    """A free TCP port on this node, as tcp://ip:port (a store some ranks rendezvous at)."""
    host = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    return f"tcp://{host}:{port}"


class DPCoreActor(ServesKVExports):
    def __init__(self, config: EngineConfig, kv_connector_factory: KVConnectorFactory | None,
                 executor_cls=None) -> None:
        self.config = config
        self.kv_connector_factory = kv_connector_factory
        self.executor_cls = executor_cls
        self.core: EngineCore | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._outbox: queue.Queue = queue.Queue()
        self._pending: list[tuple[int, int, object]] = []  # heap of inputs that came early
        self._next_seq = 0
        self._order = threading.Lock()
        self._thread: threading.Thread | None = None

    def rendezvous(self) -> tuple[str, str]:
        """Core 0 only: where the group's worker world and control group meet."""
        return free_tcp_address(), free_tcp_address()

    def start(self, dp: DPPlacement, control_init: str | None, collective_timeout_s: float,
              num_threads: int) -> CoreReady:
        torch.set_num_threads(num_threads)
        if self.config.model.device != "cpu" and torch.cuda.is_available():
            torch.cuda.set_device(0)  # Ray gave this actor its GPU(s) and made them the only ones visible
        # Its front end (LLMEngine over DPEngineClient) gives it the tokenizer.
        self.core = core = EngineCore(self.config, self.kv_connector_factory, self.executor_cls, dp=dp,
                                      tokenizer_from_front_end=True)
        timeout = timedelta(seconds=collective_timeout_s)
        control = DPControlGroup(dp.rank, dp.size, control_init, timeout) if control_init else None
        core.set_kv_wakeup(lambda: self._inbox.put(WAKE))
        transport = self._transport()
        if transport is not None:
            transport.warm_up(producer=self._connector().pd_role == "producer")
        loop = DPCoreLoop(core, dp.rank, control, self._outbox.put)
        self._thread = threading.Thread(target=self._run, args=(loop,), name="pdserve-dp-core", daemon=True)
        self._thread.start()
        return CoreReady(dp.rank, core.max_model_len, core.num_kv_blocks, core.arch.vocab_size)

    def _run(self, loop: DPCoreLoop) -> None:
        try:
            loop.run(self._inbox)
        finally:
            self._outbox.put(_END)

    def post(self, seq: int, message: object) -> None:
        """Input number `seq` (0, 1, 2, ... from the one front end), applied in order."""
        with self._order:
            heapq.heappush(self._pending, (seq, id(message), message))
            while self._pending and self._pending[0][0] == self._next_seq:
                self._inbox.put(heapq.heappop(self._pending)[2])
                self._next_seq += 1

    def messages(self) -> Iterator[object]:
        """Everything the core sends, until its loop ends (a Ray streaming generator)."""
        while True:
            try:
                message = self._outbox.get(timeout=_QUIET_POLL_S)
            except queue.Empty:
                continue
            if message is _END:
                return
            yield message

    # ---- the KV store's calls (a P/D producer core with one rank, in this actor) -----------
    def _kv_worker(self):
        """The in-process worker (one rank, "uni" executor); None with rank actors."""
        return getattr(self.core.executor, "worker", None) if self.core is not None else None

    def placement_group_id(self) -> str | None:
        """The placement group this core was placed in (hex id), for operators and tests."""
        pg = ray.get_runtime_context().get_placement_group_id()
        return pg if pg else None

    def ping(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Stop the loop and release the core's workers (rank actors, device memory)."""
        self._inbox.put(Shutdown())
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.core is not None:
            self.core.shutdown()
