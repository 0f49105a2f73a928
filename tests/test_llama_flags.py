"""The llama-server option table: every row of the spec, every spelling, its status."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from mlxcel.config import (
    FLAGS,
    Flag,
    Settings,
    SettingsError,
    Status,
    all_field_meta,
    flag_for_field,
    lookup,
    parse_serve_args,
    render_flags_markdown,
    resolve_settings,
    serve_help,
)

REPO = Path(__file__).resolve().parents[1]
MLXCEL_SECTION = "mlxcel options"


def _tsv_path() -> Path | None:
    candidates = [
        os.environ.get("MLXCEL_FLAGS_TSV", ""),
        str(REPO / "tests" / "data" / "llama-server-flags.tsv"),
        str(REPO / "spec" / "llama-server-flags.tsv"),
        "/work/shared/spec/llama-server-flags.tsv",
    ]
    return next((Path(c) for c in candidates if c and Path(c).is_file()), None)


def _tsv_rows() -> list[tuple[str, str, str, str]]:
    path = _tsv_path()
    if path is None:
        pytest.skip("llama-server-flags.tsv not found (set MLXCEL_FLAGS_TSV)")
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    rows = [ln.split("\t") for ln in lines if not ln.startswith("#")]
    assert rows[0] == ["section", "flags", "env", "default"]
    return [(r[0], r[1], r[2], r[3]) for r in rows[1:]]


LLAMA_FLAGS = [f for f in FLAGS if f.section != MLXCEL_SECTION]
MLXCEL_FLAGS = [f for f in FLAGS if f.section == MLXCEL_SECTION]


def test_table_mirrors_the_spec_row_for_row() -> None:
    rows = _tsv_rows()
    table = [(f.section, f.text, f.tsv_env, f.tsv_default) for f in LLAMA_FLAGS]
    assert table == rows


def test_every_spec_spelling_is_known() -> None:
    spelling = re.compile(r"-{1,2}[A-Za-z0-9][A-Za-z0-9.\-]*")
    for _section, text, _env, _default in _tsv_rows():
        names: list[str] = []
        head = text
        while True:  # every leading "-x, " spelling of the row
            m = spelling.match(head)
            if not m:
                break
            names.append(m.group())
            head = head[m.end() :]
            if not head.startswith(", -"):
                break
            head = head[2:]
        for name in names:
            flag = lookup(name)
            assert flag is not None and flag.text == text, name


def test_every_row_has_a_deliberate_status() -> None:
    for flag in FLAGS:
        assert isinstance(flag.status, Status)
        if flag.status is Status.SUPPORTED:
            assert flag.field or flag.spec.action, flag.text
        else:
            assert flag.field is None and flag.spec.note, flag.text
    counts = {s: sum(f.status is s for f in LLAMA_FLAGS) for s in Status}
    assert all(counts.values())


PINNED = {
    Status.IGNORED: "-tb -C --prio --poll -ngl -fa --mlock --mmap --numa -dev -sm -ts"
    " -mg -kvo --repack --no-host -fit -fitt -cb -nocb --swa-full --perf -e --check-tensors -dio"
    " -lm --threads-http -cmoe -ncmoe --op-offload --webui --ui-config -sps"
    " -hft --offline --draft-max -td -ngld",
    Status.REFUSED: "--lora --lora-scaled --control-vector --control-vector-scaled"
    " --control-vector-layer-range --grammar --grammar-file -j -jf --rope-scaling"
    " --rope-scale --rope-freq-base --rope-freq-scale --yarn-orig-ctx --yarn-ext-factor -mu -hf"
    " -hff -dr --override-kv -mm -mmu --tools --mcp-servers-config"
    " --mcp-servers-json --agent --samplers -l"
    " --gpt-oss-20b-default",
    Status.SUPPORTED: "-md --spec-type --spec-draft-n-max -m -c -n -b -ub -np --port --host"
    " --api-key --api-key-file --metrics -ctk -ctv"
    " --slots --props --cache-prompt -cram --temp --top-k --top-p --min-p -s --seed --jinja"
    " --chat-template --chat-template-kwargs -a -to --embedding --rerank --pooling --warmup"
    " --max-queue-depth --max-body-size --metrics-port -P --cpu-dtype --grammar-backend"
    " --no-chat-template --sleep-idle-seconds --top-nsigma --typical --dynatemp-range"
    " --dynatemp-exp --mirostat --mirostat-lr --mirostat-ent --adaptive-target"
    " --adaptive-decay --models-dir --models-preset --models-max --models-autoload",
}


@pytest.mark.parametrize("status", list(PINNED))
def test_pinned_statuses(status: Status) -> None:
    for spelling in PINNED[status].split():
        flag = lookup(spelling)
        assert flag is not None, spelling
        assert flag.status is status, spelling


def test_every_setting_has_an_option() -> None:
    for name in all_field_meta():
        assert flag_for_field(name) is not None, name


def test_supported_rows_use_the_spec_env_var() -> None:
    for flag in LLAMA_FLAGS:
        if flag.field and flag.tsv_env:
            assert flag.env == flag.tsv_env, flag.text
        if flag.field and not flag.tsv_env:
            assert flag.env == f"MLXCEL_{flag.field.upper()}", flag.text


# A plausible argument per supported field and the value it must produce.
FIELD_VALUES: dict[str, tuple[str, Any]] = {
    "ctx_size": ("4096", 4096),
    "n_predict": ("128", 128),
    "batch_size": ("1024", 1024),
    "ubatch_size": ("256", 256),
    "model": ("model.gguf", "model.gguf"),
    "log_file": ("x.log", "x.log"),
    "log_colors": ("off", "off"),
    "log_verbosity": ("4", 4),
    "seed": ("7", 7),
    "temp": ("0.5", 0.5),
    "top_k": ("5", 5),
    "top_p": ("0.9", 0.9),
    "min_p": ("0.1", 0.1),
    "xtc_probability": ("0.5", 0.5),
    "xtc_threshold": ("0.2", 0.2),
    "top_n_sigma": ("1.5", 1.5),
    "typical_p": ("0.7", 0.7),
    "dynatemp_range": ("0.3", 0.3),
    "dynatemp_exponent": ("2", 2.0),
    "mirostat": ("2", 2),
    "mirostat_tau": ("3", 3.0),
    "mirostat_eta": ("0.2", 0.2),
    "adaptive_target": ("0.4", 0.4),
    "adaptive_decay": ("0.5", 0.5),
    "repeat_last_n": ("32", 32),
    "repeat_penalty": ("1.1", 1.1),
    "presence_penalty": ("0.5", 0.5),
    "frequency_penalty": ("0.25", 0.25),
    "dry_multiplier": ("0.8", 0.8),
    "dry_base": ("2.0", 2.0),
    "dry_allowed_length": ("3", 3),
    "dry_penalty_last_n": ("128", 128),
    "dry_sequence_breaker": ("###", ["###"]),
    "cache_ram": ("1024", 1024),
    "pooling": ("mean", "mean"),
    "parallel": ("4", 4),
    "alias": ("my-model", "my-model"),
    "embd_normalize": ("1", 1),
    "host": ("0.0.0.0", "0.0.0.0"),
    "port": ("9090", 9090),
    "cors_origins": ("http://a", "http://a"),
    "cors_methods": ("GET", "GET"),
    "cors_headers": ("X-A", "X-A"),
    "api_prefix": ("/v", "/v"),
    "api_key": ("k1,k2", ["k1", "k2"]),
    "api_key_file": ("keys.txt", "keys.txt"),
    "ssl_key_file": ("key.pem", "key.pem"),
    "ssl_cert_file": ("cert.pem", "cert.pem"),
    "chat_template_kwargs": ('{"a": 1}', {"a": 1}),
    "timeout": ("60", 60),
    "sse_ping_interval": ("10", 10),
    "media_path": ("/media", "/media"),
    "slot_save_path": ("/slots", "/slots"),
    "prompt_cache_dir": ("/pc", "/pc"),
    "prompt_cache_disk_mib": ("512", 512),
    "reasoning_format": ("none", "none"),
    "reasoning_budget": ("0", 0),
    "reasoning": ("off", "off"),
    "tags": ("a,b", "a,b"),
    "image_model": ("zimage", "zimage"),
    "image_queue_depth": ("2", 2),
    "image_timeout": ("30", 30.0),
    "chat_template": ("chatml", "chatml"),
    "chat_template_file": ("t.jinja", "t.jinja"),
    "model_store": ("/store", "/store"),
    "cpu_dtype": ("float32", "float32"),
    "cache_type_k": ("q8_0", "q8_0"),
    "cache_type_v": ("q8_0", "q8_0"),
    "threads": ("3", 3),
    "grammar_backend": ("xgrammar", "xgrammar"),
    "loop_detection": ("64,4,3", "64,4,3"),
    "metrics_port": ("9100", 9100),
    "max_queue_depth": ("8", 8),
    "max_connections": ("64", 64),
    "sleep_idle_seconds": ("5", 5),
    "max_body_size": ("1000", 1000),
    "cache_ttl_secs": ("60", 60),
    "embedding_model": ("minilm", "minilm"),
    "reranker_model": ("reranker", "reranker"),
    "embedding_batch_size": ("8", 8),
    "embedding_queue_depth": ("16", 16),
    "embedding_timeout": ("30", 30.0),
    "embedding_max_inputs": ("100", 100),
    "audio_model": ("tiny.en", "tiny.en"),
    "tts_model": ("kokoro", "kokoro"),
    "audio_queue_depth": ("4", 4),
    "audio_timeout": ("30", 30.0),
    "video_max_frames": ("4", 4),
    "responses_store_max_entries": ("0", 0),
    "responses_store_ttl_secs": ("5", 5),
    "conversation_store_max_entries": ("7", 7),
    "conversation_store_ttl_secs": ("9", 9),
    "spec_type": ("ngram-simple", "ngram-simple"),
    "spec_draft_model": ("draft.gguf", "draft.gguf"),
    "spec_draft_n_max": ("8", 8),
    "spec_draft_n_min": ("2", 2),
    "models_dir": ("./models", "./models"),
    "models_preset": ("models.ini", "models.ini"),
    "models_max": ("2", 2),
    "distributed_timeout": ("5", 5.0),
    "realtime_max_sessions": ("3", 3),
    "realtime_idle_timeout": ("60", 60.0),
    "realtime_max_audio_seconds": ("30", 30.0),
}


def _plausible_args(flag: Flag) -> list[str]:
    """Arguments after the spelling; never one of the row's no-op values."""
    if flag.nargs == 0 or flag.optional:
        return []
    if flag.field:
        return [FIELD_VALUES[flag.field][0]]
    if flag.spec.action == "profile":
        return ["low-memory"]
    if flag.nargs == 2:
        return ["0", "10"]
    metavar = flag.metavar or ""
    choices = re.fullmatch(r"\{(.+)\}|<(\d(?:\|\d)+)>", metavar)
    if choices:
        options = (choices.group(1) or choices.group(2)).replace("|", ",").split(",")
        return [next(o for o in options if o not in flag.spec.noop)]
    if re.fullmatch(r"[A-Z_]*N|SEED|P|INDEX|SECONDS|SIMILARITY", metavar):
        return ["2"]
    return ["value"]


def _cases() -> list[tuple[Flag, str]]:
    return [(flag, spelling) for flag in FLAGS for spelling in flag.spellings]


@pytest.mark.parametrize(("flag", "spelling"), _cases(), ids=[f"{s}" for _f, s in _cases()])
def test_every_spelling_gets_its_status(flag: Flag, spelling: str) -> None:
    argv = [spelling, *_plausible_args(flag)]
    if flag.status is Status.REFUSED and spelling not in flag.spec.allow:
        with pytest.raises(SettingsError) as e:
            parse_serve_args(argv)
        assert "\n" not in str(e.value) and spelling in str(e.value)
        assert flag.spec.note in str(e.value)
        return
    out = parse_serve_args(argv)
    if flag.status is not Status.SUPPORTED:  # ignored (or a refused row's harmless spelling)
        assert out.cli == {} and out.profile is None and out.action is None
        assert len(out.warnings) == 1
        assert spelling in out.warnings[0] and "\n" not in out.warnings[0]
        return
    assert out.warnings == []
    if flag.spec.action == "profile":
        assert out.profile == "low-memory" and out.cli == {}
    elif flag.spec.action:
        assert out.action == flag.spec.action and out.cli == {}
    else:
        assert flag.field is not None
        if flag.nargs == 0:
            expected: Any = not spelling.startswith(("--no-", "-no-"))
            if flag.field == "no_chat_template":
                expected = True
        elif flag.optional:
            expected = "on"  # the bare form of an [on|off|auto] option
        else:
            expected = FIELD_VALUES[flag.field][1]
        assert out.cli == {flag.field: expected}
        Settings.model_validate(out.cli)


def test_optional_values_are_taken_only_when_they_fit() -> None:
    out = parse_serve_args(["--log-colors", "-c", "100", "-fa", "on", "-fit", "--port", "1"])
    assert out.cli == {"log_colors": "on", "ctx_size": 100, "port": 1}
    assert out.warnings == [
        "ignoring -fa on: MLX chooses its attention kernel itself",
        "ignoring -fit: llama.cpp memory fitting; MLX uses unified memory",
    ]
    assert parse_serve_args(["--log-colors", "auto"]).cli == {"log_colors": "auto"}
    assert parse_serve_args(["--log-colors=off"]).cli == {"log_colors": "off"}


def test_llama_server_command_line() -> None:
    argv = shlex.split("-m model.gguf -c 4096 -np 4 --port 8080 --api-key k --metrics")
    out = parse_serve_args(argv)
    expected = {
        "model": "model.gguf",
        "ctx_size": 4096,
        "parallel": 4,
        "port": 8080,
        "api_key": ["k"],
        "metrics": True,
    }
    assert out.cli == expected
    assert out.warnings == [] and out.profile is None and out.action is None
    s = resolve_settings(cli=out.cli, env={}).settings
    assert (s.model, s.ctx_size, s.parallel, s.port, s.api_key, s.metrics) == tuple(
        expected.values()
    )


def test_same_command_line_through_llama_env_vars() -> None:
    env = {
        "LLAMA_ARG_MODEL": "model.gguf",
        "LLAMA_ARG_CTX_SIZE": "4096",
        "LLAMA_ARG_N_PARALLEL": "4",
        "LLAMA_ARG_PORT": "8080",
        "LLAMA_API_KEY": "k",
        "LLAMA_ARG_ENDPOINT_METRICS": "1",
    }
    r = resolve_settings(env=env)
    s = r.settings
    assert (s.model, s.ctx_size, s.parallel, s.port, s.api_key, s.metrics) == (
        "model.gguf",
        4096,
        4,
        8080,
        ["k"],
        True,
    )
    assert r.sources["ctx_size"] == "env:LLAMA_ARG_CTX_SIZE"
    assert r.sources["api_key"] == "env:LLAMA_API_KEY"


def test_repeatable_and_negative_options() -> None:
    out = parse_serve_args(
        ["--api-key", "a", "--api-key", "b,c", "--no-cache-prompt", "--no-slots", "--no-jinja"]
    )
    assert out.cli == {
        "api_key": ["a", "b", "c"],
        "cache_prompt": False,
        "slots": False,
        "jinja": False,
    }
    breakers = parse_serve_args(["--dry-sequence-breaker", "a", "--dry-sequence-breaker", "b"]).cli[
        "dry_sequence_breaker"
    ]
    assert breakers == ["a", "b"]
    cleared = parse_serve_args(["--dry-sequence-breaker", "a", "--dry-sequence-breaker", "none"])
    assert cleared.cli["dry_sequence_breaker"] == []
    negative = parse_serve_args(["-n", "-1", "--seed", "-1", "--reasoning-budget", "-1"])
    assert negative.cli == {"n_predict": -1, "seed": -1, "reasoning_budget": -1}
    last = parse_serve_args(["-c", "100", "--ctx-size", "200", "--port=9000"])
    assert last.cli == {"ctx_size": 200, "port": 9000}


def test_api_key_file_keys_are_read(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("x\ny\n", encoding="utf-8")
    out = parse_serve_args(["--api-key", "k", "--api-key-file", str(keys)])
    s = resolve_settings(cli=out.cli, env={}).settings
    assert s.api_keys() == ["k", "x", "y"]


def test_refused_rows_accept_their_harmless_forms() -> None:
    out = parse_serve_args(
        ["--reasoning-effort", "default", "--no-context-shift", "--rope-scaling", "none"]
    )
    assert out.cli == {} and len(out.warnings) == 3
    for argv in (["--reasoning-effort", "high"], ["--context-shift"], ["--rope-scaling", "yarn"]):
        with pytest.raises(SettingsError):
            parse_serve_args(argv)


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--foo"], ("unknown option --foo",)),
        (["--ctx-sise", "1"], ("unknown option --ctx-sise", "--ctx-size")),
        (["model.gguf"], ("unexpected argument",)),
        (["--port"], ("--port", "needs a value")),
        (["--port", "abc"], ("--port", "integer")),
        (["--port", "70000"], ("--port", "65535")),
        (["-np", "0"], ("-np",)),
        (["--cpu-dtype", "bf16"], ("--cpu-dtype",)),
        (["--metrics=1"], ("--metrics", "no value")),
        (["--lora", "a.gguf"], ("--lora", "not supported")),
        (["-hf", "org/model"], ("-hf", "never downloads")),
        (["--chat-template-kwargs", "nope"], ("--chat-template-kwargs", "JSON")),
    ],
)
def test_bad_command_lines(argv: list[str], needles: tuple[str, ...]) -> None:
    with pytest.raises(SettingsError) as e:
        parse_serve_args(argv)
    message = str(e.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_actions_and_profile() -> None:
    assert parse_serve_args(["-h"]).action == "help"
    assert parse_serve_args(["--version"]).action == "version"
    out = parse_serve_args(["-P", "deterministic", "--temp", "0.3"])
    assert out.profile == "deterministic"
    s = resolve_settings(profile=out.profile, cli=out.cli, env={}).settings
    assert s.temp == 0.3 and s.seed == 42


def test_serve_help_lists_everything() -> None:
    text = serve_help()
    for flag in FLAGS:
        if flag.status is Status.SUPPORTED:
            assert flag.text in text, flag.text
        else:
            assert flag.name in text, flag.name
    assert "LLAMA_ARG_CTX_SIZE" in text and "Refused" in text and "ignored" in text


def test_markdown_has_a_row_per_option() -> None:
    text = render_flags_markdown()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) == len(FLAGS)
    for line, flag in zip(rows, FLAGS, strict=True):
        cells = re.split(r"(?<!\\)\|", line)[1:-1]
        assert len(cells) == 5, line
        assert cells[3].strip() == flag.status.value
        if flag.field:
            assert f"`{flag.field}`" in cells[4]


def test_underscore_spellings_are_accepted_as_llama_server_does() -> None:
    """llama-server turns `_` into `-` in a `--long` option before looking it up."""
    out = parse_serve_args(
        ["--ctx_size", "64", '--chat_template_kwargs={"a_b": 1}', "--n_gpu_layers", "3"]
    )
    assert out.cli == {"ctx_size": 64, "chat_template_kwargs": {"a_b": 1}}
    assert out.warnings and "--n-gpu-layers" in out.warnings[0]
    for flag in FLAGS:
        for spelling in flag.spellings:
            if spelling.startswith("--") and "-" in spelling[2:]:
                underscored = "--" + spelling[2:].replace("-", "_")
                args = [underscored, *_plausible_args(flag)]
                if flag.status is Status.SUPPORTED and not flag.spec.action:
                    assert parse_serve_args(args).cli == parse_serve_args([spelling, *args[1:]]).cli
    with pytest.raises(SettingsError, match="unknown option"):
        parse_serve_args(["-c_x", "1"])  # short options are taken as they are


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--reasoning", "off"], "off"),
        (["-rea", "0"], "off"),
        (["--reasoning=disabled"], "off"),
        (["--reasoning", "on"], "on"),
        (["--reasoning", "1"], "on"),
        (["--reasoning"], "on"),
        (["--reasoning", "auto"], "auto"),
        (["--reasoning", "-1"], "auto"),
    ],
)
def test_reasoning_switch_spellings(argv: list[str], expected: str) -> None:
    assert parse_serve_args(argv).cli == {"reasoning": expected}


def test_reasoning_switch_sets_template_and_format_defaults() -> None:
    off = resolve_settings(cli=parse_serve_args(["--reasoning", "off"]).cli, env={}).settings
    assert off.chat_template_kwargs == {"enable_thinking": False}
    assert off.reasoning_format == "none"
    on = resolve_settings(env={"LLAMA_ARG_REASONING": "on"}).settings
    assert on.chat_template_kwargs == {"enable_thinking": True}
    assert on.reasoning_format == "auto"
    auto = resolve_settings(env={}).settings
    assert auto.chat_template_kwargs == {} and auto.reasoning_format == "auto"
    # An explicit enable_thinking in --chat-template-kwargs wins over the switch.
    mixed = resolve_settings(
        cli={"reasoning": "off", "chat_template_kwargs": {"enable_thinking": True, "x": 1}},
        env={},
    ).settings
    assert mixed.chat_template_kwargs == {"enable_thinking": True, "x": 1}
    assert mixed.reasoning_format == "auto"
    with pytest.raises(SettingsError, match="--reasoning"):
        parse_serve_args(["--reasoning", "maybe"])
    with pytest.raises(SettingsError, match="LLAMA_ARG_REASONING"):
        resolve_settings(env={"LLAMA_ARG_REASONING": "maybe"})
