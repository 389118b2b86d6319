"""The notebooks run top to bottom and show what they promise; the launcher they rely on."""

from __future__ import annotations

import re
import time

import nbformat
import pytest
from nbclient import NotebookClient

import rewrite
from tests.paths import ROOT

NOTEBOOKS = ROOT / "notebooks"


def execute(name: str):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb


def texts(nb) -> str:
    """Every stream and text/plain output, joined."""
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            out.append(o.get("text", "") if o["output_type"] == "stream" else o.get("data", {}).get("text/plain", ""))
    return "\n".join(out)


def pngs(nb) -> list[str]:
    return [o["data"]["image/png"] for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]


@pytest.mark.parametrize("name", ["01-write-a-plan.ipynb", "02-run-parallel.ipynb", "03-schedules.ipynb"])
def test_notebooks_are_committed_without_outputs(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{name}: clear the outputs before committing"


def test_write_a_plan_notebook():
    text = texts(execute("01-write-a-plan.ipynb"))
    # The tables of `rewrite show`.
    assert "mesh: pp=2 x tp=2 = 4 ranks" in text
    # Layers alike in one row; a stage's layers as a range.
    assert re.search(r"model\.layers\.0-3\.self_attn\.q_proj\s+column\s+\[32, 64\]\s+model\.layers\.\*\.self_attn\.q_proj", text)
    assert "model.rotary_emb, model.layers.2-3, model.norm, lm_head" in text
    assert "whole model: 180,800 parameters" in text
    # The 7B-shaped config binds on the meta device.
    assert "whole model: 6.74 B parameters; cut at ('model.layers.16',)" in text
    # The typos and their fixes.
    assert "matches no module; did you mean 'model.layers.*.mlp.up_proj'?" in text
    assert "unknown key 'tpp'; did you mean 'tp'?" in text
    assert "did you mean 'column'?" in text


def test_run_parallel_notebook():
    nb = execute("02-run-parallel.ipynb")
    text = texts(nb)
    match = re.search(r"parity vs single process \(step 1\): max \|dloss\| = (\S+), max \|dgrad\| = (\S+) over 39 parameters", text)
    assert match, text[-2000:]
    assert float(match[1]) <= 1e-5 and float(match[2]) <= 1e-5
    losses = [float(x) for x in re.search(r"loss per step: ([\d. >-]+)", text)[1].split(" -> ")]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    for rank in range(4):
        assert f"[rank {rank}] rank {rank}: Stage(" in text  # worker output streamed into the cell
    assert len(pngs(nb)) == 2  # the timeline and the loss curve, inline
    assert "LaunchError from rank 1: ValueError: rank 1 could not read its shard" in text


SCHEDULE_LABELS = ["afab", "1f1b", "interleaved-1f1b", "zero-bubble (k 1)", "zero-bubble (k 2)", "zbv"]


def test_schedules_notebook():
    nb = execute("03-schedules.ipynb")
    text = texts(nb)
    # The six tables on paper, each with its predicted bubble.
    assert text.count("predicted bubble: ") == 6, text[:4000]
    zbv = text[text.index("== zbv") :]
    assert "Schedule zbv: 4 microbatches on 4 stages, 2 on each of 2 ranks" in zbv
    rank0 = re.search(r"^\s+0\s+(F0@0 .*)$", zbv, re.M)[1].split()
    assert "F0@3" in rank0 and "W0@3" in rank0, rank0  # the V: rank 0 holds the first and the last stage
    # The side-by-side table: schedule, step ms, x afab, saved KiB on ranks 0 and 1, loss, grad norm.
    rows, numbers = {}, r"\s+([\d.]+)\s+([\d.]+)\s+([\d,]+)\s+([\d,]+)\s+([\d.]+)\s+([\d.]+)$"
    for label in SCHEDULE_LABELS:
        row = re.search(rf"^\s+{re.escape(label)}{numbers}", text, re.M)
        assert row, f"{label} missing from the side-by-side table:\n{text[-1500:]}"
        rows[label] = [float(x.replace(",", "")) for x in row.groups()]
    assert rows["afab"][1] == 1.0
    assert "all schedules give the same loss: True" in text
    assert "all schedules give the same gradient norm: True" in text
    # Saved activations do not depend on the machine: afab holds the most, ZB-H1 holds 1F1B's.
    for rank in (2, 3):
        assert rows["afab"][rank] > rows["1f1b"][rank] > 0
        assert rows["zero-bubble (k 1)"][rank] == rows["1f1b"][rank]
    assert len(pngs(nb)) == 1  # the six timelines, one figure


# The launcher itself, on 2 ranks.


def test_launch_sends_a_local_function_by_value():
    offset = 100.0

    def gather_ranks(scale):  # a closure: plain pickle could not send it
        import torch
        import torch.distributed as dist

        x = torch.tensor([float(dist.get_rank())]) * scale + offset
        dist.all_reduce(x)
        return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": float(x), "threads": torch.get_num_threads()}

    results = rewrite.launch(gather_ranks, 2, 10.0, timeout_s=120, echo=False)
    assert results == [{"rank": r, "world": 2, "sum": 210.0, "threads": 1} for r in range(2)]


def _raise_on_rank_1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise KeyError("missing shard on rank 1")
    dist.barrier()


def test_launch_raises_with_the_failing_ranks_traceback():
    with pytest.raises(rewrite.LaunchError, match=r"rank 1 of 2 failed") as info:
        rewrite.launch(_raise_on_rank_1, 2, timeout_s=120, echo=False)
    assert info.value.rank == 1
    assert "KeyError: 'missing shard on rank 1'" in info.value.traceback
    assert "_raise_on_rank_1" in str(info.value)


def _sleep_forever():
    time.sleep(600)


def test_launch_timeout_kills_every_rank():
    start = time.monotonic()
    with pytest.raises(rewrite.LaunchError, match=r"timed out after 3s on 2 ranks; ranks still running \(killed\): \[0, 1\]"):
        rewrite.launch(_sleep_forever, 2, timeout_s=3, init_process_group=False, echo=False)
    assert time.monotonic() - start < 30


def test_launch_rejects_bad_arguments():
    with pytest.raises(ValueError, match="nprocs >= 1"):
        rewrite.launch(_sleep_forever, 0)
    with pytest.raises(ValueError, match="cannot serialise"):
        import threading

        rewrite.launch(_sleep_forever, 1, threading.Lock())
