"""The dcp-ext command line: inspect, verify and the demo job, run as real processes."""

from __future__ import annotations

import glob
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_ext.formats.index import INDEX_NAME

from support import FIXTURES, RunsCode, assert_state_dict_equal, load, sample_state, save


def dcp_ext_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dcp_ext.cli.main", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.mp
def test_inspect_lists_every_key(tmp_path):
    save(sample_state(), tmp_path)
    result = dcp_ext_cli("inspect", "--json", str(tmp_path))
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    keys = {k["key"]: k for k in info["keys"]}
    assert set(keys) == {"w", "b", "ids", "nested.h", "nested.step", "name"}
    assert keys["w"]["shape"] == [64, 48] and keys["w"]["dtype"] == "float32" and keys["b"]["dtype"] == "bfloat16"
    assert info["index"] is True
    table = dcp_ext_cli("inspect", str(tmp_path))
    assert table.returncode == 0 and "nested.h" in table.stdout and "float16" in table.stdout


@pytest.mark.mp
@pytest.mark.parametrize("writer", ["ours", "stock"])
def test_verify_passes_a_good_checkpoint(tmp_path, writer):
    if writer == "ours":
        save(sample_state(), tmp_path)
    else:
        dcp.save(sample_state(), storage_writer=dcp.FileSystemWriter(tmp_path))
    result = dcp_ext_cli("verify", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("OK:")


@pytest.mark.mp
def test_verify_reports_each_fault_with_file_and_key(tmp_path):
    save({"a": torch.arange(1000.0), "b": torch.ones(300)}, tmp_path, thread_count=1)
    data_file = next(p for p in tmp_path.iterdir() if p.suffix == ".distcp")
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 3] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    result = dcp_ext_cli("verify", str(tmp_path))
    assert result.returncode == 1
    faults = [line for line in result.stdout.splitlines() if line.startswith("FAULT")]
    assert len(faults) == 1 and data_file.name in faults[0] and "mismatch" in faults[0]
    data_file.unlink()
    result = dcp_ext_cli("verify", "--json", str(tmp_path))
    report = json.loads(result.stdout)
    assert result.returncode == 1 and not report["ok"]
    assert any(data_file.name in f and "missing" in f for f in report["faults"])


@pytest.mark.mp
def test_verify_reports_overlapping_and_missing_chunks(tmp_path):
    save({"t": torch.arange(12.0).reshape(4, 3)}, tmp_path)
    with open(tmp_path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    metadata.state_dict_metadata["t"].size = torch.Size([5, 3])  # one row no chunk covers
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    os.unlink(tmp_path / INDEX_NAME)
    result = dcp_ext_cli("verify", str(tmp_path))
    assert result.returncode == 1 and "t: chunks cover 12 elements of 15" in result.stdout


@pytest.mark.mp
def test_verify_of_a_directory_without_checkpoint_fails(tmp_path):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    result = dcp_ext_cli("verify", str(tmp_path))
    assert result.returncode == 1 and ".metadata is missing" in result.stdout


@pytest.mark.mp
@pytest.mark.slow
def test_demo_job_round_trips_bit_exact(tmp_path):
    result = dcp_ext_cli("demo", "--json", "--workdir", str(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["ok"] and report["mismatches"] == [] and report["tensors_checked"] > 100
    assert report["save_world"] == 4 and report["load_world"] == 2


def user_mistakes(tmp_path) -> dict[str, tuple[list[str], str]]:
    """name -> (argv, what the one error line must say), on real paths made here."""
    ckpt, afile, meta_dir, ours_meta_dir = tmp_path / "ckpt", tmp_path / "afile", tmp_path / "meta_dir", tmp_path / "ours"
    save(sample_state(), ckpt)
    afile.write_text("not a checkpoint")
    (meta_dir / ".metadata").mkdir(parents=True)
    save(sample_state(), ours_meta_dir)  # with our index and commit marker, which are read first
    (ours_meta_dir / ".metadata").unlink()
    (ours_meta_dir / ".metadata").mkdir()
    truncated = tmp_path / "truncated"  # convert loads inside its save: the error comes wrapped twice
    save(sample_state(), truncated)
    os.truncate(next(truncated.glob("*.distcp")), 100)
    hostile = tmp_path / "hostile"  # a copy would hand the pickle to stock loaders, which run it
    dcp.save({"w": torch.ones(2), "x": RunsCode(str(tmp_path / "ran"))}, storage_writer=dcp.FileSystemWriter(hostile), no_dist=True)
    damaged = tmp_path / "damaged"  # a copy would carry the damage under fresh checksums
    save({"w": torch.arange(1000.0)}, damaged, thread_count=1)
    data_file = next(damaged.glob("*.distcp"))
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "gone")
    return {
        "inspect a file": (["inspect", str(afile)], f"{afile}: is a file, not a checkpoint directory"),
        "inspect .metadata directory": (["inspect", str(meta_dir)], ".metadata is a directory, expected a file"),
        "inspect our .metadata directory": (["inspect", str(ours_meta_dir)], ".metadata is a directory, expected a file"),
        "inspect missing": (["inspect", str(tmp_path / "nope")], "no committed checkpoint here (no such directory, or it is empty)"),
        "inspect without .metadata": (["inspect", str(tmp_path)], "no committed checkpoint here (.metadata is missing)"),
        "convert onto a file": (["convert", str(ckpt), str(afile)], f"{afile}: is a file"),
        "convert onto itself": (["convert", str(ckpt), str(ckpt)], "is the source checkpoint"),
        "convert a file": (["convert", str(afile), str(tmp_path / "out")], "is a file, not a checkpoint directory"),
        "convert --iteration ten": (
            ["convert", str(ckpt), str(tmp_path / "o2"), "--iteration", "ten"], "--iteration 'ten' is neither"),
        "convert --partition-dim": (
            ["convert", str(ckpt), str(tmp_path / "o3"), "--partition-dim", "x=abc"], "is not REGEX=DIM"),
        "convert --iteration of a DCP checkpoint": (  # named as the flag, not as the library's option
            ["convert", str(ckpt), str(tmp_path / "o4"), "--iteration", "5"],
            f"{ckpt}: --iteration would be ignored: this dcp checkpoint reads none"),
        "convert --to hf --allow-incomplete of a DCP checkpoint": (
            ["convert", str(ckpt), str(tmp_path / "o14"), "--to", "hf", "--allow-incomplete", "--partition-dim", "x=0"],
            f"{ckpt}: --allow-incomplete, --partition-dim would be ignored"),
        "convert --iteration of a zarr checkpoint": (  # what it reads is named as a flag too
            ["convert", str(FIXTURES / "megatron" / "mcore012_zarr_tp2"), str(tmp_path / "o16"), "--iteration", "5"],
            "--iteration would be ignored: this zarr checkpoint reads only --allow-incomplete"),
        "convert --iteration -1": (["convert", str(ckpt), str(tmp_path / "o15"), "--iteration=-1"], "--iteration '-1' is neither"),
        "convert --partition-dim not a regex": (
            ["convert", str(ckpt), str(tmp_path / "o5"), "--partition-dim", "(=0"], "--partition-dim '(' is not a regular expression"),
        "convert --to hf --include not a regex": (
            ["convert", str(ckpt), str(tmp_path / "o6"), "--to", "hf", "--include", "("], "--include '(' is not a regular expression"),
        "convert onto a dangling symlink": (  # was reported as "a file"
            ["convert", str(ckpt), str(dangling)], f"{dangling}: is a symbolic link to '{tmp_path / 'gone'}', which does not exist"),
        "inspect an unknown URL scheme": (["inspect", "s3x://bucket/x"], "s3x://bucket/x: cannot open this URL (Protocol not known: s3x)"),
        "convert into /proc": (["convert", str(ckpt), "/proc/no/such"], "/proc/no/such: cannot create the checkpoint directory"),
        "convert a truncated checkpoint": (["convert", str(truncated), str(tmp_path / "o7")], "but the file has 100 bytes (truncated?)"),
        "inspect a server that refuses": (["inspect", "https://127.0.0.1:1/ckpt"], "https://127.0.0.1:1/ckpt: the object store failed"),
        "convert into memory://": (["convert", str(ckpt), "memory://ck"], "memory://ck: a memory:// checkpoint lives inside one process"),
        "convert a checkpoint whose item runs code": (
            ["convert", str(hostile), str(tmp_path / "o11")], "key 'x': refuses to unpickle posix.system"),
        "convert a checkpoint whose item runs code: the opt-out named": (
            ["convert", str(hostile), str(tmp_path / "o12")], "or pass convert(allow_unsafe_bytes=True) (dcp-ext convert --allow-unsafe-bytes)"),
        "convert --to hf --allow-unsafe-bytes": (
            ["convert", str(ckpt), str(tmp_path / "o13"), "--to", "hf", "--allow-unsafe-bytes"], "--allow-unsafe-bytes only applies with --to dcp"),
        "convert --iteration ²": (["convert", str(ckpt), str(tmp_path / "o8"), "--iteration=²"], "--iteration '²' is neither"),
        "convert a damaged checkpoint": (["convert", str(damaged), str(tmp_path / "o9")], "key 'w': crc32c mismatch"),
        "convert --to hf a damaged checkpoint": (
            ["convert", str(damaged), str(tmp_path / "o10"), "--to", "hf"], "key 'w': crc32c mismatch"),
    }


@pytest.mark.parametrize("mistake", [
    "inspect a file", "inspect .metadata directory", "inspect our .metadata directory", "inspect missing", "inspect without .metadata",
    "convert onto a file", "convert onto itself", "convert a file", "convert --iteration ten", "convert --partition-dim",
    "convert --iteration of a DCP checkpoint", "convert --partition-dim not a regex", "convert --to hf --include not a regex",
    "inspect an unknown URL scheme", "convert into /proc", "convert a truncated checkpoint", "convert --iteration ²",
    "convert a damaged checkpoint", "convert --to hf a damaged checkpoint", "inspect a server that refuses",
    "convert into memory://", "convert a checkpoint whose item runs code",
    "convert a checkpoint whose item runs code: the opt-out named", "convert --to hf --allow-unsafe-bytes",
    "convert --to hf --allow-incomplete of a DCP checkpoint", "convert --iteration -1", "convert onto a dangling symlink",
    "convert --iteration of a zarr checkpoint",
])
def test_user_mistakes_end_in_one_error_line(tmp_path, capsys, mistake):
    from dcp_ext.cli.main import main

    argv, message = user_mistakes(tmp_path)[mistake]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not (tmp_path / "ran").exists()


def test_verify_of_a_file_or_a_metadata_directory_fails_in_one_fault(tmp_path, capsys):
    from dcp_ext.cli.main import main

    mistakes = user_mistakes(tmp_path)
    for name in ("inspect a file", "inspect .metadata directory", "inspect our .metadata directory"):
        argv, message = mistakes[name]
        assert main(["verify", argv[1]]) == 1
        out = capsys.readouterr().out.splitlines()
        assert out[0].startswith("FAULT") and message in out[0] and out[1].startswith("FAILED"), out


def test_verify_names_a_data_file_that_is_a_directory_as_a_fault(tmp_path, capsys):
    """Before, verify stopped with a raw 'error: [Errno 21] Is a directory' and exit 2."""
    from dcp_ext.cli.main import main

    save({"a": torch.arange(4.0)}, tmp_path / "one", thread_count=1)
    data_file = next((tmp_path / "one").glob("*.distcp"))
    data_file.unlink()
    data_file.mkdir()
    assert main(["verify", str(tmp_path / "one")]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"FAULT {tmp_path / 'one'}: {data_file.name} is a directory, expected a file (holds a)", out
    assert out[1].startswith("FAILED"), out


def test_convert_refuses_an_existing_checkpoint_unless_overwrite(tmp_path, capsys):
    from dcp_ext.cli.main import main

    src, dst = tmp_path / "src", tmp_path / "dst"
    save(sample_state(1), src)
    save(sample_state(2), dst)
    assert main(["convert", str(src), str(dst)]) == 2
    err = capsys.readouterr().err  # the flag named, as every CLI refusal does (it said overwrite=False)
    assert "holds a dcp checkpoint" in err and "(dcp-ext convert --overwrite) to replace it" in err, err
    assert main(["convert", str(src), str(dst), "--overwrite"]) == 0
    assert main(["verify", str(dst)]) == 0
    want = sample_state(1)
    assert_state_dict_equal(load(want, dst)[0], want)


def test_convert_refuses_a_directory_holding_another_format_unless_overwrite(tmp_path, capsys):
    """A Hugging Face checkpoint at DST: ours was written beside it and hid it from our
    readers (``inspect`` then listed ours), where the README promises a refusal."""
    from dcp_ext.cli.main import main

    src, hf, dst = tmp_path / "src", tmp_path / "hf", tmp_path / "dst"
    save(sample_state(1), src)
    save({"hf_weight": torch.ones(2, 2)}, hf)
    assert main(["convert", str(hf), str(dst), "--to", "hf"]) == 0
    capsys.readouterr()
    assert main(["convert", str(src), str(dst)]) == 2
    assert "holds a safetensors checkpoint" in capsys.readouterr().err
    assert not (dst / ".metadata").exists()
    assert main(["convert", str(src), str(dst), "--overwrite"]) == 0
    want = sample_state(1)
    assert_state_dict_equal(load(want, dst)[0], want)


@pytest.mark.mp
def test_ctrl_c_while_the_command_starts_ends_in_one_line(tmp_path):
    """Ctrl-C in the first seconds, while torch still loads: the console script printed an
    import traceback ending in KeyboardInterrupt and died of the signal (found by the CLI
    sweep). Its entry point now sits outside the package and handles the signal first."""
    save(sample_state(1), tmp_path)
    script = os.path.join(os.path.dirname(sys.executable), "dcp-ext")  # what pip installed, as users run it
    process = subprocess.Popen([script, "inspect", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as from a terminal
    time.sleep(0.5)  # the interpreter is up; importing torch takes longer
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert (process.returncode, err, out) == (130, "error: interrupted\n", "")


@pytest.mark.mp
def test_a_closed_stdout_is_an_output_error(tmp_path):
    """``dcp-ext inspect ... >&-``: Python has no ``sys.stdout`` then, and the first write
    raised AttributeError as a traceback (found by the CLI sweep)."""
    save(sample_state(1), tmp_path)
    done = subprocess.run([sys.executable, "-m", "dcp_ext.cli.main", "inspect", str(tmp_path)], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, timeout=300, pass_fds=(), close_fds=True,
                          preexec_fn=lambda: os.close(1))
    assert (done.returncode, done.stderr) == (2, "error: cannot write the output to stdout (it is closed)\n")


@pytest.mark.mp
def test_ctrl_c_during_convert_ends_in_one_line_and_leaves_no_checkpoint(tmp_path):
    """Ctrl-C while ``dcp-ext convert`` writes: one line and the shell's status for it (it
    printed DCP's 55-line traceback of the wrapped KeyboardInterrupt and exited 1, and now
    and then aborted in the interpreter's teardown); nothing at DST, and a rerun works."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    state = {f"l{n}": torch.randn(512, 1024) for n in range(48)}  # 100 MB: the signal lands mid-write
    save(state, src)
    for _ in range(5):
        shutil.rmtree(dst, ignore_errors=True)
        process = subprocess.Popen([sys.executable, "-m", "dcp_ext.cli.main", "convert", str(src), str(dst)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as from a terminal
        while process.poll() is None and not glob.glob(str(dst / "*.distcp")):
            time.sleep(0.002)
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=300)
        if process.returncode not in (0, -signal.SIGINT):  # not done before the signal (nor ending)
            break
    assert process.returncode == 130 and err == "error: interrupted\n", (process.returncode, err)
    if (dst / ".metadata").exists():  # the signal came as the commit ended: the copy is whole
        assert dcp_ext_cli("verify", str(dst)).returncode == 0
    else:
        assert not glob.glob(str(dst / "*.distcp")), list(dst.iterdir())
    assert dcp_ext_cli("convert", str(src), str(dst), "--overwrite").returncode == 0
    assert_state_dict_equal(load(state, dst, verify_checksums=True)[0], state)


@pytest.mark.mp
def test_output_into_a_closed_pipe_ends_quietly(tmp_path):
    """``dcp-ext inspect CKPT | head -1``: the reader leaves before the listing is written;
    no error line, no traceback, and SIGPIPE's status (it printed "error: [Errno 32]" before)."""
    save({f"k{n}": torch.zeros(2) for n in range(3000)}, tmp_path)  # a listing over the pipe's buffer
    process = subprocess.Popen([sys.executable, "-m", "dcp_ext.cli.main", "inspect", str(tmp_path)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout.readline().startswith(b"key")
    process.stdout.close()
    stderr = process.stderr.read()
    assert process.wait(timeout=300) == 141
    assert stderr == b""


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_output_onto_a_full_disk_says_it_was_the_output(tmp_path, command):
    """``dcp-ext inspect CKPT > /dev/full``: it printed "error: [Errno 28] No space left on
    device", as if the checkpoint had failed."""
    save(sample_state(), tmp_path / "ckpt")
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "dcp_ext.cli.main", command, str(tmp_path / "ckpt")],
                                stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["error: cannot write the output to stdout (No space left on device)"], result.stderr


def test_a_link_that_cannot_be_resolved_ends_in_one_error_line(capsys):
    """Format detection resolves each entry of the directory; ``/proc/1/fd`` holds links
    that even root may not resolve, and ``realpath``'s PermissionError came out bare."""
    from dcp_ext.cli.main import main

    try:
        os.path.realpath("/proc/1/fd/0")
    except PermissionError:
        pass
    else:
        pytest.skip("this machine lets /proc/1/fd/0 be resolved")
    assert main(["inspect", "/proc/1/fd"]) == 2
    assert capsys.readouterr().err.splitlines() == ["error: /proc/1/fd: cannot resolve '0/.zarray' (Permission denied)"]


def test_inspect_stats_lists_every_data_file(tmp_path, capsys):
    """``--stats`` promised bytes and items per data file; the text output left them out."""
    from dcp_ext.cli.main import main

    save(sample_state(), tmp_path, thread_count=2)
    assert main(["inspect", str(tmp_path), "--stats"]) == 0
    out = capsys.readouterr().out
    files = sorted(p.name for p in tmp_path.glob("*.distcp"))
    assert len(files) == 2 and "per data file: items, bytes" in out
    for name in files:
        line = next(line for line in out.splitlines() if line.strip().startswith(name))
        items, nbytes = map(int, line.split()[1:])
        assert items >= 1 and nbytes > 0, line


@pytest.mark.mp
def test_an_object_store_that_does_not_answer_ends_in_one_error_line(tmp_path):
    """botocore's EndpointConnectionError is no OSError: it ended in a 50-frame traceback.
    The error names the checkpoint, not the listing request that failed."""
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-west-2", "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}  # port 9: nothing listens
    result = subprocess.run([sys.executable, "-m", "dcp_ext.cli.main", "inspect", "s3://bucket/ckpt"],
                            capture_output=True, text=True, timeout=300, env=env)
    err = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(err) == 1, result.stderr
    assert err[0].startswith("error: s3://bucket/ckpt: the object store failed (EndpointConnectionError: Could not connect"), err


def test_convert_copies_refused_items_only_when_told(tmp_path, capsys):
    """--allow-unsafe-bytes copies such an item as stored: convert itself never unpickles it."""
    from dcp_ext.cli.main import main

    src = tmp_path / "hostile"
    dcp.save({"w": torch.ones(2), "x": RunsCode(str(tmp_path / "ran"))}, storage_writer=dcp.FileSystemWriter(src), no_dist=True)
    assert main(["convert", str(src), str(tmp_path / "copy"), "--allow-unsafe-bytes"]) == 0
    assert not (tmp_path / "ran").exists()
    assert (tmp_path / "copy" / ".metadata").exists()


@pytest.mark.mp
def test_checkpoint_text_reaches_the_terminal_escaped(tmp_path):
    """Keys are the checkpoint author's strings: a newline in one broke the inspect table
    and the verify report's one line per fault, and an escape sequence (here: clear the
    screen) reached the terminal as it was."""
    hostile = "\x1b[2J\x1b[Hwiped\nrow"
    save({hostile: torch.arange(1000.0), "tab\tkey": torch.ones(3), "cr\rkey": 7}, tmp_path, thread_count=1)
    table = dcp_ext_cli("inspect", str(tmp_path))
    assert table.returncode == 0, table.stderr
    assert not any(c in table.stdout for c in "\x1b\r\t")
    rows = table.stdout.split("\n\n")[0].splitlines()
    assert [row.split()[0] for row in rows[1:]] == [r"\x1b[2J\x1b[Hwiped\nrow", r"tab\tkey", r"cr\rkey"]

    data_file = next(p for p in tmp_path.iterdir() if p.suffix == ".distcp")
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 3] ^= 0xFF  # inside the hostile key's payload
    data_file.write_bytes(bytes(raw))
    result = dcp_ext_cli("verify", str(tmp_path))
    assert result.returncode == 1 and "\x1b" not in result.stdout
    faults = [line for line in result.stdout.splitlines() if line.startswith("FAULT")]
    assert len(faults) == 1 and r"\x1b[2J\x1b[Hwiped\nrow" in faults[0], result.stdout

    missing = dcp_ext_cli("inspect", str(tmp_path / "gone\x1b[31m"))
    assert missing.returncode == 2
    assert missing.stderr.splitlines() == [f"error: {tmp_path}/gone\\x1b[31m: no committed checkpoint here "
                                           "(no such directory, or it is empty)"]


def test_demo_refuses_an_empty_workdir(capsys):
    """``--workdir ""`` ran in a temp directory that was then left behind, never named."""
    from dcp_ext.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--workdir", ""])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "dcp-ext demo: error: argument --workdir: must not be empty"
