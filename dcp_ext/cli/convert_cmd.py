"""``dcp-ext convert SRC DST``: any readable checkpoint (DCP, Megatron torch_dist/zarr/legacy) to ours."""

from __future__ import annotations

import argparse

from dcp_ext.cli.progress import ProgressBar
from dcp_ext.errors import InvalidRequestError
from dcp_ext.megatron.base import MegatronOptions
from dcp_ext.megatron.convert import convert


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="source checkpoint directory or URL")
    parser.add_argument("dst", help="destination directory or URL")
    parser.add_argument("--format", choices=["dcp"], default="dcp", help="destination format (default: dcp)")
    parser.add_argument("--iteration", help="legacy Megatron: iteration number or 'release'")
    parser.add_argument(
        "--partition-dim", action="append", default=[], metavar="REGEX=DIM",
        help="legacy Megatron: TP split rule, DIM an integer or 'none' (repeatable)",
    )
    parser.add_argument("--allow-incomplete", action="store_true", help="accept a save without metadata.json")
    parser.add_argument("--overwrite", action="store_true", help="replace a checkpoint already at DST")


def options_from(args: argparse.Namespace) -> MegatronOptions:
    rules: dict[str, int | None] = {}
    for rule in args.partition_dim:
        pattern, _, dim = rule.rpartition("=")
        if not pattern or not (dim.lower() == "none" or _is_int(dim)):
            raise InvalidRequestError(f"--partition-dim {rule!r} is not REGEX=DIM (DIM an integer or 'none')")
        rules[pattern] = None if dim.lower() == "none" else int(dim)
    iteration = args.iteration
    if iteration is not None and iteration != "release":
        if not _is_int(iteration):
            raise InvalidRequestError(f"--iteration {iteration!r} is neither an iteration number nor 'release'")
        iteration = int(iteration)
    return MegatronOptions(iteration=iteration, partition_dims=rules, allow_incomplete=args.allow_incomplete)


def _is_int(text: str) -> bool:
    return text.lstrip("-").isdigit()


def main(args: argparse.Namespace) -> int:
    bar = ProgressBar("converting")
    report = convert(args.src, args.dst, options=options_from(args), progress=bar, overwrite=args.overwrite)
    bar.close()
    print(f"converted {report.keys} keys ({report.bytes} tensor bytes) from {args.src} to {args.dst}")
    return 0
