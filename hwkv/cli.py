"""The `hwkv` command: `info` (devices and CPU features), `verify`, `bench`, `plan`, `generate`.

Each subcommand is a `Command` in `COMMANDS`: a function adding its arguments and one running it. The other
subcommands' modules are imported by `main` (inside its handlers, so a Ctrl-C while they load is "interrupted"),
and heavy imports belong inside the run function, so `hwkv info` stays fast. The console script enters through
the top-level `hwkv_entry`, which guards the import of this package (torch) the same way.
"""
from __future__ import annotations

import argparse
import errno
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
from dataclasses import dataclass
from typing import IO, Any, Callable, Optional

from hwkv import __version__, devices
from hwkv._amx import cpu_features
from hwkv.env import ALL as ENV_VARS
from hwkv.env import HWKV_DEVICE
from hwkv.errors import DeviceError, HwkvError

EXIT_OK = 0
EXIT_MISMATCH = 1  # reserved: an output differed from hwkv.reference (bench, verify)
EXIT_ERROR = 2  # a typed hwkv error (e.g. DeviceError, ConfigError) or a write error; one line on stderr
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)
EXIT_BROKEN_PIPE = 141  # stdout closed early (128 + SIGPIPE)
# a write that fails with one of these (no file name attached) is the output failing, e.g. `> /dev/full`
OUTPUT_ERRNOS = frozenset(getattr(errno, n) for n in ("ENOSPC", "EDQUOT", "EFBIG", "EIO") if hasattr(errno, n))


@dataclass(frozen=True)
class Command:
    """One subcommand: help line, argument builder, runner returning the exit code."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ------------------------------------------------------------------------------------ info

def add_info_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `hwkv info`."""
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--device", metavar="NAME", default=None,
                        help="show which path each layer kind takes on this device instead of the detected one "
                             "(answers from the plugin's rules, so the device need not be present)")


def _hwkv_version() -> str:
    try:
        return importlib.metadata.version("hwkv")
    except importlib.metadata.PackageNotFoundError:
        return "source tree (not installed)"


def layer_paths_data(specs: dict[str, devices.DeviceSpec], name: Optional[str]) -> Optional[dict[str, Any]]:
    """The device's answer for every layer kind (hwkv.paths.PathTable as data); None without a device.
    A device whose plugin reports no table answers with empty rows and says so."""
    if name is None:
        return None
    spec = specs.get(name)
    if spec is None:
        raise DeviceError(f"--device {name!r} names no known device (known: {', '.join(sorted(specs))})")
    fn = spec.load_layer_paths()
    if fn is None:
        return {"device": name, "geometry": "", "rows": [],
                "assumptions": [f"the {name} plugin reports no per-kind table (DeviceSpec.layer_paths is empty): "
                                f"every layer runs {spec.backend}"]}
    return spec.describe_layer_paths().as_dict()


def info_data(paths_device: Optional[str] = None) -> dict[str, Any]:
    """Everything `hwkv info` shows, as JSON-able data; `error` is the DeviceError text or None.
    `paths_device`: whose layer-path table to show (default: the detected device's)."""
    import torch

    forced = HWKV_DEVICE.get().strip() or None
    specs = devices.discover()
    rows = devices.report(specs, show_probe_errors=True)  # a device whose probe raises is listed with the error
    device: Optional[str] = None
    error: Optional[str] = None
    try:
        device = devices.select(specs, forced).name
    except DeviceError as e:
        error = str(e)
    cpu = cpu_features()
    path, why = specs["cpu"].describe_attention_path()  # the CPU plugin answers (discover() always knows it)
    return {
        "device": device,
        "forced": forced is not None,
        "HWKV_DEVICE": forced or "",
        "error": error,
        "devices": [
            {"name": s.name, "priority": s.priority, "available": reason is None, "reason": reason,
             "backend": s.backend, "graph_adapter": s.graph_adapter, "torch_device": s.torch_device,
             "description": s.description}
            for s, reason in rows
        ],
        "cpu": {"amx": cpu.amx, "amx_reason": cpu.reason, "amx_flags": list(cpu.amx_flags),
                "capability": cpu.capability, "sgl_kernel": cpu.sgl_kernel,
                "attention_path": path, "attention_path_reason": why},
        "layer_paths": layer_paths_data(specs, device if paths_device is None else paths_device),
        "torch": str(torch.__version__),
        "hwkv": _hwkv_version(),
        "python": platform.python_version(),
    }


def _summary_lines(data: dict[str, Any]) -> list[str]:
    if data["device"] is None:
        head = "device: none (see the error below)"
    elif data["forced"]:
        head = f"device: {data['device']} (forced by {HWKV_DEVICE.name}={data['HWKV_DEVICE']})"
    else:
        head = f"device: {data['device']} (highest-priority available; {HWKV_DEVICE.name} unset)"
    return [head, f"torch {data['torch']}  hwkv {data['hwkv']}  python {data['python']}"]


def _device_rows(data: dict[str, Any]) -> list[list[str]]:
    return [[d["name"], str(d["priority"]), "available" if d["available"] else f"no: {d['reason']}",
             d["backend"], d["graph_adapter"] or "-"] for d in data["devices"]]


def _cpu_rows(data: dict[str, Any]) -> list[list[str]]:
    cpu = data["cpu"]
    return [
        ["AMX", f"{'yes' if cpu['amx'] else 'no'} ({cpu['amx_reason']})"],
        ["torch CPU capability", cpu["capability"]],
        ["sgl-kernel CPU ops", "installed" if cpu["sgl_kernel"] else "not installed"],
        ["attention path", cpu["attention_path"]],
        ["because", cpu["attention_path_reason"]],
    ]


def _path_rows(data: dict[str, Any]) -> list[list[str]]:
    paths = data.get("layer_paths") or {"rows": []}
    return [[r["layer"], r["mode"], r["feature"], r["path"], r["op"], r["why"]] for r in paths["rows"]]


def _path_notes(data: dict[str, Any]) -> list[str]:
    paths = data.get("layer_paths")
    if not paths:
        return []
    head = f"layer paths on {paths['device']}" + (f" ({paths['geometry']})" if paths["geometry"] else "")
    return [head] + [f"  assumes: {a}" for a in paths["assumptions"]]


DEVICE_HEADER = ["device", "priority", "available / why not", "backend", "graph adapter"]
PATH_HEADER = ["layer", "mode", "feature", "path", "op", "why"]


def _plain_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_info_plain(data: dict[str, Any]) -> None:
    """`hwkv info` as plain text."""
    print("\n".join(_summary_lines(data)))
    print()
    print(_plain_table(DEVICE_HEADER, _device_rows(data)))
    print()
    print(_plain_table(["CPU", ""], _cpu_rows(data)))
    notes = _path_notes(data)
    if notes:
        print()
        print("\n".join(notes))
        if _path_rows(data):
            print(_plain_table(PATH_HEADER, _path_rows(data)))


def print_info_rich(data: dict[str, Any]) -> None:
    """`hwkv info` as rich tables."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    # every text is escaped: rich reads "[...]" as markup, so "pip install 'hwkv[ipex]'" would lose "[ipex]"
    console = Console()
    for line in _summary_lines(data):
        console.print(escape(line), highlight=False)
    table = Table(title="devices (highest priority first)")
    table.add_column("device", no_wrap=True)
    table.add_column("prio", justify="right", no_wrap=True)
    table.add_column(DEVICE_HEADER[2], overflow="fold", ratio=1)
    table.add_column("backend / graph adapter", no_wrap=True)
    for name, prio, status, backend, graph in _device_rows(data):
        table.add_row(escape(name), prio, escape(status), escape(f"{backend}\n{graph}"),
                      style="bold green" if name == data["device"] else None)
    console.print(table)
    cpu = Table(title="CPU", show_header=False)
    cpu.add_column("feature")
    cpu.add_column("value", overflow="fold")
    for row in _cpu_rows(data):
        cpu.add_row(*(escape(c) for c in row))
    console.print(cpu)
    notes = _path_notes(data)
    if notes and not _path_rows(data):
        for line in notes:
            console.print(escape(line), highlight=False)
    elif notes:
        paths = Table(title=escape(notes[0]))
        for i, col in enumerate(PATH_HEADER):
            paths.add_column(col, no_wrap=i < 4, overflow="fold", ratio=1 if col == "why" else None)
        for row in _path_rows(data):
            paths.add_row(*(escape(c) for c in row), style="green" if row[3] == "fused vendor op" else None)
        console.print(paths)
        for line in notes[1:]:
            console.print(escape(line), highlight=False)


def _use_rich() -> bool:
    return importlib.util.find_spec("rich") is not None


def run_info(args: argparse.Namespace) -> int:
    """Print the detected device, every known device, the CPU path; exit 2 when detection fails."""
    data = info_data(args.device)
    if args.json:
        print(json.dumps(data, indent=2))
    elif _use_rich():
        print_info_rich(data)
    else:
        print_info_plain(data)
    if data["error"] is not None:
        print(f"hwkv info: error: {one_line(data['error'])}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK


# ---------------------------------------------------------------------------- registry
# The other subcommands live in their own modules: `add_<name>_arguments(parser)` and `run_<name>(args) -> int`
# (heavy modules imported inside run_<name>), named here by module and imported when main() calls them.

def _lazy(module: str, name: str) -> Callable[..., Any]:
    """`module.name`, imported at its first call (from main(), so inside its handlers)."""
    def call(*args: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args)

    call.__name__ = call.__qualname__ = name
    return call


def _command(text: str, module: str, name: str) -> Command:
    return Command(text, _lazy(module, f"add_{name}_arguments"), _lazy(module, f"run_{name}"))


COMMANDS: dict[str, Command] = {
    "info": Command("show the detected device, every known device, the CPU attention path and which path "
                    "each layer kind takes",
                    add_info_arguments, run_info),
    "verify": _command("run the contract suite on the current device and print a pass/fail table",
                       "hwkv.testing.verify", "verify"),
    "bench": _command("time the hybrid KV attention stack per configuration and batch size, and its KV memory",
                      "hwkv.bench.bench_cli", "bench"),
    "plan": _command("size the full and SWA pools for a memory budget", "hwkv.bench.plan_cli", "plan"),
    "generate": _command("generate with a local Hugging Face model through the hybrid cache",
                         "hwkv.integrations.generate_cli", "generate"),
}


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose help, usage and version text raise a failed write (argparse drops the OSError: `hwkv
    --help > /dev/full` exited 0 with nothing written), so main() reports it as for any other output."""

    def _print_message(self, message: str, file: Optional[IO[str]] = None) -> None:
        if message:
            (file or sys.stderr).write(message)


def build_parser() -> argparse.ArgumentParser:
    """The `hwkv` parser: one subparser per entry of COMMANDS."""
    parser = _Parser(prog="hwkv", description="hardware-portable hybrid KV cache")
    parser.add_argument("--version", action="version", version=f"hwkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        command.add_arguments(sub.add_parser(name, help=command.help, description=command.help))
    return parser


def one_line(message: object) -> str:
    """An error's text on one line: its lines joined, blanks collapsed (a message names the value and the limit)."""
    text = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
    return text or type(message).__name__


def _report(prog: str, text: str) -> None:
    """One line on stderr; quietly nothing when stderr itself is gone."""
    try:
        print(f"{prog}: {text}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _drop_stdout() -> None:
    """Point the process's stdout at /dev/null: what is still buffered for a closed pipe or a full disk
    would otherwise fail again when Python flushes it at exit (its own traceback, exit code 120)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (captured in a test): nothing to drop
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _open_missing_streams() -> None:
    """A stream the shell closed (`hwkv ... >&-`, `2>&-`) is None in sys: it becomes /dev/null, so writes, flushes,
    isatty() and pytest's fileno() (`hwkv verify`) work as with an open one, and `print(file=sys.stderr)` does not
    fall back to stdout (an error line in --json output)."""
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w"))


def _from_rich_broken_pipe(e: BaseException) -> bool:
    """Whether `e` came out of rich's Console.on_broken_pipe (which already pointed stdout at /dev/null)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code if tb is not None else None
    return code is not None and code.co_name == "on_broken_pipe" and "rich" in code.co_filename


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of `hwkv` (through hwkv_entry) and `python -m hwkv.cli`; returns the exit code.

    Every subcommand gets the same endings here: a typed hwkv error is one line on stderr and exit 2 (a
    subcommand may print its own line first and return its code: 1 stays a reference mismatch); Ctrl-C
    is "interrupted" and exit 130; stdout closing early (`| head`) ends quietly with exit 141 (128 +
    SIGPIPE, what the shell reports for a process the pipe killed) and a full disk (`> /dev/full`) or
    another write error is one line and exit 2. Nothing ends in a traceback but a bug.
    """
    prog = "hwkv"
    _open_missing_streams()
    try:
        args = build_parser().parse_args(argv)  # imports the subcommands' modules
        prog = f"hwkv {args.command}"
        for var in ENV_VARS:  # a bad value (HWKV_DEBUG=maybe) fails here, not deep inside a run
            var.get()
        code = COMMANDS[args.command].run(args)
        sys.stdout.flush()  # a write error surfaces here, inside the handlers, not at interpreter exit
        return code
    except KeyboardInterrupt:
        _report(prog, "interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader went away (| head): what it wanted was written
        _drop_stdout()
        return EXIT_BROKEN_PIPE
    except SystemExit as e:  # rich's Console.on_broken_pipe exits 1 (our mismatch code) on a closed pipe
        if _from_rich_broken_pipe(e):
            return EXIT_BROKEN_PIPE
        if e.code in (0, None):  # argparse's --help and --version: their text is output too (> /dev/full)
            try:
                sys.stdout.flush()
            except BrokenPipeError:
                _drop_stdout()
                return EXIT_BROKEN_PIPE
            except OSError as err:
                return _output_failed(prog, err)
        raise
    except HwkvError as e:  # e.g. a device plugin that fails to load, a bad environment variable
        _report(prog, f"error: {one_line(e)}")
        return EXIT_ERROR
    except OSError as e:
        return _output_failed(prog, e)


def _output_failed(prog: str, e: OSError) -> int:
    """A write to our output failed (a full disk, an I/O error): one line and EXIT_ERROR; any other OSError is
    re-raised (not our output failing: a bug, kept)."""
    if e.errno not in OUTPUT_ERRNOS or e.filename is not None:
        raise e
    _drop_stdout()
    _report(prog, f"error: cannot write the output: {e.strerror or one_line(e)} (errno {e.errno})")
    return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
