"""A rank killed mid-run costs no work: under the trainer's ``--nproc 2 --max-restarts 1`` and under
``torchrun --max-restarts 1``, a rank SIGKILLed at a random tick after the first checkpoint makes the group
restart from the last checkpoint, and the run ends with the parameters (``model.pt``) and metrics of an
uninterrupted run, bit for bit; rank files an earlier run left in ``--out`` are not resumed from. The
uninterrupted reference is the simulator with the same grouping (its bit-identity with the distributed runtime
is tests/petra/test_distributed.py's)."""
import csv
import json
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch

from revkernels.petra.distributed import FAULT_ENV

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# 6 batches (one epoch, cut short), checkpoints after batches 2, 4 and 6.
ARGS = ["--model", "revnet18", "--dataset", "synthetic", "--image-size", "8", "--epochs", "1", "--max-steps", "6",
        "--batch-size", "8", "--accum", "2", "--threads", "1", "--no-progress", "--checkpoint-every", "2",
        "--timeout", "10"]
TICKS = 6 + 2  # 6 batches, then 2 (R - 1) ticks of drain on 2 ranks


TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
            "--monitor-interval", "0.2", "-m", "revkernels.petra.train"]
needs_torchrun = pytest.mark.skipif(shutil.which("torchrun") is None and not os.path.exists(
    os.path.join(os.path.dirname(sys.executable), "torchrun")), reason="needs torchrun")


def _simulated(out, args):
    from revkernels.petra.train import main

    summary = main(args + ["--runtime", "simulate", "--ranks", "2", "--out", out])
    return summary, torch.load(os.path.join(out, "model.pt"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return _simulated(str(tmp_path_factory.mktemp("sim")), ARGS)


def _fault():
    """A random rank and a random tick after the first checkpoint (written after tick 1)."""
    rng = random.Random()
    return rng.randrange(2), rng.randrange(2, TICKS)


def _check(out, uninterrupted, proc, fault):
    assert proc.returncode == 0, (fault, proc.stderr[-3000:])
    assert f"{FAULT_ENV}: SIGKILL to rank {fault[0]} at tick {fault[1]}" in proc.stderr, fault
    summary, params = uninterrupted
    got = torch.load(os.path.join(out, "model.pt"))
    assert set(got) == set(params)
    for name, t in params.items():
        assert torch.equal(got[name], t), (fault, name)
    with open(os.path.join(out, "summary.json")) as f:
        resumed = json.load(f)
    for key in ("step", "optimizer_steps", "lr", "train_loss", "test_loss", "test_acc"):
        assert resumed[key] == summary[key], (fault, key)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [json.loads(line)["epoch"] for line in f] == [1]
    assert sorted(os.listdir(os.path.join(out, "checkpoint"))) == ["rank0.pt", "rank1.pt"]


def test_nproc_max_restarts_resumes_bit_identically(tmp_path, uninterrupted):
    fault = _fault()
    out = str(tmp_path / "run")
    env = dict(os.environ, **{FAULT_ENV: f"{fault[0]}:{fault[1]}"})
    proc = subprocess.run([sys.executable, "-m", "revkernels.petra.train", *ARGS, "--runtime", "distributed",
                           "--nproc", "2", "--max-restarts", "1", "--out", out], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)
    _check(out, uninterrupted, proc, fault)
    assert "restart 1 of 1 from the last checkpoint" in proc.stderr


@needs_torchrun
def test_torchrun_max_restarts_resumes_bit_identically(tmp_path, uninterrupted):
    fault = _fault()
    out = str(tmp_path / "run")
    env = dict(os.environ, **{FAULT_ENV: f"{fault[0]}:{fault[1]}"})
    proc = subprocess.run([sys.executable, *TORCHRUN, *ARGS, "--runtime", "distributed", "--out", out],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    _check(out, uninterrupted, proc, fault)


# A run of 4 batches that writes no checkpoint: 4 + 2 ticks.
SHORT = ARGS + ["--max-steps", "4", "--checkpoint-every", "100"]


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory):
    """The --out of an earlier distributed run (ARGS: 6 batches), with its rank checkpoints of step 6."""
    out = str(tmp_path_factory.mktemp("earlier"))
    proc = subprocess.run([sys.executable, "-m", "revkernels.petra.train", *ARGS, "--runtime", "distributed", "--nproc",
                           "2", "--out", out], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.parametrize("launcher", ["nproc", pytest.param("torchrun", marks=needs_torchrun)])
def test_a_restart_does_not_resume_from_an_earlier_runs_checkpoints(launcher, tmp_path, earlier_run):
    """4 batches into an earlier 6-batch run's --out, a rank killed before any checkpoint of this run: the
    restarted attempt starts from scratch (the step-6 rank files there are not this run's) and ends as an
    uninterrupted 4-batch run."""
    reference = _simulated(str(tmp_path / "sim"), SHORT)
    out = str(tmp_path / "run")
    shutil.copytree(earlier_run, out)
    rng = random.Random()
    fault = (rng.randrange(2), rng.randrange(6))  # any rank, any of the 4 + 2 ticks
    env = dict(os.environ, **{FAULT_ENV: f"{fault[0]}:{fault[1]}"})
    launch = TORCHRUN if launcher == "torchrun" else ["-m", "revkernels.petra.train", "--nproc", "2", "--max-restarts",
                                                      "1"]
    proc = subprocess.run([sys.executable, *launch, *SHORT, "--runtime", "distributed", "--out", out],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    _check(out, reference, proc, fault)


def test_resumed_logs_keep_the_epochs_before_the_checkpoint(tmp_path):
    """A restarted attempt resuming in epoch 2 drops what the lost attempt logged from epoch 2 on."""
    from revkernels.petra.train import ANALYSIS_FIELDS, _Logger

    logger = _Logger(str(tmp_path), 2)
    for epoch in (1, 2, 3):
        logger.log({"epoch": epoch, "step": 10 * epoch, "buffer_bytes": [1, 2], "peak_buffer_bytes": [3, 4]})
        logger.log_analysis([{f: 0 for f in ANALYSIS_FIELDS if f != "epoch"}], epoch)
    _Logger(str(tmp_path), 2, before_epoch=2)
    with open(tmp_path / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [10]
    for name in ("metrics.csv", "analysis.csv"):
        with open(tmp_path / name) as f:
            rows = list(csv.DictReader(f))
        assert [r["epoch"] for r in rows] == ["1"], name
    with open(tmp_path / "analysis.jsonl") as f:
        assert [json.loads(line)["epoch"] for line in f] == [1]
    _Logger(str(tmp_path), 2)  # a fresh run: empty logs
    with open(tmp_path / "metrics.csv") as f:
        assert len(f.read().splitlines()) == 1


def test_max_restarts_errors():
    from revkernels.petra.train import main

    with pytest.raises(ValueError, match="--max-restarts is for the --nproc launcher"):
        main(ARGS + ["--runtime", "distributed", "--max-restarts", "1"])
    with pytest.raises(ValueError, match="--max-restarts must be >= 0"):
        main(ARGS + ["--runtime", "distributed", "--nproc", "2", "--max-restarts", "-1"])
