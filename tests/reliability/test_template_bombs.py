"""Chat templates that try to build huge strings (from a GGUF or `--chat-template-file`):
every string-making operation of the sandbox is refused past the size limit before the
memory is spent, through the real render path (`ChatTemplate.render`) and a real server
(400 naming the problem, the server still up)."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_harness import ServeProcess
from test_hostile_bodies import assert_still_up

from mlxcel.engine.chat.template import ChatTemplate, TemplateError
from mlxcel.engine.chat.template_limits import MAX_LOOP_STEPS, MAX_TEMPLATE_SIZE

BIG = 10**8  # ten times the limit: 100 MB to 400 MB of text if it were built
BOMBS = {
    "center": "{{ 'x'|center(BIG) }}",
    "center method": "{{ 'x'.center(BIG) }}",
    "ljust": "{{ 'x'.ljust(BIG) }}",
    "rjust": "{{ 'x'.rjust(BIG * 100) }}",
    "zfill": "{{ '1'.zfill(BIG) }}",
    "expandtabs": "{{ ('\t' * 1000).expandtabs(BIG // 100) }}",
    "join": "{{ ('x' * 10**6).join(range(100)|map('string')) }}",
    "join filter": "{{ range(1000)|join('x' * 10**5) }}",
    "format": "{{ '{:>BIG}'.format('x') }}",
    "format nested width": "{{ '{:>{}}'.format('x', BIG) }}",
    "format precision": "{{ '{:.BIGf}'.format(1.5) }}",
    "format filter": "{{ '%BIGs'|format('x') }}",
    "format filter star": "{{ '%*s'|format(BIG, 'x') }}",
    "percent": "{{ '%BIGs' % 'x' }}",
    "indent": "{{ ('a\n' * 1000)|indent(10**5) }}",
    "indent string": "{{ ('a\n' * 1000)|indent('x' * 10**5) }}",
    "concat": "{% set ns = namespace(s='x' * 10**6) %}"
    "{% for i in range(30) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "plus": "{% set ns = namespace(s='x' * 10**6) %}"
    "{% for i in range(30) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
    "plus lists": "{% set ns = namespace(s=[1] * 10**6) %}"
    "{% for i in range(30) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
    "replace": "{{ ('x' * 1000)|replace('x', 'y' * 10**6) }}",
    "replace method": "{{ ('x' * 1000).replace('', 'y' * 10**6) }}",
    "wordwrap": "{{ ('ab ' * 10**5)|wordwrap(1, wrapstring='z' * 10**4) }}",
    "multiply": "{{ 'x' * BIG }}",
    "multiply bytes": "{{ ('x'.encode() * BIG)|length }}",
    "print a list": "{% set big = 'x' * 5 * 10**6 %}{{ [big] * 1000 }}",
    "string filter": "{% set big = 'x' * 5 * 10**6 %}{{ ([big] * 1000)|string }}",
    "concat a list": "{% set big = 'x' * 5 * 10**6 %}{{ ([big] * 1000) ~ '' }}",
    "escape a list": "{% set big = 'x' * 5 * 10**6 %}{{ ([big] * 100)|e }}",
    "output in a loop": "{% set big = 'x' * 5 * 10**6 %}"
    "{% for i in range(1000) %}{{ big }}{% endfor %}",
    "macro body": "{% macro m() %}{% for i in range(1000) %}{{ 'x' * 10**5 }}{% endfor %}"
    "{% endmacro %}{{ m()|length }}",
    "set block": "{% set s %}{% for i in range(10**5) %}{{ 'x' * 1000 }}{% endfor %}{% endset %}"
    "{{ s|length }}",
    "new strings kept in a list": "{% set ns = namespace(l=[]) %}{% set big = 'x' * 5 * 10**6 %}"
    "{% for i in range(1000) %}{% set ns.l = ns.l + [big ~ i] %}{% endfor %}{{ ns.l|length }}",
    "tojson": "{% set big = 'x' * 5 * 10**6 %}{{ ([big] * 1000)|tojson }}",
    "tojson indent": "{{ [[[[1]]]]|tojson(indent=BIG) }}",
    "batch": "{{ [1]|batch(BIG, 'x')|list|length }}",
    "slice": "{{ [1]|slice(BIG)|list|length }}",
    "nested loops": "{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}"
    "{% endfor %}",
}
MESSAGES = [{"role": "user", "content": "hi"}]


def render(source: str) -> str:
    template = ChatTemplate(source.replace("BIG", str(BIG)), bos_token="", eos_token="")
    return template.render(MESSAGES)


@pytest.mark.parametrize("name", list(BOMBS))
def test_a_string_bomb_is_refused_before_the_memory_is_spent(name: str) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(TemplateError) as caught:
            render(BOMBS[name])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(caught.value)
    assert message.startswith("chat template refused: "), message
    assert "too large" in message or "more than" in message, message
    assert "\n" not in message
    # at most a couple of strings or lists at the limit (a list takes 8 bytes an item)
    assert peak < 20 * MAX_TEMPLATE_SIZE, (name, peak)


def test_what_fits_still_renders() -> None:
    """The same operations within the limit render as Jinja renders them."""
    assert render("{{ 'x'|center(5) }}|{{ 'ab'.rjust(4, '-') }}") == "  x  |--ab"
    assert render("{{ '{:>6}'.format('a') }}{{ '%3s'|format('b') }}{{ '%02d' % 7 }}") == (
        "     a  b07"
    )
    assert render("{{ 'a\nb'|indent(2, first=True) }}") == "  a\n  b"
    assert render("{{ ['a', 'b']|join(', ') }} {{ ', '.join(['c', 'd']) }}") == "a, b c, d"
    assert render("{{ 'aXbX'|replace('X', '-') }}{{ 'x' ~ 1 ~ [2] }}") == "a-b-x1[2]"
    assert render("{{ 'one two three'|wordwrap(7) }}") == "one two\nthree"
    assert render("{{ 'hello world'|truncate(7, True, '..', 0) }}") == "hello.."
    assert render("{{ {'a': [1, 2]}|tojson(indent=2) }}") == '{\n  "a": [\n    1,\n    2\n  ]\n}'
    exact = render("{{ 'x' * " + str(MAX_TEMPLATE_SIZE) + " }}")
    assert len(exact) == MAX_TEMPLATE_SIZE  # the limit itself is allowed
    steps = MAX_LOOP_STEPS // 1000 - 1  # outer and inner iterations together: under the budget
    loops = "{% for i in range(1000) %}{% for j in range(N) %}{% endfor %}{% endfor %}ok"
    assert render(loops.replace("N", str(steps))) == "ok"


def test_truncate_stays_within_its_input() -> None:
    """`truncate` never makes a string longer than its input and its `end`."""
    text = render("{{ ('x' * 9 * 10**6)|truncate(BIG, end='y' * 10) }}")
    assert len(text) == 9 * 10**6
    with pytest.raises(TemplateError):  # Jinja refuses an `end` longer than `length`
        render("{{ ('x' * 100)|truncate(5, end='y' * 10**6) }}")


def test_every_render_gets_its_own_budget() -> None:
    inner = MAX_LOOP_STEPS * 3 // 4 // 1000  # three quarters of the budget, each render
    source = "{% for i in range(1000) %}{% for j in range(N) %}{% endfor %}{% endfor %}ok"
    source = source.replace("N", str(inner))
    template = ChatTemplate(source, bos_token="", eos_token="")
    assert [template.render(MESSAGES) for _ in range(3)] == ["ok"] * 3


# ----------------------------------------------------------------------- on the server

SERVER_BOMBS = {
    "center": "'x'|center(BIG)",
    "ljust": "'x'.ljust(BIG)",
    "rjust": "'x'.rjust(BIG)",
    "join": "('x' * 10**6).join(range(100)|map('string'))",
    "format": "'{:>{}}'.format('x', BIG)",
    "indent": "('a\\n' * 1000)|indent(10**5)",
    "concat": "('x' * 5 * 10**6) ~ ('x' * 5 * 10**6) ~ 'x'",
    "replace": "('x' * 1000)|replace('x', 'y' * 10**6)",
    "wordwrap": "('ab ' * 10**5)|wordwrap(1, wrapstring='z' * 10**4)",
}


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServeProcess]:
    """A server whose template builds the bomb the last message names (others render)."""
    branches = "".join(
        f"{{%- elif last == {name!r} -%}}{{{{ {expr} }}}}" for name, expr in SERVER_BOMBS.items()
    ).replace("BIG", str(BIG))
    source = (
        "{%- set last = messages[-1]['content'] -%}{%- if false -%}"
        + branches
        + "{%- else -%}{%- for m in messages -%}{{ m['role'] }}: {{ m['content'] }}{{ '\\n' }}"
        "{%- endfor -%}{%- if add_generation_prompt -%}assistant:{%- endif -%}{%- endif -%}"
    )
    path = tmp_path_factory.mktemp("template") / "bombs.jinja"
    path.write_text(source, encoding="utf-8")
    args = ["-m", str(tiny_llama_dir), "-np", "1", "-c", "512", "--no-warmup"]
    with ServeProcess([*args, "--chat-template-file", str(path)]) as running:
        yield running


@pytest.mark.parametrize("name", list(SERVER_BOMBS))
def test_a_template_bomb_is_a_400_on_the_server(server: ServeProcess, name: str) -> None:
    messages = [{"role": "user", "content": name}]
    with server.client() as http:
        for path, body in (
            ("/apply-template", {"messages": messages}),
            ("/v1/chat/completions", {"messages": messages, "max_tokens": 2}),
            ("/v1/messages", {"model": "m", "max_tokens": 2, "messages": messages}),
        ):
            response = http.post(path, json=body)
            assert response.status_code == 400, (path, response.text[:300])
            error = response.json()["error"]
            assert "chat template" in error["message"] and "too large" in error["message"]
        fine = http.post("/apply-template", json={"messages": [{"role": "user", "content": "hi"}]})
        assert fine.status_code == 200 and fine.json()["prompt"] == "user: hi\nassistant:"
    assert_still_up(server)


def test_the_template_still_renders_normal_chats(server: ServeProcess) -> None:
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text[:300]
