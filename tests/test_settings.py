"""The settings model, env parsing and resolution order (defaults < profile < env < cli)."""

from __future__ import annotations

import importlib.util
import io
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from pydantic import ValidationError

from mlxcel.config import (
    ResolvedSettings,
    Settings,
    SettingsError,
    all_field_meta,
    resolve_settings,
)

REPO = Path(__file__).resolve().parents[1]


def _one_line_error(excinfo: pytest.ExceptionInfo[SettingsError], *needles: str) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message
    return message


def test_defaults_follow_llama_server() -> None:
    s = Settings()
    assert (s.temp, s.top_k, s.top_p, s.min_p) == (0.8, 40, 0.95, 0.05)
    assert (s.repeat_penalty, s.repeat_last_n, s.dry_base, s.dry_allowed_length) == (
        1.0,
        64,
        1.75,
        2,
    )
    assert s.dry_sequence_breaker == ["\n", ":", '"', "*"]
    assert (s.seed, s.n_predict, s.ignore_eos) == (-1, -1, False)
    assert (s.host, s.port, s.ctx_size, s.parallel) == ("127.0.0.1", 8080, 0, -1)
    assert (s.batch_size, s.ubatch_size, s.timeout, s.cache_ram) == (2048, 512, 3600, 8192)
    assert s.cors_methods == "GET, POST, DELETE, OPTIONS"
    assert s.max_body_size == 8 * 1024 * 1024
    assert (s.cpu_dtype, s.grammar_backend, s.reasoning_format) == ("auto", "llguidance", "auto")
    assert s.api_key == [] and s.chat_template_kwargs == {}


def test_mutable_defaults_are_not_shared() -> None:
    a, b = Settings(), Settings()
    a.dry_sequence_breaker.append("x")
    a.api_key.append("k")
    assert b.dry_sequence_breaker == ["\n", ":", '"', "*"] and b.api_key == []


def test_model_is_strict() -> None:
    with pytest.raises(ValidationError):
        Settings(unknown_key=1)  # type: ignore[call-arg]
    s = Settings()
    with pytest.raises(ValidationError):
        s.temp = "hot"  # type: ignore[assignment]
    with pytest.raises(ValidationError):
        Settings(parallel=0)
    with pytest.raises(ValidationError):
        Settings(cpu_dtype="bf16")  # type: ignore[arg-type]


def test_every_field_has_a_unique_env_var() -> None:
    meta = all_field_meta()
    envs = [m.env for m in meta.values()]
    assert len(envs) == len(set(envs))
    for name, m in meta.items():
        assert m.env.startswith(("LLAMA_ARG_", "MLXCEL_")) or m.env == "LLAMA_API_KEY", name
        assert m.help, name
    assert meta["top_k"].env == "LLAMA_ARG_TOP_K"
    assert meta["temp"].env == "MLXCEL_TEMP"
    assert meta["api_key"].env == "LLAMA_API_KEY"


def _profile(tmp_path: Path, text: str, name: str = "p.toml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_precedence_default_profile_env_cli(tmp_path: Path) -> None:
    prof = _profile(tmp_path, "temp = 0.5\ntop_k = 10\nport = 9000\n[server]\nhost = '0.0.0.0'\n")
    env = {"LLAMA_ARG_TOP_K": "20", "LLAMA_ARG_PORT": "9001", "MLXCEL_MIN_P": "0.2"}
    r = resolve_settings(profile=prof, env=env, cli={"port": 9002, "min_p": 0.3})
    s = r.settings
    assert (s.temp, s.top_k, s.port, s.min_p, s.host, s.top_p) == (
        0.5,
        20,
        9002,
        0.3,
        "0.0.0.0",
        0.95,
    )
    assert r.sources["temp"] == f"profile:{prof}"
    assert r.sources["host"] == f"profile:{prof}"
    assert r.sources["top_k"] == "env:LLAMA_ARG_TOP_K"
    assert r.sources["port"] == "cli"
    assert r.sources["min_p"] == "cli"
    assert r.sources["top_p"] == "default"
    assert set(r.sources) == set(all_field_meta())
    assert r.profile == prof
    assert r.changed() == {"temp": 0.5, "top_k": 20, "port": 9002, "min_p": 0.3, "host": "0.0.0.0"}


def test_no_profile_no_env_gives_defaults() -> None:
    r = resolve_settings(env={})
    assert r.settings == Settings()
    assert set(r.sources.values()) == {"default"}
    assert r.profile is None and r.warnings == []


def test_profile_from_env_and_explicit_profile_wins(tmp_path: Path) -> None:
    a = _profile(tmp_path, "temp = 0.1\n", "a.toml")
    b = _profile(tmp_path, "temp = 0.2\n", "b.toml")
    assert resolve_settings(env={"MLXCEL_PROFILE": a}).settings.temp == 0.1
    assert resolve_settings(profile=b, env={"MLXCEL_PROFILE": a}).settings.temp == 0.2


def test_named_shipped_profile_resolves() -> None:
    r = resolve_settings(profile="deterministic", env={})
    assert r.settings.temp == 0.0
    assert r.sources["temp"] == "profile:deterministic"


def test_missing_profile_is_a_settings_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError) as e:
        resolve_settings(profile="no-such-profile", env={"MLXCEL_CONFIG_DIR": str(tmp_path)})
    _one_line_error(e, "no-such-profile")
    with pytest.raises(SettingsError) as e:
        resolve_settings(profile=str(tmp_path / "gone.toml"), env={})
    _one_line_error(e, "gone.toml")


@pytest.mark.parametrize(
    ("word", "expected"),
    [
        ("1", True),
        ("0", False),
        ("true", True),
        ("False", False),
        ("on", True),
        ("OFF", False),
        ("enabled", True),
        ("disabled", False),
        ("yes", True),
        ("no", False),
    ],
)
def test_env_booleans_accept_llama_spellings(word: str, expected: bool) -> None:
    env = {"LLAMA_ARG_ENDPOINT_METRICS": word, "LLAMA_ARG_CACHE_PROMPT": word}
    s = resolve_settings(env=env).settings
    assert s.metrics is expected and s.cache_prompt is expected


@pytest.mark.parametrize(
    ("var", "value", "extra"),
    [
        ("LLAMA_ARG_PORT", "abc", "integer"),
        ("LLAMA_ARG_PORT", "70000", "65535"),
        ("MLXCEL_TEMP", "hot", "number"),
        ("LLAMA_ARG_CACHE_PROMPT", "maybe", "boolean"),
        ("MLXCEL_CPU_DTYPE", "bf16", "keep"),
        ("LLAMA_ARG_N_PARALLEL", "0", "-1"),
        ("LLAMA_ARG_CHAT_TEMPLATE_KWARGS", "{bad", "JSON object"),
        ("LLAMA_ARG_CHAT_TEMPLATE_KWARGS", "[1]", "JSON object"),
        ("MLXCEL_DRY_SEQUENCE_BREAKER", "[1, 2]", "list of strings"),
        ("LLAMA_ARG_POOLING", "max", "mean"),
    ],
)
def test_malformed_env_names_the_variable(var: str, value: str, extra: str) -> None:
    with pytest.raises(SettingsError) as e:
        resolve_settings(env={var: value})
    assert isinstance(e.value, ValueError)
    _one_line_error(e, var, extra)


def test_malformed_env_is_reported_even_when_cli_overrides() -> None:
    with pytest.raises(SettingsError) as e:
        resolve_settings(env={"LLAMA_ARG_PORT": "abc"}, cli={"port": 1234})
    _one_line_error(e, "LLAMA_ARG_PORT")


def test_env_text_values() -> None:
    env = {
        "LLAMA_API_KEY": "a, b,,c",
        "MLXCEL_DRY_SEQUENCE_BREAKER": '["x", ","]',
        "LLAMA_ARG_CHAT_TEMPLATE_KWARGS": '{"enable_thinking": false}',
        "LLAMA_ARG_LOG_COLORS": "1",
        "LLAMA_ARG_HOST": "",  # empty counts as unset
        "MLXCEL_METRICS_PORT": "9100",
        "MLXCEL_LOOP_DETECTION": "64,4,3",
    }
    r = resolve_settings(env=env)
    s = r.settings
    assert s.api_key == ["a", "b", "c"]
    assert s.dry_sequence_breaker == ["x", ","]
    assert s.chat_template_kwargs == {"enable_thinking": False}
    assert s.log_colors == "on"
    assert s.host == "127.0.0.1" and r.sources["host"] == "default"
    assert s.metrics_port == 9100
    assert s.loop_detection == "64,4,3"
    single = resolve_settings(env={"MLXCEL_DRY_SEQUENCE_BREAKER": "###"}).settings
    assert single.dry_sequence_breaker == ["###"]
    none = resolve_settings(env={"MLXCEL_DRY_SEQUENCE_BREAKER": "none"}).settings
    assert none.dry_sequence_breaker == []


def test_ignored_and_refused_env_vars() -> None:
    quiet = resolve_settings(env={"LLAMA_ARG_THREADS_HTTP": "8", "LLAMA_ARG_N_GPU_LAYERS": "99"})
    assert quiet.warnings == [] and quiet.settings == Settings()
    assert resolve_settings(env={"LLAMA_ARG_THREADS": "8"}).settings.threads == 8
    loud = resolve_settings(env={"LLAMA_ARG_HF_REPO": "org/model", "LLAMA_ARG_MODEL": "m.gguf"})
    assert len(loud.warnings) == 1
    assert "LLAMA_ARG_HF_REPO" in loud.warnings[0] and "\n" not in loud.warnings[0]
    assert loud.settings.model == "m.gguf"
    assert resolve_settings(env={"LLAMA_ARG_CONTEXT_SHIFT": "0"}).warnings == []
    assert len(resolve_settings(env={"LLAMA_ARG_CONTEXT_SHIFT": "1"}).warnings) == 1
    assert resolve_settings(env={"LLAMA_ARG_SPEC_TYPE": "none"}).warnings == []


def test_cli_values_are_checked_and_coerced() -> None:
    r = resolve_settings(env={}, cli={"ctx_size": "4096", "metrics": "enabled", "model": None})
    assert r.settings.ctx_size == 4096 and r.settings.metrics is True
    assert r.sources["model"] == "default"
    with pytest.raises(SettingsError) as e:
        resolve_settings(env={}, cli={"port": -1})
    _one_line_error(e, "--port")
    with pytest.raises(SettingsError) as e:
        resolve_settings(env={}, cli={"tmep": 0.5})
    _one_line_error(e, "tmep", "temp")


def test_api_key_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("one\n\n  two  \none\n", encoding="utf-8")
    r = resolve_settings(env={"LLAMA_ARG_API_KEY_FILE": str(keys), "LLAMA_API_KEY": "zero"})
    assert r.settings.api_keys() == ["zero", "one", "two"]
    with pytest.raises(SettingsError) as e:
        resolve_settings(env={"LLAMA_ARG_API_KEY_FILE": str(tmp_path / "nope")})
    _one_line_error(e, "LLAMA_ARG_API_KEY_FILE", "nope")
    with pytest.raises(SettingsError) as e:
        resolve_settings(env={}, cli={"api_key_file": str(tmp_path / "nope")})
    _one_line_error(e, "--api-key-file")


def test_api_key_file_with_no_key_or_no_text_is_one_line(tmp_path: Path) -> None:
    """An empty key file served with no auth at all; bytes that are no UTF-8 were a
    UnicodeDecodeError traceback at start."""
    empty, blank, latin = tmp_path / "empty", tmp_path / "blank", tmp_path / "latin"
    empty.write_bytes(b"")
    blank.write_bytes(b"\n  \n")
    latin.write_bytes(b"cl\xe9\n")
    for path, needle in ((empty, "holds no key"), (blank, "holds no key"), (latin, "UTF-8")):
        with pytest.raises(SettingsError) as e:
            resolve_settings(env={}, cli={"api_key_file": str(path)})
        _one_line_error(e, "--api-key-file", needle)


def test_text_settings_that_are_not_utf8_are_one_line() -> None:
    """Bytes on argv or in the environment that are no UTF-8 reach Python as lone
    surrogates; the key was a UnicodeEncodeError traceback when the server started."""
    with pytest.raises(SettingsError) as e:
        resolve_settings(env={}, cli={"api_key": ["good", "bad\udcff"]})
    _one_line_error(e, "--api-key: not UTF-8")
    with pytest.raises(SettingsError) as e:
        resolve_settings(env={"LLAMA_API_KEY": "\udcff"})
    _one_line_error(e, "LLAMA_API_KEY: not UTF-8")
    # an --alias (or a model file's name) of such bytes made every reply a 500
    with pytest.raises(SettingsError) as e:
        resolve_settings(env={}, cli={"alias": "m\udcff"})
    _one_line_error(e, "--alias: not UTF-8")
    with pytest.raises(SettingsError) as e:
        resolve_settings(env={"LLAMA_ARG_MODEL": "/models/m\udcff.gguf"})
    _one_line_error(e, "LLAMA_ARG_MODEL: not UTF-8")


def test_chat_template_file_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    from mlxcel.server.boot import chat_template_text

    template = tmp_path / "latin.jinja"
    template.write_bytes(b"{{ 'caf\xe9' }}")
    settings = resolve_settings(env={}, cli={"chat_template_file": str(template)}).settings
    with pytest.raises(SettingsError) as e:
        chat_template_text(settings)
    _one_line_error(e, "--chat-template-file", "not UTF-8")


def test_import_stays_light() -> None:
    code = (
        "import sys, mlxcel.config\n"
        "heavy = [m for m in ('mlx', 'mlx_lm', 'transformers', 'numpy', 'fastapi', 'torch')"
        " if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    )
    assert out.stdout.strip() == ""


def _settings_helpers() -> ModuleType:
    path = REPO / "commands" / "_settings.py"
    spec = importlib.util.spec_from_file_location("_mlxcel_settings_helpers", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_print_settings_shows_value_and_source() -> None:
    from rich.console import Console

    helpers = _settings_helpers()
    r = resolve_settings(env={"LLAMA_ARG_PORT": "9001", "LLAMA_API_KEY": "secret"})
    console = Console(file=io.StringIO(), width=200, record=True)
    helpers.print_settings(r, console)
    text = console.export_text()
    port_line = next(line for line in text.splitlines() if " port " in line)
    assert "9001" in port_line and "env:LLAMA_ARG_PORT" in port_line
    temp_line = next(line for line in text.splitlines() if " temp " in line)
    assert "0.8" in temp_line and "default" in temp_line
    assert "secret" not in text


def test_exit_with_settings_error(capsys: pytest.CaptureFixture[str]) -> None:
    import typer

    helpers = _settings_helpers()
    with pytest.raises(typer.Exit) as e:
        helpers.exit_with_settings_error(SettingsError("LLAMA_ARG_PORT: bad\nmore"))
    assert e.value.exit_code == 2
    err = capsys.readouterr().err
    assert err == "mlxcel: error: LLAMA_ARG_PORT: bad more\n"


def test_resolved_settings_type() -> None:
    r = resolve_settings(env={})
    assert isinstance(r, ResolvedSettings) and isinstance(r.settings, Settings)
