"""`pdserve serve` as a subprocess (compare mode): start, wait for /health, stop."""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import time

from scripts.serve_bench import BenchError
from scripts.serve_bench.client import http_get

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_ray(num_cpus: int, env: dict[str, str] | None = None) -> None:
    """A local Ray for an in-process Serve app: its workers get pdserve's Serve environment
    (cluster.launch.serve_env) and `env`, while this driver's own handles stay synchronous
    (tests/conftest.py does the same). Ray and Serve are imported only after it: they read
    some of that environment when imported."""
    from cluster.launch.serve_env import configure_serve_env

    before = set(os.environ)
    os.environ.update(env or {})
    configure_serve_env()
    import ray

    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    for name in set(os.environ) - before:
        del os.environ[name]


def server_command(mode: str, port: int, model: str | None, num_kv_blocks: int | None,
                   served_model: str | None, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "cluster.launch.cli", "serve", "--mode", mode, "--port", str(port)]
    if model:
        cmd += ["--model", model]
    if num_kv_blocks is not None:
        cmd += ["--num-kv-blocks", str(num_kv_blocks)]
    if served_model:
        cmd += ["--served-model-name", served_model]
    return cmd + list(extra)


def _log_tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError as e:
        return f"(cannot read {path}: {e})"


class ServerProcess:
    """`pdserve serve` in its own process group, output to a log file."""

    def __init__(self, cmd: list[str], log_path: str) -> None:
        self.cmd, self.log_path = cmd, log_path
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
        self._log = open(log_path, "wb")  # closed in stop()
        try:
            self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=self._log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            self._log.close()
            raise BenchError(f"cannot start {cmd[0]}: {e}") from e

    def wait_ready(self, url: str, deadline_s: float) -> None:
        """Poll GET /health until 200; fail if the process exits or the deadline passes."""
        t_end = time.monotonic() + deadline_s
        last = "no answer yet"
        while time.monotonic() < t_end:
            code = self.proc.poll()
            if code is not None:
                raise BenchError(f"server exited with code {code} before it was ready; "
                                 f"log {self.log_path}:\n{_log_tail(self.log_path)}")
            try:
                status, body = http_get(f"{url}/health", timeout_s=2.0)
                if status == 200:
                    return
                last = f"HTTP {status} {body[:100]}"
            except OSError as e:  # refused / reset while starting
                last = str(e)
            except http.client.HTTPException as e:
                # Not HTTP: something else took the port between free_port() and the server's
                # bind (a Ray daemon's gRPC port); the server then fails to bind and exits.
                last = f"not an HTTP answer on {url}: {e!r}"[:200]
            time.sleep(1.0)
        raise BenchError(f"server not ready after {deadline_s:g} s ({last}); "
                         f"log {self.log_path}:\n{_log_tail(self.log_path)}")

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGINT, then SIGTERM/SIGKILL to its group if it does not exit in time."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGINT)
                try:
                    self.proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    print(f"server did not exit {timeout_s:g} s after SIGINT; terminating",
                          file=sys.stderr)
                    self._signal_group(signal.SIGTERM)
                    try:
                        self.proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        self._signal_group(signal.SIGKILL)
                        self.proc.wait(timeout=10)
            self._signal_group(signal.SIGTERM)  # stragglers it left in its group
        finally:
            self._log.close()

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)
