"""Request bodies and the ingress's limits (cluster/http/body_limits.py, docs/serving.md#limits):
a body over --max-request-body-bytes is a 413 before it is read, one that arrives too slowly a
408, malformed or ill-typed ones 4xx and never 5xx, a full queue a 429, and a keep-alive
connection stays usable after any 4xx that read its body.

Most tests run the ingress's real FastAPI app under uvicorn without Serve
(tests/cluster/ingress_harness.py); tests/cluster/test_serve_front_door.py sends the same bodies
through Serve's HTTP proxy to a deployed app, to show the proxy hands the request to the app
before the body arrives."""

from __future__ import annotations

import base64
import http.client
import io
import json
import time

import pytest
import requests

from cluster.http.body_limits import MAX_REQUEST_BODY_BYTES, BodyLimits
from tests.cluster.helpers import ENGINE
from tests.cluster.ingress_harness import make_ingress, serve_ingress
from tests.cluster.raw_http import assert_openai_error, exchange, post_head

NAME = "m"
CHAT = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def served(tiny_model):
    s = serve_ingress(make_ingress(tiny_model, name=NAME))
    yield s
    s.stop()


@pytest.fixture
def limits(monkeypatch):
    """limits(max_bytes=..., timeout_s=...): put these body limits in force for one test."""
    from cluster.http import ingress as ingress_module

    def put(**kw):
        monkeypatch.setattr(ingress_module, "_body_limits", BodyLimits(**kw))

    return put


# ---- size ------------------------------------------------------------------------------------
def test_a_body_declared_over_the_limit_is_413_before_any_byte_of_it_is_sent(served):
    """Only the headers go out: an answer at all proves the body was not waited for."""
    status, headers, body, closed = exchange(served.port, post_head(served.port, 64 * MiB))
    assert status == 413 and headers["connection"] == "close" and closed
    assert_openai_error(body, 413, str(64 * MiB), str(MAX_REQUEST_BODY_BYTES), "--max-request-body-bytes")


def test_a_client_sending_a_64_mib_body_gets_the_413_and_its_session_goes_on(served):
    with requests.Session() as session:
        r = session.post(f"{served.url}/v1/completions", data=b"x" * (64 * MiB),
                         headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 413 and r.headers["connection"] == "close"
        assert_openai_error(r.json(), 413, "--max-request-body-bytes")
        assert session.post(f"{served.url}/v1/chat/completions", json=CHAT, timeout=30).status_code == 200


def test_a_chunked_body_is_cut_off_as_soon_as_it_passes_the_limit(served, limits):
    """The body never ends (no last chunk): the 413 comes once the bytes pass the limit."""
    limits(max_bytes=MiB)
    piece = b"x" * (64 * 1024)
    chunk = b"%x\r\n" % len(piece) + piece + b"\r\n"
    status, headers, body, closed = exchange(served.port, post_head(served.port, None), chunk * 17)
    assert status == 413 and headers["connection"] == "close" and closed
    assert_openai_error(body, 413, f"over {MiB} bytes")


def test_a_chunked_body_within_the_limit_is_served(served, limits):
    limits(max_bytes=MiB)
    data = json.dumps(CHAT).encode()
    chunks = b"".join(b"%x\r\n" % len(p) + p + b"\r\n" for p in (data[:10], data[10:])) + b"0\r\n\r\n"
    status, _, body, _ = exchange(served.port, post_head(served.port, None), chunks, closes=False)
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"


# ---- time ------------------------------------------------------------------------------------
def test_a_body_that_stops_arriving_is_cut_off_with_408_at_the_bound(served, limits):
    limits(timeout_s=1.0)
    start = time.monotonic()
    status, headers, body, closed = exchange(served.port, post_head(served.port, 100), b'{"model": "m"')
    waited = time.monotonic() - start
    assert status == 408 and headers["connection"] == "close" and closed
    assert_openai_error(body, 408, "within 1 s")
    assert 1.0 <= waited < 10.0, waited


# ---- bad bodies: 4xx in OpenAI's shape, never 5xx --------------------------------------------
def _deep_tool_arguments() -> bytes:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 5000}}
    return json.dumps({"model": NAME, "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}, {"role": "user", "content": "y"}]}).encode()


BAD_BODIES = [
    ("nested-100000", b"[" * 100_000 + b"]" * 100_000, 400, "nests too deeply"),
    ("invalid-utf8", b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "UTF-8"),
    ("truncated", b'{"model": "m", "messages": [', 400, "malformed JSON"),
    ("top-level-array", b"[]", 400, "dictionary or object"),
    ("model-not-a-string", json.dumps({**CHAT, "model": 3}).encode(), 400, "'model'"),
    ("messages-not-a-list", json.dumps({**CHAT, "messages": "hi"}).encode(), 400, "'messages'"),
    ("max-tokens-a-list", json.dumps({**CHAT, "max_tokens": [1]}).encode(), 400, "'max_tokens'"),
    ("temperature-nan", json.dumps({**CHAT, "temperature": float("nan")}).encode(), 400, "temperature"),
    # A tool call's arguments string is parsed for the template: nested past the parser's
    # depth it is kept as text (this one then exceeds the context).
    ("deep-tool-arguments", _deep_tool_arguments(), 400, "max_model_len"),
]


@pytest.mark.parametrize("body,status,needle", [b[1:] for b in BAD_BODIES], ids=[b[0] for b in BAD_BODIES])
def test_bad_bodies_are_4xx_in_openai_shape(served, body, status, needle):
    r = requests.post(f"{served.url}/v1/chat/completions", data=body,
                      headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    assert_openai_error(r.json(), status, needle)


def test_a_recursion_error_anywhere_in_a_route_is_a_400_not_a_500():
    """JSON nested just within the parser's depth can still take other code past Python's
    recursion limit: the ingress answers that as the client's error."""
    import asyncio

    from fastapi import FastAPI

    from cluster.http.errors import install_error_handlers

    deep = FastAPI()
    install_error_handlers(deep)

    @deep.post("/deep")
    async def route() -> dict:
        raise RecursionError("maximum recursion depth exceeded")

    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/deep", "headers": [], "query_string": b"",
             "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("c", 1), "root_path": ""}
    asyncio.run(deep(scope, receive, send))
    assert sent[0]["status"] == 400
    assert_openai_error(json.loads(sent[1]["body"]), 400, "nests too deeply")


@pytest.mark.parametrize("message", [
    {"role": "user", "content": None}, {"role": "system", "content": None}, {"role": "developer", "content": None},
    {"role": "tool", "tool_call_id": "c1", "content": None}, {"role": "user"},
], ids=["user", "system", "developer", "tool", "user-without-content"])
def test_a_message_other_than_an_assistants_with_null_content_is_400_naming_messages(served, message):
    body = {**CHAT, "messages": [message, {"role": "user", "content": "hi"}]}
    r = requests.post(f"{served.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages"
    assert_openai_error(r.json(), 400, f"a {message['role']} message needs content", "null", "messages.0")


def test_an_assistant_message_with_tool_calls_may_have_null_content(served):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = {**CHAT, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
            "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": "1"}]}
    r = requests.post(f"{served.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text


# ---- keep-alive ------------------------------------------------------------------------------
def test_a_keep_alive_connection_stays_usable_after_any_4xx_that_read_its_body(served, monkeypatch):
    """One connection: each 4xx, then a valid request on the same socket. The 401 and the 404
    of an unknown route never read their bodies; the server must still find the next request."""
    from cluster.http import ingress as ingress_module
    from cluster.http.auth import ApiKeyCheck, digest

    monkeypatch.setattr(ingress_module, "_api_keys", ApiKeyCheck([digest("sk-test")]))
    key = {"Authorization": "Bearer sk-test", "Content-Type": "application/json"}
    big = json.dumps({**CHAT, "padding": "x" * 200_000})
    bad = [
        ("POST", "/v1/chat/completions", b'{"model": ', key, 400),
        ("POST", "/v1/chat/completions", json.dumps({**CHAT, "messages": [{"role": "user"}]}), key, 400),
        ("POST", "/v1/chat/completions", json.dumps({**CHAT, "model": "other"}), key, 404),
        ("POST", "/v1/nowhere", big, key, 404),
        ("GET", "/v1/chat/completions", None, key, 405),
        ("POST", "/v1/chat/completions", big, {"Content-Type": "application/json"}, 401),
        ("POST", "/v1/completions", json.dumps({"model": NAME, "prompt": "x", "n": 129}), key, 400),
    ]
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    conn.connect()
    sock = conn.sock
    for method, path, body, headers, status in bad:
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        payload = json.loads(r.read())
        assert r.status == status and "error" in payload, (path, r.status, payload)
        assert r.getheader("connection") is None
        conn.request("POST", "/v1/chat/completions", body=json.dumps(CHAT), headers=key)
        ok = conn.getresponse()
        assert ok.status == 200 and json.loads(ok.read())["choices"], (path, ok.status)
        assert conn.sock is sock  # http.client reconnects silently: the same socket, never closed
    conn.close()


# ---- the queue --------------------------------------------------------------------------------
def test_a_full_queue_is_429_with_retry_after_and_the_connection_stays_usable(served):
    ing = served.ingress
    held = ing._admit(ing.max_pending)  # the ingress holds as many requests as it admits
    try:
        with requests.Session() as session:
            r = session.post(f"{served.url}/v1/chat/completions", json=CHAT, timeout=30)
            assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert_openai_error(r.json(), 429, "--max-pending-requests", code="rate_limit_exceeded")
            ing._release(held)
            assert session.post(f"{served.url}/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
    finally:
        ing._release(held)


# ---- images ------------------------------------------------------------------------------------
def _data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _chat_with_images(urls):
    from cluster.http.protocol import ChatCompletionRequest

    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return ChatCompletionRequest(model=NAME, messages=[{"role": "user", "content": parts}])


def test_images_over_the_limit_are_refused_before_any_is_decoded():
    from cluster.http.chat import load_images
    from cluster.http.errors import OpenAIError

    undecodable = "data:image/png;base64," + base64.b64encode(b"not an image").decode()
    with pytest.raises(OpenAIError) as e:
        load_images(None, 2, _chat_with_images([undecodable] * 3))
    assert e.value.status == 400 and e.value.param == "messages"
    assert "at most 2 images" in e.value.message and "limit_mm_per_prompt" in e.value.message


def test_a_decompression_bomb_is_a_400_naming_its_part():
    """A few KiB of PNG that declares 200 million pixels: PIL refuses to decode it."""
    from PIL import Image

    from cluster.http.chat import load_images
    from cluster.http.errors import OpenAIError

    bomb = _data_url(Image.new("1", (20_000, 10_000)))
    assert len(bomb) < 64 * 1024
    with pytest.raises(OpenAIError) as e:
        load_images(None, 4, _chat_with_images([bomb]))
    assert e.value.status == 400 and e.value.param == "messages[0].content[0].image_url.url"
    assert "pixels" in e.value.message


def test_an_image_over_the_pixel_bound_is_refused_from_its_header_naming_its_part(monkeypatch):
    """Within PIL's bound but over --max-image-pixels: refused before it is decoded."""
    from PIL import Image, ImageFile

    from cluster.http.chat import load_images
    from cluster.http.errors import OpenAIError

    big = _data_url(Image.new("1", (4_000, 3_000)))  # 12 million pixels, a few KiB of PNG
    decoded = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: decoded.append(self) or None)
    with pytest.raises(OpenAIError) as e:
        load_images(None, 4, _chat_with_images([big]), max_pixels=10_000_000)
    assert e.value.status == 400 and e.value.param == "messages[0].content[0].image_url.url"
    assert "4000 x 3000 = 12000000 pixels; at most 10000000" in e.value.message
    assert "--max-image-pixels" in e.value.message and not decoded
    assert len(load_images(None, 4, _chat_with_images([big]), max_pixels=12_000_000)) == 1 and decoded


# ---- configuration ------------------------------------------------------------------------------
def test_the_flag_sets_the_apps_body_limit_and_bad_bounds_name_their_field(tiny_model):
    from cluster.launch.app_config import AppConfig
    from cluster.launch.cli import build_parser
    from cluster.launch.serve_cli import _config
    from engine import EngineArgs
    from engine.errors import ParameterError

    cfg = _config(build_parser().parse_args(["serve", "--model", tiny_model, "--max-request-body-bytes", "4096"]))
    assert cfg.body_limits() == BodyLimits(4096, 60.0)
    assert _config(build_parser().parse_args(["serve", "--model", tiny_model])).max_request_body_bytes == 32 * MiB
    for field, value in (("max_request_body_bytes", 0), ("request_body_timeout_s", 0), ("request_body_timeout_s", -1)):
        with pytest.raises(ParameterError, match=field) as e:
            AppConfig(engine_args=EngineArgs(model=tiny_model, **ENGINE), **{field: value})
        assert e.value.field == field


def test_a_500_names_an_id_and_keeps_the_exception_in_the_log(caplog):
    """A fault of the server: the body says so with an id; the exception's text (paths,
    addresses, another request's data) goes only to the log, under that id."""
    import asyncio
    import json
    import logging

    from fastapi import FastAPI

    from cluster.http.errors import install_error_handlers

    broken = FastAPI()
    install_error_handlers(broken)

    @broken.get("/broken")
    async def route() -> dict:
        raise KeyError("/secret/path/of/the/server")

    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/broken", "headers": [], "query_string": b""}
    with caplog.at_level(logging.ERROR, logger="cluster.http.errors"):
        try:
            asyncio.run(broken(scope, receive, send))
        except KeyError:
            pass  # Starlette's server-error middleware re-raises after the handler answered
    assert sent[0]["status"] == 500
    error = json.loads(sent[1]["body"])["error"]
    assert "secret" not in error["message"] and error["type"] == "internal_server_error"
    error_id = error["message"].split("id ")[1].split(":")[0]
    assert error_id.startswith("err-")
    logged = [r for r in caplog.records if error_id in r.getMessage()]
    assert logged and "secret" in str(logged[0].exc_info[1])
