"""Image URLs as chat requests carry them: data URLs decode, local files only under the
allowed path, nothing from the network; every refusal is a ValueError naming image_url."""

from __future__ import annotations

import base64
import io

import pytest

from engine.multimodal.media import load_image
from tests.engine.mm_reference import image


def _png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_a_data_url_decodes_to_the_same_pixels():
    img = image(60)
    url = "data:image/png;base64," + base64.b64encode(_png_bytes(img)).decode()
    assert load_image(url).tobytes() == img.tobytes()


def test_a_file_url_is_read_only_under_the_allowed_path(tmp_path):
    img = image(61)
    (tmp_path / "a.png").write_bytes(_png_bytes(img))
    assert load_image(f"file://{tmp_path}/a.png", str(tmp_path)).tobytes() == img.tobytes()
    with pytest.raises(ValueError, match="allowed-local-media-path"):
        load_image(f"file://{tmp_path}/a.png")
    with pytest.raises(ValueError, match="outside the allowed"):
        load_image(f"file://{tmp_path}/../a.png", str(tmp_path))


@pytest.mark.parametrize("url,match", [
    ("http://169.254.169.254/latest", "not fetched"),
    ("cat.png", "not fetched"),
    ("data:image/png,rawbytes", "data:image/<type>;base64"),
    ("data:image/png;base64,@@@", "base64 payload is invalid"),
    ("data:image/png;base64," + base64.b64encode(b"\x89PNG truncated").decode(), "cannot be decoded"),
])
def test_refused_urls_name_the_field(url, match):
    with pytest.raises(ValueError, match=match) as info:
        load_image(url)
    assert info.value.field == "image_url"
