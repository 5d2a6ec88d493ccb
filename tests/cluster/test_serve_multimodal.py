"""Images over HTTP: OpenAI chat image_url parts and Anthropic image blocks against a colocated
LLaVA app, driven by the official openai and anthropic clients. Oracles: HF LLaVA greedy text,
the same chat request's prompt tokens, the OpenAI and Anthropic error shapes, the replicas' KV
figures and the encoder-cache counters on /metrics."""

from __future__ import annotations

import base64
import io

import pytest
import requests

from tests.cluster.helpers import ENGINE, assert_no_leaks, metric_value, wait_for
from tests.engine.mm_reference import hf_llava, hf_llava_greedy, image

APP = "mmtest"
NAME = "tiny-llava"
MAX_TOKENS = 8


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _data_url(img) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(img)).decode()


def _messages(url: str, text: str = "What is in this picture?", text_first: bool = False) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    return [{"role": "user", "content": parts[::-1] if text_first else parts}]


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def app(deploy, llava_model, media_dir):
    from cluster.launch.app_config import AppConfig
    from engine import EngineArgs

    cfg = AppConfig(engine_args=EngineArgs(model=llava_model, allowed_local_media_path=str(media_dir), **ENGINE),
                    mode="colocated", served_model_name=NAME, app_name=APP, replica_num_cpus=0)
    return deploy(cfg)


@pytest.fixture(scope="module")
def client(app):
    from openai import OpenAI

    return OpenAI(base_url=f"{app}/v1", api_key="unused", max_retries=0)


def _expected(llava_model, img, text="What is in this picture?", text_first: bool = False) -> str:
    processor, _ = hf_llava(llava_model)
    parts = [{"type": "image"}, {"type": "text", "text": text}]
    conv = [{"role": "user", "content": parts[::-1] if text_first else parts}]
    prompt = processor.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    tokens = hf_llava_greedy(llava_model, prompt, [img], MAX_TOKENS)
    return processor.tokenizer.decode(tokens, skip_special_tokens=True)


def _chat(client, messages):
    return client.chat.completions.create(model=NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0)


def test_chat_with_a_data_url_image_equals_hf(client, llava_model):
    img = image(20)
    r = _chat(client, _messages(_data_url(img)))
    assert r.choices[0].message.content == _expected(llava_model, img)
    assert r.usage.prompt_tokens > 16  # the image's placeholders count as prompt tokens


def test_repeated_image_hits_the_encoder_cache(app, client, llava_model):
    img = image(21)
    # Different text before the image: the prefix cache cannot cover the image's placeholders,
    # so the second request needs the encoder output and finds it cached.
    before = metric_value(app, "pdserve:encoder_cache_hits_total")
    first = _chat(client, _messages(_data_url(img), "Describe it", text_first=True))
    second = _chat(client, _messages(_data_url(img), "Name the colours", text_first=True))
    assert first.choices[0].message.content == _expected(llava_model, img, "Describe it", True)
    assert second.choices[0].message.content == _expected(llava_model, img, "Name the colours", True)
    wait_for(lambda: metric_value(app, "pdserve:encoder_cache_hits_total") >= before + 1,
             "the second request's image to count as an encoder cache hit", 30)


def test_a_file_url_under_the_allowed_path_is_read(client, llava_model, media_dir):
    img = image(22)
    path = media_dir / "pic.png"
    path.write_bytes(_png(img))
    r = _chat(client, _messages(f"file://{path}"))
    assert r.choices[0].message.content == _expected(llava_model, img)


BAD_URLS = [
    ("https://example.com/cat.png", "not fetched"),
    ("file:///etc/hostname", "outside the allowed"),
    ("data:text/plain;base64,aGVsbG8=", "data:image/<type>;base64"),
    ("data:image/png;base64,!!!not-base64!!!", "base64 payload is invalid"),
    ("data:image/png;base64," + base64.b64encode(b"not a png at all").decode(), "cannot be decoded"),
]


@pytest.mark.parametrize("url,match", BAD_URLS)
def test_bad_image_urls_are_400_naming_the_part(app, url, match):
    body = {"model": NAME, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}}]}], "max_tokens": 4}
    r = requests.post(f"{app}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages[0].content[1].image_url.url"
    assert match in err["message"]


def test_too_many_images_is_400_on_messages(app):
    url = _data_url(image(23))
    content = [{"type": "image_url", "image_url": {"url": url}}] * 5
    body = {"model": NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    r = requests.post(f"{app}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages" and "at most 4 images" in r.json()["error"]["message"]


def _anthropic_image(source: dict, text: str = "What is in this picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": text}]}]


def _base64_source(img) -> dict:
    return {"type": "base64", "media_type": "image/png", "data": base64.b64encode(_png(img)).decode()}


def test_anthropic_image_blocks_answer_as_chat_and_hf(app, client, llava_model, media_dir):
    from anthropic import Anthropic

    anthropic = Anthropic(base_url=app, api_key="unused", max_retries=0)
    img = image(24)
    path = media_dir / "block.png"
    path.write_bytes(_png(img))
    chat = _chat(client, _messages(_data_url(img)))
    for source in (_base64_source(img), {"type": "url", "url": f"file://{path}"}):
        message = anthropic.messages.create(model=NAME, max_tokens=MAX_TOKENS, messages=_anthropic_image(source),
                                            extra_body={"temperature": 0})
        assert message.content[0].text == _expected(llava_model, img), source["type"]
        assert message.usage.input_tokens == chat.usage.prompt_tokens
    counted = anthropic.messages.count_tokens(model=NAME, messages=_anthropic_image(_base64_source(img)))
    assert counted.input_tokens == chat.usage.prompt_tokens  # the image's placeholders counted


BAD_SOURCES = [
    ({"type": "base64", "media_type": "image/tiff", "data": "AAAA"}, "source.media_type must be one of"),
    ({"type": "base64", "media_type": "image/png"}, "source.data: a base64 image source needs its data"),
    ({"type": "base64", "media_type": "image/png", "data": "!!!not-base64!!!"}, "source.data: the base64 payload"),
    ({"type": "base64", "media_type": "image/png", "data": base64.b64encode(b"not a png").decode()},
     "source.data: the image cannot be decoded"),
    ({"type": "url"}, "source.url: a url image source needs a url"),
    ({"type": "url", "url": "https://example.com/cat.png"}, "source.url: must be a data:image"),
]


@pytest.mark.parametrize("source,match", BAD_SOURCES)
def test_bad_anthropic_image_blocks_are_400_naming_the_field(app, source, match):
    body = {"model": NAME, "max_tokens": 4, "system": "Be brief.", "messages": [  # chat: one message more
        {"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image", "source": source}]}]}
    r = requests.post(f"{app}/v1/messages", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error"
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and f"messages[2].content[1].{match}" in error["message"], error


def test_nothing_leaks_after_the_image_requests(app):
    assert_no_leaks(app, APP, {"colocated"})


def test_an_image_to_a_text_only_model_is_400_naming_the_part():
    from cluster.http.chat import load_images
    from cluster.http.errors import OpenAIError
    from cluster.http.protocol import ChatCompletionRequest

    body = ChatCompletionRequest(model=NAME, messages=_messages(_data_url(image(0))))
    with pytest.raises(OpenAIError) as info:
        load_images(None, None, body)  # a model that takes no images (no image limit)
    assert info.value.status == 400 and info.value.param == "messages[0].content[0].image_url.url"
