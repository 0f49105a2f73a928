"""`mlxcel cache stats|reset`: the prompt cache of a running `mlxcel serve`."""

from __future__ import annotations

import json
from typing import Any

import typer

from mlxcel.config import process_env

from .common import fail

DEFAULT_URL = "http://127.0.0.1:8080"

URL_OPTION = typer.Option(
    DEFAULT_URL, "--url", envvar=process_env.SERVER_URL, help="Base URL of the running server."
)
API_KEY_OPTION = typer.Option(
    None,
    "--api-key",
    envvar="LLAMA_API_KEY",
    help="API key of the server (env LLAMA_API_KEY: the first of a comma-separated list).",
)
JSON_OPTION = typer.Option(False, "--json", help="Print the server's JSON answer.")
MODEL_OPTION = typer.Option(
    None,
    "-m",
    "--model",
    help="On a router server (--models-dir / --models-preset): the model whose cache to use.",
)


def _path(route: str, model: str | None) -> str:
    """`route`, with `?model=` when a routed model is named."""
    from urllib.parse import urlencode

    return f"{route}?{urlencode({'model': model})}" if model else route


def _call(method: str, url: str, path: str, api_key: str | None) -> dict[str, Any]:
    """One request to the server; exits with one line on any failure."""
    import httpx

    headers = {}
    key = (api_key or "").split(",")[0].strip()
    if key:
        headers["Authorization"] = f"Bearer {key}"
    target = url.rstrip("/") + path
    try:
        response = httpx.request(method, target, headers=headers, timeout=30.0)
    except httpx.HTTPError as exc:
        fail(f"cannot reach {url}: {exc}")
    except httpx.InvalidURL as exc:  # not an HTTPError ('http://[::1')
        fail(f"--url {url!r} is not a valid URL: {exc}")
    try:
        payload = response.json()
    except ValueError:
        payload = None
    if response.status_code >= 400:
        message = ""
        if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
            message = str(payload["error"].get("message") or "")
        fail(f"{target} answered {response.status_code}{': ' + message if message else ''}")
    if not isinstance(payload, dict):
        fail(f"{target} did not answer with a JSON object")
    return payload


def _human_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _show(value: Any, key: str) -> str:
    if key in ("bytes", "capacity_bytes", "freed_bytes") and isinstance(value, int):
        if key == "capacity_bytes" and value < 0:
            return "unlimited"
        return f"{_human_bytes(value)} ({value})"
    if key == "hit_rate" and isinstance(value, (int, float)):
        return f"{value:.1%}"
    return json.dumps(value) if isinstance(value, (bool, type(None))) else str(value)


def _table(title: str, payload: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("field")
    table.add_column("value", justify="right")
    for key, value in payload.items():
        table.add_row(key, _show(value, key))
    Console().print(table)


def stats(
    url: str = URL_OPTION,
    api_key: str | None = API_KEY_OPTION,
    as_json: bool = JSON_OPTION,
    model: str | None = MODEL_OPTION,
) -> None:
    """Show the prompt-cache counters of a running server (GET /v1/cache/stats)."""
    payload = _call("GET", url, _path("/v1/cache/stats", model), api_key)
    if as_json:
        print(json.dumps(payload))
        return
    _table(f"prompt cache at {url}" + (f" ({model})" if model else ""), payload)


def reset(
    url: str = URL_OPTION,
    api_key: str | None = API_KEY_OPTION,
    as_json: bool = JSON_OPTION,
    model: str | None = MODEL_OPTION,
) -> None:
    """Drop every prompt-cache entry of a running server (POST /v1/cache/reset)."""
    payload = _call("POST", url, _path("/v1/cache/reset", model), api_key)
    if as_json:
        print(json.dumps(payload))
        return
    freed = int(payload.get("freed_entries", 0))
    print(f"cleared {freed} entries, freed {_human_bytes(int(payload.get('freed_bytes', 0)))}")
