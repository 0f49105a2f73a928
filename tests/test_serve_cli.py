"""`mlxcel serve` as a command: llama-server launch lines, env vars, help, errors, exit codes."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_harness import InProcessServer, ServeProcess

from mlxcel.config import Settings
from mlxcel.server.boot import plan_slots


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mlxcel", "serve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ------------------------------------------------------------------------- no server needed


def test_help_lists_llama_server_options() -> None:
    for flag in ("-h", "--help"):
        result = run_cli(flag)
        assert result.returncode == 0
        assert result.stdout.startswith("usage: mlxcel serve")
        for option in ("--ctx-size", "--parallel", "--api-key", "--metrics", "--max-queue-depth"):
            assert option in result.stdout


def test_unknown_option_is_one_line_and_exit_2() -> None:
    result = run_cli("--definitely-not-an-option")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("mlxcel: error:")
    assert "--definitely-not-an-option" in lines[0]


def test_a_sampling_default_every_request_would_refuse_exits_2_before_listening() -> None:
    result = run_cli("--repeat-penalty", "0", "--port", str(free_port()))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "mlxcel: error: --repeat-penalty must be > 0, not 0.0"
    ]


def test_bad_value_is_one_line_and_exit_2() -> None:
    result = run_cli("--port", "not-a-number")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert "--port" in result.stderr


def test_ignored_option_warns_and_missing_model_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "model.gguf"
    result = run_cli("-ngl", "99", "-m", str(missing), "--port", "0", "--no-warmup")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    warnings = [line for line in lines if line.startswith("mlxcel: warning:")]
    assert len(warnings) == 1 and "-ngl" in warnings[0]
    assert lines[-1].startswith("mlxcel: error:")


def test_port_in_use_is_one_line_and_exit_1() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("--host", "127.0.0.1", "--port", str(port))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines == [f"mlxcel: error: cannot listen on 127.0.0.1:{port}: Address already in use"]


@pytest.mark.parametrize(
    "parallel,ctx,model_ctx,expected",
    [(-1, 0, 2048, (4, 2048)), (4, 4096, 2048, (4, 1024)), (1, 512, 2048, (1, 512)),
     (3, 1000, 8192, (3, 333))],
)  # fmt: skip
def test_slot_plan(parallel: int, ctx: int, model_ctx: int, expected: tuple[int, int]) -> None:
    plan = plan_slots(Settings(parallel=parallel, ctx_size=ctx), model_ctx)
    assert (plan.slots, plan.context_per_slot) == expected


# --------------------------------------------------------------------- real launch lines


def check_launched(url: str, key: str) -> None:
    """What `-c 4096 -np 4 --api-key k --metrics` must give, whichever way it was set."""
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok"
    assert health["batch"]["max_batch_size"] == 4
    assert health["context_size"] == 1024
    headers = {"Authorization": f"Bearer {key}"}
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    assert httpx.post(f"{url}/v1/chat/completions", json=body).status_code == 401
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert answer.status_code == 200
    assert answer.json()["usage"]["completion_tokens"] <= 2
    metrics = httpx.get(f"{url}/metrics", headers=headers)
    assert metrics.status_code == 200
    assert "mlxcel_requests_total 1" in metrics.text


def test_llama_server_launch_line_unchanged(tiny_gguf: Path, tmp_path: Path) -> None:
    shutil.copy(tiny_gguf, tmp_path / "model.gguf")
    port = free_port()
    line = f"-m model.gguf -c 4096 -np 4 --port {port} --api-key k --metrics"
    server = ServeProcess(line.split(), add_address=False, cwd=tmp_path)
    server.start()
    try:
        assert server.url == f"http://127.0.0.1:{port}"
        check_launched(server.url, "k")
    finally:
        code = server.stop()
    assert code == 0, server.stderr  # SIGTERM is a clean shutdown


def test_llama_server_launch_through_env_vars(tiny_gguf: Path, tmp_path: Path) -> None:
    shutil.copy(tiny_gguf, tmp_path / "model.gguf")
    port = free_port()
    env = {
        "LLAMA_ARG_MODEL": "model.gguf",
        "LLAMA_ARG_CTX_SIZE": "4096",
        "LLAMA_ARG_N_PARALLEL": "4",
        "LLAMA_ARG_PORT": str(port),
        "LLAMA_API_KEY": "k",
        "LLAMA_ARG_ENDPOINT_METRICS": "1",
        "MLXCEL_METRICS_PORT": str(metrics_port := free_port()),
    }
    with ServeProcess([], env=env, add_address=False, cwd=tmp_path) as server:
        assert server.url.endswith(f":{port}")
        check_launched(server.url, "k")
        # --metrics-port: /metrics alone on a second port, behind the same key
        metrics_url = f"http://127.0.0.1:{metrics_port}"
        assert httpx.get(f"{metrics_url}/metrics").status_code == 401
        key = {"Authorization": "Bearer k"}
        scraped = httpx.get(f"{metrics_url}/metrics", headers=key)
        assert scraped.status_code == 200 and "mlxcel_requests_total 1" in scraped.text
        assert httpx.get(f"{metrics_url}/health", headers=key).status_code == 404


def test_tls_with_ssl_key_and_cert_files(tiny_llama_dir: Path, tmp_path: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is needed to make a test certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    settings = Settings(
        model=str(tiny_llama_dir), ssl_key_file=str(key), ssl_cert_file=str(cert), warmup=False
    )
    with InProcessServer(settings) as server, server.client() as client:
        assert server.url.startswith("https://")
        assert client.get("/health").json()["status"] == "ok"
        with pytest.raises(httpx.TransportError):  # plain HTTP is not served
            httpx.get(server.url.replace("https://", "http://") + "/health", timeout=5)


def test_ssl_key_without_cert_is_refused(tmp_path: Path) -> None:
    key = tmp_path / "key.pem"
    key.write_text("x")
    result = run_cli("--ssl-key-file", str(key), "--port", "0")
    assert result.returncode == 2
    assert "--ssl-cert-file" in result.stderr.strip().splitlines()[-1]


def test_ssl_files_that_are_no_certificate_and_key_are_one_line(tmp_path: Path) -> None:
    """Files that exist but hold no PEM certificate and key (or a key of another
    certificate): uvicorn failed on them after the model loaded, exit 1 with nothing said."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is needed to make a test certificate")
    pairs = {}
    for name in ("a", "b"):
        key, cert = tmp_path / f"{name}-key.pem", tmp_path / f"{name}-cert.pem"
        subprocess.run(
            [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
             "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        pairs[name] = (key, cert)
    junk = tmp_path / "junk.pem"
    junk.write_bytes(b"RIFF not a certificate")
    (key_a, cert_a), (key_b, _) = pairs["a"], pairs["b"]
    for key, cert in ((junk, junk), (junk, cert_a), (key_a, junk), (key_b, cert_a)):
        args = ("--ssl-key-file", str(key), "--ssl-cert-file", str(cert), "--port", "0")
        result = run_cli(*args, "-m", "/nonexistent.gguf")  # refused before the model
        assert result.returncode == 2, (key.name, cert.name, result.stderr)
        [line] = result.stderr.strip().splitlines()
        assert line.startswith("mlxcel: error: --ssl-cert-file/--ssl-key-file: not a PEM")


@pytest.mark.slow
def test_default_model_end_to_end(smollm2_gguf: Path) -> None:
    """No -m: the embedded SmolLM2 answers through the OpenAI route (a few tokens)."""
    import openai

    with ServeProcess(["-np", "1", "-c", "2048"]) as server:
        models = httpx.get(f"{server.url}/v1/models").json()
        assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        result = client.chat.completions.create(
            model="SmolLM2",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=8,
            temperature=0,
        )
        assert result.choices[0].message.content
        assert result.choices[0].finish_reason in ("stop", "length")
        assert result.usage is not None and 0 < result.usage.completion_tokens <= 8


def test_chat_template_option_forms(tmp_path: Path) -> None:
    from mlxcel.engine.chat.builtin_templates import builtin_template
    from mlxcel.server.boot import chat_template_text

    assert chat_template_text(Settings()) is None
    assert chat_template_text(Settings(chat_template="chatml")) == builtin_template("chatml")
    jinja = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert chat_template_text(Settings(chat_template=jinja)) == jinja
    file = tmp_path / "t.jinja"
    file.write_text("{{ messages[0].content }}")
    assert chat_template_text(Settings(chat_template_file=str(file))) == file.read_text()
    result = run_cli("--chat-template", "no-such-template", "--port", "0")
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(
        "mlxcel: error: --chat-template: unknown built-in template 'no-such-template'"
    )
    assert "llama3" in line and "or pass Jinja text" in line
