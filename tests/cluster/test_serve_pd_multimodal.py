"""A chat request with an image through the Serve app in P/D mode: the prefill replica
encodes, the decode replica only loads KV (its encoder counters stay at zero)."""

from __future__ import annotations

import pytest

from tests.cluster.helpers import ENGINE, assert_no_leaks, metric_value, wait_for
from tests.cluster.test_serve_multimodal import MAX_TOKENS, _data_url, _expected, _messages
from tests.engine.mm_reference import image

APP = "mmpdtest"
NAME = "tiny-llava-pd"


@pytest.fixture(scope="module")
def app(deploy, llava_model):
    from cluster.launch.app_config import AppConfig
    from engine import EngineArgs

    cfg = AppConfig(engine_args=EngineArgs(model=llava_model, **ENGINE), mode="pd", served_model_name=NAME,
                    app_name=APP, replica_num_cpus=0)
    return deploy(cfg)


def test_pd_chat_with_an_image_equals_hf_and_decode_never_encodes(app, llava_model):
    from openai import OpenAI

    client = OpenAI(base_url=f"{app}/v1", api_key="unused", max_retries=0)
    for seed in (40, 41):  # same text, different images
        img = image(seed)
        r = client.chat.completions.create(model=NAME, messages=_messages(_data_url(img)), max_tokens=MAX_TOKENS,
                                           temperature=0)
        assert r.choices[0].message.content == _expected(llava_model, img)

    def queries(role):
        return metric_value(app, "pdserve:encoder_cache_queries_total", role=role)

    wait_for(lambda: queries("prefill") == 2, "the prefill replica to report its 2 encoder lookups", 30)
    assert queries("decode") == 0  # decode loaded the KV: it never ran the encoder
    assert_no_leaks(app, APP, {"prefill", "decode"})
