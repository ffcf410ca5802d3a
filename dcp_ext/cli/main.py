"""Entry point of the ``dcp-ext`` console script."""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import signal
import sys
import warnings
from collections.abc import Iterator
from typing import Any, TextIO

from torch.distributed.checkpoint.api import CheckpointException

from dcp_ext.cli.terminal import for_terminal
from dcp_ext.errors import CheckpointError, rank_failure

_COMMANDS = {
    "inspect": ("dcp_ext.cli.inspect_cmd", "list keys, dtypes, shapes, chunks, bytes and files"),
    "verify": ("dcp_ext.cli.verify_cmd", "check completeness, file sizes and every checksum"),
    "demo": ("dcp_ext.cli.demo", "multi-process FSDP2 save and resharded load on CPU"),
    "convert": ("dcp_ext.cli.convert_cmd", "copy a DCP or Megatron (torch_dist, zarr, legacy) checkpoint to ours"),
}


INTERRUPTED = 128 + signal.SIGINT  # what a shell reports for a process ended by Ctrl-C


ONE_PROCESS_NOTE = "torch.distributed is disabled, unavailable or uninitialized"  # DCP's, on every step


DESCRIPTION = (
    "Inspect, verify or convert a checkpoint dcp_ext reads (DCP, Megatron torch_dist, zarr or legacy, "
    "Hugging Face safetensors), or run a multi-process save and resharded load on CPU (demo)."
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dcp-ext", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module_name, help_text) in _COMMANDS.items():
        modules[name] = importlib.import_module(module_name)
        modules[name].add_arguments(commands.add_parser(name, help=help_text))
    args = parser.parse_args(argv)
    stdout = sys.stdout
    try:
        with warnings.catch_warnings():  # the commands run DCP in one process on purpose: its note says so
            warnings.filterwarnings("ignore", message=ONE_PROCESS_NOTE)
            sys.stdout = _Output(stdout)
            code = modules[args.command].main(args)
            sys.stdout.flush()  # a full disk under ``> file`` is reported here, not at exit
            return code
    except BrokenPipeError:  # the output's reader went away (``| head``): nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python flushes stdout at exit
        return 128 + signal.SIGPIPE  # what a shell reports for a process ended by SIGPIPE
    except (KeyboardInterrupt, CheckpointException) as exc:  # dcp.save/load: report the first rank's failure
        error = rank_failure(exc)
        if isinstance(error, KeyboardInterrupt):  # Ctrl-C, raised here or inside a DCP step (it wraps even that)
            # reader and writer threads may still start a DCP step after the one line: their note stays quiet
            warnings.filterwarnings("ignore", message=ONE_PROCESS_NOTE)
            print("error: interrupted", file=sys.stderr)
            return INTERRUPTED
        if not isinstance(error, (CheckpointError, OSError)):
            raise
        print(for_terminal(f"error: {error}"), file=sys.stderr)
    except (CheckpointError, OSError) as exc:  # bad input or a storage fault (an object store's too); both name the path
        print(for_terminal(f"error: {exc}"), file=sys.stderr)
    finally:
        sys.stdout = stdout
    return 2


class _Output:
    """``sys.stdout`` while a command runs: control characters from the checkpoint are
    shown escaped (``terminal``), and a write that fails (``> /dev/full``, a full disk) is
    reported as the output's failure, not as one of the checkpoint's."""

    def __init__(self, stream: TextIO | None):
        self._stream = stream

    def write(self, text: str) -> int:
        with self._errors():
            if self._stream is None:  # Python found no stdout: descriptor 1 was closed (``>&-``)
                raise OSError(errno.EBADF, "it is closed")
            return self._stream.write(for_terminal(text))

    def flush(self) -> None:
        with self._errors():
            if self._stream is not None:
                self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except BrokenPipeError:  # the reader went away: handled by ``main``
            raise
        except OSError as exc:
            raise CheckpointError(f"cannot write the output to stdout ({exc.strerror or exc})") from None


def run() -> None:
    """The console script: ``main``; after Ctrl-C the process ends at once, without the
    interpreter's teardown: reader and writer threads that were mid-call into torch when
    the interrupt came still run, and a teardown under them aborted the process
    (``terminate called without an active exception``) now and then. The command removed
    what it had written before ``main`` returned."""
    code = main()
    if code == INTERRUPTED:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
