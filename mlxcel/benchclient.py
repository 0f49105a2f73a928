"""Load client for `mlxcel bench serve`: streaming requests against an OpenAI-compatible server.

It talks to the one base URL it is given (mlxcel, llama-server, mlx_lm.server, vLLM...) over
`/v1/chat/completions` or `/v1/completions` with `stream: true` and
`stream_options.include_usage` (token counts come from the usage chunk when the server sends
one, else each content chunk counts as a token). For every concurrency level C it sends N
requests with at most C in flight and reports time to first token, inter-token latency
(gaps between content chunks), aggregate output tok/s, errors and 503s. Bounded in requests
per level and in overall time. Only httpx is needed; nothing here touches MLX.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}

_WORDS = (
    "the", "river", "runs", "north", "past", "the", "old", "mill", "and", "the", "market",
    "square", "where", "people", "meet", "every", "morning", "to", "trade", "bread", "fish",
    "and", "news", "about", "the", "weather", "and", "the", "harvest",
)  # fmt: skip


class BenchClientError(Exception):
    """The server cannot be benchmarked (unreachable, refuses the key); one line."""


@dataclass(frozen=True)
class ServeBenchConfig:
    """What to send: `requests` None means 4 x the concurrency of each level."""

    url: str
    concurrency: tuple[int, ...] = (1, 4, 8, 16)
    requests: int | None = None
    prompt_len: int = 128
    max_tokens: int = 128
    api_key: str | None = None
    model: str | None = None
    endpoint: str = "chat"  # "chat" | "completions"
    timeout: float = 300.0
    ignore_eos: bool = False
    verify: bool = True  # TLS certificate verification (off: `--insecure`)
    warmup: bool = True  # one untimed request before the first level

    @property
    def base_url(self) -> str:
        """The URL without a trailing `/` or `/v1`."""
        base = self.url.strip().rstrip("/")
        return base[:-3] if base.endswith("/v1") else base

    def n_requests(self, concurrency: int) -> int:
        return self.requests if self.requests is not None else 4 * concurrency

    def validate(self) -> None:
        """Raise BenchClientError (one line) for the first invalid field."""
        if not self.base_url.startswith(("http://", "https://")):
            raise BenchClientError(f"--url must start with http:// or https://, not {self.url!r}")
        try:
            httpx.URL(self.base_url)
        except httpx.InvalidURL as exc:  # not an HTTPError: it escaped as a traceback
            raise BenchClientError(f"--url {self.url!r} is not a valid URL: {exc}") from None
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise BenchClientError("--concurrency levels must be >= 1")
        if self.requests is not None and self.requests < 1:
            raise BenchClientError("--requests must be >= 1")
        if self.prompt_len < 1 or self.max_tokens < 1:
            raise BenchClientError("--prompt-len and --max-tokens must be >= 1")
        if self.timeout <= 0:
            raise BenchClientError("--timeout must be > 0")
        if self.endpoint not in ENDPOINTS:
            raise BenchClientError(f"--endpoint must be chat or completions, not {self.endpoint}")


@dataclass
class RequestResult:
    """One streamed request; times are `time.perf_counter()` seconds."""

    sent: float
    ended: float = 0.0
    status: int | None = None  # HTTP status; None when the connection failed
    error: str | None = None
    chunk_times: list[float] = field(default_factory=list)
    usage_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tokens(self) -> int:
        """Completion tokens: the usage count, else one per content chunk."""
        return self.usage_tokens if self.usage_tokens is not None else len(self.chunk_times)


@dataclass
class LevelReport:
    """The results of one concurrency level."""

    concurrency: int
    requests: int
    completed: int = 0
    errors: int = 0  # failed requests other than 503s (timeouts included)
    http_503: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    tokens_per_second: float = 0.0
    ttft_p50_ms: float | None = None
    ttft_p95_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p95_ms: float | None = None
    usage_reported: bool = False
    error_messages: list[str] = field(default_factory=list)  # distinct, at most 5

    def to_dict(self) -> dict[str, Any]:
        return {
            "concurrency": self.concurrency,
            "requests": self.requests,
            "completed": self.completed,
            "errors": self.errors,
            "http_503": self.http_503,
            "output_tokens": self.output_tokens,
            "wall_s": self.wall_s,
            "tokens_per_second": self.tokens_per_second,
            "ttft_ms": {"p50": self.ttft_p50_ms, "p95": self.ttft_p95_ms},
            "itl_ms": {"p50": self.itl_p50_ms, "p95": self.itl_p95_ms},
            "usage_reported": self.usage_reported,
            "error_messages": list(self.error_messages),
        }


@dataclass
class ServeBenchReport:
    """All levels, in order; `timed_out` when the overall time bound cut the run short."""

    config: ServeBenchConfig
    model: str | None
    levels: list[LevelReport] = field(default_factory=list)
    timed_out: bool = False
    world_size: int | None = None  # ranks the served model is split across (`/props`)

    def to_dict(self) -> dict[str, Any]:
        """The documented JSON shape (docs/bench.md)."""
        c = self.config
        return {
            "url": c.base_url,
            "endpoint": ENDPOINTS[c.endpoint],
            "model": self.model,
            "prompt_len": c.prompt_len,
            "max_tokens": c.max_tokens,
            "timed_out": self.timed_out,
            "world_size": self.world_size,
            "levels": [level.to_dict() for level in self.levels],
        }


@dataclass
class Hooks:
    """Progress callbacks (the CLI drives a progress bar with them)."""

    level_started: Callable[[int, int], None] = lambda concurrency, n: None
    request_done: Callable[[RequestResult], None] = lambda result: None


# --------------------------------------------------------------------------- public API


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def make_prompt(n_words: int, index: int) -> str:
    """About `n_words` tokens of plain text, unique from its first word (no shared prefix)."""
    words = [f"Request {index}:"]
    words += [_WORDS[(index + i) % len(_WORDS)] for i in range(max(0, n_words - 3))]
    return " ".join(words)


def headers(config: ServeBenchConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}


async def preflight(
    config: ServeBenchConfig, *, transport: httpx.AsyncBaseTransport | None = None
) -> str | None:
    """Check that the server answers; return the model name to send (None: send none).

    `GET /v1/models` decides: a connection failure or a refused key raises
    BenchClientError; with exactly one model listed and no `--model`, that one is used.
    The model list needs no key on llama-server (and mlxcel), so the key is checked on
    `GET /props` too (a server without that route answers 404, which passes).
    """
    try:
        async with httpx.AsyncClient(
            timeout=min(config.timeout, 30.0), verify=config.verify, transport=transport
        ) as client:
            response = await client.get(f"{config.base_url}/v1/models", headers=headers(config))
            keyed = await client.get(f"{config.base_url}/props", headers=headers(config))
    except httpx.HTTPError as exc:
        raise BenchClientError(f"cannot reach {config.base_url}: {_describe(exc)}") from None
    refused = next((r for r in (response, keyed) if r.status_code in (401, 403)), None)
    if refused is not None:
        raise BenchClientError(
            f"{config.base_url} refused the request ({refused.status_code}): check --api-key"
        )
    if config.model:
        return config.model
    if response.status_code != 200:
        return None
    with contextlib.suppress(ValueError, TypeError, AttributeError, KeyError):
        listed = response.json().get("data") or []
        if len(listed) == 1 and isinstance(listed[0].get("id"), str):
            return str(listed[0]["id"])
    return None


async def run_serve_bench(
    config: ServeBenchConfig,
    *,
    model: str | None = None,
    hooks: Hooks | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> ServeBenchReport:
    """Drive every concurrency level in turn within `config.timeout` seconds overall.

    `transport` replaces the network (tests pass an `httpx.MockTransport`).
    """
    config.validate()
    hooks = hooks or Hooks()
    report = ServeBenchReport(config=config, model=model)
    deadline = time.perf_counter() + config.timeout
    limits = httpx.Limits(max_connections=max(config.concurrency) + 4)
    timeout = httpx.Timeout(config.timeout, connect=min(config.timeout, 30.0))
    async with httpx.AsyncClient(
        timeout=timeout,
        limits=limits,
        verify=config.verify,
        headers=headers(config),
        transport=transport,
    ) as client:
        report.world_size = await _world_size(client, config)
        if config.warmup:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(_one_request(client, config, model, -1), config.timeout)
        for concurrency in config.concurrency:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                report.timed_out = True
                break
            n = config.n_requests(concurrency)
            hooks.level_started(concurrency, n)
            level, cut = await _run_level(client, config, model, concurrency, n, remaining, hooks)
            report.levels.append(level)
            if cut:
                report.timed_out = True
                break
    return report


# ----------------------------------------------------------------------------- internals


async def _world_size(client: httpx.AsyncClient, config: ServeBenchConfig) -> int | None:
    """The ranks the server's model is split across (mlxcel's `/props` `world_size`); None
    when the server does not say."""
    try:
        response = await client.get(f"{config.base_url}/props", timeout=min(config.timeout, 30.0))
        size = response.json().get("world_size") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return size if isinstance(size, int) and not isinstance(size, bool) else None


async def _run_level(
    client: httpx.AsyncClient,
    config: ServeBenchConfig,
    model: str | None,
    concurrency: int,
    n: int,
    budget: float,
    hooks: Hooks,
) -> tuple[LevelReport, bool]:
    results: list[RequestResult] = []
    next_index = iter(range(n))

    async def worker() -> None:
        for index in next_index:
            result = await _one_request(client, config, model, index)
            results.append(result)
            hooks.request_done(result)

    started = time.perf_counter()
    tasks = [asyncio.ensure_future(worker()) for _ in range(min(concurrency, n))]
    _, pending = await asyncio.wait(tasks, timeout=budget)
    cut = bool(pending)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    ended = time.perf_counter()
    level = summarize_level(concurrency, n, results, ended - started)
    if cut:  # requests in flight or never sent when the time ran out
        missing = n - len(results)
        level.errors += missing
        _note(level, f"overall timeout ({config.timeout:g} s) reached with {missing} unfinished")
    return level, cut


async def _one_request(
    client: httpx.AsyncClient, config: ServeBenchConfig, model: str | None, index: int
) -> RequestResult:
    body: dict[str, Any] = {
        "max_tokens": config.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    prompt = make_prompt(config.prompt_len, index)
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if model:
        body["model"] = model
    if config.ignore_eos:
        body["ignore_eos"] = True
    result = RequestResult(sent=time.perf_counter())
    try:
        async with client.stream(
            "POST", config.base_url + ENDPOINTS[config.endpoint], json=body
        ) as response:
            result.status = response.status_code
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {response.status_code}: {_error_text(text)}"
            else:
                await _read_stream(response, result)
    except httpx.HTTPError as exc:
        result.error = _describe(exc)
    result.ended = time.perf_counter()
    if result.ok and not result.chunk_times:
        result.error = "the stream carried no content"
    return result


async def _read_stream(response: httpx.Response, result: RequestResult) -> None:
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            result.error = "malformed SSE data"
            return
        if not isinstance(chunk, dict):
            continue
        if chunk.get("error"):
            result.error = f"stream error: {_error_text(json.dumps(chunk['error']))}"
            return
        usage = chunk.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            result.usage_tokens = int(usage["completion_tokens"])
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            piece = (
                delta.get("content") or delta.get("reasoning_content") or choice.get("text") or ""
            )
            if piece:
                result.chunk_times.append(time.perf_counter())


def summarize_level(
    concurrency: int, n: int, results: list[RequestResult], wall: float
) -> LevelReport:
    """Percentiles, counts and aggregate tok/s of one level's finished requests."""
    level = LevelReport(concurrency=concurrency, requests=n, wall_s=wall)
    ttfts: list[float] = []
    gaps: list[float] = []
    for r in results:
        if not r.ok:
            if r.status == 503:
                level.http_503 += 1
            else:
                level.errors += 1
            _note(level, r.error or "error")
            continue
        level.completed += 1
        level.output_tokens += r.tokens
        level.usage_reported = level.usage_reported or r.usage_tokens is not None
        ttfts.append(r.chunk_times[0] - r.sent)
        gaps.extend(b - a for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False))
    level.tokens_per_second = level.output_tokens / wall if wall > 0 else 0.0
    level.ttft_p50_ms = _ms(percentile(ttfts, 50))
    level.ttft_p95_ms = _ms(percentile(ttfts, 95))
    level.itl_p50_ms = _ms(percentile(gaps, 50))
    level.itl_p95_ms = _ms(percentile(gaps, 95))
    return level


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _note(level: LevelReport, message: str) -> None:
    if message not in level.error_messages and len(level.error_messages) < 5:
        level.error_messages.append(message)


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    name = type(exc).__name__
    return f"{name}: {text}" if text else name


def _error_text(text: str) -> str:
    """The `error.message` of an OpenAI-style error body, else its first 200 characters."""
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        payload = json.loads(text)
        error = payload.get("error", payload)
        message = error.get("message") if isinstance(error, dict) else error
        if message:
            return str(message).splitlines()[0][:200]
    return text.strip().splitlines()[0][:200] if text.strip() else "(empty body)"
