"""Helpers for the HTTP tests: polling with a deadline, load threads that report, SSE parsing,
leak checks, free ports, processes and listeners read from /proc."""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import requests

# Engine sizes for the app tests: few blocks, so a leaked block is visible.
ENGINE = {"max_model_len": 512, "num_kv_blocks": 96, "max_num_seqs": 16}


def wait_for(fn, what: str, timeout_s: float = 60.0, interval_s: float = 0.05):
    """Poll `fn` until it returns a truthy value (bounded: fails the test on timeout)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


async def until(fn, what: str, timeout_s: float = 30.0, interval_s: float = 0.001):
    """wait_for on an event loop: poll `fn` (bounded), letting the loop's other tasks run
    between tries. For a state that tasks reach by themselves, not by the loop's turn order."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not (last := fn()):
        if loop.time() >= deadline:
            raise AssertionError(f"timed out waiting for {what}; last: {last!r}")
        await asyncio.sleep(interval_s)
    return last


class LoadThreads:
    """Client threads that send requests until stopped: thread `worker` calls
    `send(worker, i)` for i = 0, 1, ..., one request a call. `send` raises on any answer the
    test does not expect (a reset or timeout raises in `requests`; a 5xx, a malformed 200 or a
    wrong text fails its own checks). The first error stops every thread and fails the test:
    at `check()`, which a test calls while it waits (so it fails at once, not at a timeout),
    and at the end of the `with` block, which also fails when a thread outlives its bound.

        with LoadThreads(send, 3) as load:
            wait_for(lambda: load.check() or enough(), "traffic", 60)
    """

    def __init__(self, send: Callable[[int, int], None], workers: int, join_timeout_s: float = 120.0,
                 name: str = "load"):
        self.join_timeout_s = join_timeout_s
        self.errors: list[tuple[str, BaseException]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(send, w), name=f"{name}-{w}", daemon=True)
                         for w in range(workers)]

    def _run(self, send: Callable[[int, int], None], worker: int) -> None:
        i = 0
        try:
            while not self._stop.is_set():
                send(worker, i)
                i += 1
        except BaseException as e:  # noqa: BLE001 - kept, and raised in the test's thread
            with self._lock:
                self.errors.append((threading.current_thread().name, e))
            self._stop.set()

    def check(self) -> None:
        """Raise the first error a thread met (None while all is well)."""
        with self._lock:
            errors = list(self.errors)
        if errors:
            name, first = errors[0]
            summary = "; ".join(f"{n}: {e!r}" for n, e in errors)
            raise AssertionError(f"{len(errors)} load thread(s) failed: {summary}") from first

    def __enter__(self) -> LoadThreads:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        deadline = time.monotonic() + self.join_timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.check()
        alive = [t.name for t in self._threads if t.is_alive()]
        assert not alive, f"load threads still sending {self.join_timeout_s} s after the stop: {alive}"


def in_thread(fn: Callable, *args) -> Future:
    """Run fn(*args) in a daemon thread. `result(timeout)` on the returned future waits, bounded,
    and raises what fn raised, so a helper thread cannot fail unseen."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting test
            future.set_exception(e)

    threading.Thread(target=run, name=f"in-thread-{getattr(fn, '__name__', 'fn')}", daemon=True).start()
    return future


def wait_http_ok(url: str, timeout_s: float = 120.0) -> None:
    def ok():
        try:
            return requests.get(url, timeout=5).status_code == 200
        except requests.RequestException:
            return False

    wait_for(ok, f"{url} to answer 200", timeout_s, 0.2)


def sse_events(response) -> list:
    """The `data:` payloads of an SSE response, JSON-decoded except the final [DONE]."""
    events = []
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def replicas(url: str) -> list[dict]:
    """Every replica's latest report from GET /status, with its role."""
    # A bound, not a wait: a loaded 2-core machine (two xdist workers) took over 10 s to answer.
    status = requests.get(f"{url}/status", timeout=30).json()
    return [{**r, "role": role} for role in ("prefill", "decode", "colocated") for r in status.get(role, [])]


def assert_no_leaks(url: str, app_name: str, roles: set[str]) -> None:
    """Every replica reports all KV blocks free, nothing queued or running and no handed-back
    prompt KV held, and the app's KV store holds no transfer. Replica figures arrive with Serve's routing-stats rounds, so
    this polls (bounded) for reports made after the call, which must show that state."""
    import ray

    from kvstore.store_actor import STORE_NAMESPACE, store_name

    since = time.time()

    def clean():
        reps = [r for r in replicas(url) if r["time"] > since]
        if {r["role"] for r in reps} != roles:
            return False
        # kv_handoffs: prompt KV a prefill holds for its reply, or an ingress for its decode.
        return all(r["free_blocks"] == r["total_blocks"] and r["running"] == 0 and r["waiting"] == 0
                   and r.get("kv_handoffs", 0) == 0 for r in reps)

    wait_for(clean, "every replica to report no running request and all KV blocks free", 30)
    if "prefill" in roles:
        store = ray.get_actor(store_name(app_name), namespace=STORE_NAMESPACE)
        wait_for(lambda: ray.get(store.stats.remote())["live_transfers"] == 0, "no live KV transfer", 30)


def metric_value(url: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def serve_logs(app_name: str, deployment: str) -> list[str]:
    """The text of each Serve replica log of `deployment` in `app_name` (this Ray session)."""
    import glob

    import ray

    logs = os.path.join(ray._private.worker._global_node.get_logs_dir_path(), "serve")
    paths = sorted(glob.glob(os.path.join(logs, f"replica_{app_name}_{deployment}_*.log")))
    texts = []
    for path in paths:
        with open(path) as f:
            texts.append(f.read())
    return texts


# Ports for the servers tests start: below Linux's ephemeral range (32768-60999), where the
# kernel puts every outgoing connection and every port-0 bind (Ray's own ports among them), and
# above Ray's worker ports (10002-19999). A port-0 pick lies in the ephemeral range, so it could
# be taken by some connection before the server bound it (HAProxy then exits: "Address already
# in use"); a pick here is only ever taken by another test's pick.
PORT_RANGE = (20000, 29999)
_PORTS = random.SystemRandom()  # not the module's generator, which a test may have seeded


def free_port() -> int:
    """A port in PORT_RANGE that 127.0.0.1 can bind now, chosen at random (two xdist workers
    picking at once rarely meet)."""
    for _ in range(500):
        port = _PORTS.randint(*PORT_RANGE)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORT_RANGE[0]}-{PORT_RANGE[1]} after 500 tries")


def proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name: [state, ppid, pgrp, session, ...]."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()


def process_tree(root: int) -> dict[int, str]:
    """{pid: start time} of every live process below `root`; the start time tells a pid that
    was reused from the process recorded here."""
    parent_of = {int(p): st for p in os.listdir("/proc") if p.isdigit() and (st := proc_stat(int(p)))}
    tree, todo = {}, [root]
    while todo:
        parent = todo.pop()
        for pid, st in parent_of.items():
            if int(st[1]) == parent and st[0] != "Z":
                tree[pid] = st[19]
                todo.append(pid)
    return tree


def running(pid: int, start: str | None = None) -> bool:
    """`pid` is alive (not a zombie) and, given its start time, still the same process."""
    st = proc_stat(pid)
    return st is not None and st[0] != "Z" and start in (None, st[19])


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def listeners(port: int) -> list[str]:
    """Who listens on TCP `port` (any address): the command lines owning such sockets."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{cols[9]}]")
    owners = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            if inodes & {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}:
                owners.append(f"{pid}: {cmdline(int(pid))}")
        except OSError:
            continue
    return owners or sorted(inodes)


def hf_text(model: str, prompt: str, max_tokens: int) -> str:
    """Hugging Face's greedy continuation of `prompt` (the oracle of the served text)."""
    from transformers import AutoTokenizer

    from tests.engine.hf_reference import hf_greedy

    tokenizer = AutoTokenizer.from_pretrained(model)
    out = hf_greedy(model, [tokenizer(prompt)["input_ids"]], max_tokens)[0]
    return tokenizer.decode(out, skip_special_tokens=True)


def tiny_app(model: str, mode: str, name: str, app_name: str, engine: dict | None = None, **fields):
    """The AppConfig of a module's app on the suite's tiny model, in `mode`: in P/D every
    prompt is disaggregated whatever its length or the load, so the P/D path is what is tested
    (unless `fields` set the local-prefill rule themselves)."""
    from cluster.launch.app_config import AppConfig
    from engine import EngineArgs

    pd = {"local_prefill_queue": 0, "max_local_prefill_length": 0} if mode == "pd" else {}
    return AppConfig(engine_args=EngineArgs(model=model, **{**ENGINE, **(engine or {})}), mode=mode,
                     served_model_name=name, app_name=app_name, replica_num_cpus=0, **{**pd, **fields})


class RecordingStore:
    """A stand-in for the KV store actor's handle: records the transfers the caller releases."""

    def __init__(self) -> None:
        self.released: list[str] = []
        self.release = self

    def remote(self, transfer_id: str):
        self.released.append(transfer_id)

        async def done():
            return None
        return done()


SHARED_NAME = "tiny"


def shared_app_config(model: str, mode: str, lora_a1: str):
    """The app the question-asking modules share (tests/cluster/conftest.py, shared_app): what
    each of them needs at once. A context of 1024 (the tools' JSON is long in the tiny
    tokenizer's tokens), hermes tool parsing for tool_choice "auto", and LoRA with adapter a1
    served from the start and run-time loading; base-model requests run through the LoRA layers
    with no adapter, as they do on a vLLM server started with --enable-lora. Two replicas of the
    routed role (prefill, or colocated) under KV-aware routing (--router-mode kv), each engine
    with a host KV tier (--kv-offloading-size)."""
    routed = {"prefill_replicas": 2} if mode == "pd" else {"colocated_replicas": 2}
    return tiny_app(model, mode, SHARED_NAME, f"shared-{mode}",
                    engine={"max_model_len": 1024, "enable_lora": True, "max_loras": 2, "max_lora_rank": 16,
                            "kv_offloading_size": 0.125},
                    enable_auto_tool_choice=True, tool_call_parser="hermes", lora_modules=(f"a1={lora_a1}",),
                    enable_lora_runtime_updating=True, router_mode="kv", **routed)


# The app of `shared_direct_app` (tests/cluster/conftest.py).
DIRECT_APP = "pddirect"
DIRECT_NAME = "pd-direct-model"
# engine_step_timeout_s: test_pd_fallback stops a core and waits this long for the watchdog.
# Every module on the shared app runs under it, structured outputs included, on a loaded
# 2-core machine: 10 s leaves their slowest steps (well under a second here) a wide margin.
DIRECT_STEP_TIMEOUT_S = 10.0
DIRECT_SHORT = 3  # max_local_prefill_length: test_serve_pd's short prompts prefill on their decode replica


def shared_direct_app_config(model: str):
    """P/D with direct streaming (the ingress is the decode replica), every engine core in a
    child process, every prompt of more than DIRECT_SHORT tokens disaggregated whatever the
    load, health checks every second (the kill tests wait on failed ones), and room for a
    second decode replica (the scale test)."""
    return tiny_app(model, "pd", DIRECT_NAME, DIRECT_APP,
                    engine={"engine_core_process": True, "engine_step_timeout_s": DIRECT_STEP_TIMEOUT_S},
                    direct_streaming=True, health_check_period_s=1.0, max_replicas=2,
                    max_local_prefill_length=DIRECT_SHORT)


def openai_client(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def assert_plain_and_streamed_answer(client, model: str, prompt: str, expected: str, max_tokens: int = 10) -> None:
    """A greedy completion answers `expected`, plain and streamed alike."""
    args = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
    assert client.completions.create(**args).choices[0].text == expected
    with client.completions.create(**args, stream=True) as s:
        assert "".join(c.choices[0].text for c in s) == expected


def answers_exactly(client, model: str, prompt: str, expected: str, max_tokens: int = 10):
    """A check for wait_for: False while the server answers 5xx or drops the connection (a
    replica being replaced: with direct streaming that is the HTTP server itself), True once
    it answers `expected`; a 4xx or a wrong 200 fails the test at once."""
    import openai

    def check() -> bool:
        try:
            r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
        except openai.APIStatusError as e:
            assert e.status_code >= 500  # never a 4xx for a good request
            return False
        except openai.APIConnectionError:  # APITimeoutError included
            return False
        assert r.choices[0].text == expected  # never a wrong 200
        return True
    return check


def deployment_processes(deployment: str, app_name: str) -> dict:
    """`processes()` of a replica of `deployment`: its pid and its engine core processes'."""
    from ray import serve

    return serve.get_deployment_handle(deployment, app_name).processes.remote().result(timeout_s=30)


def engine_core_of(deployment: str, app_name: str) -> int:
    """The one engine core process of a replica of `deployment`, checked to be that replica's
    child (--engine-core-process, --direct-streaming)."""
    procs = deployment_processes(deployment, app_name)
    [core] = procs["engine_cores"]
    assert core != procs["replica"] and int(proc_stat(core)[1]) == procs["replica"]  # its child
    return core


def kill_core_then_answers_again(url: str, deployment: str, app_name: str, model: str, prompt: str,
                                 expected: str) -> None:
    """SIGKILL a replica's engine core process: the next request is answered `expected` (a
    prefill engine's is prefilled on its decode engine; one on a dead decode or colocated
    engine waits for Serve's replacement, docs/pd.md#decode-migration) or, where nothing took
    it within the migration's bound, a 5xx; never a hang or a wrong 200. Serve's health check
    replaces the replica, which answers `expected`."""
    import signal

    import openai

    old = deployment_processes(deployment, app_name)
    os.kill(old["engine_cores"][0], signal.SIGKILL)
    client = openai_client(url)
    try:
        text = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0).choices[0].text
        assert text == expected
    except openai.APIStatusError as e:
        assert e.status_code >= 500, e
    # A dead prefill engine's prompts fall back at once, so answers alone do not show the
    # replacement: wait for the replica itself to change too.
    def replaced() -> bool:
        try:
            return deployment_processes(deployment, app_name)["replica"] != old["replica"]
        except Exception:  # noqa: BLE001 - no replica answers while Serve replaces it: ask again
            return False
    wait_for(replaced, "Serve to replace the replica", 180, 1.0)
    wait_for(answers_exactly(client, model, prompt, expected), "a replaced replica to answer", 180, 2.0)


def engine_request(request_id: str = "r", ids=(1, 2), params=None, **fields):
    """An EngineRequest as an ingress builds it (max_tokens resolved), for tests whose engines
    are stand-ins; `fields`: any other EngineRequest field."""
    from engine.engine_request import EngineRequest
    from engine.sampling_params import SamplingParams

    return EngineRequest(request_id, list(ids), params or SamplingParams(max_tokens=4), **fields)
