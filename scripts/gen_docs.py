"""Regenerate the files derived from the code: completions/ and docs/llama-server-flags.md.

.venv/bin/python scripts/gen_docs.py          # write them
.venv/bin/python scripts/gen_docs.py --check  # exit 1 when a committed file is stale
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def settings_markdown() -> str:
    """Every setting: its profile table and key, env var, flag and default."""
    from mlxcel.config import all_field_meta, cli_label

    lines = [
        "# Settings reference",
        "",
        "Generated from `mlxcel/config/settings.py` by `scripts/gen_docs.py`; do not edit by hand.",
        "",
        "Precedence: built-in default < TOML profile < environment < command-line flag.",
        "",
        "| Profile key | Env var | Flag | Default | Meaning |",
        "|---|---|---|---|---|",
    ]
    for name, meta in all_field_meta().items():
        default = "" if meta.default is None else repr(meta.default)
        flag = cli_label(name) or ""
        lines.append(
            f"| `[{meta.group}] {name}` | `{meta.env}` | `{flag}` | `{default}` | {meta.help} |"
        )
    return "\n".join(lines) + "\n"


def generated() -> dict[Path, str]:
    """Every generated file and its content."""
    from mlxcel.completion import SCRIPTS
    from mlxcel.config import render_flags_markdown

    files = {ROOT / "completions" / name: render() for name, render in SCRIPTS.items()}
    files[ROOT / "docs" / "llama-server-flags.md"] = render_flags_markdown()
    files[ROOT / "docs" / "settings-reference.md"] = settings_markdown()
    return files


def main() -> int:
    check = "--check" in sys.argv[1:]
    stale = []
    for path, content in generated().items():
        current = path.read_text() if path.exists() else None
        if current != content:
            stale.append(path)
            if not check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(content)
    for path in stale:
        print(f"{'stale' if check else 'wrote'}: {path.relative_to(ROOT)}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
