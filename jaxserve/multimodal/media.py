"""Image URLs of chat content parts, read as vLLM's MediaConnector reads them:

    data:image/...;base64,...   decoded here (its size checked before decoding)
    http://, https://           fetched with httpx (fetch.py): a timeout (vLLM's VLLM_IMAGE_FETCH_TIMEOUT, 5 s),
                                at most `max_bytes` read (the download stops past it), redirects followed only
                                to http(s) URLs (at most 3); hosts only from --allowed-media-domains when
                                given, else only public addresses (no SSRF), each hop checked before connecting
    file:///abs/path, /abs/path read only under --allowed-local-media-path DIR (after resolving `..` and
                                symlinks); without that flag, refused

Each body is decoded by Pillow at once (a truncated PNG, a body that is not an image, one past Pillow's
decompression-bomb pixel limit fail here, not in the processor). Every failure is a ValueError naming the
part (`messages[i].content[j].image_url.url: ...`): a 400 over HTTP. The count limit
(--limit-mm-per-prompt) is checked by the caller before any URL is read (chat.py).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from jaxserve.multimodal.fetch import fetch, normalize_domains, precheck

DEFAULT_FETCH_TIMEOUT = 5.0  # seconds, vLLM's VLLM_IMAGE_FETCH_TIMEOUT default
DEFAULT_MAX_BYTES = 20 << 20  # an image body larger than this is refused (JAXSERVE_MAX_IMAGE_BYTES)


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        raise ValueError(f"{name}: expected a number, got {os.environ[name]!r}") from None


@dataclass(frozen=True)
class MediaLoader:
    """Reads an image URL into a decoded Pillow image; `allowed_local_media_path` None: no local files,
    `allowed_media_domains` None: any host with public addresses."""
    allowed_local_media_path: Path | None = None
    allowed_media_domains: frozenset[str] | None = None
    timeout: float = field(default_factory=lambda: _env_float("VLLM_IMAGE_FETCH_TIMEOUT", DEFAULT_FETCH_TIMEOUT))
    max_bytes: int = field(default_factory=lambda: int(_env_float("JAXSERVE_MAX_IMAGE_BYTES", DEFAULT_MAX_BYTES)))

    @classmethod
    def from_args(cls, args: Any) -> "MediaLoader":
        """The engine's loader; --allowed-local-media-path must be an existing folder (checked at start-up)."""
        folder = getattr(args, "allowed_local_media_path", None)
        domains = normalize_domains(getattr(args, "allowed_media_domains", None))
        if folder is None:
            return cls(allowed_media_domains=domains)
        path = Path(folder).expanduser().resolve()
        if not path.is_dir():
            raise ValueError(f"allowed_local_media_path: {folder!r} is not a folder")
        return cls(allowed_local_media_path=path, allowed_media_domains=domains)

    def load(self, url: str, where: str) -> Any:
        """The image at `url` (a Pillow image, decoded); ValueError naming `where` for anything wrong."""
        scheme = urlparse(url).scheme.lower() if ":" in url else ""
        if url.startswith("data:"):
            body = self._data(url, where)
        elif scheme in ("http", "https"):
            body = self._fetch(url, where)
        elif scheme == "file" or (not scheme and url.startswith("/")):
            body = self._file(url, where)
        else:
            raise ValueError(f"{where}: unsupported URL scheme {scheme or url[:16]!r}: use a data:, http(s) or "
                             "file:// URL")
        return decode(body, where)

    def precheck(self, url: str, where: str) -> None:
        """An http(s) URL's scheme and host judged without DNS or a connection (--allowed-media-domains, an IP
        literal's address): for every image of a request before the first is read."""
        if ":" in url and urlparse(url).scheme.lower() in ("http", "https"):
            precheck(url, where, self.allowed_media_domains)

    def _data(self, url: str, where: str) -> bytes:
        header, _, payload = url.partition(",")
        if not header.endswith(";base64"):
            raise ValueError(f"{where}: a data URL must be base64 (data:image/...;base64,...)")
        if len(payload) * 3 // 4 > self.max_bytes:  # before decoding it
            raise ValueError(f"{where}: the image is larger than {self.max_bytes} bytes")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"{where}: not valid base64 ({e})") from None

    def _file(self, url: str, where: str) -> bytes:
        if self.allowed_local_media_path is None:
            raise ValueError(f"{where}: local files are read only when the server runs with "
                             "--allowed-local-media-path DIR")
        parsed = urlparse(url)
        if parsed.scheme and parsed.netloc not in ("", "localhost"):
            raise ValueError(f"{where}: a file:// URL must name a local path (file:///...)")
        path = Path(unquote(parsed.path if parsed.scheme else url)).resolve()  # `..` and symlinks resolved
        if not path.is_relative_to(self.allowed_local_media_path):
            raise ValueError(f"{where}: {path} is outside --allowed-local-media-path "
                             f"{self.allowed_local_media_path}")
        try:
            if path.stat().st_size > self.max_bytes:
                raise ValueError(f"{where}: the image is larger than {self.max_bytes} bytes")
            return path.read_bytes()
        except OSError as e:
            raise ValueError(f"{where}: cannot read {path}: {e.strerror}") from None

    def _fetch(self, url: str, where: str) -> bytes:
        return fetch(url, where, timeout=self.timeout, max_bytes=self.max_bytes, allowed=self.allowed_media_domains)


def decode(body: bytes, where: str) -> Any:
    """A Pillow image decoded now: a truncated or corrupt body fails here, naming `where`."""
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(body))  # reads the header only
    except Exception as e:  # noqa: BLE001  (Pillow: UnidentifiedImageError, OSError, DecompressionBombError)
        raise ValueError(f"{where}: not a readable image ({type(e).__name__}: {e})") from None
    # Pillow's decompression-bomb limit, from the header before any pixel is decoded (Pillow itself only
    # warns between the limit and twice it): a few KB of PNG can declare gigabytes of pixels
    if Image.MAX_IMAGE_PIXELS is not None and image.width * image.height > Image.MAX_IMAGE_PIXELS:
        raise ValueError(f"{where}: the image declares {image.width}x{image.height} pixels, more than Pillow's "
                         f"decompression-bomb limit of {Image.MAX_IMAGE_PIXELS}")
    try:
        image.load()
    except Exception as e:  # noqa: BLE001  (truncated or corrupt pixel data)
        raise ValueError(f"{where}: not a readable image ({type(e).__name__}: {e})") from None
    return image


def image_limit(args: Any) -> int | None:
    """--limit-mm-per-prompt's image count (None: no limit), checked at start-up: vLLM's JSON form
    '{"image": N}'; video and audio are refused (not supported)."""
    limits = getattr(args, "limit_mm_per_prompt", None)
    if limits is None:
        return None
    if not isinstance(limits, dict):
        raise ValueError(f"limit_mm_per_prompt: expected a JSON object such as {{\"image\": 2}}, got {limits!r}")
    for key, value in limits.items():
        if key != "image":
            raise ValueError(f"limit_mm_per_prompt: {key!r}: only 'image' is supported")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"limit_mm_per_prompt: 'image' must be an integer >= 0, got {value!r}")
    return limits.get("image")
