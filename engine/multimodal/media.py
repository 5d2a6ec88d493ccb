"""Images from URLs as OpenAI chat requests carry them: `data:` URLs always, `file://` paths
under an operator-allowed directory, nothing from the network (a server that fetched any
URL a client named would be an open proxy into its own network)."""

from __future__ import annotations

import base64
import binascii
import io
import os
from urllib.parse import unquote, urlparse

from engine.errors import ParameterError

FIELD = "image_url"
# Why 40 million: an 8K frame (7680 x 4320) is 33 million, a 50-megapixel camera's photo 50
# million in full size; a vision encoder sees a few hundred thousand pixels of any of them. A
# bound on what one image costs to decode (~0.5 s of a core at 40 million), below PIL's own
# decompression-bomb bound (twice 89 million).
MAX_IMAGE_PIXELS = 40_000_000


def load_image(url: str, allowed_local_media_path: str | None = None, max_pixels: int = MAX_IMAGE_PIXELS):
    """A decoded PIL image, or ParameterError(field="image_url") saying why not; one of more
    than `max_pixels` pixels is refused from its header, before it is decoded."""
    if not isinstance(url, str):
        raise ParameterError(FIELD, f"image_url.url must be a string, got {type(url).__name__}")
    if url.startswith("data:"):
        return _decode(_data_url_bytes(url), max_pixels)
    if url.startswith("file:"):
        return _decode(_local_bytes(url, allowed_local_media_path), max_pixels)
    scheme = urlparse(url).scheme or "(none)"
    raise ParameterError(FIELD, f"image_url.url must be a data:image/...;base64 URL; URL scheme {scheme!r} "
                         "is not fetched (this server loads nothing from the network)")


def _data_url_bytes(url: str) -> bytes:
    header, sep, payload = url[len("data:"):].partition(",")
    media_type, _, encoding = header.partition(";")
    if not sep or not media_type.startswith("image/") or encoding != "base64":
        raise ParameterError(FIELD, "image_url.url must look like data:image/<type>;base64,<data>, "
                             f"got a data URL with header {header[:40]!r}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ParameterError(FIELD, f"image_url.url: the base64 payload is invalid ({e})") from e


def _local_bytes(url: str, allowed: str | None) -> bytes:
    if not allowed:
        raise ParameterError(FIELD, "image_url.url: file:// URLs are refused unless the server runs with "
                             "--allowed-local-media-path")
    path = os.path.realpath(unquote(urlparse(url).path))
    root = os.path.realpath(allowed)
    if os.path.commonpath([path, root]) != root:
        raise ParameterError(FIELD, f"image_url.url: {path!r} is outside the allowed local media path")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ParameterError(FIELD, f"image_url.url: cannot read {path!r} ({e.strerror})") from e


def _decode(data: bytes, max_pixels: int):
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
        width, height = image.size
        if width * height > max_pixels:
            raise ParameterError(FIELD, f"image_url.url: the image is {width} x {height} = {width * height} "
                                 f"pixels; at most {max_pixels} are accepted (--max-image-pixels)")
        image.load()  # decode now: a truncated file fails here, not inside a step
    # DecompressionBombError: PIL refuses to decode past twice Image.MAX_IMAGE_PIXELS (a few KiB
    # of PNG can declare 200 million pixels); the client's image, so the client's error.
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError) as e:
        raise ParameterError(FIELD, f"image_url.url: the image cannot be decoded ({e})") from e
    return image
