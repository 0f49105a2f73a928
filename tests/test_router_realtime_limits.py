"""A router's `/v1/realtime` past `--realtime-max-sessions`: the session is closed with 1013
before any model loads for it (a client could otherwise make the router load, and evict
for, models it will never use)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import websockets
from realtime_client import Client, connect, ws_url
from server_harness import ServeProcess
from test_router import statuses


def test_a_session_past_the_limit_loads_nothing(smollm2_gguf: Path, tmp_path: Path) -> None:
    from fixtures.audio import require_shipped_whisper, tiny_kokoro_dir

    whisper = require_shipped_whisper()
    links = {
        "smol.gguf": smollm2_gguf,
        "other.gguf": smollm2_gguf,
        "whisper": whisper,
        "kokoro": tiny_kokoro_dir(),
    }
    root = tmp_path / "models"
    root.mkdir()
    for name, target in links.items():
        (root / name).symlink_to(target)
    args = ["--models-dir", str(root), "-c", "2048", "--models-max", "4"]
    server = ServeProcess([*args, "--realtime-max-sessions", "1"]).start()

    async def scenario() -> tuple[int | None, str, dict[str, str]]:
        async with connect(ws_url(server.url, "/v1/realtime?model=smol"), None) as ws:
            await Client(ws).until("session.created")
            async with connect(ws_url(server.url, "/v1/realtime?model=other"), None) as second:
                with pytest.raises(websockets.ConnectionClosed):
                    await asyncio.wait_for(second.recv(), 60)
                code, reason = second.close_code, second.close_reason
            with server.client() as http:
                return code, reason, statuses(http)

    try:
        code, reason, loaded = asyncio.run(scenario())
    finally:
        server.stop()
    assert code == 1013 and "too many realtime sessions" in reason
    assert loaded == {
        "smol": "loaded",
        "whisper": "loaded",
        "kokoro": "loaded",
        "other": "unloaded",
    }
