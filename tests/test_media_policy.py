"""The media access policy: remote URLs never reach non-public addresses, local files stay
under their roots, staged files are private. Loopback only: 127.0.0.1 stands in for a public
host through an injected predicate; the "internal" servers on 127.0.0.2 and ::1 count every
request they get, and must get none."""

from __future__ import annotations

import asyncio
import base64
import io
import ipaddress
import os
import socket
import stat
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from mlxcel.engine.media.images import decode_image
from mlxcel.engine.media.staging import staged_file
from mlxcel.server.media import MediaError, MediaPolicy, load_media
from mlxcel.server.media.addresses import is_public_address, parse_address
from mlxcel.server.media.policy import parse_video_allowlist

PUBLIC_STAND_IN = ipaddress.ip_address("127.0.0.1")


def stand_in_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """127.0.0.1 counts as public; everything else by the real rule."""
    return address == PUBLIC_STAND_IN or is_public_address(address)


class _Handler(BaseHTTPRequestHandler):
    server: _CountingServer

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.server.hits.append(self.path)
        self.server.hosts.append(self.headers.get("Host", ""))
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        if url.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", query["to"][0])
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif url.path == "/loop":
            self.send_response(302)
            self.send_header("Location", "/loop")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif url.path == "/big":
            self.send_response(200)
            self.send_header("Content-Length", str(10_000_000))
            self.end_headers()
        elif url.path == "/stream-big":
            self.send_response(200)
            self.end_headers()  # no length: read until close
            try:
                for _ in range(64):
                    self.wfile.write(b"x" * 4096)
            except OSError:
                pass
            self.close_connection = True
        elif url.path == "/slow":
            time.sleep(2.0)
            self._ok(b"late")
        elif url.path == "/missing":
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self._ok(self.server.body)

    def _ok(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _CountingServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, body: bytes, family: int = socket.AF_INET) -> None:
        self.address_family = family
        super().__init__((host, 0), _Handler)
        self.hits: list[str] = []
        self.hosts: list[str] = []
        self.body = body

    @property
    def port(self) -> int:
        return int(self.server_address[1])


def _serve(host: str, body: bytes, family: int = socket.AF_INET) -> Iterator[_CountingServer]:
    server = _CountingServer(host, body, family)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def public() -> Iterator[_CountingServer]:
    yield from _serve("127.0.0.1", b"public-bytes")


@pytest.fixture(scope="module")
def internal() -> Iterator[_CountingServer]:
    yield from _serve("127.0.0.2", b"SECRET-v4")


@pytest.fixture(scope="module")
def internal6() -> Iterator[_CountingServer]:
    yield from _serve("::1", b"SECRET-v6", socket.AF_INET6)


@pytest.fixture(autouse=True)
def _reset_hits(request: pytest.FixtureRequest) -> None:
    for name in ("public", "internal", "internal6"):
        if name in request.fixturenames:
            server = request.getfixturevalue(name)
            server.hits.clear()
            server.hosts.clear()


def _policy(**overrides: object) -> MediaPolicy:
    fields: dict[str, object] = {"is_public": stand_in_public, "timeout_s": 5.0}
    fields.update(overrides)
    return MediaPolicy(**fields)  # type: ignore[arg-type]


def _fetch(url: str, policy: MediaPolicy, kind: str = "image") -> bytes:
    return asyncio.run(load_media(url, kind, policy)).data  # type: ignore[arg-type]


def _refused(url: str, policy: MediaPolicy, match: str | None = None) -> str:
    with pytest.raises(MediaError, match=match) as info:
        _fetch(url, policy)
    return str(info.value)


# --- which addresses are public -------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "10.0.0.1",
        "172.16.5.4",
        "192.168.1.1",
        "127.0.0.1",
        "127.255.255.254",
        "169.254.169.254",  # cloud metadata
        "100.64.0.1",  # shared address space (CGNAT)
        "0.0.0.0",
        "224.0.0.1",
        "255.255.255.255",
        "198.18.0.1",
        "::1",
        "::",
        "fe80::1%eth0",
        "fc00::1",
        "fd00:ec2::254",  # AWS IPv6 metadata
        "ff02::1",
        "::ffff:127.0.0.1",  # IPv4-mapped
        "::ffff:169.254.169.254",
        "::ffff:10.0.0.1",
        "64:ff9b::a00:1",  # NAT64 of 10.0.0.1
        "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
        "64:ff9b:1::a9fe:a9fe",  # local-use NAT64 of 169.254.169.254
        "2002:a00:1::1",  # 6to4 of 10.0.0.1
        "2002:7f00:1::",  # 6to4 of 127.0.0.1
        "::7f00:1",  # IPv4-compatible 127.0.0.1
    ],
)
def test_non_public_addresses(text: str) -> None:
    assert not is_public_address(parse_address(text))


@pytest.mark.parametrize(
    "text", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "64:ff9b::808:808", "::ffff:8.8.4.4"]
)
def test_public_addresses(text: str) -> None:
    assert is_public_address(parse_address(text))


# --- remote URLs ----------------------------------------------------------------------------


def test_public_fetch_works_and_keeps_the_host_header(public: _CountingServer) -> None:
    resolver_calls: list[str] = []

    async def resolver(host: str, port: int) -> list[str]:
        resolver_calls.append(host)
        return ["127.0.0.1"]

    body = _fetch(f"http://images.example:{public.port}/cat.png", _policy(resolver=resolver))
    assert body == b"public-bytes"
    assert public.hosts == [f"images.example:{public.port}"]
    assert resolver_calls == ["images.example"]


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.2",
        "2130706434",  # decimal
        "0177.0.0.02",  # octal
        "0x7f.0.0.2",  # hex
        "0x7f000002",
        "127.2",  # short form
        "[::ffff:127.0.0.2]",  # IPv4-mapped
        "[::ffff:7f00:2]",
    ],
)
def test_literal_spellings_of_a_private_address_are_refused(
    internal: _CountingServer, host: str
) -> None:
    # httpx itself rejects some spellings as URLs; either way nothing is fetched
    _refused(f"http://{host}:{internal.port}/secret", _policy(), "non-public|not a valid URL")
    assert internal.hits == []


def test_ipv6_loopback_literal_is_refused(internal6: _CountingServer) -> None:
    _refused(f"http://[::1]:{internal6.port}/secret", _policy(), "non-public")
    assert internal6.hits == []


def test_metadata_address_is_refused() -> None:
    _refused("http://169.254.169.254/latest/meta-data/", _policy(), "non-public")


def test_dns_to_private_is_refused(internal: _CountingServer, internal6: _CountingServer) -> None:
    async def resolver(host: str, port: int) -> list[str]:
        return {"v4.test": ["127.0.0.2"], "v6.test": ["::1"], "meta.test": ["169.254.169.254"]}[
            host
        ]

    policy = _policy(resolver=resolver)
    _refused(f"http://v4.test:{internal.port}/", policy, "non-public")
    _refused(f"http://v6.test:{internal6.port}/", policy, "non-public")
    _refused("http://meta.test/", policy, "non-public")
    assert internal.hits == [] and internal6.hits == []


def test_mixed_dns_answers_are_refused(public: _CountingServer, internal: _CountingServer) -> None:
    async def resolver(host: str, port: int) -> list[str]:
        return ["127.0.0.1", "127.0.0.2"]

    _refused(f"http://mixed.test:{public.port}/", _policy(resolver=resolver), "non-public")
    assert public.hits == [] and internal.hits == []


def test_rebinding_cannot_move_the_connection(
    public: _CountingServer, internal: _CountingServer
) -> None:
    """The host is resolved once and the connection pinned to that answer; a resolver that
    would answer a private address on a second lookup is never asked again."""
    answers = iter([["127.0.0.1"], ["127.0.0.2"], ["127.0.0.2"]])
    calls = 0

    async def rebinding(host: str, port: int) -> list[str]:
        nonlocal calls
        calls += 1
        return next(answers)

    assert _fetch(f"http://rebind.test:{public.port}/x", _policy(resolver=rebinding)) == (
        b"public-bytes"
    )
    assert calls == 1
    assert internal.hits == []


def test_peer_checked_after_connecting(public: _CountingServer) -> None:
    """A predicate that stops trusting the address between the lookup and the connected peer
    (what a changed route or a transparent proxy would look like) refuses the body."""
    verdicts = iter([True])

    def once_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        return next(verdicts, False)

    _refused(f"http://127.0.0.1:{public.port}/x", _policy(is_public=once_public), "peer")


@pytest.mark.parametrize(
    "target",
    [
        "http://127.0.0.2:{iport}/secret",
        "http://0x7f.0.0.2:{iport}/secret",
        "http://[::ffff:127.0.0.2]:{iport}/secret",
        "http://169.254.169.254/latest/meta-data/",
        "http://[::1]:{i6port}/secret",
        "file:///etc/passwd",
        "gopher://127.0.0.1:{pport}/",
    ],
)
def test_redirects_to_private_or_other_schemes_are_refused(
    public: _CountingServer, internal: _CountingServer, internal6: _CountingServer, target: str
) -> None:
    location = target.format(iport=internal.port, i6port=internal6.port, pport=public.port)
    url = f"http://127.0.0.1:{public.port}/redirect?to={location}"
    _refused(url, _policy())
    assert internal.hits == [] and internal6.hits == []
    assert len(public.hits) == 1  # the redirect itself, nothing after it


def test_redirect_to_a_public_path_is_followed(public: _CountingServer) -> None:
    url = f"http://127.0.0.1:{public.port}/redirect?to=/final"
    assert _fetch(url, _policy()) == b"public-bytes"
    assert [h.split("?")[0] for h in public.hits] == ["/redirect", "/final"]


def test_redirect_loop_is_bounded(public: _CountingServer) -> None:
    _refused(f"http://127.0.0.1:{public.port}/loop", _policy(max_redirects=3), "redirected more")
    assert len(public.hits) == 4


def test_size_caps_by_content_length_and_while_streaming(public: _CountingServer) -> None:
    policy = _policy(max_image_bytes=100_000)
    _refused(f"http://127.0.0.1:{public.port}/big", policy, "larger than")
    _refused(f"http://127.0.0.1:{public.port}/stream-big", policy, "larger than")


def test_timeout_and_http_errors(public: _CountingServer) -> None:
    _refused(f"http://127.0.0.1:{public.port}/slow", _policy(timeout_s=0.5), "timed out")
    _refused(f"http://127.0.0.1:{public.port}/missing", _policy(), "HTTP 404")


def test_nothing_listening_is_a_clear_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    _refused(f"http://127.0.0.1:{port}/", _policy(), "could not be fetched")


def test_allow_private_lifts_only_the_address_rule(
    internal: _CountingServer, tmp_path: Path
) -> None:
    policy = MediaPolicy(allow_private_urls=True, timeout_s=5.0)
    assert _fetch(f"http://127.0.0.2:{internal.port}/x", policy) == b"SECRET-v4"
    picture = tmp_path / "a.png"
    picture.write_bytes(b"png")
    _refused(str(picture), policy, "--media-path")


@pytest.mark.parametrize(("value", "allowed"), [("1", True), ("true", False), ("yes", False)])
def test_allow_private_env_is_exactly_one(value: str, allowed: bool) -> None:
    policy = MediaPolicy.from_environment(None, {"MLXCEL_ALLOW_PRIVATE_MEDIA_URLS": value})
    assert policy.allow_private_urls is allowed
    assert MediaPolicy.from_environment(None, {}).allow_private_urls is False


# --- local files ----------------------------------------------------------------------------


@pytest.fixture
def media_root(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    root.mkdir()
    (root / "cat.png").write_bytes(b"cat")
    (root / "sub").mkdir()
    (root / "sub" / "dog.png").write_bytes(b"dog")
    (tmp_path / "outside.txt").write_bytes(b"secret")
    return root


def test_local_files_under_the_media_path(media_root: Path) -> None:
    policy = MediaPolicy.from_environment(str(media_root), {})
    assert _fetch(str(media_root / "cat.png"), policy) == b"cat"
    assert _fetch(f"file://{media_root}/sub/dog.png", policy) == b"dog"
    assert _fetch(f"file://localhost{media_root}/sub/dog.png", policy) == b"dog"


def test_local_escapes_are_refused(media_root: Path) -> None:
    policy = MediaPolicy.from_environment(str(media_root), {})
    outside = media_root.parent / "outside.txt"
    _refused(f"{media_root}/../outside.txt", policy, "outside")
    _refused(f"file://{media_root}/sub/../../outside.txt", policy, "outside")
    _refused(f"file://{media_root}/%2e%2e/outside.txt", policy, "outside")
    (media_root / "link.png").symlink_to(outside)
    _refused(str(media_root / "link.png"), policy, "outside")
    (media_root / "dirlink").symlink_to(media_root.parent)
    _refused(f"{media_root}/dirlink/outside.txt", policy, "outside")
    _refused("relative/cat.png", policy, "absolute path")
    _refused(f"file://otherhost{media_root}/cat.png", policy, "local path")


def test_symlink_inside_the_root_is_followed(media_root: Path) -> None:
    (media_root / "alias.png").symlink_to(media_root / "sub" / "dog.png")
    policy = MediaPolicy.from_environment(str(media_root), {})
    assert _fetch(str(media_root / "alias.png"), policy) == b"dog"


def test_fifo_directory_and_missing_files_are_refused(media_root: Path) -> None:
    os.mkfifo(media_root / "pipe.png")
    policy = MediaPolicy.from_environment(str(media_root), {})
    started = time.monotonic()
    _refused(str(media_root / "pipe.png"), policy, "not a regular file")
    assert time.monotonic() - started < 5  # opening it did not block on a writer
    _refused(str(media_root / "sub"), policy, "not a regular file")
    _refused(str(media_root / "nope.png"), policy, "not found")


def test_local_size_cap(media_root: Path) -> None:
    (media_root / "huge.png").write_bytes(b"x" * 2048)
    policy = MediaPolicy(media_root=media_root.resolve(), max_image_bytes=1024)
    _refused(str(media_root / "huge.png"), policy, "larger than")


def test_no_media_path_means_no_local_files(media_root: Path) -> None:
    _refused(str(media_root / "cat.png"), MediaPolicy(), "--media-path")


# --- local video: a separate, fail-closed allowlist ------------------------------------------


def test_video_allowlist_parsing(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (tmp_path / "file").write_bytes(b"")
    value = f"{a}, {b} ,relative/dir,{tmp_path / 'missing'},{tmp_path / 'file'},,{a}"
    assert parse_video_allowlist(value) == (a.resolve(), b.resolve())
    assert parse_video_allowlist(None) == ()
    assert parse_video_allowlist("") == ()
    assert parse_video_allowlist("relative") == ()


def test_local_video_only_under_the_allowlist(media_root: Path, tmp_path: Path) -> None:
    clips = tmp_path / "clips"
    clips.mkdir()
    (clips / "a.mp4").write_bytes(b"mp4")
    (media_root / "b.mp4").write_bytes(b"mp4-b")
    closed = MediaPolicy.from_environment(str(media_root), {})
    with pytest.raises(MediaError, match="MLXCEL_VIDEO_DIR_ALLOWLIST"):
        asyncio.run(load_media(str(media_root / "b.mp4"), "video", closed))
    opened = MediaPolicy.from_environment(
        str(media_root), {"MLXCEL_VIDEO_DIR_ALLOWLIST": str(clips)}
    )
    assert asyncio.run(load_media(str(clips / "a.mp4"), "video", opened)).data == b"mp4"
    with pytest.raises(MediaError, match="outside"):
        asyncio.run(load_media(str(media_root / "b.mp4"), "video", opened))
    with pytest.raises(MediaError, match="outside"):  # images do not get the video directories
        asyncio.run(load_media(str(clips / "a.mp4"), "image", opened))


def test_allowlist_is_read_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clips = tmp_path / "clips"
    clips.mkdir()
    (clips / "a.mp4").write_bytes(b"mp4")
    monkeypatch.setenv("MLXCEL_VIDEO_DIR_ALLOWLIST", str(clips))
    policy = MediaPolicy.from_environment(None)
    monkeypatch.setenv("MLXCEL_VIDEO_DIR_ALLOWLIST", "")
    assert asyncio.run(load_media(str(clips / "a.mp4"), "video", policy)).data == b"mp4"


# --- staging --------------------------------------------------------------------------------


def test_staged_files_are_private_under_umask_zero() -> None:
    old = os.umask(0)
    try:
        with staged_file(b"clip-bytes", ".mp4") as path:
            assert path.read_bytes() == b"clip-bytes"
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
            directory = path.parent
    finally:
        os.umask(old)
    assert not directory.exists()


def test_staged_file_removed_on_error() -> None:
    with pytest.raises(RuntimeError), staged_file(b"x") as path:
        directory = path.parent
        raise RuntimeError("decoder failed")
    assert not directory.exists()


# --- data URIs and decoding -----------------------------------------------------------------


def _png(width: int, height: int) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 10)).save(out, format="PNG")
    return out.getvalue()


def test_data_uris() -> None:
    png = _png(4, 3)
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    blob = asyncio.run(load_media(uri, "image", MediaPolicy()))
    assert blob.data == png and blob.mime_type == "image/png" and blob.source == "data"
    _refused("data:image/png;base64,@@@not-base64@@@", MediaPolicy(), "not valid base64")
    _refused("data:image/png;base64", MediaPolicy(), "no ','")
    big = "data:image/png;base64," + "A" * 4000
    _refused(big, MediaPolicy(max_image_bytes=1000), "larger than")
    _refused("ftp://example.com/a.png", MediaPolicy(), "must be a data URI")
    _refused("", MediaPolicy(), "non-empty")


def test_decode_image_bounds_pixels() -> None:
    image = decode_image(_png(8, 6), max_pixels=100)
    assert image.size == (8, 6) and image.mode == "RGB"
    with pytest.raises(MediaError, match="pixel limit"):
        decode_image(_png(20, 20), max_pixels=100)
    with pytest.raises(MediaError):
        decode_image(b"not an image at all", max_pixels=100)
    with pytest.raises(MediaError):
        decode_image(_png(8, 6)[:40], max_pixels=100)
