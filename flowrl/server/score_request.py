"""Parsing /score requests of the reward service within fixed resource bounds.

`ServerLimits` holds the bounds; `parse_score_request` turns a request body into
(images (B, 3, H, W) uint8, prompts, metadata), or raises `BadRequest` (answered 4xx) naming the
field and the fix. Every bound is checked before the work it bounds: the image count before any
image is decoded, each PNG's width and height from its header (PIL reads the header lazily) before
its pixels are decompressed, so a small PNG that claims 100000x100000 pixels costs nothing.
Deeply nested or otherwise malformed JSON is a 400, never a server error.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import re
from dataclasses import dataclass, fields

import numpy as np
from PIL import Image


class BadRequest(ValueError):
    """A client error: answered with 400 (or `status_code`) and the message; `param` names the
    request field at fault when there is one."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.param = param


@dataclass(frozen=True)
class ServerLimits:
    """What one request may cost the server (the command-line flag of each field in brackets).

    max_body_bytes: request body size [--max-body-mb]; larger bodies get 413 unread.
    max_batch_size: images per request [--max-batch-size].
    max_image_pixels: width x height of one image [--max-image-pixels].
    max_request_pixels: summed width x height of a request's images [--max-request-pixels]: the
        decoded batch takes 3 bytes per pixel.
    max_concurrency: requests decoded and scored at once [--max-concurrency]; others wait, unread.
    scoring_threads: threads the rows of a reward that scores rows one by one
        (`Reward.scores_rows_one_by_one`, as OCR) are cut over, shared by the requests scored at
        once [--scoring-threads]; a batched reward (one model call, as CLIP) scores on one.
    """

    max_body_bytes: int = 64 * 2**20
    max_batch_size: int = 256
    max_image_pixels: int = 4096 * 4096
    max_request_pixels: int = 2**27
    max_concurrency: int = 1
    scoring_threads: int = 1

    def __post_init__(self):
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"reward server limit {field.name}={value!r} must be an integer >= 1")


def parse_multipart(body: bytes, content_type: str) -> list[tuple[str, bytes]]:
    """multipart/form-data body -> [(field name, content bytes)] in order (RFC 7578)."""
    match = re.search(r'boundary="?([^";]+)"?', content_type)
    if not match:
        raise BadRequest("multipart request has no boundary in its Content-Type header")
    delimiter = b"\r\n--" + match.group(1).encode("latin-1")
    parts = (b"\r\n" + body).split(delimiter)
    found = []
    for part in parts[1:]:
        if part.startswith(b"--"):  # closing delimiter
            return found
        headers, separator, content = part.partition(b"\r\n\r\n")
        if not separator:
            raise BadRequest("malformed multipart body: a part has no header/content separator")
        name = re.search(rb'name="([^"]*)"', headers)
        if not name:
            raise BadRequest("malformed multipart body: a part has no Content-Disposition name")
        found.append((name.group(1).decode("utf-8", errors="replace"), content))
    raise BadRequest("malformed multipart body: missing the closing boundary")


def load_json(data: bytes, what: str, fields: str = "images, prompts, metadata"):
    """Parsed JSON, or BadRequest(400) for malformed or too deeply nested JSON (`fields`: what
    a flat request holds, for the message)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise BadRequest(f"{what} is nested too deeply; send flat JSON ({fields})") from None
    except (UnicodeDecodeError, ValueError) as error:  # JSONDecodeError, and ints over Python's digit limit
        raise BadRequest(f"{what} is not valid JSON ({error})") from None


def _base64_png(value, index: int) -> bytes:
    if not isinstance(value, str):
        raise BadRequest(f"images[{index}] must be a base64 PNG string, got {type(value).__name__}")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as error:
        raise BadRequest(f"images[{index}] is not valid base64 ({error}); send base64-encoded PNG bytes") from None


def open_png(data: bytes, field: str, max_pixels: int) -> Image.Image:
    """PNG bytes -> an opened, not yet decoded, RGB image within `max_pixels` (read from the header)."""
    try:
        image = Image.open(io.BytesIO(data), formats=["PNG"])
    except Image.DecompressionBombError as error:  # PIL's own bound, a backstop behind ours
        raise BadRequest(f"{field} is too large ({error})", 413) from None
    except Exception as error:
        raise BadRequest(
            f"{field} is not a readable PNG ({type(error).__name__}: {error}); send RGB PNG bytes"
        ) from None
    width, height = image.size
    if width * height > max_pixels:
        raise BadRequest(
            f"{field} is {width}x{height} ({width * height} pixels); this server takes at most {max_pixels} pixels "
            "per image (--max-image-pixels)",
            413,
        )
    if image.mode != "RGB":
        raise BadRequest(f"{field} has mode {image.mode!r}; send 8-bit RGB images (convert RGBA/L to RGB first)")
    return image


def _decode_into(image: Image.Image, out: np.ndarray, field: str) -> None:
    try:
        image.load()
        out[...] = np.asarray(image).transpose(2, 0, 1)
    except Exception as error:  # a damaged PNG stream fails here, after its header was fine
        raise BadRequest(
            f"{field} is not a readable PNG ({type(error).__name__}: {error}); send RGB PNG bytes"
        ) from None
    finally:
        image.close()


def _png_payloads(body: bytes, content_type: str, limits: ServerLimits) -> tuple[list[bytes], dict]:
    """The request's PNG byte strings (at most max_batch_size, counted before decoding) and its JSON."""
    if content_type.startswith("application/json"):
        payload = load_json(body, "body")
        if not isinstance(payload, dict):
            raise BadRequest("JSON body must be an object with images, prompts and metadata")
        raw_images = payload.get("images")
        if not isinstance(raw_images, list) or not raw_images:
            raise BadRequest("field 'images' must be a non-empty list of base64 PNG strings")
        _check_count(len(raw_images), limits)
        return [_base64_png(value, index) for index, value in enumerate(raw_images)], payload
    if content_type.startswith("multipart/form-data"):
        parts = parse_multipart(body, content_type)
        requests = [content for name, content in parts if name == "request"]
        if len(requests) != 1:
            raise BadRequest("multipart request needs exactly one 'request' field with JSON {prompts, metadata}")
        payload = load_json(requests[0], "multipart field 'request'")
        if not isinstance(payload, dict):
            raise BadRequest("multipart field 'request' must be a JSON object with prompts and metadata")
        files = [content for name, content in parts if name == "images"]
        if not files:
            raise BadRequest("multipart request has no 'images' file parts")
        _check_count(len(files), limits)
        return files, payload
    raise BadRequest(f"unsupported Content-Type {content_type!r}; use application/json or multipart/form-data", 415)


def _check_count(count: int, limits: ServerLimits) -> None:
    if count > limits.max_batch_size:
        raise BadRequest(
            f"{count} images in one request, at most {limits.max_batch_size} (--max-batch-size); split the batch "
            "(the http reward's max_request_images option)",
            413,
        )


def parse_score_request(
    body: bytes, content_type: str, limits: ServerLimits
) -> tuple[np.ndarray, list[str], list[dict]]:
    """Validate a /score request into (images (B, 3, H, W) uint8, prompts, metadata)."""
    pngs, payload = _png_payloads(body, content_type, limits)
    batch_size = len(pngs)
    prompts = payload.get("prompts", [""] * batch_size)
    metadata = payload.get("metadata", [{}] * batch_size)
    if not isinstance(prompts, list) or len(prompts) != batch_size or not all(isinstance(p, str) for p in prompts):
        raise BadRequest(f"field 'prompts' must be a list of {batch_size} strings, one per image")
    if not isinstance(metadata, list) or len(metadata) != batch_size or not all(isinstance(m, dict) for m in metadata):
        raise BadRequest(f"field 'metadata' must be a list of {batch_size} objects, one per image")
    images = [open_png(data, f"images[{index}]", limits.max_image_pixels) for index, data in enumerate(pngs)]
    sizes = sorted({image.size for image in images})
    if len(sizes) != 1:
        shapes = [(3, height, width) for width, height in sizes]
        raise BadRequest(f"all images of one request must have the same size, got {shapes}; send one request per size")
    width, height = sizes[0]
    if batch_size * width * height > limits.max_request_pixels:
        raise BadRequest(
            f"{batch_size} images of {width}x{height} are {batch_size * width * height} pixels; this server takes "
            f"at most {limits.max_request_pixels} per request (--max-request-pixels); send fewer images per request "
            "(the http reward's max_request_images option)",
            413,
        )
    out = np.empty((batch_size, 3, height, width), dtype=np.uint8)
    for index, image in enumerate(images):
        _decode_into(image, out[index], f"images[{index}]")
    return out, prompts, metadata
