"""The OpenAI server with a vision-language model: ``image_url`` content parts as base64
``data:`` URLs and as http(s) URLs (served here by a loopback HTTP server), the same reply as
the offline API, and a 400 naming the problem for every bad image input, after which the
server keeps serving."""

from __future__ import annotations

import base64
import io
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from pagelm import LLM, SamplingParams
from pagelm.models.testing import build_tiny_llava
from test_server import running_server

MAX_IMAGE_BYTES = 200_000


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


IMAGE = Image.fromarray(np.random.RandomState(0).randint(0, 256, (40, 60, 3), dtype=np.uint8))
OTHER = Image.fromarray(np.random.RandomState(1).randint(0, 256, (30, 30, 3), dtype=np.uint8))
# A 20,000 x 20,000 image: a small PNG (one colour), 400 million pixels once decoded.
HUGE_PNG = png(Image.new("1", (20000, 20000)))
ROUTES = {
    "/image.png": png(IMAGE),
    "/big.png": png(Image.fromarray(np.random.RandomState(2).randint(0, 256, (400, 400, 3), dtype=np.uint8))),
    "/text.png": b"this is not an image",
}


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/slow.png":
            time.sleep(3)
        body = ROUTES.get(self.path)
        if body is None and self.path != "/slow.png":
            self.send_error(404)
            return
        body = body or ROUTES["/image.png"]
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def images_url():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return build_tiny_llava(tmp_path_factory.mktemp("llava-server") / "tiny-llava")


@pytest.fixture(scope="module")
def server(llava_dir):
    with running_server(
        str(llava_dir), "--served-model-name", "tiny-llava", "--device", "cpu", "--block-size", "4",
        "--limit-mm-per-prompt", '{"image": 2}', "--image-fetch-timeout", "1", "--max-image-bytes", str(MAX_IMAGE_BYTES),
    ) as url:
        yield url


def chat(server: str, *parts: dict, text: str = "describe ") -> httpx.Response:
    content = [{"type": "text", "text": text}, *parts]
    body = {"model": "tiny-llava", "messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0}
    return httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_data_and_http_image_urls_give_the_offline_reply(server, images_url, llava_dir):
    by_data = chat(server, image_part(data_url(ROUTES["/image.png"])))
    by_http = chat(server, image_part(f"{images_url}/image.png"))
    assert by_data.status_code == by_http.status_code == 200, by_data.text
    with LLM(str(llava_dir), device="cpu", block_size=4) as llm:
        messages = [{"role": "user", "content": [{"type": "text", "text": "describe "},
                                                 {"type": "image_pil", "image_pil": IMAGE}]}]
        offline = llm.chat(messages, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
    text = offline.outputs[0].text
    assert by_data.json()["choices"][0]["message"]["content"] == by_http.json()["choices"][0]["message"]["content"] == text
    assert by_data.json()["usage"]["prompt_tokens"] == len(offline.prompt_token_ids)


@pytest.mark.parametrize(
    "part, words",
    [
        (image_part(data_url(b"this is not an image")), "not a readable image"),
        (image_part("data:image/png;base64,!!!not base64!!!"), "invalid base64"),
        (image_part(data_url(HUGE_PNG)), "too large"),
        (image_part("{images}/text.png"), "not a readable image"),
        (image_part("{images}/missing.png"), "could not fetch"),
        (image_part("{images}/slow.png"), "could not fetch"),
        (image_part("{images}/big.png"), f"at most {MAX_IMAGE_BYTES}"),
        (image_part("file:///etc/passwd"), "http(s) URL"),
    ],
    ids=["not-an-image", "bad-base64", "20000x20000", "http-not-an-image", "http-404", "http-timeout",
         "http-too-large", "file-url"],
)
def test_bad_image_input_is_a_400_naming_the_problem(server, images_url, part, words):
    if "{images}" in part["image_url"]["url"]:
        part = image_part(part["image_url"]["url"].format(images=images_url))
    r = chat(server, part)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["param"] == "messages.0.content", error
    assert chat(server, image_part(data_url(ROUTES["/image.png"]))).status_code == 200  # serves on


def test_more_images_than_allowed_and_a_placeholder_mismatch_are_400s(server):
    image = image_part(data_url(ROUTES["/image.png"]))
    r = chat(server, image, image, image)
    assert r.status_code == 400 and "limit_mm_per_prompt" in r.json()["error"]["message"], r.text
    r = chat(server, image, text="an extra <image> placeholder ")
    assert r.status_code == 400 and "2 image placeholder(s)" in r.json()["error"]["message"], r.text
    assert chat(server, image).status_code == 200


def test_the_same_image_again_is_an_encoder_cache_hit(server):
    def encoder_counters() -> tuple[float, float]:
        text = httpx.get(f"{server}/metrics", timeout=10).text
        values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        return values["pagelm:encoder_cache_queries_total"], values["pagelm:encoder_cache_hits_total"]

    part = image_part(data_url(png(OTHER)))
    queries, hits = encoder_counters()
    assert chat(server, part).status_code == 200
    assert chat(server, part, text="again ").status_code == 200
    time.sleep(0.5)  # the stats of the last step reach the API process with its outputs
    assert encoder_counters() == (queries + 2, hits + 1)


def test_image_fetcher_keeps_to_its_allowed_domains_and_limits(images_url):
    from pagelm.plugins.server.media import ImageFetcher

    with pytest.raises(ValueError, match="'127.0.0.1' is not among the allowed media domains"):
        ImageFetcher(allowed_domains=("images.example.com",)).load(f"{images_url}/image.png", "part")
    with pytest.raises(ValueError, match="does not fetch http"):
        ImageFetcher(allow_http=False).load(f"{images_url}/image.png", "part")
    image = ImageFetcher(allowed_domains=("127.0.0.1",)).load(f"{images_url}/image.png", "part")
    assert image.size == IMAGE.size and image.tobytes() == IMAGE.tobytes()
