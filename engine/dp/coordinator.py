"""The front end's view of its data-parallel cores (docs/parallel.md#routing-and-messages): which core
takes a new request, and the request waves of a lockstep group.

Load balancing: the least `4 * waiting + running`, from the figures each core sends after its
steps; requests routed to a core since its last figures count as waiting there (otherwise a
burst lands on whichever core looked idle at its last report). Ties go round-robin. With KV
events on, the cores' cached prefixes count too (docs/kv_cache.md#kv-aware-routing).

Waves (lockstep groups only, engine.config.ParallelConfig.lockstep): the cores step together
while any of them has work and pause together when none has, which ends wave w (core 0 reports
WaveComplete(w)). A request routed while the cores are paused starts the next wave: every core
is told to join it. A request that reaches a core after that core finished the wave it
was routed in (the front end had not heard yet) makes that core ask for a new wave, which the
coordinator relays to the others.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core_client.messages import StartWave
from engine.kv_cache.kv_routing import rank as kv_rank
from engine.kv_cache.prefix_index import PrefixIndex


@dataclass
class CoreFigures:
    waiting: int = 0
    running: int = 0
    routed_since_report: int = 0

    @property
    def score(self) -> int:
        return 4 * (self.waiting + self.routed_since_report) + self.running


class DPCoordinator:
    def __init__(self, size: int, lockstep: bool) -> None:
        self.size = size
        self.lockstep = lockstep
        self.cores = [CoreFigures() for _ in range(size)]
        self.wave = 0
        self.cores_running = False  # a wave is under way (as far as the front end knows)
        self._next = 0  # round-robin among equally loaded cores

    def route(self, kv: tuple[PrefixIndex, list[bytes]] | None = None
              ) -> tuple[int, int, list[tuple[int, StartWave]]]:
        """(core for a new request, the wave to tag it with, StartWave messages to send first).
        `kv`: the cores' prefix index and the prompt's block hashes, for KV-aware routing
        (engine.kv_cache.kv_routing): the core that would compute the least, load counted."""
        order = [(self._next + i) % self.size for i in range(self.size)]
        if kv is not None and kv[1]:
            index, hashes = kv
            rank = kv_rank([(r, self.cores[r].score) for r in order], lambda r: index.match(r, hashes),
                           len(hashes)).order[0]
        else:
            rank = min(order, key=lambda r: self.cores[r].score)
        self._next = (rank + 1) % self.size
        self.cores[rank].routed_since_report += 1
        starts: list[tuple[int, StartWave]] = []
        if self.lockstep and not self.cores_running:
            # The cores paused: all of them step from now on, the chosen one included (were its
            # request aborted before it ran, the others must still find it in their collectives).
            starts = [(r, StartWave(self.wave)) for r in range(self.size)]
            self.cores_running = True
        return rank, self.wave, starts

    def on_figures(self, rank: int, waiting: int, running: int) -> None:
        self.cores[rank] = CoreFigures(waiting, running)

    def on_wave_complete(self, wave: int) -> None:
        if wave >= self.wave:  # older news than a wave already started: nothing to do
            self.wave = wave + 1
            self.cores_running = False

    def on_start_wave_request(self, rank: int, wave: int) -> list[tuple[int, StartWave]]:
        """Core `rank` started `wave` for a request of its own while the others may have
        paused: tell them."""
        if wave > self.wave or not self.cores_running:
            self.wave = max(self.wave, wave)
            self.cores_running = True
            return [(r, StartWave(self.wave)) for r in range(self.size) if r != rank]
        return []
