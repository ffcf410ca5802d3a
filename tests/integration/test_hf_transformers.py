"""transformers as the real producer and consumer: ``save_pretrained`` checkpoints of a tiny
Llama (committed under tests/fixtures/hf, see its README.md) load bit-exact through
ShardReader, and our safetensors exports load back with ``from_pretrained`` to the very
logits transformers computed when it wrote the fixture."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from dcp_ext import export_safetensors
from dcp_ext.cli.main import main as cli

from mp import run_job
from support import FIXTURES, dtensor_load_job, load_tensors

HF_FIXTURES = FIXTURES / "hf"
NAMES = ["tiny_llama", "tiny_llama_bf16"]  # float32 with 4 shards; the same weights cast to bfloat16, 2 shards


def expected(name: str) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` as transformers held it when it called ``save_pretrained``."""
    return load_file(HF_FIXTURES / f"{name}.expected.safetensors")


@pytest.mark.parametrize("name", NAMES)
def test_save_pretrained_shards_load_bit_exact(name):
    want = expected(name)
    assert len(list((HF_FIXTURES / name).glob("*.safetensors"))) > 1
    _, reader = load_tensors(HF_FIXTURES / name, want)  # into garbage-filled tensors
    assert reader.stats.bytes_read == sum(t.numel() * t.element_size() for t in want.values())


@pytest.mark.mp
@pytest.mark.parametrize("name", NAMES)
def test_save_pretrained_shards_load_as_dtensors_at_2_processes(name):
    """Shard(0) / Shard(-1) / Replicate in turn; vocab 61 and intermediate 23 split unevenly."""
    run_job(dtensor_load_job, 2, str(HF_FIXTURES / name), expected(name))


@pytest.fixture
def one_thread():
    """The fixture's logits were computed in one thread: same summation order, same bits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "source, cast, logits_of",
    [
        ("tiny_llama", None, "tiny_llama"),  # export of the save_pretrained directory itself
        ("tiny_llama_bf16", None, "tiny_llama_bf16"),  # via a DCP checkpoint made by `dcp-ext convert`
        ("tiny_llama", torch.bfloat16, "tiny_llama_bf16"),  # our cast == transformers' model.to(bfloat16)
    ],
    ids=["float32", "bf16-via-dcp", "float32-exported-as-bf16"],
)
def test_export_loads_in_from_pretrained_to_the_same_logits(tmp_path, one_thread, source, cast, logits_of):
    from transformers import AutoModelForCausalLM  # ~2 s import, paid only by this test

    src = HF_FIXTURES / source
    if source.endswith("bf16"):
        assert cli(["convert", str(src), str(tmp_path / "dcp")]) == 0
        src = tmp_path / "dcp"
    report = export_safetensors(src, tmp_path / "hf", max_shard_bytes=6000, dtype=cast)
    assert len(report.files) > 1 and report.skipped == []
    # The exporter writes tensors only; the model's config comes from the fixture.
    shutil.copy(HF_FIXTURES / logits_of / "config.json", tmp_path / "hf")
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}  # no missing, unexpected or mismatched keys
    stored = load_file(HF_FIXTURES / f"{logits_of}.logits.safetensors")
    logits = _logits(model, stored["input_ids"])
    # transformers' own logits for its save_pretrained directory, computed here: the same
    # kernels and transformers version, so the export must give the very same bits. The
    # logits stored at generation time agree to rounding only: another transformers release
    # or CPU sums in another order (5.24.0 on another host: 3.4e-8 off in float32)
    want = _logits(AutoModelForCausalLM.from_pretrained(HF_FIXTURES / logits_of), stored["input_ids"])
    torch.testing.assert_close(want, stored["logits"])
    assert logits.dtype == want.dtype and torch.equal(logits, want)


def _logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=input_ids).logits
