"""The one table of sampling knobs drives request parsing, server defaults and /props."""

from __future__ import annotations

from typing import Any

import pytest

from mlxcel.config import Settings
from mlxcel.engine.defaults import sampling_from_settings
from mlxcel.engine.sampling.params import SAMPLING_KNOBS, SamplingKnob, SamplingParams
from mlxcel.engine.text.request import Priority
from mlxcel.server.llama_native.protocol import default_settings_flat
from mlxcel.server.openai_chat.protocol import ChatCompletionRequest
from mlxcel.server.sampling_fields import SamplingFields, to_generation_request


def _value(knob: SamplingKnob) -> Any:
    """A valid value that differs from SamplingParams' default."""
    if knob.kind is bool:
        return True
    if knob.kind is int:
        return 2 if knob.name == "mirostat" else 7
    return 0.5 if knob.name != "dry_base" else 2.5


def test_every_sampling_params_field_but_the_token_lists_is_a_knob() -> None:
    covered = {param for knob in SAMPLING_KNOBS for param in knob.params}
    fields = set(SamplingParams.__dataclass_fields__)
    assert fields - covered == {"dry_sequence_breakers", "logit_bias"}
    assert set(SamplingFields.model_fields) >= {knob.name for knob in SAMPLING_KNOBS}


@pytest.mark.parametrize("knob", SAMPLING_KNOBS, ids=[k.name for k in SAMPLING_KNOBS])
def test_a_knob_reaches_the_engine_under_each_of_its_names(knob: SamplingKnob) -> None:
    value = _value(knob)
    for name in knob.request:
        body = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], name: value}
        )
        request = to_generation_request(
            body,
            settings=Settings(warmup=False),
            tokenizer=None,  # type: ignore[arg-type]
            family=None,
            prompt_tokens=[1],
            max_tokens=None,
            priority=Priority.NORMAL,
        )
        for param in knob.params:
            assert getattr(request.sampling, param) == value, (name, param)


@pytest.mark.parametrize(
    "knob",
    [k for k in SAMPLING_KNOBS if k.setting],
    ids=[k.name for k in SAMPLING_KNOBS if k.setting],
)
def test_a_knob_default_comes_from_its_setting_and_shows_in_props(knob: SamplingKnob) -> None:
    value = _value(knob)
    sampling = sampling_from_settings(Settings(warmup=False, **{knob.setting: value}))
    for param in knob.params:
        assert getattr(sampling, param) == value
    if knob.props is not None:
        assert default_settings_flat(sampling, n_predict=-1)[knob.props] == value


def test_a_negative_seed_is_unset_everywhere() -> None:
    assert sampling_from_settings(Settings(warmup=False, seed=-1)).seed is None
    flat = default_settings_flat(SamplingParams(seed=None), n_predict=-1)
    assert flat["seed"] == 18446744073709551615  # llama-server's "random"


def _generate_cli(monkeypatch: pytest.MonkeyPatch, *args: str) -> dict[str, Any]:
    """The settings `mlxcel generate ARGS` passes on as given on its command line."""
    import mlxcel.commands.generate as generate
    import typer
    from typer.testing import CliRunner

    from mlxcel.app import app

    seen: dict[str, Any] = {}

    def resolve(profile: str | None, cli: dict[str, Any]) -> Any:
        seen.update(cli)
        raise typer.Exit(0)

    monkeypatch.setattr(generate, "resolve", resolve)
    result = CliRunner().invoke(app, ["generate", *args, "hi"])
    assert result.exit_code == 0, result.output
    return seen


def test_generate_has_an_option_per_knob_setting_under_each_llama_spelling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`mlxcel generate`'s sampling options come from the knob table: every knob with a
    setting answers to each spelling of its llama-server flag row and sets that setting."""
    from mlxcel.config import flag_for_field

    with_setting = [k for k in SAMPLING_KNOBS if k.setting]
    assert len(with_setting) == len(SAMPLING_KNOBS) - 1  # p_less has no setting
    rounds = max(len(flag_for_field(k.setting).spellings) for k in with_setting)  # type: ignore[union-attr]
    for i in range(rounds):
        args: list[str] = []
        for knob in with_setting:
            spellings = flag_for_field(knob.setting).spellings  # type: ignore[union-attr]
            args += [spellings[i % len(spellings)], str(_value(knob))]
        cli = _generate_cli(monkeypatch, *args)
        for knob in with_setting:
            assert cli[knob.setting] == _value(knob), (knob.setting, i)
    named = {"--temperature": "temp", "--top-nsigma": "top_n_sigma", "--typical": "typical_p"}
    for spelling, setting in {**named, "-s": "seed", "--mirostat-ent": "mirostat_tau"}.items():
        assert _generate_cli(monkeypatch, spelling, "1")[setting] == 1


# p_less (a bool) is checked on its own; the seed may be None.
NUMBER_KNOBS = [k for k in SAMPLING_KNOBS if k.kind is not bool and not k.negative_unset]


@pytest.mark.parametrize("knob", NUMBER_KNOBS, ids=[k.name for k in NUMBER_KNOBS])
def test_validate_checks_each_number_knobs_type_from_the_table(knob: SamplingKnob) -> None:
    word = "an integer" if knob.kind is int else "a number"
    for param in knob.params:
        with pytest.raises(ValueError, match=f"^{param} must be {word}, not True$"):
            SamplingParams(**{param: True}).validate()


BOUNDED_KNOBS = [k for k in SAMPLING_KNOBS if (k.ge, k.gt, k.le) != (None, None, None)]


@pytest.mark.parametrize("knob", BOUNDED_KNOBS, ids=[k.name for k in BOUNDED_KNOBS])
def test_validate_checks_each_knobs_range_from_the_table(knob: SamplingKnob) -> None:
    """A value on a closed bound passes; one past any bound (or on an open one) is a
    one-line ValueError naming the param."""
    step = 1 if knob.kind is int else 0.01
    inside = [knob.ge, knob.le]
    outside = [
        *([knob.ge - step] if knob.ge is not None else []),
        *([knob.gt, knob.gt - step] if knob.gt is not None else []),
        *([knob.le + step] if knob.le is not None else []),
    ]
    for param in knob.params:
        for value in inside:
            if value is not None:
                SamplingParams(**{param: knob.kind(value)}).validate()
        for value in outside:
            with pytest.raises(ValueError, match=f"^{param} must be .*, not "):
                SamplingParams(**{param: knob.kind(value)}).validate()


def test_top_p_zero_keeps_only_the_most_probable_token() -> None:
    """The spec's top_p range is [0, 1]; 0 keeps the top token, as llama.cpp keeps at least
    one (it used to mask every token and draw from NaNs)."""
    import mlx.core as mx

    from mlxcel.engine.sampling.samplers import make_sampler

    logits = mx.random.normal((1, 49152), key=mx.random.key(3))
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    top = int(mx.argmax(logprobs, axis=-1).item())
    for seed in range(8):
        params = SamplingParams(temperature=1.5, top_k=0, top_p=0.0, min_p=0.0, seed=seed)
        params.validate()
        assert int(make_sampler(params)(logprobs).item()) == top


def test_dry_below_base_one_is_off_as_in_llama_cpp() -> None:
    from mlxcel.engine.sampling.processors import make_dry

    assert make_dry(0.8, 0.5, 2, -1) is None
    assert make_dry(0.8, 1.75, 2, -1) is not None
    SamplingParams(dry_multiplier=0.8, dry_base=0.5).validate()


STARTUP_REFUSALS = [
    ("repeat_penalty", 0.0, "--repeat-penalty"),
    ("temp", -1.0, "--temp"),
    ("dry_allowed_length", 0, "--dry-allowed-length"),
]


@pytest.mark.parametrize(("field", "value", "flag"), STARTUP_REFUSALS)
def test_a_sampling_option_every_request_would_refuse_is_refused_at_startup(
    field: str, value: float, flag: str
) -> None:
    """The server's defaults pass the same knob table as a request's values: a server that
    would answer every request 400 refuses to start, naming the option (it used to start)."""
    from mlxcel.config import SettingsError
    from mlxcel.server.boot import check_sampling_defaults

    settings = Settings(**{field: value})
    with pytest.raises(SettingsError, match=f"^{flag} must be "):
        check_sampling_defaults(settings)
    with pytest.raises(ValueError):
        sampling_from_settings(settings)
    check_sampling_defaults(Settings(top_p=0.0, dry_base=0.5))  # both llama.cpp-valid
