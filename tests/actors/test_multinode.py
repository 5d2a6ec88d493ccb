"""Two Ray nodes on this machine with token authentication (a head and a second node joined by
`ray start --address`, each with its own ports and a custom resource): a P/D request with its
prefill on one node and its decode on the other moves the KV across nodes and gives HF's
greedy tokens; the driver reaches the head by RAY_ADDRESS=host:port with the token and no
RAY_AUTH_MODE; a wrong token is one clear error.

The nodes (this machine's node IP, as
Ray addresses local nodes) run `ray start --block` in their own process groups under a private temp dir (so no
other Ray on the machine records or joins them); they are stopped by process group, and any
process left in their session is killed by PID (never `ray stop`)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from tests.engine.hf_reference import hf_greedy, random_prompts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def _ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _node_flags(resource: str) -> list[str]:
    node, obj, agent, agent_grpc, metrics, rt_env, client = _ports(7)
    return ["--num-cpus=1", f"--resources={json.dumps({resource: 10})}",
            f"--node-manager-port={node}", f"--object-manager-port={obj}",
            f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={rt_env}", "--block"]


def _in_session(pid: int, temp_dir: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return temp_dir.encode() in f.read()
    except OSError:
        return False


def _wait_port(host: str, port: int, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)  # polling a port that is coming up, bounded
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def cluster():
    temp_dir = tempfile.mkdtemp(prefix="pdmn-", dir="/tmp")
    token = secrets.token_hex(16)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    env.pop("RAY_ADDRESS", None)
    # Ray turns a loopback address into this machine's node IP when it connects, so the nodes
    # are addressed by that IP.
    from ray.util import get_node_ip_address

    ip = get_node_ip_address()
    gcs, client, dashboard = _ports(3)
    procs = [subprocess.Popen([RAY, "start", "--head", f"--port={gcs}", "--include-dashboard=false",
                               f"--ray-client-server-port={client}", f"--dashboard-port={dashboard}",
                               f"--temp-dir={temp_dir}",
                               *_node_flags("node_a")], env=env, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        _wait_port(ip, gcs, "the head's GCS")
        procs.append(subprocess.Popen([RAY, "start", f"--address={ip}:{gcs}", *_node_flags("node_b")],
                                      env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        yield f"{ip}:{gcs}", token
    finally:
        for p in procs:  # a throwaway test cluster: no graceful stop needed
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=30)
        # Anything of this session still alive (daemons that left the group) goes by PID.
        for pid in [int(d) for d in os.listdir("/proc") if d.isdigit()]:
            if _in_session(pid, temp_dir):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _drive(address: str, env_extra: dict, model: str, prompt: list[int]) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(RAY_ADDRESS=address, PYTHONPATH=ROOT, **env_extra)
    # Both nodes must have joined before the request needs node_b: the driver's actors wait
    # for their resources, bounded by this timeout.
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "actors", "multinode_driver.py"), model,
                        json.dumps(prompt)], env=env, capture_output=True, text=True, timeout=540, cwd=ROOT)
    lines = [line for line in r.stdout.splitlines() if line.startswith("REPORT ")]
    assert lines, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
    return json.loads(lines[-1][len("REPORT "):])


def test_pd_across_two_token_auth_nodes_moves_the_kv_and_gives_hf_tokens(cluster, tiny_model):
    address, token = cluster
    prompt = random_prompts([40], 1000, seed=77)[0]
    report = _drive(address, {"RAY_AUTH_TOKEN": token}, tiny_model, prompt)  # no RAY_AUTH_MODE given
    assert "error" not in report, report
    assert report["nodes"] == 2
    assert report["prefill_node"] != report["decode_node"]
    assert report["bytes_in"] > 0  # the prompt's KV was loaded on the decode node
    assert report["tokens"] == hf_greedy(tiny_model, [prompt], 8)[0]


def test_a_wrong_token_is_one_clear_error(cluster, tiny_model):
    address, _ = cluster
    # Ray's client retries a refused connection for ~20 s; two retries are enough here.
    report = _drive(address, {"RAY_AUTH_TOKEN": "wrong" * 8, "RAY_gcs_server_port_wait_time_s": "2"},
                    tiny_model, [1, 2, 3])
    assert address in report["error"] and "RAY_AUTH_TOKEN" in report["error"]
    assert "\n" not in report["error"]
