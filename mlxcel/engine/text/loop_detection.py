"""Detect generation stuck in a loop: the same token pattern repeated back to back.

Policy for one request (`resolve_loop_params`): values set in the request win (any one of
the three fields counts, so `max_pattern_size=0` turns detection off); else the
`MLXCEL_LOOP_DETECTION` environment variable; else the model family's default; else off.

`MLXCEL_LOOP_DETECTION` format (case-insensitive, spaces ignored):

- `off` (or `0`, `none`, `false`, `no`, `disabled`): never detect, even for a family default;
- `on` (or `default`, `true`, `yes`, `enabled`): the family default, else `DEFAULT_LOOP`;
- `MAX,MIN,COUNT`: three integers, e.g. `20,1,4`;
- `max=20,min=1,count=4`: named fields in any order; missing ones come from the family
  default, else `DEFAULT_LOOP`.

An empty value counts as unset. Anything else raises ValueError naming the variable.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mlxcel.config import process_env

MAX_PATTERN_SIZE = 4096
"""The longest pattern a request may ask to detect. The detector holds two lists of that
size and checks every length per token: `max_pattern_size` 2**64 grew a list until the
kernel killed the server."""


@dataclass(frozen=True)
class LoopParams:
    """Stop when the last tokens are one pattern of length `min_pattern_size` to
    `max_pattern_size` repeated `min_count` times in a row.

    `min_pattern_size` 0 means 1; `min_count` < 2 or `max_pattern_size` 0 disables.
    """

    max_pattern_size: int
    min_pattern_size: int
    min_count: int

    @property
    def enabled(self) -> bool:
        """False when these parameters never detect anything."""
        return self.max_pattern_size > 0 and self.min_count >= 2

    @property
    def min_size(self) -> int:
        """The smallest pattern length checked (at least 1)."""
        return max(self.min_pattern_size, 1)

    def validate(self) -> None:
        """Raise ValueError (one line) for negative sizes, a maximum over `MAX_PATTERN_SIZE`
        or min > max."""
        for name in ("max_pattern_size", "min_pattern_size", "min_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"loop detection {name} must be an integer >= 0, not {value!r}")
        if self.max_pattern_size > MAX_PATTERN_SIZE:
            raise ValueError(
                f"loop detection max_pattern_size must be at most {MAX_PATTERN_SIZE}, "
                f"not {self.max_pattern_size}"
            )
        if self.enabled and self.min_size > self.max_pattern_size:
            raise ValueError(
                f"loop detection min_pattern_size ({self.min_pattern_size}) is larger than "
                f"max_pattern_size ({self.max_pattern_size})"
            )


DEFAULT_LOOP = LoopParams(max_pattern_size=20, min_pattern_size=1, min_count=4)

FAMILY_DEFAULTS: dict[str, LoopParams] = {
    "gemma4": LoopParams(max_pattern_size=20, min_pattern_size=1, min_count=4),
}


class LoopDetector:
    """Feed generated tokens one by one; `push` says when the tail is a repeated pattern.

    For each pattern length p it keeps how many trailing tokens equal the token p places
    earlier; the tail is p-periodic over p * min_count tokens (the pattern repeated
    min_count times) once that run reaches p * (min_count - 1). O(max_pattern_size) per token.
    """

    def __init__(self, params: LoopParams) -> None:
        params.validate()
        self.params = params
        self._enabled = params.enabled
        self._sizes = range(params.min_size, params.max_pattern_size + 1)
        self._ring_size = max(params.max_pattern_size, 1)
        self._needed = [p * (params.min_count - 1) for p in range(params.max_pattern_size + 1)]
        self.reset()

    def reset(self) -> None:
        """Forget every token pushed so far."""
        self._ring = [-1] * self._ring_size  # the last max_pattern_size tokens, circular
        self._count = 0  # tokens pushed so far
        self._runs = [0] * len(self._needed)

    def push(self, token_id: int) -> bool:
        """Add a generated token; True when the tail now repeats a pattern `min_count` times."""
        if not self._enabled:
            return False
        ring, size, count, runs = self._ring, self._ring_size, self._count, self._runs
        looping = False
        for p in self._sizes:
            # ring[(count - p) % size] is the token p places before the new one.
            if p <= count and ring[(count - p) % size] == token_id:
                runs[p] += 1
                if runs[p] >= self._needed[p]:
                    looping = True
            else:
                runs[p] = 0
        ring[count % size] = token_id
        self._count = count + 1
        return looping


def parse_loop_env(value: str, family_default: LoopParams | None = None) -> LoopParams | None:
    """Parse a `MLXCEL_LOOP_DETECTION` value (see the module docstring); None means off."""
    text = "".join(value.split()).lower()
    base = family_default or DEFAULT_LOOP
    if text in ("off", "0", "none", "false", "no", "disabled"):
        return None
    if text in ("on", "default", "true", "yes", "enabled"):
        return base
    parts = text.split(",")
    try:
        if all("=" in part for part in parts):
            names = {"max": "max_pattern_size", "min": "min_pattern_size", "count": "min_count"}
            fields: dict[str, int] = {}
            for part in parts:
                key, _, number = part.partition("=")
                name = names.get(key) or (key if key in names.values() else None)
                if name is None or name in fields:
                    raise ValueError
                fields[name] = int(number)
            params = replace(base, **fields)
        elif len(parts) == 3 and not any("=" in part for part in parts):
            size_max, size_min, count = (int(part) for part in parts)
            params = LoopParams(size_max, size_min, count)
        else:
            raise ValueError
        params.validate()
    except ValueError as exc:
        detail = f" ({exc})" if str(exc) else ""
        raise ValueError(
            f"{process_env.LOOP_DETECTION}={value!r} is not 'off', 'on', 'MAX,MIN,COUNT' or "
            f"'max=N,min=N,count=N'{detail}"
        ) from None
    return params if params.enabled else None


def resolve_loop_params(
    max_pattern_size: int | None = None,
    min_pattern_size: int | None = None,
    min_count: int | None = None,
    *,
    env_value: str | None = None,
    model_family: str | None = None,
) -> LoopParams | None:
    """Loop detection for one request (request > env > family default > off); None is off.

    Request fields left as None are filled from the env/family result, else `DEFAULT_LOOP`.
    Raises ValueError for invalid request values or a malformed `env_value`.
    """
    family = FAMILY_DEFAULTS.get(model_family.lower()) if model_family else None
    lower: LoopParams | None = family
    if env_value is not None and env_value.strip():
        lower = parse_loop_env(env_value, family)
    requested = {
        "max_pattern_size": max_pattern_size,
        "min_pattern_size": min_pattern_size,
        "min_count": min_count,
    }
    if any(v is not None for v in requested.values()):
        params = replace(
            lower or family or DEFAULT_LOOP, **{k: v for k, v in requested.items() if v is not None}
        )
        params.validate()
        return params if params.enabled else None
    if lower is not None and not lower.enabled:
        return None
    return lower
