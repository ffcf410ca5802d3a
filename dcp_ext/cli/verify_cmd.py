"""``dcp-ext verify PATH``: completeness, files and checksums; non-zero exit on any fault."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from dcp_ext.cli.progress import ProgressBar
from dcp_ext.cli.terminal import for_cell
from dcp_ext.storage.verify import verify_checkpoint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="checkpoint directory or URL")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def main(args: argparse.Namespace) -> int:
    bar = ProgressBar("verifying")
    report = verify_checkpoint(args.path, progress=bar)
    bar.close()
    if args.json:
        print(json.dumps({**asdict(report), "ok": report.ok}, indent=2))
        return 0 if report.ok else 1
    for fault in report.faults:
        print(f"FAULT {for_cell(fault)}")  # one line each
    for name in map(for_cell, report.unreferenced_files):
        if name.endswith(".safetensors"):
            print(f"note: {name} is not in the index: ShardReader never reads it, but stock HuggingFaceStorageReader "
                  "reads every *.safetensors file of the directory")
            continue
        print(f"note: {name} is not referenced by the committed metadata (left by an interrupted save, or an "
              "empty file a stock writer with more threads than items makes; loads never read it)")
    status = "OK" if report.ok else f"FAILED ({len(report.faults)} faults)"
    print(
        f"{status}: {report.path}{'' if report.save_id is None else f' (save {report.save_id})'}: "
        f"{report.items_checked} items in {report.files} files, "
        f"{report.bytes_checked} bytes checked"
        + (f", {report.items_without_checksum} items carry no checksum (their format records none)" if report.items_without_checksum else "")
    )
    return 0 if report.ok else 1
