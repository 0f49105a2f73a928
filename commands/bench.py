"""Benchmarks: `mlxcel bench` (local prefill/decode tok/s) and `mlxcel bench serve` (a server)."""

from __future__ import annotations

import csv
import json
import sys
from typing import TYPE_CHECKING, Any

import typer

from .common import PROFILE_OPTION, fail, load_model_or_exit, resolve

if TYPE_CHECKING:
    from mlxcel.benchclient import ServeBenchReport
    from mlxcel.engine.bench import BenchReport

app = typer.Typer(
    help="Measure prefill/decode tok/s locally, or drive a running server (`bench serve`).",
    invoke_without_command=True,
    no_args_is_help=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

CSV_COLUMNS = (
    "engine",
    "model",
    "architecture",
    "quantization",
    "size_bytes",
    "n_params",
    "backend",
    "blas",
    "cpu_kernels",
    "test",
    "kind",
    "n_prompt",
    "n_gen",
    "batch",
    "repetitions",
    "tokens_per_second",
    "stddev",
    "peak_memory_bytes",
    "ratio_vs_mlx_lm",
)


def parse_int_list(text: str, option: str) -> tuple[int, ...]:
    """`"1,4,8"` -> (1, 4, 8); one line and exit 2 when it is not a list of integers >= 1."""
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        fail(f"{option} takes comma-separated integers, not {text!r}")
    if not values or any(v < 1 for v in values):
        fail(f"{option} takes comma-separated integers >= 1, not {text!r}")
    return values


@app.callback(invoke_without_command=True)
def bench(
    ctx: typer.Context,
    model: str | None = typer.Option(
        None, "--model", "-m", help="GGUF file, MLX dir or HF repo id (default: embedded model)."
    ),
    n_prompt: int = typer.Option(512, "--n-prompt", "-p", help="Prompt tokens (0: no pp test)."),
    n_gen: int = typer.Option(128, "--n-gen", "-n", help="Generated tokens (0: no tg test)."),
    repetitions: int = typer.Option(3, "--repetitions", "-r", help="Timed runs per test."),
    batch: str = typer.Option(
        "1", "--batch", help="Concurrent sequences for the decode test, e.g. 1,4,8."
    ),
    compare: str | None = typer.Option(
        None, "--compare", help="Also run the workload through mlx-lm and print the ratio."
    ),
    threads: int | None = typer.Option(
        None, "--threads", "-t", help="CPU threads for mlxcel's CPU kernel (-1: one per core)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    as_csv: bool = typer.Option(False, "--csv", help="Print CSV (one row per test)."),
    profile: str | None = PROFILE_OPTION,
) -> None:
    """Prefill and decode tok/s of a local model, like llama-bench."""
    if ctx.invoked_subcommand is not None:
        return
    if as_json and as_csv:
        fail("--json and --csv cannot be combined")
    if compare is not None and compare.strip().lower() not in ("mlx-lm", "mlx_lm"):
        fail(f"--compare only knows mlx-lm, not {compare!r}")
    batches = parse_int_list(batch, "--batch")
    settings = resolve(profile, {"model": model, "threads": threads}).settings

    from mlxcel.engine.bench import BenchConfig, BenchError, run_bench

    config = BenchConfig(
        n_prompt=n_prompt,
        n_gen=n_gen,
        repetitions=repetitions,
        batches=batches,
        prefill_chunk=settings.batch_size,
        compare_mlx_lm=compare is not None,
    )
    try:
        config.validate()
    except BenchError as exc:
        fail(str(exc))
    from mlxcel.engine.distributed.group import launched

    if launched():
        fail(
            "mlxcel bench runs the model in one process; for a model split across ranks, "
            "run `mlxcel serve` under mlx.launch and `mlxcel bench serve --url` against "
            "rank 0 (it reports the world size)"
        )
    loaded = load_model_or_exit(
        settings.model,
        store=settings.model_store,
        cpu_dtype=settings.cpu_dtype,
        cpu_threads=settings.threads,
    )

    from rich.console import Console

    console = Console(stderr=True)
    try:
        if console.is_terminal:
            with console.status("benchmarking…") as status:
                report = run_bench(loaded, config, progress=lambda m: status.update(m))
        else:
            report = run_bench(loaded, config)
    except BenchError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        raise typer.Exit(130) from None
    if as_json:
        print(json.dumps(report.to_dict()))
    elif as_csv:
        _print_csv(report)
    else:
        _print_table(report)


@app.command("serve")
def serve(
    url: str = typer.Option(
        ..., "--url", help="Base URL of the server, e.g. http://127.0.0.1:8080"
    ),
    concurrency: str = typer.Option(
        "1,4,8,16", "--concurrency", "-c", help="Concurrency levels, run in turn."
    ),
    requests: int | None = typer.Option(
        None, "--requests", "-N", help="Requests per level (default: 4 x the concurrency)."
    ),
    prompt_len: int = typer.Option(128, "--prompt-len", help="Prompt length (about, in words)."),
    max_tokens: int = typer.Option(128, "--max-tokens", "-n", help="max_tokens of each request."),
    api_key: str | None = typer.Option(None, "--api-key", help="Bearer token for the server."),
    model_name: str | None = typer.Option(
        None, "--model", "-m", help="`model` field to send (default: the server's only model)."
    ),
    endpoint: str = typer.Option(
        "chat", "--endpoint", help="chat (/v1/chat/completions) or completions (/v1/completions)."
    ),
    timeout: float = typer.Option(300.0, "--timeout", help="Overall time bound, in seconds."),
    ignore_eos: bool = typer.Option(
        False, "--ignore-eos", help="Send ignore_eos (llama-server, vLLM, mlxcel honour it)."
    ),
    insecure: bool = typer.Option(False, "--insecure", help="Do not verify TLS certificates."),
    warmup: bool = typer.Option(
        True, "--warmup/--no-warmup", help="Send one untimed request before the first level."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Drive a running OpenAI-compatible server with streaming requests; latency and tok/s."""
    import asyncio

    from mlxcel.benchclient import (
        BenchClientError,
        Hooks,
        ServeBenchConfig,
        preflight,
        run_serve_bench,
    )

    config = ServeBenchConfig(
        url=url,
        concurrency=parse_int_list(concurrency, "--concurrency"),
        requests=requests,
        prompt_len=prompt_len,
        max_tokens=max_tokens,
        api_key=api_key,
        model=model_name,
        endpoint=endpoint,
        timeout=timeout,
        ignore_eos=ignore_eos,
        verify=not insecure,
        warmup=warmup,
    )
    try:
        config.validate()
        model = asyncio.run(preflight(config))
    except BenchClientError as exc:
        fail(str(exc))

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not console.is_terminal,
        transient=True,
    )
    task: dict[str, Any] = {}

    def level_started(level: int, n: int) -> None:
        if "id" in task:
            progress.remove_task(task["id"])
        task["id"] = progress.add_task(f"concurrency {level}", total=n)

    hooks = Hooks(
        level_started=level_started,
        request_done=lambda _result: progress.advance(task["id"]),
    )
    try:
        with progress:
            report = asyncio.run(run_serve_bench(config, model=model, hooks=hooks))
    except BenchClientError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        raise typer.Exit(130) from None
    if as_json:
        print(json.dumps(report.to_dict()))
    else:
        _print_serve_table(report)


# ------------------------------------------------------------------------------ output


def _human_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def _human_count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return str(n)


def _backend(report: BenchReport) -> str:
    m = report.model
    if not m.blas:
        return m.backend
    from mlxcel.engine.blas import short_name

    kernel = " + mlxcel kernel" if "mlxcel CPU kernel" in m.quantization else ""
    return f"{m.backend} ({short_name(m.blas)}{kernel})"


def _model_label(report: BenchReport) -> str:
    """The model as the table names it: its name, architecture (unless the name is just
    that) and quantization (unless none), e.g. `gemma-3-270m (gemma3) Q4_K_M`."""
    m = report.model
    label = m.name
    if m.architecture and m.architecture != m.name:
        label += f" ({m.architecture})"
    return label if m.quantization in ("", "none") else f"{label} {m.quantization}"


def _stdout_console() -> Any:
    """A console on stdout that does not wrap tables when stdout is a file or a pipe."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=200)


def _print_table(report: BenchReport) -> None:
    from rich.table import Table

    console = _stdout_console()
    table = Table(show_edge=False, header_style="bold")
    for title in ("model", "size", "params", "backend", "engine", "batch", "test"):
        table.add_column(title)
    table.add_column("t/s", justify="right")
    table.add_column("peak mem", justify="right")
    common = (
        _model_label(report),
        _human_bytes(report.model.size_bytes),
        _human_count(report.model.n_params),
        _backend(report),
    )
    for r in report.results:
        table.add_row(
            *common,
            r.engine,
            str(r.batch),
            r.name,
            f"{r.mean:.2f} ± {r.stddev:.2f}",
            _human_bytes(r.peak_memory_bytes),
        )
    console.print(table)
    comparisons = report.comparisons()
    if comparisons:
        ratios = Table(show_edge=False, header_style="bold", title="mlxcel / mlx-lm")
        for title in ("test", "batch", "mlxcel t/s", "mlx-lm t/s", "ratio"):
            ratios.add_column(title, justify="left" if title == "test" else "right")
        for c in comparisons:
            ratios.add_row(
                c.test, str(c.batch), f"{c.mlxcel:.2f}", f"{c.mlx_lm:.2f}", f"{c.ratio:.2f}x"
            )
        console.print()
        console.print(ratios)
    from mlxcel.engine.bench import TG_PROMPT_TOKENS

    console.print(
        f"{report.config.repetitions} runs per test after a warm-up; "
        f"tg tests start from a {TG_PROMPT_TOKENS}-token prompt."
    )


def _print_csv(report: BenchReport) -> None:
    ratios = {(c.test, c.batch): c.ratio for c in report.comparisons()}
    writer = csv.writer(sys.stdout, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    m = report.model
    for r in report.results:
        ratio = ratios.get((r.name, r.batch)) if r.engine == "mlxcel" else None
        writer.writerow(
            [
                r.engine,
                m.name,
                m.architecture,
                m.quantization,
                m.size_bytes,
                m.n_params,
                m.backend,
                m.blas,
                m.cpu_kernels,
                r.name,
                r.kind,
                r.n_prompt,
                r.n_gen,
                r.batch,
                report.config.repetitions,
                f"{r.mean:.4f}",
                f"{r.stddev:.4f}",
                r.peak_memory_bytes,
                "" if ratio is None else f"{ratio:.4f}",
            ]
        )


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _print_serve_table(report: ServeBenchReport) -> None:
    from rich.table import Table

    console = _stdout_console()
    data = report.to_dict()
    ranks = f"  world size {report.world_size}" if report.world_size else ""
    console.print(
        f"{data['url']}{data['endpoint']}  model: {report.model or '(not sent)'}{ranks}  "
        f"prompt ~{data['prompt_len']} words, max_tokens {data['max_tokens']}"
    )
    table = Table(show_edge=False, header_style="bold")
    columns = (
        "concurrency",
        "requests",
        "ok",
        "errors",
        "503",
        "TTFT p50 ms",
        "TTFT p95 ms",
        "ITL p50 ms",
        "ITL p95 ms",
        "tok/s",
        "wall s",
    )
    for title in columns:
        table.add_column(title, justify="right")
    for level in report.levels:
        table.add_row(
            str(level.concurrency),
            str(level.requests),
            str(level.completed),
            str(level.errors),
            str(level.http_503),
            _fmt_ms(level.ttft_p50_ms),
            _fmt_ms(level.ttft_p95_ms),
            _fmt_ms(level.itl_p50_ms),
            _fmt_ms(level.itl_p95_ms),
            f"{level.tokens_per_second:.2f}",
            f"{level.wall_s:.2f}",
        )
    console.print(table)
    for level in report.levels:
        for message in level.error_messages:
            console.print(f"concurrency {level.concurrency}: {message}", markup=False)
    if report.levels and not any(level.usage_reported for level in report.levels):
        console.print("the server sent no usage: tokens were counted as content chunks")
    if report.timed_out:
        console.print(f"stopped by --timeout after {len(report.levels)} level(s)")
