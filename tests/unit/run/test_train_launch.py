"""`rewrite train --nproc-per-node N`: the launcher's flags taken out of what the workers run, bad ones refused."""

from __future__ import annotations

from rewrite.run.cli import main
from rewrite.run.train_launch import split_launch_args


def test_the_workers_run_the_command_without_the_launchers_flags():
    launch, rest = split_launch_args(["plans/llama-pp2.yaml", "--nproc-per-node=2", "--steps", "3", "--nnodes", "1",
                                      "--max-restarts", "1", "--out", "o"])
    assert (launch.nproc_per_node, launch.nnodes, launch.max_restarts, launch.rdzv_endpoint) == (2, "1", 1, None)
    assert rest == ["plans/llama-pp2.yaml", "--steps", "3", "--out", "o"]


def test_bad_launch_flags_are_refused_in_one_line(capsys, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    for flags, words in ((["--nproc-per-node", "0"], "--nproc-per-node is 0"),
                         (["--nproc-per-node", "2", "--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
                         (["--nproc-per-node", "2", "--nnodes", "x:2"], "--nnodes is 'x:2'"),
                         (["--nproc-per-node", "2", "--max-restarts", "-1"], "--max-restarts is -1")):
        assert main(["train", "plans/llama-pp2.yaml", *flags]) == 2
        said = capsys.readouterr().err
        assert said.startswith("error: ") and words in said and said.count("\n") == 1, said
    monkeypatch.setenv("LOCAL_RANK", "0")  # a worker of torchrun already
    assert main(["train", "plans/llama-pp2.yaml", "--nproc-per-node", "2"]) == 2
    assert "use one launcher" in capsys.readouterr().err
