"""``dcp-ext convert SRC DST [--to dcp|hf]``: any readable checkpoint (DCP, Megatron
torch_dist/zarr/legacy) to ours, or to Hugging Face safetensors shards."""

from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import Iterator

import torch

from dcp_ext.cli.progress import ProgressBar
from dcp_ext.conversion.hf_export import export_safetensors
from dcp_ext.errors import IgnoredOptionsError, InvalidRequestError
from dcp_ext.megatron.base import MegatronOptions
from dcp_ext.megatron.convert import convert
from dcp_ext.storage.catalog_formats import ignored_because


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="source checkpoint directory or URL")
    parser.add_argument("dst", help="destination directory or URL")
    parser.add_argument(
        "--to", "--format", dest="to", choices=["dcp", "hf"], default="dcp",
        help="destination format: dcp (ours, default) or hf (safetensors shards + model.safetensors.index.json)",
    )
    parser.add_argument("--iteration", help="legacy Megatron: iteration number or 'release'")
    parser.add_argument(
        "--partition-dim", action="append", default=[], metavar="REGEX=DIM",
        help="legacy Megatron: TP split rule, DIM 0, 1, ... or 'none' (repeatable)",
    )
    parser.add_argument("--allow-incomplete", action="store_true", help="accept a save without metadata.json")
    parser.add_argument("--overwrite", action="store_true", help="replace a checkpoint already at DST")
    parser.add_argument(
        "--allow-uncommitted", action="store_true",
        help="copy a checkpoint without a matching commit marker (a save interrupted after its data files were written)",
    )
    parser.add_argument(
        "--allow-unsafe-bytes", action="store_true",
        help="copy non-tensor items the restricted loader refuses (pickles that may run code): trusted sources only",
    )
    hf = parser.add_argument_group("--to hf only")
    hf.add_argument("--max-shard-size", metavar="SIZE", help="largest shard, e.g. 5GB (default), 500MB, 2GiB")
    hf.add_argument("--dtype", help="cast floating-point tensors, e.g. bfloat16")
    hf.add_argument("--include", metavar="REGEX", help="export only keys this regex matches")
    hf.add_argument("--exclude", metavar="REGEX", help="skip keys this regex matches")


_HF_ONLY = ("max_shard_size", "dtype", "include", "exclude")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


_MEGATRON_FLAGS = {"iteration": "--iteration", "partition_dims": "--partition-dim", "allow_incomplete": "--allow-incomplete"}


def options_from(args: argparse.Namespace) -> MegatronOptions:
    """The Megatron flags as ``MegatronOptions``, each checked here so that a bad one is
    named as the flag it is."""
    rules: dict[str, int | None] = {}
    for rule in args.partition_dim:
        pattern, _, dim = rule.rpartition("=")
        if not pattern or not (dim.lower() == "none" or _is_count(dim)):
            raise InvalidRequestError(f"--partition-dim {rule!r} is not REGEX=DIM (DIM 0, 1, ... or 'none')")
        _check_regex("--partition-dim", pattern)
        rules[pattern] = None if dim.lower() == "none" else int(dim)
    iteration = args.iteration
    if iteration is not None and iteration != "release":
        if not _is_count(iteration):
            raise InvalidRequestError(f"--iteration {iteration!r} is neither an iteration number nor 'release'")
        iteration = int(iteration)
    return MegatronOptions(iteration=iteration, partition_dims=rules, allow_incomplete=args.allow_incomplete)


def _check_regex(flag: str, pattern: str) -> None:
    try:
        re.compile(pattern)
    except re.error as exc:
        raise InvalidRequestError(f"{flag} {pattern!r} is not a regular expression ({exc})") from None


@contextlib.contextmanager
def _flags_named(src: str) -> Iterator[None]:
    """Megatron options the source cannot use, named as the flags that set them."""
    try:
        yield
    except IgnoredOptionsError as exc:
        flags = ", ".join(_MEGATRON_FLAGS[name] for name in exc.names)
        reason = ignored_because(exc.kind, [_MEGATRON_FLAGS[name] for name in exc.used])
        raise InvalidRequestError(f"{src}: {flags} would be ignored: {reason}") from None


def _commit_marker(args: argparse.Namespace) -> bool | None:
    """``--allow-uncommitted``: the reader's require_commit_marker=False; else its default."""
    return False if args.allow_uncommitted else None


def _is_count(text: str) -> bool:
    """ASCII digits: an iteration or a dim (``str.isdigit`` also takes characters such as
    '²', which ``int`` refuses)."""
    return re.fullmatch(r"[0-9]+", text) is not None


def parse_size(text: str) -> int:
    """``5GB`` (decimal, as Hugging Face), ``2GiB``, or plain bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", text.upper())
    size = 0 if match is None or match[2] not in _UNITS else int(float(match[1]) * _UNITS[match[2]])
    if size < 1:  # also a size under one byte (0.5B)
        raise InvalidRequestError(f"--max-shard-size {text!r} is not a size like 5GB, 500MB or 2GiB")
    return size


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InvalidRequestError(f"--dtype {name!r} is not a floating-point torch dtype (e.g. bfloat16, float16)")
    return dtype


def main(args: argparse.Namespace) -> int:
    options = options_from(args)
    if args.to == "dcp":
        given = [f"--{name.replace('_', '-')}" for name in _HF_ONLY if getattr(args, name) is not None]
        if given:
            raise InvalidRequestError(f"{', '.join(given)} only appl{'y' if len(given) > 1 else 'ies'} with --to hf")
    elif args.allow_unsafe_bytes:
        raise InvalidRequestError("--allow-unsafe-bytes only applies with --to dcp (an export holds tensors alone)")
    for flag in ("include", "exclude"):
        if getattr(args, flag) is not None:
            _check_regex(f"--{flag}", getattr(args, flag))
    if args.dst.startswith("memory://"):
        raise InvalidRequestError(
            f"{args.dst}: a memory:// checkpoint lives inside one process; this one would end with dcp-ext"
        )
    with _flags_named(args.src):
        return _run(args, options)


def _run(args: argparse.Namespace, options: MegatronOptions) -> int:
    bar = ProgressBar("converting")
    if args.to == "hf":
        report = export_safetensors(
            args.src, args.dst, max_shard_bytes=parse_size(args.max_shard_size or "5GB"),
            dtype=parse_dtype(args.dtype) if args.dtype else None, include=args.include, exclude=args.exclude,
            overwrite=args.overwrite, megatron=options, progress=bar, require_commit_marker=_commit_marker(args),
        )
        bar.close()
        print(f"exported {report.keys} tensors ({report.bytes} bytes) in {len(report.files)} safetensors files to {args.dst}")
        if report.skipped:
            print(f"skipped {len(report.skipped)} non-tensor items: {', '.join(report.skipped)}")
        return 0
    report = convert(
        args.src, args.dst, options=options, progress=bar, overwrite=args.overwrite,
        require_commit_marker=_commit_marker(args), allow_unsafe_bytes=args.allow_unsafe_bytes,
    )
    bar.close()
    print(f"converted {report.keys} keys ({report.bytes} tensor bytes) from {args.src} to {args.dst}")
    for name in report.not_copied:
        print(f"note: {name} (Megatron's common state: args, iteration, ...) is not part of the DCP data and was not "
              f"copied; read it with dcp_ext.megatron.load_common_state({args.src!r})")
    return 0
