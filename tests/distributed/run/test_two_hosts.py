"""Several machines, on one: two network namespaces joined by a veth pair stand for two hosts, each
running `torchrun --nnodes 2 --nproc-per-node 2` with c10d rendezvous across them. tp 2 x pp 2 (tp
within a host, pp across) and dp 2 x tp 2 train like one host; a host whose workers are killed
restarts them (--max-restarts) and the run resumes from its last checkpoint, ending like one that
was never interrupted. Needs root and `ip` (iproute2): skipped, saying so, where either is missing."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rewrite.checkpoint.training_state import latest_checkpoint
from tests.distributed.run.test_demo import PARITY, torchrun
from tests.launched import workers as _workers
from tests.paths import ROOT

SUBNET = f"10.213.{os.getpid() % 250}"
ARGS = ["--seq-len", "32", "--batch-size", "2", "--no-progress"]


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def hosts():
    """[(namespace, address, interface)] of two hosts that reach each other; removed afterwards."""
    if shutil.which("ip") is None:
        pytest.skip("`ip` (iproute2) is not installed: no network namespaces to stand for two hosts")
    tag = f"rw{os.getpid() % 100000}"
    made = [(f"{tag}a", f"{SUBNET}.1", f"{tag}va"), (f"{tag}b", f"{SUBNET}.2", f"{tag}vb")]
    try:
        for ns, _, _ in made:
            if (done := _ip("netns", "add", ns)).returncode != 0:
                pytest.skip(f"cannot make a network namespace ({done.stderr.strip()}): needs root")
        steps = [("link", "add", made[0][2], "type", "veth", "peer", "name", made[1][2])]
        for ns, addr, dev in made:
            steps += [("link", "set", dev, "netns", ns), ("-n", ns, "addr", "add", f"{addr}/24", "dev", dev),
                      ("-n", ns, "link", "set", dev, "up"), ("-n", ns, "link", "set", "lo", "up")]
        for step in steps:
            if (done := _ip(*step)).returncode != 0:
                pytest.skip(f"cannot join the namespaces (ip {' '.join(step)}: {done.stderr.strip()})")
        yield made
    finally:
        for ns, _, _ in made:
            _ip("netns", "del", ns)  # its end of the veth pair goes with it, and so the other


def _start(hosts, run_dir: Path, plan: str, *extra: str, restarts: int = 0) -> list[subprocess.Popen]:
    """One torchrun agent per host, in its namespace, output to run_dir/host<i>.log."""
    run_dir.mkdir(parents=True, exist_ok=True)
    endpoint = f"{hosts[0][1]}:29400"
    procs = []
    for i, (ns, addr, dev) in enumerate(hosts):
        # Restarts across machines need a fresh store per attempt (torch issue 135712; docs/data_parallel.md).
        fresh = ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"] if restarts else []
        cmd = ["ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={dev}", "OMP_NUM_THREADS=1", *fresh,
               sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_dir.name, "--local-addr", addr,
               *(["--rdzv-conf", "is_host=true"] if i == 0 else []), f"--max-restarts={restarts}",
               "--monitor-interval=0.2", "-m", "rewrite", "train", plan, *ARGS, "--out", str(run_dir / "out"), *extra]
        with open(run_dir / f"host{i}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def _finish(procs: list[subprocess.Popen], run_dir: Path, timeout_s: float = 240) -> str:
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(1, deadline - time.monotonic()))
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    said = "\n".join((run_dir / f"host{i}.log").read_text() for i in range(len(procs)))
    assert [p.returncode for p in procs] == [0, 0], said[-4000:]
    return said


def _losses(out: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("plan", ["plans/llama-tp2-pp2.yaml", "plans/llama-dp2-tp2.yaml"])
def test_two_hosts_train_like_one(hosts, tmp_path, plan):
    said = _finish(_start(hosts, tmp_path / "two", plan, "--steps", "3"), tmp_path / "two")
    parity = PARITY.search(said)  # step 1 against one process, in the run itself
    assert parity and float(parity["dloss"]) <= 1e-5 and float(parity["dgrad"]) <= 1e-5, said[-3000:]
    one = torchrun(4, "train", plan, *ARGS, "--steps", "3", "--no-parity", "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-3000:]
    two, alone = _losses(tmp_path / "two" / "out"), _losses(tmp_path / "one")
    assert two.keys() == alone.keys() == {1, 2, 3}
    assert max(abs(two[s] - alone[s]) for s in two) <= 1e-6, (two, alone)


@pytest.mark.timeout(500)
def test_a_host_whose_workers_die_restarts_and_resumes(hosts, tmp_path):
    run_dir, steps = tmp_path / "crashed", 8
    ckpt = ["--ckpt", str(tmp_path / "ckpt"), "--save-every", "1", "--resume", "--no-parity", "--steps", str(steps)]
    procs = _start(hosts, run_dir, "plans/llama-tp2-pp2.yaml", *ckpt, restarts=1)
    killed, deadline = None, time.monotonic() + 180
    while killed is None and time.monotonic() < deadline and procs[1].poll() is None:
        found = latest_checkpoint(tmp_path / "ckpt") if (tmp_path / "ckpt" / "latest").exists() else None
        if found is not None and found[0] >= 3:
            for pid in _workers(procs[1].pid).values():  # every worker of the second host
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed = found[0]
        time.sleep(0.05)
    said = _finish(procs, run_dir)
    assert killed is not None and killed < steps, f"no host's workers were killed mid-run:\n{said[-3000:]}"
    assert "resumed from" in said, said[-3000:]
    one = torchrun(4, "train", "plans/llama-tp2-pp2.yaml", *ARGS, "--steps", str(steps), "--no-parity",
                   "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-3000:]
    crashed, alone = _losses(run_dir / "out"), _losses(tmp_path / "one")
    assert crashed.keys() == alone.keys() and max(abs(crashed[s] - alone[s]) for s in alone) <= 1e-6, (crashed, alone)
