"""TOML profiles: shipped ones load, lookup rules, errors, and a lossless round trip."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mlxcel.config import (
    GROUPS,
    Settings,
    SettingsError,
    all_field_meta,
    find_profile,
    list_profiles,
    load_profile,
    save_profile,
    settings_to_toml,
)
from mlxcel.config.profiles import is_profile_path, parse_profile, shipped_profile_dir

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p.stem for p in (REPO / "configs").glob("*.toml"))


def _settings(values: dict[str, object]) -> Settings:
    return Settings.model_validate(values)


def test_the_three_profiles_ship() -> None:
    assert {"default", "deterministic", "low-memory"} <= set(SHIPPED)
    assert {"default", "deterministic", "low-memory"} <= set(list_profiles(env={}))
    assert (shipped_profile_dir() / "default.toml").is_file()


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_profile_loads(name: str) -> None:
    profile = load_profile(name, env={})
    assert profile.name == name
    settings = _settings(profile.values)
    for key, value in profile.values.items():
        assert getattr(settings, key) == value


def test_default_profile_is_exactly_the_defaults() -> None:
    values = load_profile("default", env={}).values
    defaults = Settings()
    assert _settings(values) == defaults
    unset = {name for name, m in all_field_meta().items() if m.default is None}
    assert set(values) == set(all_field_meta()) - unset


def test_deterministic_profile_is_greedy_with_a_fixed_seed() -> None:
    s = _settings(load_profile("deterministic", env={}).values)
    assert s.temp == 0.0 and s.seed >= 0
    assert s.parallel == 1


def test_low_memory_profile_is_small() -> None:
    s = _settings(load_profile("low-memory", env={}).values)
    d = Settings()
    assert 0 < s.ctx_size <= 8192
    assert s.parallel == 1
    assert s.ubatch_size < d.ubatch_size and s.batch_size < d.batch_size
    assert 0 <= s.cache_ram < d.cache_ram


def _write(tmp_path: Path, text: str, name: str = "p.toml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("tempp = 0.5\n", ("tempp", "temp")),
        ("[sampling]\nbogus = 1\n", ("sampling.bogus",)),
        ("[sampling]\nport = 1\n", ("sampling.port", "[server]")),
        ("[weird]\nx = 1\n", ("weird",)),
        ('temp = "hot"\n', ("temp", "hot")),
        ("port = 1.5\n", ("port",)),
        ('cpu_dtype = "bf16"\n', ("cpu_dtype", "bf16")),
        ("temp = 0.5\n[sampling]\ntemp = 0.6\n", ("temp", "twice")),
        ("temp = = 1\n", ("invalid TOML",)),
        # A TOML boolean for a number: pydantic's lax mode read it as 1 or 0.
        ("n_predict = true\n", ("n_predict: expected an integer, got true",)),
        ("[sampling]\ntemp = false\n", ("sampling.temp: expected a number, got false",)),
        ("port = true\n", ("port: expected an integer, got true",)),
    ],
)
def test_bad_profiles_give_one_line_errors(
    tmp_path: Path, text: str, needles: tuple[str, ...]
) -> None:
    ref = _write(tmp_path, text)
    with pytest.raises(SettingsError) as e:
        load_profile(ref, env={})
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"profile {ref}")
    for needle in needles:
        assert needle in message, message


def test_flat_and_grouped_keys_are_equivalent() -> None:
    flat = parse_profile("temp = 0.3\nport = 9000\nmodel = 'm.gguf'\n", "flat")
    grouped = parse_profile(
        "[sampling]\ntemp = 0.3\n[server]\nport = 9000\n[model]\nmodel = 'm.gguf'\n", "grouped"
    )
    assert flat == grouped == {"temp": 0.3, "port": 9000, "model": "m.gguf"}


def test_profile_references(tmp_path: Path) -> None:
    assert is_profile_path("./x") and is_profile_path("x.toml") and is_profile_path("/a/b")
    assert not is_profile_path("low-memory")
    with pytest.raises(SettingsError):
        find_profile("bad name!", env={})
    with pytest.raises(SettingsError) as e:
        find_profile("missing", env={"MLXCEL_CONFIG_DIR": str(tmp_path)})
    assert "missing" in str(e.value) and "low-memory" in str(e.value)


def test_user_profiles_shadow_shipped_ones(tmp_path: Path) -> None:
    (tmp_path / "low-memory.toml").write_text("ctx_size = 1024\n", encoding="utf-8")
    (tmp_path / "mine.toml").write_text("temp = 0.1\n", encoding="utf-8")
    env = {"MLXCEL_CONFIG_DIR": str(tmp_path)}
    assert load_profile("low-memory", env=env).values == {"ctx_size": 1024}
    assert load_profile("mine", env=env).values == {"temp": 0.1}
    names = list_profiles(env=env)
    assert names["mine"] == str(tmp_path / "mine.toml")
    assert names["low-memory"] == str(tmp_path / "low-memory.toml")
    assert "deterministic" in names


def test_xdg_config_home_is_the_fallback(tmp_path: Path) -> None:
    folder = tmp_path / "mlxcel" / "profiles"
    folder.mkdir(parents=True)
    (folder / "xdg.toml").write_text("top_k = 3\n", encoding="utf-8")
    assert load_profile("xdg", env={"XDG_CONFIG_HOME": str(tmp_path)}).values == {"top_k": 3}


def _unusual_settings() -> Settings:
    return Settings(
        model="~/models/x.gguf",
        alias='my "model"',
        chat_template="{{ messages }}\n{% if x %}y{% endif %}",
        chat_template_kwargs={"enable_thinking": False, "nested": {"a": [1, 2]}},
        temp=0.0,
        top_k=1,
        seed=1234,
        dry_sequence_breaker=["\n", "'", "\\"],
        api_key=["k1", "k2"],
        metrics_port=9100,
        cors_credentials=False,
        log_colors="off",
        pooling="mean",
        cpu_dtype="float32",
        max_body_size=1024,
    )


@pytest.mark.parametrize("only_changed", [False, True])
def test_round_trip_settings_toml_settings(only_changed: bool) -> None:
    original = _unusual_settings()
    text = settings_to_toml(original, only_changed=only_changed)
    loaded = _settings(parse_profile(text, "round-trip"))
    assert loaded == original
    data = tomllib.loads(text)
    assert set(data) <= set(GROUPS)
    assert "metrics_port" in data["server"]
    if only_changed:
        assert "host" not in data.get("server", {})
    else:
        assert data["server"]["host"] == "127.0.0.1"


def test_none_values_are_left_out() -> None:
    text = settings_to_toml(Settings())
    data = tomllib.loads(text)
    flat = {k for table in data.values() for k in table}
    assert "model" not in flat and "api_key_file" not in flat and "metrics_port" not in flat
    assert settings_to_toml(Settings(), only_changed=True) == ""


def test_save_profile_to_path_and_name(tmp_path: Path) -> None:
    original = _unusual_settings()
    path = save_profile(original, tmp_path / "sub" / "saved.toml")
    assert path == tmp_path / "sub" / "saved.toml"
    assert _settings(load_profile(str(path), env={}).values) == original
    env = {"MLXCEL_CONFIG_DIR": str(tmp_path / "profiles")}
    named = save_profile(original, "named", env=env, only_changed=False)
    assert named == tmp_path / "profiles" / "named.toml"
    assert _settings(load_profile("named", env=env).values) == original
    with pytest.raises(SettingsError):
        save_profile(original, "bad name!", env=env)
