"""Fetching media over http(s) without reaching non-public addresses.

Each hop is resolved once; every answer must be public (mixed answers are refused); the
connection goes to that pinned address (no second lookup, so DNS rebinding cannot move it), with
the original Host header and TLS server name; the peer address is checked again once connected;
redirects are followed by hand, each hop checked the same way; the size is capped by
Content-Length and while streaming; the whole fetch has one deadline.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import time

import httpx

from mlxcel.engine.media.errors import MediaError
from mlxcel.server.media.addresses import parse_address
from mlxcel.server.media.policy import MediaPolicy

_REDIRECTS = frozenset({301, 302, 303, 307, 308})


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """The default verifying TLS context, built once (loading the CA store costs ~0.1 s)."""
    return ssl.create_default_context()


async def _pinned_address(url: httpx.URL, policy: MediaPolicy) -> str:
    host = url.host
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        answers = await policy.resolver(host, port)
    except OSError:
        raise MediaError(f"media URL host {host!r} cannot be resolved") from None
    if not answers:
        raise MediaError(f"media URL host {host!r} cannot be resolved")
    addresses = [parse_address(a) for a in answers]
    if not policy.allow_private_urls and not all(policy.is_public(a) for a in addresses):
        raise MediaError(f"media URL host {host!r} resolves to a non-public address; refused")
    return str(addresses[0])


def _check_peer(response: httpx.Response, pinned: str, policy: MediaPolicy) -> None:
    stream = response.extensions.get("network_stream")
    peer = stream.get_extra_info("server_addr") if stream is not None else None
    if not peer:
        raise MediaError("media URL: the connected peer address is unknown; refused")
    address = parse_address(str(peer[0]))
    if address != parse_address(pinned):
        raise MediaError("media URL: connected to another address than resolved; refused")
    if not policy.allow_private_urls and not policy.is_public(address):
        raise MediaError("media URL: connected peer is a non-public address; refused")


async def fetch_url(url_text: str, policy: MediaPolicy, max_bytes: int, what: str) -> bytes:
    """The body of `url_text` (http or https), under `policy`."""
    deadline = time.monotonic() + policy.timeout_s
    try:
        return await asyncio.wait_for(
            _fetch(url_text, policy, max_bytes, what, deadline), timeout=policy.timeout_s
        )
    except asyncio.TimeoutError:
        raise MediaError(f"{what} URL timed out after {policy.timeout_s:g} s") from None


async def _fetch(
    url_text: str, policy: MediaPolicy, max_bytes: int, what: str, deadline: float
) -> bytes:
    try:
        url = httpx.URL(url_text)
    except (httpx.InvalidURL, ValueError):
        raise MediaError(f"{what} URL is not a valid URL") from None
    async with httpx.AsyncClient(
        trust_env=False, follow_redirects=False, verify=_tls_context()
    ) as client:
        for _ in range(policy.max_redirects + 1):
            if url.scheme not in ("http", "https") or not url.host:
                raise MediaError(f"{what} URL must be http(s); {url.scheme!r} refused")
            pinned = await _pinned_address(url, policy)
            target = url.copy_with(host=pinned)
            headers = {"Host": url.netloc.decode("ascii"), "Accept": "*/*"}
            extensions = {"sni_hostname": url.host} if url.scheme == "https" else {}
            timeout = httpx.Timeout(max(0.1, deadline - time.monotonic()))
            try:
                async with client.stream(
                    "GET", target, headers=headers, extensions=extensions, timeout=timeout
                ) as response:
                    _check_peer(response, pinned, policy)
                    if response.status_code in _REDIRECTS:
                        location = response.headers.get("location")
                        if not location:
                            raise MediaError(f"{what} URL redirected without a Location")
                        url = url.join(location)
                        continue
                    if response.status_code != 200:
                        raise MediaError(f"{what} URL answered HTTP {response.status_code}")
                    return await _read_capped(response, max_bytes, what)
            except httpx.TimeoutException:
                raise MediaError(f"{what} URL timed out") from None
            except httpx.HTTPError as exc:
                reason = type(exc).__name__
                raise MediaError(f"{what} URL could not be fetched ({reason})") from None
        raise MediaError(f"{what} URL redirected more than {policy.max_redirects} times")


async def _read_capped(response: httpx.Response, max_bytes: int, what: str) -> bytes:
    length = response.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise MediaError(f"{what} is larger than {max_bytes} bytes")
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > max_bytes:
            raise MediaError(f"{what} is larger than {max_bytes} bytes")
    return bytes(body)
