"""PETRA's distributed runtime (gloo, CPU processes): identical parameters to the simulator with the same
stage grouping, no buffers in reversible stages, every process exits non-zero naming the failed stage when
a worker is killed, and the trainer CLI's ``--runtime distributed --nproc`` writes its logs."""
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from revkernels.petra import Trainer
from revkernels.petra.distributed import FAULT_ENV, LaunchError, PipelineRank, init, launch
from tests.petra.test_simulate import _batches, synthetic_stages

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

KW = dict(accum_k=2, base_lr=0.5, warmup_steps=1, weight_decay=1e-3)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _train_rank(layout, groups, n_steps, timeout=20.0, batched=None, method="petra", as_list=False):
    """One rank: the model from seed 0 (`as_list`: a plain list of its stage modules), N steps, flush; returns
    this rank's stage states and stats."""
    torch.manual_seed(0)
    model = synthetic_stages(layout)
    if as_list:
        model = list(model)
    init(timeout=timeout)
    pr = PipelineRank(model, groups=groups, timeout=timeout, batched=batched, method=method, **KW)
    own = pr.trainer.groups[pr.rank]
    peak_rev = 0
    losses = []
    for x, y in _batches(n_steps):
        out = pr.train_step(x, y)
        losses.append(out["loss"])
        peak_rev = max([peak_rev] + [s.buffer_bytes for s in pr.stages if s.index in own and s.reversible])
    losses += [r["loss"] for r in pr.flush()]
    stats = pr.buffer_stats()
    steps = [pr.trainer.optimizers[i].steps for i in own]
    state = {i: {k: v.clone() for k, v in pr.stages[i].module.state_dict().items()} for i in own}
    schedule = {key: t for key, t in pr.trainer.schedule.items() if key[1] in own}
    pr.close()
    return {"state": state, "stats": stats, "steps": steps, "peak_rev": peak_rev, "losses": losses,
            "schedule": schedule, "ticks": pr.tick}


def _simulate(layout, groups, n_steps, method="petra"):
    torch.manual_seed(0)
    model = synthetic_stages(layout)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = Trainer(model, method, groups=groups, **KW)
        losses = [trainer.train_step(x, y)["loss"] for x, y in _batches(n_steps)]
        losses += [r["loss"] for r in trainer.flush()]
    finally:
        torch.set_num_threads(threads)
    return model, trainer, losses


@pytest.mark.parametrize("layout, groups, batched", [("S r H", None, None), ("S d D r d H", 3, None),
                                                     ("S r D r r H", 3, True)])
def test_distributed_equals_simulator(layout, groups, batched, tmp_path):
    """J = 3 stages on 3 ranks, and 6 stages in 3 groups (also with the grouped posting NCCL uses).
    "d": reversible stages with dropout, on two ranks whose generators start alike: each stage
    draws from its own stream, so the ranks draw the simulator's masks (before, every rank drew
    from its process's generator: other masks than the simulator's, the same on every rank)."""
    n = 6
    results = launch(_train_rank, 3, (layout, groups, n, 20.0, batched), log_dir=str(tmp_path), timeout=120)
    model, trainer, sim_losses = _simulate(layout, groups, n)
    assert len(trainer.workers) == 3
    assert_ranks_hold_the_simulators_parameters(results, trainer, tmp_path)
    for r, res in enumerate(results):
        assert res["steps"] == [trainer.optimizers[i].steps for i in trainer.groups[r]]
        assert res["ticks"] == trainer.tick
        assert res["schedule"] == {k: v for k, v in trainer.schedule.items() if k[1] in trainer.groups[r]}
    assert results[-1]["losses"] == sim_losses  # the head's losses, bit for bit
    assert all(x is None for res in results[:-1] for x in res["losses"])
    # Buffers: reversible stages hold none; every stage's peak equals the simulator's.
    stats, sim_stats = results[0]["stats"], trainer.buffer_stats()
    assert [s["peak_bytes"] for s in stats] == [s["peak_bytes"] for s in sim_stats]
    assert all(s["peak_bytes"] == 0 for s in stats if s["reversible"])
    assert stats[0]["peak_bytes"] > 0 and all(res["peak_rev"] == 0 for res in results)
    assert trainer.optimizers[0].steps == n // KW["accum_k"]


def _bad_batches_rank():
    """One rank: the errors of an empty first batch and of a batch of another dtype, then the run
    goes on (neither changed the rank's state)."""
    torch.manual_seed(0)
    init(timeout=20.0)
    pr = PipelineRank(synthetic_stages("S r H"), timeout=20.0, **KW)
    errors = []
    try:
        pr.train_step(torch.randn(0, 8), torch.zeros(0, dtype=torch.int64))
    except ValueError as e:
        errors.append(str(e))
    batches = _batches(2)
    pr.train_step(*batches[0])
    try:
        pr.train_step(batches[1][0].double(), batches[1][1])
    except ValueError as e:
        errors.append(str(e))
    pr.train_step(*batches[1])
    pr.flush()
    out = (errors, pr.trainer.batch_size, pr.batches_in)
    pr.close()
    return out


def test_bad_batches_raise_on_every_rank_and_change_nothing(tmp_path):
    """An empty first batch raises as in the simulator (it set the batch size, and so the peak learning
    rate, to 0 and trained nothing); a batch of another dtype is not told to drop the last batch."""
    results = launch(_bad_batches_rank, 2, (), log_dir=str(tmp_path), timeout=120)
    for r, res in enumerate(results):
        assert res is not None, open(tmp_path / f"rank{r}.err").read()
        (empty, dtype), batch_size, batches_in = res
        assert "first batch is empty" in empty and "pass batch_size=..." in empty
        assert "float64" in dtype and "drop the last batch" not in dtype
        assert batch_size == 4 and batches_in == 2

def _slow_rank_meets(busy_s):
    torch.manual_seed(0)
    init(timeout=2.0)
    pr = PipelineRank(synthetic_stages("S r H"), timeout=2.0, **KW)
    for x, y in _batches(2):
        pr.train_step(x, y)
    pr.flush()
    start = time.monotonic()
    if pr.is_last:
        time.sleep(busy_s)  # an epoch-end evaluation: busy, heartbeat going
    pr.meet()
    waited = time.monotonic() - start
    for x, y in _batches(2):  # the next epoch's ticks, and the final barrier, see no late rank
        pr.train_step(x, y)
    pr.flush()
    pr.close()
    return waited


def test_ranks_meet_a_busy_rank_past_the_timeout(tmp_path):
    """`PipelineRank.meet` (what the trainer CLI calls after each epoch, while the logging rank evaluates)
    waits past `timeout` for a rank that is busy but alive (before, the other ranks went on to the next
    epoch's ticks and stopped the run when its messages were `timeout` + 0.8 s late, or at the final
    barrier)."""
    results = launch(_slow_rank_meets, 2, (5.0,), log_dir=str(tmp_path), timeout=120)
    for r, res in enumerate(results):
        assert res is not None, open(tmp_path / f"rank{r}.err").read()
    assert results[0] >= 4.5


def _environment(name):
    return os.environ.get(name), os.environ["RANK"]


def test_ranks_get_the_launchers_environment_as_of_each_launch(tmp_path, monkeypatch):
    """The ranks are forks of a forkserver that started at the first launch (its children inherit its
    environment): each launch's ranks still get the launcher's environment as it is then, `env` on top."""
    name = "REVKERNELS_TEST_LAUNCH"
    for value in ("first", "second", None, "env"):
        if value is None:
            monkeypatch.delenv(name)
        else:
            monkeypatch.setenv(name, value if value != "env" else "launcher")
        results = launch(_environment, 2, (name,), log_dir=str(tmp_path / str(value)), timeout=60,
                         env={name: "env"} if value == "env" else None)
        assert results == [(value, "0"), (value, "1")]


def test_pipeline_rank_takes_a_list_of_stage_modules(tmp_path):
    """As `Trainer` and `partition` do: 5 stage modules in a list, on 2 ranks, train as the simulator's."""
    results = launch(_train_rank, 2, ("S r D r H", 2, 4, 20.0, None, "petra", True), log_dir=str(tmp_path), timeout=120)
    _, trainer, _ = _simulate("S r D r H", 2, 4)
    assert_ranks_hold_the_simulators_parameters(results, trainer, tmp_path)


def assert_ranks_hold_the_simulators_parameters(results, trainer, log_dir):
    """Each rank finished (else its stderr is the message) and every stage it owns holds the
    simulator `trainer`'s parameters and buffers bit for bit."""
    for r, res in enumerate(results):
        assert res is not None, open(os.path.join(log_dir, f"rank{r}.err")).read()
        for i, state in res["state"].items():
            for name, t in trainer.stages[i].module.state_dict().items():
                assert torch.equal(state[name], t), f"rank {r} stage {i} {name}: max diff " \
                    f"{(state[name].double() - t.double()).abs().max().item() if t.is_floating_point() else 'int'}"


def _fault_time(err_path):
    """The wall-clock time at which the fault hook signalled its rank (from that rank's stderr)."""
    line = next(x for x in open(err_path).read().splitlines() if FAULT_ENV in x)
    return float(re.search(r"\(time ([0-9.]+)\)", line).group(1))


@pytest.mark.serial  # a wall-clock bound
@pytest.mark.parametrize("killed", [1, 0])  # a middle rank; rank 0, which also hosts the rendezvous store
def test_killed_worker_stops_every_process_naming_the_stage(killed, tmp_path):
    """Every other process exits non-zero within the documented timeout + 1 s of the kill, naming the rank."""
    timeout = 10.0
    with pytest.raises(LaunchError) as e:
        launch(_train_rank, 3, ("S r D r r H", 3, 40, timeout), log_dir=str(tmp_path), env={FAULT_ENV: f"{killed}:4"},
               grace=60, timeout=120)
    codes = e.value.exitcodes
    assert codes[killed] == -9 and all(c == 1 for r, c in enumerate(codes) if r != killed), codes
    assert f"rank {killed} exited with signal SIGKILL" in str(e.value)
    name = {0: "rank 0 (stages 0-1) failed", 1: "rank 1 (stages 2-3) failed"}[killed]
    for r in {0, 1, 2} - {killed}:
        err = open(tmp_path / f"rank{r}.err").read()
        assert name in err.strip().splitlines()[-1], err
    killed_at = _fault_time(tmp_path / f"rank{killed}.err")
    late = [e.value.exit_times[r] - killed_at for r in range(3) if r != killed]
    assert max(late) <= timeout + 1, late


def test_a_receive_that_fails_to_post_names_the_sender(monkeypatch):
    """gloo raises from ``irecv`` itself (not from the wait) when the sender's connection has already
    closed: the rank then reports the sender as failed, as a failed wait does, instead of dying with
    gloo's traceback (which left the killed rank unnamed in the survivors' last line)."""
    import types

    import revkernels.petra.distributed as distributed

    def closed(*args, **kwargs):
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:14220")

    class Failed(Exception):
        pass

    def fail(culprit, why):
        raise Failed(culprit, why)

    monkeypatch.setattr(distributed.dist, "irecv", closed)
    rank = types.SimpleNamespace(_batched=False, device=torch.device("cpu"), tick=7, fail=fail)
    with pytest.raises(Failed) as e:
        PipelineRank._irecv(rank, 0, 6, 0, [((2, 3), torch.float32)])
    assert e.value.args[0] == 0 and "a receive from it at tick 7 failed" in e.value.args[1]
    assert "Connection closed by peer" in e.value.args[1]


@pytest.mark.serial  # a wall-clock bound
@pytest.mark.parametrize("hung", [1, 0])
def test_hung_worker_is_detected_within_the_timeout(hung, tmp_path):
    """A rank stopped by SIGSTOP (alive, connections open, silent): every other process exits non-zero
    within timeout + 1 s naming it as hung (its heartbeat stalls; for rank 0 the store it hosts stops
    answering), and not before the timeout."""
    timeout = 3.0
    with pytest.raises(LaunchError) as e:
        launch(_train_rank, 3, ("S r D r r H", 3, 40, timeout), log_dir=str(tmp_path),
               env={FAULT_ENV: f"{hung}:4:STOP"}, grace=1, timeout=120)
    codes = e.value.exitcodes
    assert codes[hung] == -9 and all(c == 1 for r, c in enumerate(codes) if r != hung), codes  # launch killed it
    stopped_at = _fault_time(tmp_path / f"rank{hung}.err")
    late = [e.value.exit_times[r] - stopped_at for r in range(3) if r != hung]
    assert timeout - 0.5 <= min(late) and max(late) <= timeout + 1, late
    # its heartbeat stalls, a message from it times out or (rank 0) the store it hosts stops answering: whichever
    # a rank notices first
    why = {1: r"exiting: rank 1 \(stages 2-3\) failed: (no heartbeat for 3 s \(hung or killed\)|.* did not arrive .*Timed out)",
           0: r"exiting: rank 0 \(stages 0-1\) failed: (the rendezvous store it hosts|.* Timed out)"}[hung]
    for r in {0, 1, 2} - {hung}:
        err = open(tmp_path / f"rank{r}.err").read()
        assert re.search(why, err.strip().splitlines()[-1]), err


def test_cli_distributed_nproc_writes_logs_like_simulate(tmp_path):
    args = ["--model", "revnet18", "--dataset", "synthetic", "--image-size", "8", "--epochs", "1", "--batch-size", "8",
            "--max-steps", "5", "--accum", "2", "--threads", "1", "--no-progress", "--ranks", "3"]
    dist_out, sim_out = str(tmp_path / "dist"), str(tmp_path / "sim")
    proc = subprocess.run([sys.executable, "-m", "revkernels.petra.train", *args, "--runtime", "distributed",
                           "--nproc", "3", "--out", dist_out], capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final:" in proc.stdout and proc.stdout.count("final:") == 1
    from revkernels.petra.train import main
    main(args + ["--runtime", "simulate", "--out", sim_out])
    logs = {}
    for name, out in (("dist", dist_out), ("sim", sim_out)):
        with open(os.path.join(out, "metrics.jsonl")) as f:
            logs[name] = [json.loads(line) for line in f]
        with open(os.path.join(out, "metrics.csv")) as f:
            assert len(f.read().splitlines()) == 2
        with open(os.path.join(out, "config.json")) as f:
            config = json.load(f)
        assert config["runtime"] == ("distributed" if name == "dist" else "simulate") and config["groups"] == \
            [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
        assert os.path.exists(os.path.join(out, "summary.json"))
    d, s = logs["dist"][0], logs["sim"][0]
    for key in ("step", "optimizer_steps", "lr", "train_loss", "test_loss", "test_acc", "buffer_bytes",
                "peak_buffer_bytes"):
        assert d[key] == s[key], key  # same parameters, bit for bit
    assert all(b == 0 for b, k in zip(d["peak_buffer_bytes"], config["stage_kinds"]) if k == "reversible")


@pytest.mark.serial  # a wall-clock bound
def test_cli_nproc_kills_a_hung_rank_timeout_plus_1_s_after_the_others_exit(tmp_path):
    """The launcher gives the ranks --timeout + 1 s after the first exit (the bound within which a rank that is not
    hung exits after a failure), then kills the hung one: the command ends ~2 --timeout + 1 s after the hang."""
    timeout = 2.0
    args = ["--model", "revnet18", "--dataset", "synthetic", "--image-size", "8", "--epochs", "1", "--batch-size", "8",
            "--max-steps", "12", "--threads", "1", "--no-progress", "--runtime", "distributed", "--nproc", "2",
            "--timeout", str(timeout), "--out", str(tmp_path)]
    proc = subprocess.run([sys.executable, "-m", "revkernels.petra.train", *args], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, **{FAULT_ENV: "1:3:STOP"}), timeout=180)
    ended = time.time()
    assert proc.returncode == 1 and "rank 1 exited with signal SIGKILL" in proc.stderr, proc.stderr[-3000:]
    stopped_at = float(re.search(r"SIGSTOP to rank 1 at tick 3 \(time ([0-9.]+)\)", proc.stderr).group(1))
    # ~2 --timeout + 1 s = 5 s; a fixed 60 s grace took over 60 s. The bound leaves a busy machine room.
    assert ended - stopped_at < 30, ended - stopped_at


def test_cli_nproc_rank_argument_error_is_one_line(tmp_path):
    """An argument error a rank finds (here --batch-size 1 at 1x1 feature maps) is printed as the CLI prints
    argument errors, by each rank, without a traceback; the run exits as an argument error does (status 2),
    without restarting (a restart would find the same error)."""
    args = ["--model", "revnet18", "--dataset", "synthetic", "--image-size", "8", "--epochs", "1", "--batch-size", "1",
            "--max-steps", "2", "--threads", "1", "--no-progress", "--runtime", "distributed", "--nproc", "2",
            "--max-restarts", "1", "--out", str(tmp_path)]
    proc = subprocess.run([sys.executable, "-m", "revkernels.petra.train", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=180)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("python -m revkernels.petra.train: error: revkernels: --batch-size must be >= 2") == 2
    assert "rank 0 exited with status 2, rank 1 exited with status 2" in proc.stderr
    assert "restart" not in proc.stderr



@pytest.mark.parametrize("found", [True, False])
def test_resume_with_another_rank_count_is_an_argument_error(found, tmp_path):
    """A distributed checkpoint resumed by one rank: saved by 2 ranks, this rank's file is there, but the
    checkpoint is refused before any training (a ValueError, which the CLI reports as an argument error:
    status 2, no restart; before, the rank's load_state_dict raised inside training, status 1, and
    --max-restarts restarted into the same error); with no file for this rank, no step is complete."""
    import argparse

    import torch.distributed as dist

    from revkernels.petra.train import _read_checkpoint

    name = "rank0.pt" if found else "rank1.pt"
    torch.save({"step": 2, "trainer": {"world_size": 2}}, tmp_path / name)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        match = "saved by 2 ranks, this run has 1" if found else "no step with a complete rank file"
        with pytest.raises(ValueError, match=match):
            _read_checkpoint(argparse.Namespace(runtime="distributed"), str(tmp_path))
    finally:
        dist.destroy_process_group()

# --- the simulator's stage groups (what the ranks run) ------------------------------------------------

def test_split_groups_and_grouped_simulator_schedule():
    from revkernels.petra import split_groups

    assert split_groups(10, 3) == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert split_groups(4, None) == [[0], [1], [2], [3]] and split_groups(5, [2, 3]) == [[0, 1], [2, 3, 4]]
    for bad in (0, 11, [2, 2], [5, 0, 5], "3"):
        with pytest.raises(ValueError, match="groups"):
            split_groups(10, bad)
    with pytest.raises(ValueError, match="methods .'petra', 'delayed'. only"):
        Trainer(synthetic_stages("S r H"), "backprop", groups=2)
    # Worker w (0-based, of R) runs batch b's forward at tick b + w and its backward 2(R - 1 - w) ticks later,
    # every stage of a group at its group's ticks; a group of stages holds the inputs of its non-reversible ones.
    trainer = Trainer(synthetic_stages("S r D r r H"), "petra", groups=[2, 2, 2], accum_k=2)
    n, R = 5, 3
    for x, y in _batches(n):
        trainer.train_step(x, y)
    trainer.flush()
    assert trainer.tick == n + 2 * (R - 1)
    for b in range(n):
        for w, group in enumerate(trainer.groups):
            for i in group:
                assert trainer.schedule[(b, i)] == {"forward": b + w, "backward": b + w + 2 * (R - 1 - w)}
    peaks = [s["peak_bytes"] for s in trainer.buffer_stats()]
    assert peaks[0] > 0 and peaks[2] > 0 and peaks[1] == peaks[3] == peaks[4] == peaks[5] == 0
    assert [o.steps for o in trainer.optimizers] == [n // 2] * 6


@pytest.mark.slow
def test_distributed_delayed_equals_simulator(tmp_path):
    """The delayed-gradient baseline runs on the same Worker.step: 3 ranks, bit-identical to the simulator
    (slow: about 15 s on a busy 2-core machine)."""
    n = 6
    results = launch(_train_rank, 3, ("S r D r r H", 3, n, 20.0, None, "delayed"), log_dir=str(tmp_path), timeout=120)
    model, trainer, sim_losses = _simulate("S r D r r H", 3, n, "delayed")
    assert_ranks_hold_the_simulators_parameters(results, trainer, tmp_path)
    assert results[-1]["losses"] == sim_losses
    stats = results[0]["stats"]
    assert [s["peak_bytes"] for s in stats] == [s["peak_bytes"] for s in trainer.buffer_stats()]
    assert all(s["peak_bytes"] > 0 for s in stats[:-1]) and all(res["peak_rev"] > 0 for res in results[:-1])


# --- checkpoints: resume under the distributed runtime ------------------------------------------------

def _resume_rank(layout, groups, data_range, ckpt_in, ckpt_out, save_at, timeout=20.0):
    """One rank: a fresh model from seed 0, optionally restored from ``ckpt_in/rank{r}.pt``, trained on
    batches ``data_range`` of `_batches(6)` (saving ``ckpt_out/rank{r}.pt`` after batch `save_at`), flushed."""
    torch.manual_seed(0)
    model = synthetic_stages(layout)
    init(timeout=timeout)
    pr = PipelineRank(model, groups=groups, timeout=timeout, **KW)
    if ckpt_in:
        pr.load_state_dict(torch.load(os.path.join(ckpt_in, f"rank{pr.rank}.pt"), weights_only=False))
    losses = []
    data = _batches(6)
    for b in range(*data_range):
        losses.append(pr.train_step(*data[b])["loss"])
        if ckpt_out and b + 1 == save_at:
            torch.save(pr.state_dict(), os.path.join(ckpt_out, f"rank{pr.rank}.pt"))
            pr.barrier()
    losses += [r["loss"] for r in pr.flush()]
    own = pr.trainer.groups[pr.rank]
    state = {i: {k: v.clone() for k, v in pr.stages[i].module.state_dict().items()} for i in own}
    steps = [pr.trainer.optimizers[i].steps for i in own]
    pr.close()
    return {"state": state, "losses": losses, "steps": steps, "ticks": pr.tick}


def _same(a, b, where="state"):
    """Recursive equality with torch.equal for tensors (dict vs OrderedDict and list vs tuple alike)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, set(a) ^ set(b))
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def test_distributed_resume_is_exact_and_matches_the_simulator(tmp_path):
    """3 ranks (6 stages in 3 groups), 6 batches + flush straight (saving every rank's state after batch 3,
    mid-pipeline: FIFOs, received messages, partial grads in flight) vs fresh processes restored from those
    files for batches 3..5 + flush: identical parameters and losses. The rank files equal the simulator's
    state at the same point, split by rank, and, merged, resume the simulator to the same parameters."""
    from revkernels.petra.distributed import merge_rank_states, split_trainer_state

    layout, groups = "S r D r r H", 3
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    straight = launch(_resume_rank, 3, (layout, groups, (0, 6), None, str(ckpt), 3), log_dir=str(tmp_path / "a"),
                      timeout=120)
    resumed = launch(_resume_rank, 3, (layout, groups, (3, 6), str(ckpt), None, None), log_dir=str(tmp_path / "b"),
                     timeout=120)
    for r in range(3):
        assert straight[r] is not None and resumed[r] is not None, r
        assert set(straight[r]["state"]) == set(resumed[r]["state"])
        for i, state in straight[r]["state"].items():
            for name, t in state.items():
                assert torch.equal(resumed[r]["state"][i][name], t), f"rank {r} stage {i} {name}"
        assert resumed[r]["steps"] == straight[r]["steps"] and resumed[r]["ticks"] == straight[r]["ticks"]
    assert straight[-1]["losses"][3:] == resumed[-1]["losses"]
    assert any(x is not None for x in resumed[-1]["losses"])

    # The simulator: the same 6 batches straight equal the distributed run; its state after 3 batches is
    # the rank files' content; the merged rank files resume it bit for bit.
    model, trainer, sim_losses = _simulate(layout, groups, 6)
    for r in range(3):
        for i, state in straight[r]["state"].items():
            for name, t in trainer.stages[i].module.state_dict().items():
                assert torch.equal(state[name], t), f"rank {r} stage {i} {name}"
    rank_states = [torch.load(ckpt / f"rank{r}.pt", weights_only=False) for r in range(3)]
    assert rank_states[0]["fifos"][0][0] and rank_states[1]["bwd_in"] is not None and rank_states[2]["labels"]
    data = _batches(6)
    torch.manual_seed(0)
    sim = Trainer(synthetic_stages(layout), "petra", groups=groups, **KW)
    for x, y in data[:3]:
        sim.train_step(x, y)
    sim_state = sim.state_dict()
    for r in range(3):
        _same(split_trainer_state(sim_state, r, image_spec=(tuple(data[0][0].shape), data[0][0].dtype)),
              rank_states[r], f"rank {r}")
    torch.manual_seed(0)
    model2 = synthetic_stages(layout)
    sim2 = Trainer(model2, "petra", groups=groups, **KW)
    sim2.load_state_dict(merge_rank_states(rank_states))
    losses = [sim2.train_step(x, y)["loss"] for x, y in data[3:]] + [r["loss"] for r in sim2.flush()]
    assert losses == resumed[-1]["losses"] == sim_losses[3:]
    sa, sb = model.state_dict(), model2.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_cli_distributed_checkpoint_and_resume(tmp_path):
    """``--runtime distributed --nproc 3 --checkpoint-every 3``: every rank writes checkpoint/rank{r}.pt; fresh
    processes with ``--resume <out>/checkpoint`` finish the run with the same final metrics, bit for bit."""
    args = ["--model", "revnet18", "--dataset", "synthetic", "--image-size", "8", "--epochs", "1", "--batch-size", "8",
            "--max-steps", "5", "--accum", "2", "--threads", "1", "--no-progress", "--runtime", "distributed",
            "--nproc", "3"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    proc = subprocess.run([sys.executable, "-m", "revkernels.petra.train", *args, "--checkpoint-every", "3",
                           "--out", a], capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(os.path.join(a, "checkpoint"))) == ["rank0.pt", "rank1.pt", "rank2.pt"]
    proc = subprocess.run([sys.executable, "-m", "revkernels.petra.train", *args, "--resume",
                           os.path.join(a, "checkpoint"), "--out", b], capture_output=True, text=True, cwd=ROOT,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = {}
    for name, out in (("a", a), ("b", b)):
        with open(os.path.join(out, "summary.json")) as f:
            logs[name] = json.load(f)
    for key in ("step", "optimizer_steps", "lr", "train_loss", "test_loss", "test_acc", "buffer_bytes",
                "peak_buffer_bytes"):
        assert logs["a"][key] == logs["b"][key], key
    from revkernels.petra.train import main
    with pytest.raises(ValueError, match="not a folder of rank checkpoints"):
        main(args + ["--resume", os.path.join(a, "checkpoint", "rank0.pt")])
