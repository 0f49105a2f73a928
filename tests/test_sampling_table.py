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
