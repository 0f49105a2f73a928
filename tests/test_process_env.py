"""The `MLXCEL_*` variables read outside the settings model: one module reads them all, each as
the code that used to read it did, and nothing outside `mlxcel/config/` reads one itself."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mlxcel.config import env_var, process_env

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("name", "field"),
    [
        (process_env.MODEL_STORE, "model_store"),
        (process_env.LOOP_DETECTION, "loop_detection"),
        (process_env.AUDIO_MODEL, "audio_model"),
        (process_env.TTS_MODEL, "tts_model"),
        (process_env.IMAGE_MODEL, "image_model"),
    ],
)
def test_setting_backed_names_are_the_settings_variables(name: str, field: str) -> None:
    assert name == env_var(field)


@pytest.mark.parametrize("value", ["off", " OFF ", "0", "false", "no", "none"])
def test_switches_turn_off(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(process_env.CPU_KERNELS, value)
    monkeypatch.setenv(process_env.KERNEL_INT8, value)
    assert process_env.cpu_kernels_enabled() is False
    assert process_env.kernel_int8_enabled() is False


@pytest.mark.parametrize("value", [None, "", "auto", "on", "1"])
def test_switches_stay_on(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    for name in (process_env.CPU_KERNELS, process_env.KERNEL_INT8):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert process_env.cpu_kernels_enabled() is True
    assert process_env.kernel_int8_enabled() is True


def test_kernel_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(process_env.KERNEL_DIR, str(tmp_path / "k"))
    assert process_env.kernel_cache_dir() == tmp_path / "k"
    monkeypatch.setenv(process_env.KERNEL_DIR, "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert process_env.kernel_cache_dir() == tmp_path / "mlxcel" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert process_env.kernel_cache_dir() == Path.home() / ".cache" / "mlxcel" / "kernels"


def test_text_values_and_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in (process_env.BLAS, process_env.WHISPER_FORWARD, process_env.MODEL_STORE):
        monkeypatch.delenv(name, raising=False)
    assert process_env.blas_choice() == "auto"
    assert process_env.whisper_forward() is None
    assert process_env.model_store() is None
    monkeypatch.setenv(process_env.BLAS, "  ")
    assert process_env.blas_choice() == "auto"
    monkeypatch.setenv(process_env.BLAS, " off ")
    assert process_env.blas_choice() == "off"
    monkeypatch.setenv(process_env.WHISPER_FORWARD, "")
    assert process_env.whisper_forward() is None
    monkeypatch.setenv(process_env.MODEL_STORE, str(tmp_path))
    assert process_env.model_store() == tmp_path
    monkeypatch.setenv(process_env.BATCHED_SAMPLING, "0")
    assert process_env.batched_sampling() is False
    monkeypatch.setenv(process_env.BATCHED_SAMPLING, "no")  # only 0 turns it off
    assert process_env.batched_sampling() is True


def test_media_and_budget_read_a_given_mapping() -> None:
    assert process_env.allow_private_media_urls({process_env.ALLOW_PRIVATE_MEDIA_URLS: "1"})
    assert not process_env.allow_private_media_urls({process_env.ALLOW_PRIVATE_MEDIA_URLS: "yes"})
    assert process_env.video_dir_allowlist({process_env.VIDEO_DIR_ALLOWLIST: ""}) is None
    assert process_env.video_dir_allowlist({process_env.VIDEO_DIR_ALLOWLIST: "/a,/b"}) == "/a,/b"
    assert process_env.request_memory_budget({}) is None
    assert process_env.request_memory_budget({process_env.REQUEST_MEMORY_BUDGET: "1G"}) == "1G"


def test_no_mlxcel_variable_is_read_outside_config() -> None:
    read = re.compile(r"""(\b(environ|getenv)\b|envvar=)[^\n]*["']MLXCEL_|["']MLXCEL_\w+["']\)""")
    offenders = [
        f"{path.relative_to(REPO)}:{number}"
        for root in ("mlxcel", "commands")
        for path in sorted((REPO / root).rglob("*.py"))
        if "config" not in path.relative_to(REPO).parts[:2]
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if read.search(line) or re.search(r"""^\w*ENV\w* = ["']MLXCEL_""", line)
    ]
    assert offenders == []


def test_importing_it_loads_no_settings_model() -> None:
    code = "import sys, mlxcel.config.process_env; print('pydantic' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    )
    assert out.stdout.strip() == "False"
