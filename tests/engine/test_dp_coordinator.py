"""The front end's data-parallel coordinator: load balancing and request waves (pure logic)."""

from __future__ import annotations

from engine.core_client.messages import StartWave
from engine.dp.coordinator import DPCoordinator


def test_a_new_request_goes_to_the_least_loaded_core_waiting_counting_four_times():
    c = DPCoordinator(3, lockstep=False)
    c.on_figures(0, waiting=1, running=0)  # score 4
    c.on_figures(1, waiting=0, running=3)  # score 3
    c.on_figures(2, waiting=0, running=5)  # score 5
    assert c.route()[0] == 1


def test_requests_routed_since_a_report_count_as_waiting_so_a_burst_spreads():
    c = DPCoordinator(2, lockstep=False)
    ranks = [c.route()[0] for _ in range(6)]
    assert sorted(ranks) == [0, 0, 0, 1, 1, 1]
    c.on_figures(0, waiting=0, running=3)  # core 0 reported; core 1's three still count as waiting
    assert c.route()[0] == 0


def test_equally_loaded_cores_take_turns():
    c = DPCoordinator(3, lockstep=False)
    picks = []
    for _ in range(6):
        rank = c.route()[0]
        picks.append(rank)
        c.on_figures(rank, 0, 0)  # every core reports idle again at once
    assert picks == [0, 1, 2, 0, 1, 2]


def test_without_lockstep_there_are_no_waves():
    c = DPCoordinator(2, lockstep=False)
    assert c.route()[2] == []


def test_a_request_while_the_cores_are_paused_starts_a_wave_on_every_core():
    c = DPCoordinator(3, lockstep=True)
    rank, wave, starts = c.route()
    # The chosen core too: were its request aborted before it stepped, the others would wait for it.
    assert wave == 0 and starts == [(0, StartWave(0)), (1, StartWave(0)), (2, StartWave(0))]
    assert c.route()[2] == []  # the wave is under way
    c.on_wave_complete(0)
    rank, wave, starts = c.route()
    assert wave == 1 and [s.wave for _, s in starts] == [1, 1, 1]


def test_a_core_with_work_for_a_finished_wave_gets_the_others_to_join_the_next():
    c = DPCoordinator(3, lockstep=True)
    c.route()  # wave 0 under way, as far as the front end knows
    # The cores finished wave 0 before the request routed in it arrived at core 2, which asks
    # for wave 1 before the front end hears that wave 0 ended.
    assert c.on_start_wave_request(2, 1) == [(0, StartWave(1)), (1, StartWave(1))]
    c.on_wave_complete(0)  # old news now
    assert c.wave == 1 and c.cores_running
    assert c.route()[1:] == (1, [])


def test_a_start_request_for_the_wave_already_under_way_is_not_relayed_again():
    c = DPCoordinator(2, lockstep=True)
    c.on_wave_complete(0)
    c.route()  # starts wave 1 everywhere
    assert c.on_start_wave_request(1, 1) == []
