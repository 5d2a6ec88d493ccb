"""How `pdserve serve` and `pdserve batch` reach Ray: bounded, and one clear line on failure.

- RAY_ADDRESS=host:port: that cluster. Its GCS port must answer within CONNECT_TIMEOUT_S
  (else: nothing is listening there, say so). When a token is available the way Ray looks for
  one (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token) and RAY_AUTH_MODE is unset, token
  mode is switched on, as a head started on this machine with that file expects; a refused
  token is one line naming what to set.
- No RAY_ADDRESS: a live cluster recorded by `ray start --head` on this machine is joined; a
  recorded one that no longer answers is ignored (bare `ray.init()` would wait on it forever),
  and a fresh local Ray is started.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

CONNECT_TIMEOUT_S = 5.0
RECORDED_CLUSTER = Path("/tmp/ray/ray_current_cluster")


class RayConnectError(ValueError):
    """Ray could not be reached; the message says what to set (the CLI prints it as one line)."""


def _split(address: str) -> tuple[str, int] | None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> bool:
    hp = _split(address)
    if hp is None:
        return False
    try:
        with socket.create_connection(hp, timeout=timeout_s):
            return True
    except OSError:
        return False


def token_available(environ=os.environ, home: Path | None = None) -> bool:
    if environ.get("RAY_AUTH_TOKEN"):
        return True
    path = environ.get("RAY_AUTH_TOKEN_PATH")
    if path:
        return Path(path).is_file()
    return ((home or Path.home()) / ".ray" / "auth_token").is_file()


def recorded_address(path: Path = RECORDED_CLUSTER) -> str | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return text or None


def resolve_address(environ=os.environ, recorded: Path = RECORDED_CLUSTER,
                    timeout_s: float = CONNECT_TIMEOUT_S) -> str:
    """The address to pass to ray.init: RAY_ADDRESS's cluster (checked to answer), a live
    recorded local cluster, or "local" (start a fresh one)."""
    address = environ.get("RAY_ADDRESS", "").strip()
    if address and address not in ("auto", "local") and "://" not in address:
        if _split(address) is None:
            raise RayConnectError(f"RAY_ADDRESS={address!r} is not host:port (the head's GCS address, "
                                  f"e.g. 10.0.0.1:6379)")
        if not reachable(address, timeout_s):
            raise RayConnectError(f"cannot reach the Ray cluster at {address} (RAY_ADDRESS): nothing answered "
                                  f"within {timeout_s:g} s; start it (`ray start --head`) or fix RAY_ADDRESS")
        return address
    if address:
        return address  # ray://, auto or local: Ray's own meaning
    live = recorded_address(recorded)
    if live and reachable(live, min(timeout_s, 1.0)):
        return live
    return "local"


def connect(namespace: str = "pdserve", environ=os.environ, **init_kwargs) -> str:
    """ray.init on the resolved address; returns it. Failures are RayConnectError."""
    import ray

    address = resolve_address(environ)
    if address != "local" and "RAY_AUTH_MODE" not in environ and token_available(environ):
        _enable_token_mode(environ)
    if address == "local":
        init_kwargs.setdefault("include_dashboard", False)
    try:
        ray.init(address=address, namespace=namespace, **init_kwargs)
    except Exception as e:
        ray.shutdown()
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        if isinstance(e, ray.exceptions.AuthenticationError) or "uthentication" in text:
            raise RayConnectError(f"the Ray cluster at {address} refused this client's authentication: set "
                                  f"RAY_AUTH_MODE=token and its token in RAY_AUTH_TOKEN or ~/.ray/auth_token "
                                  f"({text})") from None
        hint = ""
        if environ.get("RAY_AUTH_MODE", "").lower() == "token" and address != "local" and reachable(address):
            # A token-auth GCS that rejects the token is seen by the client as "failed to
            # connect" after its retries: the port answers, so say what to check.
            hint = ("; the address answers, so check that RAY_AUTH_TOKEN (or ~/.ray/auth_token) holds the "
                    "cluster's token")
        raise RayConnectError(f"could not connect to Ray at {address}: {type(e).__name__}: {text}{hint}") from None
    return address


def _enable_token_mode(environ) -> None:
    """RAY_AUTH_MODE=token for this process (and its children). Ray caches its config when it
    is imported, so the cache is refreshed the way Ray's own `ray start` does it (an internal
    call, confined here)."""
    environ["RAY_AUTH_MODE"] = "token"
    try:
        from ray._raylet import Config

        Config.initialize("")
    except Exception as e:  # a Ray without it reads the variable at connect time
        import logging

        logging.getLogger(__name__).debug("could not refresh Ray's config: %s", e)
