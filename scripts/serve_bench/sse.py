"""Server-sent events: splitting a byte stream into `data:` payloads, reading chunks."""

from __future__ import annotations

import json


class SSEDecoder:
    """Splits a byte stream into the `data:` payloads of server-sent events.

    A `data:` line that is complete on its own (valid JSON or `[DONE]`, as OpenAI-style
    servers send) is emitted at once; otherwise data lines are joined and emitted at the blank
    line that ends the event, per the SSE format. Comments (`:`) and other fields are skipped.
    """

    def __init__(self) -> None:
        self._buf = b""
        self._pending: list[str] = []

    def feed(self, data: bytes) -> list[str]:
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        out: list[str] = []
        for raw in lines:
            self._line(raw.rstrip(b"\r").decode("utf-8", errors="replace"), out)
        return out

    def flush(self) -> list[str]:
        """Payloads still held at the end of the stream."""
        out: list[str] = []
        if self._buf:
            self._line(self._buf.rstrip(b"\r").decode("utf-8", errors="replace"), out)
            self._buf = b""
        self._dispatch(out)
        return out

    def _line(self, line: str, out: list[str]) -> None:
        if not line:
            self._dispatch(out)
            return
        if not line.startswith("data:"):
            return  # comment, event:, id:, retry:
        value = line[5:]
        if value.startswith(" "):
            value = value[1:]
        if not self._pending and _complete_payload(value):
            out.append(value)
        else:
            self._pending.append(value)

    def _dispatch(self, out: list[str]) -> None:
        if self._pending:
            out.append("\n".join(self._pending))
            self._pending = []


def _complete_payload(value: str) -> bool:
    if value.strip() == "[DONE]":
        return True
    try:
        json.loads(value)
    except ValueError:
        return False
    return True


def chunk_error(chunk) -> str | None:
    """The message of an error event (`{"error": ...}` or `{"object": "error", ...}`), else None."""
    if not isinstance(chunk, dict):
        return f"unexpected stream chunk: {str(chunk)[:200]}"
    err = chunk.get("error")
    if err:
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    if chunk.get("object") == "error":
        return str(chunk.get("message") or chunk)
    return None


def chunk_text(chunk: dict) -> str:
    return "".join((c.get("text") or "") for c in chunk.get("choices") or [] if isinstance(c, dict))
