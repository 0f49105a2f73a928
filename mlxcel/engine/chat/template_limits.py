"""Size limits for what a chat template builds in the sandbox (string and memory bombs).

A template (from a GGUF or `--chat-template-file`) is untrusted code: `'x'|center(10**9)`,
`' '.join(...)`, `'{:>999999999}'.format(x)`, `s ~ s` in a loop, `|indent`, `|replace`,
`|wordwrap`, `[s] * n` printed... can each ask for gigabytes. Every operation that makes a
string or a list is checked *before* it runs where an argument sets the size (a width, a
count, a separator times the items) and its result after; the rendered text, the body of a
macro or `{% set %}` block and every value printed are bounded too. Past `MAX_TEMPLATE_SIZE`
characters (or items) the render fails with SecurityError "... is too large", which the
template layer reports as a one-line TemplateError (a 400 on the server). Each render also
has a budget (`render_budget`): MAX_BUILT characters built in all, MAX_LOOP_STEPS loop
iterations, so that many strings within the limit, or loops that build nothing, cannot
run away either.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import wraps
from inspect import Parameter, signature
from typing import Any

from jinja2.sandbox import SandboxedFormatter, SecurityError

MAX_TEMPLATE_SIZE = 10_000_000
"""Most characters a chat template may render or build in one string, or items in one list."""

MAX_LOOP_STEPS = 1_000_000
"""Most `{% for %}` iterations one render may run, all loops together (nested loops over
`range(100000)` would otherwise run for hours)."""

MAX_BUILT = 10 * MAX_TEMPLATE_SIZE
"""Most characters (or list items) one render may build in all: each string can be within
MAX_TEMPLATE_SIZE and still a loop could keep thousands of them (in a list, a macro's
output); a real prompt is built a few times over at most."""


@dataclass
class _Budget:
    steps: int = 0
    built: int = 0


_budget: ContextVar[_Budget | None] = ContextVar("template_render_budget", default=None)

_SEQUENCES = (str, bytes, list, tuple)
# Largest text a non-container scalar prints as (a float, a bool, None, a short object).
_SCALAR_TEXT = 32
# A printf conversion: flags, width, precision (`*` takes them from the arguments).
_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")
_SPEC_NUMBERS = re.compile(r"\d+")


def too_large(what: str) -> SecurityError:
    """The error for an operation whose result would pass MAX_TEMPLATE_SIZE."""
    return SecurityError(
        f"{what} is too large: a chat template may build at most {MAX_TEMPLATE_SIZE} "
        "characters in one string"
    )


def check(size: int, what: str) -> None:
    """Raise `too_large(what)` when `size` passes the limit."""
    if size > MAX_TEMPLATE_SIZE:
        raise too_large(what)


def spend(size: int) -> None:
    """Count `size` newly built characters (or items) against the render's MAX_BUILT."""
    budget = _budget.get()
    if budget is not None:
        budget.built += size
        if budget.built > MAX_BUILT:
            raise SecurityError(f"the chat template built more than {MAX_BUILT} characters in all")


def check_result(value: Any, what: str) -> Any:
    """`value`, after checking the size of a string or list an operation returned (and
    counting it against the render's budget)."""
    if isinstance(value, _SEQUENCES):
        check(len(value), f"the result of {what}")
        spend(len(value))
    return value


def text_size(value: Any, budget: int = MAX_TEMPLATE_SIZE) -> int:
    """About how many characters `str(value)` has (an upper bound: strings inside a list or
    dict count their quotes, and every character as an escape unless all are printable);
    the walk is iterative, visits each item once and stops past `budget`."""
    total = 0
    pending: list[tuple[Any, bool]] = [(value, False)]
    while pending and total <= budget:
        item, nested = pending.pop()
        if isinstance(item, str):
            total += len(item) if not nested or item.isprintable() else 10 * len(item)
            total += 2 if nested else 0
        elif isinstance(item, bytes):
            total += 4 * len(item) + 3
        elif isinstance(item, int) and not isinstance(item, bool):
            total += item.bit_length() // 3 + 2
        elif isinstance(item, Mapping):
            total += 4 * len(item) + 2
            pending.extend((part, True) for pair in item.items() for part in pair)
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 2 * len(item) + 2
            pending.extend((part, True) for part in item)
        else:
            total += _SCALAR_TEXT
    return total


def printed(value: Any) -> Any:
    """`value`, after checking the text it prints as (the environment's `finalize`, called
    for every value a template prints; a string prints as itself, nothing is built)."""
    if not isinstance(value, str):
        size = text_size(value)
        check(size, "a printed value")
        spend(size)
    return value


def bounded_concat(pieces: Iterable[str]) -> str:
    """`"".join(pieces)`, stopping as soon as the text passes MAX_TEMPLATE_SIZE (the
    environment's `concat`: the rendered text and every macro or block body)."""
    parts: list[str] = []
    total = 0
    for piece in pieces:
        total += len(piece)
        if total > MAX_TEMPLATE_SIZE:
            raise too_large("the rendered text")
        parts.append(piece)
    spend(total)
    return "".join(parts)


def concat_text(values: Iterable[Any]) -> str:
    """The `~` operator: the values as text, joined, checked before anything is built."""
    items = list(values)
    check(sum(text_size(v) for v in items), "the result of ~")
    return bounded_concat(str(v) for v in items)


# ------------------------------------------------------------------------ operators


def check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse `*`, `+` and `%` whose result would be too large, before computing it."""
    if operator == "*":
        for seq, count in ((left, right), (right, left)):
            if isinstance(seq, _SEQUENCES) and isinstance(count, int):
                check(len(seq) * count, "the result of *")
    elif operator == "+":
        if isinstance(left, _SEQUENCES) and isinstance(right, _SEQUENCES):
            check(len(left) + len(right), "the result of +")
    elif operator == "%" and isinstance(left, str):
        args = right if isinstance(right, tuple) else (right,)
        check(printf_size(left, args), "the result of %")


def printf_size(fmt: str, args: tuple[Any, ...] | Mapping[str, Any]) -> int:
    """An upper bound of the length of `fmt % args` (`|format` and the `%` operator)."""
    values = list(args.values()) if isinstance(args, Mapping) else list(args)
    numbers = [v for v in values if isinstance(v, int)]
    size = len(fmt) + sum(text_size(v) for v in values)
    for width, precision in _PRINTF.findall(fmt):
        for part in (width, precision):
            if part == "*":
                size += max((abs(n) for n in numbers), default=0)
            elif part:
                size += int(part)
    return size


def check_format_spec(spec: str) -> None:
    """Refuse a `str.format` field whose width or precision is too large."""
    for number in _SPEC_NUMBERS.findall(spec):
        check(int(number), "a format width")


class BoundedFormatter(SandboxedFormatter):
    """The sandbox's `str.format` formatter, checking each field before formatting it."""

    def format_field(self, value: Any, format_spec: str) -> Any:
        check_format_spec(format_spec)
        if not isinstance(value, str):
            check(text_size(value), "a formatted value")
        return super().format_field(value, format_spec)


# ------------------------------------------------------------------ calls and filters


def _arg(args: tuple[Any, ...], kwargs: Mapping[str, Any], index: int, name: str) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name)


def _int(value: Any) -> int:
    return value if isinstance(value, int) else 0


def _replace_size(text: str, old: Any, new: Any, count: Any) -> int:
    if not isinstance(old, str) or not isinstance(new, str):
        return len(text)
    hits = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * max(0, len(new) - len(old))


def _join_size(separator: str, items: list[Any]) -> int:
    return sum(text_size(i) for i in items) + len(separator) * max(0, len(items) - 1)


def check_str_method(
    text: str, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> tuple[Any, ...]:
    """Refuse a call of `text.<name>(...)` whose result would be too large; the arguments
    to call with (an iterable given to `join` is read into a list first)."""
    what = f"the result of str.{name}"
    if name in ("center", "ljust", "rjust", "zfill"):
        check(max(len(text), _int(_arg(args, kwargs, 0, "width"))), what)
    elif name == "expandtabs":
        tabsize = _arg(args, kwargs, 0, "tabsize")
        check(len(text) + text.count("\t") * _int(8 if tabsize is None else tabsize), what)
    elif name == "replace":
        old, new = _arg(args, kwargs, 0, "old"), _arg(args, kwargs, 1, "new")
        check(_replace_size(text, old, new, _arg(args, kwargs, 2, "count")), what)
    elif name == "join" and args:
        items = list(args[0])
        check(_join_size(text, items), what)
        return (items, *args[1:])
    return args


FilterEstimate = Callable[[Mapping[str, Any]], int]


def _indent_size(a: Mapping[str, Any]) -> int:
    text, width = a["s"], a.get("width", 4)
    pad = len(width) if isinstance(width, str) else _int(width)
    return text_size(text) + pad * (str(text).count("\n") + 1 if isinstance(text, str) else 1)


def _wordwrap_size(a: Mapping[str, Any]) -> int:
    text = a["s"] if isinstance(a["s"], str) else ""
    wrap = a.get("wrapstring") or "\n"
    lines = len(text) // max(1, _int(a.get("width", 79))) + len(text.split()) + text.count("-")
    return len(text) + len(str(wrap)) * (lines + 1)


def _format_size(a: Mapping[str, Any]) -> int:
    fmt = a["value"] if isinstance(a["value"], str) else str(a["value"])
    return printf_size(fmt, a.get("kwargs") or tuple(a.get("args", ())))


# Filters whose result size an argument sets: the estimate from the bound arguments.
FILTER_ESTIMATES: dict[str, FilterEstimate] = {
    "center": lambda a: max(text_size(a["value"]), _int(a.get("width", 80))),
    "indent": _indent_size,
    "replace": lambda a: (
        _replace_size(
            str(a["s"]) if isinstance(a["s"], str) else "", a["old"], a["new"], a.get("count")
        )
        + (0 if isinstance(a["s"], str) else text_size(a["s"]))
    ),
    "wordwrap": _wordwrap_size,
    "format": _format_size,
    "batch": lambda a: _int(a.get("linecount")) if a.get("fill_with") is not None else 0,
    "slice": lambda a: 8 * _int(a.get("slices")),
}
# Filters that print their value (any object) as text, and by how much they can grow it.
TEXT_FILTERS: dict[str, int] = {
    "string": 1,
    "pprint": 2,
    "e": 6,
    "escape": 6,
    "forceescape": 6,
    "urlencode": 9,
    "urlize": 2,
    "xmlattr": 6,
    "upper": 1,  # at most 3 times longer ('ﬃ' -> 'FFI'): a string is checked after
    "lower": 1,
    "title": 1,
    "capitalize": 1,
    "trim": 1,
    "striptags": 1,
    "truncate": 1,
    "wordcount": 1,
}


def bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """`func` (the filter `name`) checked before it runs and its result after."""
    try:
        params = signature(func)
    except (TypeError, ValueError):  # a builtin without a signature (abs, len)
        params = None
    passes_context = getattr(func, "jinja_pass_arg", None) is not None
    # Jinja's async-ready filters take the pass argument without naming it in the signature
    first = next(iter(params.parameters), "") if params is not None else ""
    skip = 1 if passes_context and first not in ("context", "eval_ctx", "environment") else 0
    estimate = FILTER_ESTIMATES.get(name)
    growth = TEXT_FILTERS.get(name)
    what = f"the result of the {name} filter"

    @wraps(func)
    def checked(*args: Any, **kwargs: Any) -> Any:
        value_index = 1 if passes_context else 0
        if name == "join" and len(args) > value_index:  # read the items once, then measure
            items = list(args[value_index])
            args = (*args[:value_index], items, *args[value_index + 1 :])
            separator = _arg(args, kwargs, value_index + 1, "d")
            check(_join_size(str(separator or ""), items), what)
        elif estimate is not None and params is not None:
            bound = params.bind(*args[skip:], **kwargs)
            bound.apply_defaults()
            named = dict(bound.arguments)
            for parameter in params.parameters.values():
                if parameter.kind is Parameter.VAR_KEYWORD:
                    named["kwargs"] = named.pop(parameter.name, {})
            check(estimate(named), what)
        elif growth is not None and len(args) > value_index:
            check(growth * text_size(args[value_index]), what)
        return check_result(func(*args, **kwargs), f"the {name} filter")

    return checked


@contextmanager
def render_budget() -> Iterator[None]:
    """One render's budget: MAX_LOOP_STEPS loop iterations, MAX_BUILT characters built
    (per thread: renders may run on several at once)."""
    token = _budget.set(_Budget())
    try:
        yield
    finally:
        _budget.reset(token)


def bounded_iter(iterable: Iterable[Any]) -> Iterator[Any]:
    """`iterable`, counting each item against the render's loop budget (wraps the iterable
    of every `{% for %}` of a template)."""
    budget = _budget.get()
    for item in iterable:
        if budget is not None:
            budget.steps += 1
            if budget.steps > MAX_LOOP_STEPS:
                raise SecurityError(
                    f"the chat template's loops ran more than {MAX_LOOP_STEPS} iterations"
                )
        yield item
