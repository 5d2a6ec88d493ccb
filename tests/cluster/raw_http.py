"""Raw HTTP/1.1 on a socket, for the body-limit tests: heads with a declared or chunked body,
bodies sent in parts, and what the server answered (and whether it then closed)."""

from __future__ import annotations

import http.client
import json
import socket


def post_head(port: int, length: int | None, path: str = "/v1/chat/completions", headers: dict | None = None) -> bytes:
    """The head of a POST whose body follows (`length` declared, or chunked when None)."""
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"{extra}{framing}\r\n\r\n").encode()


def exchange(port: int, *parts: bytes, timeout_s: float = 20.0, closes: bool = True):
    """Send `parts` on a new connection, then read one response (bounded by `timeout_s`):
    (status, headers, body as JSON, whether the server then closed the connection, looked at
    only when `closes` says it should)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        for part in parts:
            sock.sendall(part)
        response = http.client.HTTPResponse(sock)
        response.begin()
        body = json.loads(response.read())
        closed = None
        if closes:
            try:
                closed = sock.recv(1) == b""
            except ConnectionResetError:
                # Closed with bytes of ours still unread (the rest of a body it refused): the
                # kernel answers with a reset instead of an orderly end. Closed all the same.
                closed = True
            except TimeoutError:
                closed = False
        return response.status, response.headers, body, closed


def assert_openai_error(body: dict, status: int, *needles: str, code: str | None = None) -> str:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == (code or status), body
    for needle in needles:
        assert needle in err["message"], err["message"]
    return err["message"]
