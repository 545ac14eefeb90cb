"""Images over HTTP (issue 52): `image_url` content parts in /v1/chat/completions through the real app, a
real uvicorn server in this process and the openai client, on the tiny Qwen2.5-VL of tests/vl_fixtures.py.

    warm-up      the tower compiled at start-up for its patch buckets: images of several sizes then compile
                 nothing (num_compilations_after_warmup 0); one past max_pixels is resized down, as vLLM does
    URLs         data:, http:// (a PNG served by a local http.server on a free port), file:// and a plain
                 path under --allowed-local-media-path: greedy tokens equal to the offline LLM.chat of the
                 same image (itself equal to transformers: tests/test_qwen2_vl.py), two images in a prompt
    bad input    truncated PNG bytes, a body that is not an image, a 1x300 image the processor refuses, more
                 images than --limit-mm-per-prompt (refused before any fetch), a file outside the allowed
                 folder, an unreachable host, a redirect to file://, a video part, a PNG header declaring
                 120 M pixels (over Pillow's bomb limit, where Pillow only warns; refused before decoding),
                 a body over the byte cap (base64 before decoding; a download stopped): each a 400 naming
                 the part; /health stays 200 and the next request is answered
    text-only    an image part to a text-only model: a 400 naming messages.0.content
    flags        --limit-mm-per-prompt's JSON form and --allowed-local-media-path checked at start-up
    hosts        --allowed-media-domains (the engine's: 127.0.0.1) and, without it, private/loopback/... addresses
                 (SSRF): each a 400 before any connection (servers counting their accepts), redirect hops too;
                 a name resolving elsewhere on its second lookup (DNS rebinding) is fetched from the first
    encoder      the same image in 10 concurrent requests: the tower runs once (vLLM's mm_hash)
    processor    --mm-processor-cache-gb's cache hit for an image sent again; --mm-processor-kwargs' max_pixels
                 gives the image tokens transformers' processor gives with it; the multimodal flags refused
                 at start-up for a bad key, a bad value and a text-only model
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import http.server
import io
import socket
import struct
import threading
import zlib
from pathlib import Path

import httpx
import openai
import pytest

from tests.moe_fixtures import EXACT
from tests.vl_fixtures import image, save_vl_checkpoint

pytestmark = pytest.mark.warmup  # its engines hold 0 compilations after warm-up (tests/conftest.py)
MAX_TOKENS = 5
IMG = image(84, 112, 0)
IMG2 = image(56, 56, 1)


def _png(im) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height RGB pixels, with one empty image-data chunk."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def _data_url(body: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(body).decode()


def _message(*urls: str) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
                                         {"type": "text", "text": "What is it?"}]}]


class _Handler(http.server.SimpleHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802  (http.server's name)
        if self.path == "/redirect":  # a redirect to a local file: must not be followed
            self.send_response(302)
            self.send_header("Location", "file:///etc/passwd")
            self.end_headers()
            return
        super().do_GET()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> tuple[Path, str]:
    """(the allowed folder, the base URL of an http server serving it)."""
    root = tmp_path_factory.mktemp("media")
    (root / "img.png").write_bytes(_png(IMG))
    (root / "img2.png").write_bytes(_png(IMG2))
    (root / "notes.txt").write_bytes(b"not an image at all")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Handler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_vl_checkpoint("qwen2_5_vl", tmp_path_factory.mktemp("vl") / "qwen2_5_vl")


@pytest.fixture(scope="module")
def served(checkpoint, media):
    """(openai client, httpx client, offline greedy tokens of _message(IMG) and of _message(IMG, IMG2), the
    model's name, the engine). One compiled engine with a small budget (16 tokens a step: the tower's 64
    patches, raised to the processor's largest image, 256), its warm-up the tower's buckets included."""
    from jaxserve import LLM
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.entrypoints.openai.api_server import build_app
    from tests.fake_engine import serve_in_thread

    llm = LLM(str(checkpoint), progress=False, max_model_len=128, max_num_seqs=1, max_num_batched_tokens=16,
              kv_cache_memory=1 << 20, compilation_cache_dir="", allowed_local_media_path=str(media[0]),
              limit_mm_per_prompt={"image": 2}, allowed_media_domains=["127.0.0.1"], **EXACT)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    one, two = (llm.chat(m, params, use_tqdm=False)[0]
                for m in (_message(_data_url(_png(IMG))), _message(_data_url(_png(IMG)), _data_url(_png(IMG2)))))
    refs = (list(one.outputs[0].token_ids), list(two.outputs[0].token_ids))
    engine = AsyncLLM(llm.llm_engine)  # from here on only the server drives the engine
    try:
        with serve_in_thread(build_app(engine)) as url, httpx.Client(base_url=url, timeout=60) as raw:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            yield client, raw, refs, str(llm.llm_engine.args.model), llm.llm_engine
    finally:
        engine.shutdown()


def _tokens(client: openai.OpenAI, model: str, messages: list[dict]) -> list[int]:
    out = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=MAX_TOKENS,
                                         temperature=0.0, logprobs=True,
                                         extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    return [int(t.token.removeprefix("token_id:")) for t in out.choices[0].logprobs.content]


def test_image_urls_equal_offline_chat(served, media):
    client, _, (one, two), model, _ = served
    root, base = media
    for url in (_data_url(_png(IMG)), f"{base}/img.png", f"file://{root}/img.png", str(root / "img.png")):
        assert _tokens(client, model, _message(url)) == one, url
    assert _tokens(client, model, _message(f"{base}/img.png", f"file://{root}/img2.png")) == two


def test_bad_images_are_400_and_the_server_stays_up(served, media, tmp_path):
    client, raw, (one, _), model, engine = served
    root, base = media
    png = _png(IMG)
    media_loader = engine.mm_processor.media
    outside = tmp_path / "outside.png"
    outside.write_bytes(png)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/img.png"
    cases = [
        (_message(_data_url(png[:len(png) // 2])), "not a readable image"),  # truncated PNG
        (_message(f"{base}/notes.txt"), "not a readable image"),
        (_message(_data_url(_png(image(1, 300, 3)))), "image processor refused"),  # aspect ratio over 200
        (_message(dead, dead, dead), "3 images in the prompt, more than --limit-mm-per-prompt's 2"),  # no fetch
        (_message(f"file://{outside}"), "outside --allowed-local-media-path"),
        (_message(f"file://{root}/../{outside.parent.name}/outside.png"), "outside --allowed-local-media-path"),
        (_message(dead), "cannot fetch the image"),
        (_message(f"{base}/missing.png"), "answered HTTP 404"),
        (_message(f"{base}/redirect"), "redirected to a non-http"),
        ([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": f"{base}/a.mp4"}}]}],
         "video_url parts are not supported"),
        (_message(_data_url(_png_header(12000, 10000))), "decompression-bomb limit"),  # 120 M pixels declared
        (_message(_data_url(b"\0" * (len(png) + 4))), "the image is larger than"),  # base64: before decoding
        (_message(f"{base}/img.png"), "the image is larger than"),  # fetched: the download stops
    ]
    cap = dataclasses.replace(engine.mm_processor.media, max_bytes=len(png) - 1)  # both of the last two
    for i, (messages, match) in enumerate(cases):
        engine.mm_processor.media = cap if i >= len(cases) - 2 else media_loader
        r = raw.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 2})
        assert r.status_code == 400, (match, r.text)
        assert match in r.json()["error"]["message"], r.text
        assert "messages[0].content" in r.text or "multi_modal_data.image" in r.text  # names the part
        assert raw.get("/health").status_code == 200
    engine.mm_processor.media = media_loader
    assert _tokens(client, model, _message(f"{base}/img.png")) == one  # still answering


def test_text_only_model_refuses_image_parts():
    from jaxserve.entrypoints.openai.api_server import build_app
    from tests.fake_engine import FakeAsyncLLM, serve_in_thread

    with serve_in_thread(build_app(FakeAsyncLLM())) as url:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=10, json={
            "model": "fake-model", "messages": _message(_data_url(_png(IMG2)))})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages.0.content"
    assert "'image_url' is not supported" in r.json()["error"]["message"]


def test_flags_checked_at_start_up(tmp_path):
    from types import SimpleNamespace

    from jaxserve.entrypoints import cli_args
    from jaxserve.multimodal.media import MediaLoader, image_limit

    parser = cli_args.add_serve_args(__import__("argparse").ArgumentParser(), positional_model=False)
    ns = parser.parse_args(["--limit-mm-per-prompt", '{"image": 3}', "--allowed-local-media-path", str(tmp_path)])
    assert (ns.limit_mm_per_prompt, ns.allowed_local_media_path) == ({"image": 3}, str(tmp_path))
    assert image_limit(ns) == 3 and MediaLoader.from_args(ns).allowed_local_media_path == tmp_path.resolve()
    ns = parser.parse_args(["--allowed-media-domains", "Images.Example.com.", "10.0.0.5"])
    assert MediaLoader.from_args(ns).allowed_media_domains == {"images.example.com", "10.0.0.5"}
    for limits, match in (({"video": 1}, "'video': only 'image'"), ({"image": -1}, "'image' must be an integer >= 0")):
        with pytest.raises(ValueError, match=f"^limit_mm_per_prompt: {match}"):
            image_limit(SimpleNamespace(limit_mm_per_prompt=limits))
    with pytest.raises(ValueError, match="^allowed_local_media_path: .* is not a folder"):
        MediaLoader.from_args(SimpleNamespace(allowed_local_media_path=str(tmp_path / "nope")))


def test_tower_warmup_then_no_compilations(served):
    """The tower's buckets 64, 128 and 256 patches ran at warm-up; images of four sizes, two in one prompt
    (more patches than one run takes: two runs) and one past max_pixels then compile nothing."""
    client, _, _, model, engine = served
    mm = engine.runner.mm
    assert (mm.patch_budget, mm.buckets) == (256, [64, 128, 256])
    encoded = mm.num_images_encoded
    sizes = [(56, 56), (84, 112), (224, 224), (140, 56)]  # 16, 48, 256 (the processor's max) and 40 patches
    urls = [_data_url(_png(image(h, w, 10 + i))) for i, (h, w) in enumerate(sizes)]
    prompt_tokens = []
    for messages in [_message(u) for u in urls] + [_message(urls[2], _data_url(_png(image(84, 112, 20)))),
                                                   _message(_data_url(_png(image(448, 448, 21))))]:
        out = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=2)
        prompt_tokens.append(out.usage.prompt_tokens)
    assert mm.num_images_encoded == encoded + 6  # urls[2] twice: once
    assert engine.get_stats().num_compilations_after_warmup == 0
    # larger than max_pixels: resized down by the checkpoint's processor (as vLLM does), not refused
    assert prompt_tokens[-1] == prompt_tokens[2]


class _Counting(http.server.ThreadingHTTPServer):
    """Counts the connections it accepts: a refused URL must open none."""
    accepted = 0

    def get_request(self):  # noqa: ANN201  (socketserver's)
        self.accepted += 1
        return super().get_request()


class _Redirect(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802  (http.server's name)
        self.send_response(302)
        self.send_header("Location", self.path[len("/to/"):])  # /to/<absolute URL>
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def _server(host: str, handler, port: int = 0):
    server = _Counting((host, port), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, f"http://{host}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def _domains(engine, domains: frozenset[str] | None):
    """The engine's loader with other --allowed-media-domains for a while (the flag's own parsing:
    test_flags_checked_at_start_up)."""
    processor = engine.mm_processor
    old = processor.media
    processor.media = dataclasses.replace(old, allowed_media_domains=domains)
    try:
        yield
    finally:
        processor.media = old


def _public_stand_in(monkeypatch) -> None:
    """127.0.0.2 stands in for a public host (the tests have no network): judged public, all else as it is."""
    from jaxserve.multimodal import fetch

    monkeypatch.setattr(fetch, "non_public", lambda a, real=fetch.non_public: None if a == "127.0.0.2" else real(a))


def _refused(raw: httpx.Client, model: str, url: str, match: str) -> None:
    r = raw.post("/v1/chat/completions", json={"model": model, "messages": _message(url), "max_tokens": 2})
    assert r.status_code == 400, (url, r.text)
    assert "messages[0].content[0].image_url.url" in r.text and match in r.json()["error"]["message"], r.text
    assert raw.get("/health").status_code == 200


def test_hosts_refused_before_any_connection(served, media, monkeypatch):
    client, raw, (one, _), model, engine = served
    files = functools.partial(_Handler, directory=str(media[0]))
    with (_server("127.0.0.1", files) as (target, url), _server("127.0.0.1", _Redirect) as (hop, hop_url),
          _server("127.0.0.2", _Redirect) as (public_hop, public_url)):
        port = target.server_address[1]
        # the engine's --allowed-media-domains 127.0.0.1: another name refused, and a redirect to one
        _refused(raw, model, f"http://localhost:{port}/img.png", "'localhost' is not in --allowed-media-domains")
        _refused(raw, model, f"{hop_url}/to/http://localhost:{port}/img.png",
                 "'localhost' is not in --allowed-media-domains (127.0.0.1)")
        assert hop.accepted == 1
        # every image's host is judged before the first is fetched: the allowed first one is not read
        r = raw.post("/v1/chat/completions", json={"model": model, "max_tokens": 2, "messages": _message(
            f"{url}/img.png", f"http://localhost:{port}/img.png")})
        assert r.status_code == 400 and "messages[0].content[1].image_url.url: the host 'localhost'" in r.text
        with _domains(engine, None):  # no list: public addresses only (SSRF), IPv4 and IPv6
            for bad, kind in ((f"{url}/img.png", "loopback"), (f"http://localhost:{port}/img.png", "loopback"),
                              (f"http://[::1]:{port}/img.png", "loopback"),
                              (f"http://[::ffff:127.0.0.1]:{port}/img.png", "loopback"),
                              ("http://169.254.169.254/latest/meta-data/", "link-local"),
                              ("http://10.1.2.3/img.png", "private"), ("http://[fd00::1]/img.png", "private"),
                              (f"http://0.0.0.0:{port}/img.png", "unspecified"), ("http://224.0.0.1/a", "multicast")):
                _refused(raw, model, bad, f"a {kind} address: only public addresses are fetched")
            _public_stand_in(monkeypatch)  # each redirect hop is checked: a public host redirecting to loopback
            _refused(raw, model, f"{public_url}/to/{url}/img.png", "127.0.0.1, a loopback address")
            assert public_hop.accepted == 1
        assert target.accepted == 0  # no refused URL opened a connection to it
    assert _tokens(client, model, _message(f"{media[1]}/img.png")) == one  # still answering


def test_resolved_address_is_the_one_connected_to(served, media, monkeypatch):
    """DNS rebinding: `rebind.test` answers 127.0.0.2 (public, as tests stand in) when checked and 127.0.0.1
    after; the image comes from 127.0.0.2, the address checked, and 127.0.0.1's port sees no connection."""
    client, _, (one, _), model, engine = served
    files = functools.partial(_Handler, directory=str(media[0]))
    real, answers = socket.getaddrinfo, iter(["127.0.0.2"])

    def getaddrinfo(host, port, *args, **kwargs):
        return real(next(answers, "127.0.0.1") if host == "rebind.test" else host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    _public_stand_in(monkeypatch)
    with _server("127.0.0.2", files) as (checked, _):
        port = checked.server_address[1]
        with _server("127.0.0.1", files, port) as (other, _), _domains(engine, None):
            assert _tokens(client, model, _message(f"http://rebind.test:{port}/img.png")) == one
        assert (checked.accepted, other.accepted) == (1, 0)


def test_processor_cache_hit(served):
    client, _, _, model, engine = served
    cache = engine.mm_processor.cache  # --mm-processor-cache-gb's default 4 GiB
    hits, misses = cache.hits, cache.misses
    url = _data_url(_png(image(56, 84, 30)))
    for _ in range(2):
        client.chat.completions.create(model=model, messages=_message(url), max_completion_tokens=1)
    assert (cache.hits - hits, cache.misses - misses) == (1, 1)


def test_one_image_in_ten_concurrent_requests_runs_the_tower_once(served):
    """The encoder cache (vLLM's mm_hash): the same image in 10 requests at once, over HTTP, is encoded
    once, whether the requests share a step (one tower run per distinct image) or follow it (cached)."""
    from concurrent.futures import ThreadPoolExecutor

    client, _, _, model, engine = served
    encoded = engine.runner.mm.num_images_encoded
    url = _data_url(_png(image(84, 56, 31)))
    with ThreadPoolExecutor(10) as pool:
        outs = list(pool.map(lambda _: client.chat.completions.create(
            model=model, messages=_message(url), max_completion_tokens=1), range(10)))
    assert len({o.usage.prompt_tokens for o in outs}) == 1
    assert engine.runner.mm.num_images_encoded == encoded + 1


def test_mm_processor_kwargs_max_pixels(served, checkpoint):
    """--mm-processor-kwargs '{"max_pixels": 28*28*16}': a 224x168 image (192 patches at the checkpoint's
    max_pixels) takes the image tokens transformers' processor loaded with the same kwargs gives it, over
    HTTP. The engine's processor is the one LLMEngine builds from these EngineArgs (processor_for)."""
    from transformers import AutoImageProcessor

    from jaxserve.multimodal.processor import processor_for

    client, _, _, model, engine = served
    big = image(224, 168, 5)
    kwargs = {"max_pixels": 28 * 28 * 16}
    tokens = {}
    for name, processor in (("checkpoint", engine.mm_processor), ("kwargs", processor_for(
            engine.model, dataclasses.replace(engine.args, mm_processor_kwargs=kwargs, mm_processor_cache_gb=0.0)))):
        old, engine.mm_processor = engine.mm_processor, processor
        try:
            out = client.chat.completions.create(model=model, messages=_message(_data_url(_png(big))),
                                                 max_completion_tokens=1)
        finally:
            engine.mm_processor = old
        tokens[name] = out.usage.prompt_tokens
        if name == "kwargs":
            assert processor.cache is None  # --mm-processor-cache-gb 0: no cache
    grid = lambda p: int(p(images=[big], return_tensors="np")["image_grid_thw"].prod()) // 4  # noqa: E731
    ref = grid(AutoImageProcessor.from_pretrained(str(checkpoint), **kwargs))
    assert tokens["checkpoint"] - tokens["kwargs"] == grid(AutoImageProcessor.from_pretrained(str(checkpoint))) - ref
    assert ref <= 16 < grid(AutoImageProcessor.from_pretrained(str(checkpoint)))  # the kwargs changed it


def test_mm_flags_refused_at_start_up(served, tmp_path):
    """A bad key or value of --mm-processor-kwargs (checked by the engine's processor_for, as it starts), and
    each multimodal flag for a text-only model (LLM: before its weights are read)."""
    from jaxserve import LLM
    from jaxserve.multimodal.processor import processor_for

    import torch
    import transformers

    from tests.vl_fixtures import TEXT, save_tokenizer

    engine = served[4]
    text_only = tmp_path / "qwen2"  # the VL checkpoints' language model alone: a model without images
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**{**TEXT, "num_hidden_layers": 1})
    transformers.Qwen2ForCausalLM(config).save_pretrained(text_only)
    save_tokenizer(text_only)
    for kwargs, match in (({"max_pixel": 5}, "'max_pixel' is not an option of Qwen2VLImageProcessor"),
                          ({"return_tensors": "pt"}, "'return_tensors' is set by jaxserve"),
                          ({"max_pixels": "many"}, "the image processor fails with")):
        with pytest.raises(ValueError, match=f"^mm_processor_kwargs: {match}"):
            processor_for(engine.model, dataclasses.replace(engine.args, mm_processor_kwargs=kwargs))
    for name, value in (("allowed_media_domains", ["a.com"]), ("mm_processor_kwargs", {"max_pixels": 1}),
                        ("mm_processor_cache_gb", 0.0), ("limit_mm_per_prompt", {"image": 1}),
                        ("allowed_local_media_path", "/tmp")):
        with pytest.raises(ValueError, match=f"^{name}: does not apply to Qwen2ForCausalLM, a model without images"):
            LLM(str(text_only), progress=False, **{name: value})
