"""`hwkv bench` output: the tables (rich, or plain text), one JSON object, the plot.

Schema hwkv-bench/2 (over /1: rows time the whole decode step, `mean_ms` and per-phase `phases`
were added, and a top-level `timing` says what the step and each phase hold)."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, List, Sequence

from hwkv.bench.run import PHASES, STEP, BenchResult
from hwkv.engine.plan import format_bytes
from hwkv.errors import ConfigError

SCHEMA = "hwkv-bench/2"
TIME_HEADER = ["config", "bs", "ms/step", "p10-p90 ms", "tokens/s", "translations/fwd", "max |err|"]
PHASE_LABELS = {"alloc_release": "alloc+release", "metadata": "metadata", "forward": "forward/replay"}
PHASE_HEADER = ["config", "bs"] + [f"{PHASE_LABELS[p]} ms" for p in PHASES]
MEMORY_HEADER = ["bs", "live tokens", "full slots", "SWA slots", "hybrid KV", "all-full KV", "saving"]


def to_dict(res: BenchResult) -> Dict[str, Any]:
    """The JSON object (schema 'hwkv-bench/2')."""
    import torch

    shape = res.model
    return {
        "schema": SCHEMA,
        "device": {"name": res.target, "torch_device": res.torch_device, "backend": res.backend,
                   "torch": str(torch.__version__), "threads": res.threads},
        "model": {"name": shape.name, "summary": shape.summary(), "num_layers": shape.num_layers,
                  "run_layers": res.run_layers, "run_swa_layers": sum(shape.layer_is_swa[:res.run_layers]),
                  "window": shape.window, "kv_bytes_per_token_all_full": shape.bytes_per_token_all_full},
        "workload": {**dataclasses.asdict(res.workload), "batch_sizes": list(res.workload.batch_sizes)},
        "configs": list(res.configs),
        "timing": {"step": STEP, "phases": dict(PHASES)},
        "rows": [dataclasses.asdict(r) for r in res.rows],
        "memory": [dataclasses.asdict(m) for m in res.memory],
        "notes": list(res.notes),
        "wall_s": res.wall_s,
    }


def to_json(res: BenchResult) -> str:
    return json.dumps(to_dict(res), indent=2)


def title(res: BenchResult) -> str:
    """One line: device, backend, model, layers actually run."""
    shape, n = res.model, res.run_layers
    swa = sum(shape.layer_is_swa[:n])
    layers = f"all {n} layers" if n == shape.num_layers else f"running {n} of {shape.num_layers} layers"
    threads = f", {res.threads} CPU threads" if res.torch_device == "cpu" else ""
    return (f"hwkv bench on {res.target} ({res.backend}): {shape.name}, {layers} "
            f"({swa} SWA W={shape.window} + {n - swa} full), {res.workload.dtype}, page {res.workload.page_size}"
            f"{threads}")


def caption(res: BenchResult) -> str:
    """One line: the workload behind every row."""
    w = res.workload
    lens = w.prompt_lens(max(w.batch_sizes))
    check = f"reference checked every {w.check_every} forwards" if w.check_every else "no reference check"
    if w.check_every and (w.check_requests or w.check_queries):
        check += (f" ({f'first {w.check_requests} requests' if w.check_requests else 'all requests'}, "
                  f"{f'last {w.check_queries} queries each' if w.check_queries else 'all queries'})")
    return (f"decode: {w.steps} timed steps (+{w.warmup} warm-up) x {w.repeats} repeat(s) after chunked prefill "
            f"(prompts {min(lens)}-{max(lens)} tokens, {w.chunk} tokens/forward); configurations take turns "
            f"each step; a step is allocation + release, metadata and forward; {check}")


def phase_caption() -> str:
    return ("ms per decode step, median (p10-p90): alloc+release = the allocator's alloc_decode and "
            "out-of-window release; metadata = init_forward_metadata, or the graph runner's copy-in, pad and "
            "refill; forward/replay = the layers, or the graph replay (device synchronized around each)")


def time_rows(res: BenchResult) -> List[List[str]]:
    return [[r.config, str(r.batch_size), f"{r.median_ms:.2f}", f"{r.p10_ms:.2f}-{r.p90_ms:.2f}",
             f"{r.tokens_per_s:,.0f}", f"{r.translations_per_forward:g}",
             "-" if r.max_abs_err is None else f"{r.max_abs_err:.1e}"] for r in res.rows]


def _ms(x: float) -> str:
    return f"{x:.3f}" if x < 1 else f"{x:.2f}"


def phase_rows(res: BenchResult) -> List[List[str]]:
    return [[r.config, str(r.batch_size)] + [
        f"{_ms(r.phases[p].median_ms)} ({_ms(r.phases[p].p10_ms)}-{_ms(r.phases[p].p90_ms)})" for p in PHASES]
        for r in res.rows]


def memory_rows(res: BenchResult) -> List[List[str]]:
    return [[str(m.batch_size), f"{m.live_tokens:,}", f"{m.full_slots:,}", f"{m.swa_slots:,}",
             format_bytes(m.hybrid_bytes), format_bytes(m.all_full_bytes), f"{m.saving:.2f}x"] for m in res.memory]


def memory_title(res: BenchResult) -> str:
    shape = res.model
    return (f"KV memory at the end of the run, whole model ({shape.num_layers} layers, "
            f"{shape.dtype_bytes} bytes/element): hybrid pools vs one all-full pool")


def plain_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_plain(res: BenchResult) -> None:
    """The three tables as plain text."""
    print(title(res))
    print(caption(res))
    print()
    print(plain_table(TIME_HEADER, time_rows(res)))
    print()
    print("Phases of a decode step")
    print(phase_caption())
    print(plain_table(PHASE_HEADER, phase_rows(res)))
    print()
    print(memory_title(res))
    print(plain_table(MEMORY_HEADER, memory_rows(res)))
    for note in res.notes:
        print(f"note: {note}")


def print_rich(res: BenchResult) -> None:
    """The three tables through rich."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # piped or redirected: wide enough for every column, not rich's 80
        console = Console(width=120)
    for head, rows, name, cap in ((TIME_HEADER, time_rows(res), title(res), caption(res)),
                                  (PHASE_HEADER, phase_rows(res), "Phases of a decode step", phase_caption()),
                                  (MEMORY_HEADER, memory_rows(res), memory_title(res), None)):
        # text is escaped: rich would take a bracketed part such as "[ipex]" for markup and drop it
        table = Table(title=escape(name), caption=None if cap is None else escape(cap), title_justify="left",
                      caption_justify="left")
        for i, col in enumerate(head):
            table.add_column(escape(col), justify="left" if i == 0 else "right", no_wrap=i == 0)
        for row in rows:
            table.add_row(*(escape(str(c)) for c in row))
        console.print(table)
    for note in res.notes:
        console.print(f"note: {escape(note)}", highlight=False)


# formats matplotlib's Agg canvas lists but writes only through a program outside Python (the plot has text)
NEEDS_PROGRAM = {"pgf": "a LaTeX install (xelatex)"}


def plot_formats() -> Dict[str, str]:
    """File formats the plot can be written in (matplotlib's Agg canvas, less NEEDS_PROGRAM's): extension ->
    description."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    return {k: v for k, v in FigureCanvasAgg.get_supported_filetypes().items() if k not in NEEDS_PROGRAM}


def plot_format(path: str) -> str:
    """The format `plot` writes `path` in: its extension (ConfigError, before any run, when matplotlib cannot
    write it), or png for a path without one (written at exactly `path`)."""
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    if not ext:
        return "png"
    formats = plot_formats()
    if ext not in formats:
        why = f"a .{ext} file needs {NEEDS_PROGRAM[ext]}, which hwkv does not check for" if ext in NEEDS_PROGRAM \
            else f"cannot write a .{ext} file"
        raise ConfigError(f"--plot {path!r}: {why}; use one of {', '.join('.' + f for f in sorted(formats))} (or "
                          "no extension for png)")
    return ext


def plot(res: BenchResult, path: str) -> None:
    """PNG (or the format of the path's extension, `plot_format`): time per decode step vs batch size per
    configuration (p10-p90 bars), the memory comparison, and below them the step's phases stacked, per
    configuration and batch size. ConfigError naming the path and the cause when the file cannot be written (the
    run is over: a disk that filled up, a folder removed meanwhile)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fmt = plot_format(path)

    fig = plt.figure(figsize=(13, 9.5), layout="constrained")
    top, bottom = fig.subfigures(2, 1)
    ax_t, ax_m = top.subplots(1, 2)
    _plot_steps(ax_t, res)
    _plot_memory(ax_m, res)
    _plot_phases(bottom, res)
    fig.suptitle(f"hwkv bench: {res.model.name} on {res.target} ({res.backend})")
    try:
        fig.savefig(path, dpi=110, format=fmt)
    except (OSError, RuntimeError, ValueError, ImportError) as e:  # matplotlib's and its writers' failures
        cause = (str(e).strip().splitlines() or [""])[0]
        raise ConfigError(f"--plot could not write {path!r} after the run: {type(e).__name__}: {cause}") from e
    finally:
        plt.close(fig)


def _plot_steps(ax: Any, res: BenchResult) -> None:
    for config in res.configs:
        rows = [r for r in res.rows if r.config == config]
        xs, ys = [r.batch_size for r in rows], [r.median_ms for r in rows]
        err = [[r.median_ms - r.p10_ms for r in rows], [r.p90_ms - r.median_ms for r in rows]]
        translation, mode = config.split("/")  # colour: eager or graph; dashed: the per-layer baseline
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=config,
                    color="tab:blue" if mode == "eager" else "tab:red",
                    linestyle="--" if translation == "per-layer" else "-")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(res.workload.batch_sizes), [str(b) for b in res.workload.batch_sizes])
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("ms per decode step (median, p10-p90)")
    ax.set_title(f"time per decode step, {res.run_layers} of {res.model.num_layers} layers")
    ax.legend()
    ax.grid(alpha=0.3)


PHASE_COLORS = {"alloc_release": "tab:orange", "metadata": "tab:purple", "forward": "tab:blue"}


def _plot_phases(fig: Any, res: BenchResult) -> None:
    """One panel per batch size (each its own scale): per configuration, the phase medians stacked."""
    sizes = list(res.workload.batch_sizes)
    axes = fig.subplots(1, len(sizes), squeeze=False)[0]
    for ax, bs in zip(axes, sizes):
        rows = [r for r in res.rows if r.batch_size == bs]
        xs = list(range(len(rows)))
        base = [0.0] * len(rows)
        for p in PHASES:
            hs = [r.phases[p].median_ms for r in rows]
            ax.bar(xs, hs, bottom=base, width=0.6, color=PHASE_COLORS[p], label=PHASE_LABELS[p])
            base = [b + h for b, h in zip(base, hs)]
        for x, r, top in zip(xs, rows, base):
            outside = top - r.phases["forward"].median_ms
            ax.annotate(f"{top:.3g} ms\n{100 * outside / top if top else 0:.0f}% not layers", (x, top),
                        ha="center", va="bottom", fontsize=7)
        ax.set_xticks(xs, [r.config.replace("/", "\n") for r in rows], fontsize=8)
        ax.set_ylim(0, max(base, default=1) * 1.4 or 1)  # room for the labels and the legend
        ax.set_title(f"batch size {bs}", fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylabel("ms per decode step (phase medians)")
    axes[0].legend(fontsize=8, loc="upper center", ncol=len(PHASES))
    fig.suptitle("where a decode step goes: allocation + release, metadata, forward or graph replay")


def _plot_memory(ax: Any, res: BenchResult) -> None:
    xs = list(range(len(res.memory)))
    mib = 2.0 ** 20
    hybrid = [m.hybrid_bytes / mib for m in res.memory]
    full = [m.all_full_bytes / mib for m in res.memory]
    ax.bar([x - 0.2 for x in xs], full, width=0.4, label="all-full pool", color="tab:gray")
    bars = ax.bar([x + 0.2 for x in xs], hybrid, width=0.4, label="hybrid (full + SWA)", color="tab:green")
    for bar, m in zip(bars, res.memory):
        ax.annotate(f"{m.saving:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks(xs, [f"bs {m.batch_size}\n{m.live_tokens:,} tok" for m in res.memory])
    ax.set_ylabel("KV MiB held at the end (whole model)")
    ax.set_title("KV memory at the same load")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
