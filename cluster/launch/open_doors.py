"""Refuse to serve an app without API keys on an address others can reach.

Without keys every route is open, `POST /scale` and the LoRA routes among them: anyone who
reaches the port can add or remove replicas. On a loopback address that is the machine's own
users; on any other (`0.0.0.0`, a LAN or public address) it is the network. Such an app
starts only with keys (`--api-key`, PDSERVE_API_KEY, `api_keys`) or with the explicit opt-out
`allow_unauthenticated_admin: true` (`--allow-unauthenticated-admin`). Checked when the app is
built (`serve deploy`, `serve run`, `pdserve serve`), against the HTTP host Serve was started
with (docs/operations.md#api-keys).
"""

from __future__ import annotations

import ipaddress
import logging

from engine.errors import ParameterError

logger = logging.getLogger(__name__)
_ASK_TIMEOUT_S = 10.0


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it resolves wherever it resolves, so not known to be local
        return False


def check_open_admin(has_keys: bool, allowed: bool, http_host: str | None) -> None:
    """ParameterError when an app without keys would listen on a non-loopback `http_host`,
    unless `allowed`. An unknown host (Serve's config could not be read) is let through with
    a warning: refusing every start because of it would be worse."""
    if has_keys or allowed:
        return
    if http_host is None:
        logger.warning("Serve's HTTP host is unknown: if it is reachable from other machines, anyone there can "
                       "call POST /scale; set api_keys (PDSERVE_API_KEY)")
        return
    if not is_loopback(http_host):
        raise ParameterError(
            "api_keys", f"Serve listens on {http_host!r}, which other machines can reach, and the app has no API "
                        "keys: anyone reaching the port could call POST /scale and the LoRA routes. Set keys "
                        "(--api-key, PDSERVE_API_KEY in the environment that builds the app, or api_keys), bind "
                        "127.0.0.1, or opt out with allow_unauthenticated_admin: true "
                        "(--allow-unauthenticated-admin)")


def serve_http_host() -> str | None:
    """The host Serve's HTTP proxy binds, from its controller; None when it cannot be asked."""
    import ray

    if not ray.is_initialized():  # asking would start a Ray of its own
        return None
    try:
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        return ray.get(controller.get_http_config.remote(), timeout=_ASK_TIMEOUT_S).host
    except Exception as e:  # no Serve yet, an older controller: unknown
        logger.debug("Serve's HTTP host unknown: %r", e)
        return None
