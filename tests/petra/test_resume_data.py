"""Checkpoint / resume (the trainer's state and the CLI's ``--checkpoint-every`` / ``--resume``: a resumed
run equals an uninterrupted one bit for bit), the CLI's ``--analyze-every`` logs and ``--method delayed``,
and the ``imagefolder`` / ``cifar10`` datasets on tiny generated fixtures."""
import csv
import io
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

from revkernels.petra import Trainer
from revkernels.petra.data import load_cifar10, load_dataset, load_imagefolder
from revkernels.petra.train import main
from tests.petra.test_simulate import _batches, synthetic_stages

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


# --- the trainer's state_dict ------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["petra", "delayed", "backprop"])
def test_trainer_resume_is_exact(method):
    """9 steps + flush straight vs 4 steps, save (mid-pipeline: messages, FIFOs, partial grads in flight),
    fresh model and trainer, load, 5 steps + flush: identical parameters, buffers, losses and analysis."""
    kw = dict(accum_k=2, base_lr=1.0, warmup_steps=2, weight_decay=1e-3, analyze_every=2)
    data = _batches(9, batch=6)

    def fresh():
        torch.manual_seed(0)
        model = synthetic_stages("S r D r H")
        return model, Trainer(model, method, **kw)

    model_a, ta = fresh()
    losses_a = [ta.train_step(x, y)["loss"] for x, y in data] + [r["loss"] for r in ta.flush()]
    model_b, tb = fresh()
    losses_b = [tb.train_step(x, y)["loss"] for x, y in data[:4]]
    if method != "backprop":
        assert tb.pending() and any(s.buffered_inputs for s in tb.stages)
    buf = io.BytesIO()
    torch.save(tb.state_dict(), buf)
    del model_b, tb
    model_c, tc = fresh()
    buf.seek(0)
    tc.load_state_dict(torch.load(buf, weights_only=False))
    losses_b += [tc.train_step(x, y)["loss"] for x, y in data[4:]] + [r["loss"] for r in tc.flush()]
    assert losses_a == losses_b
    sa, sc = _state(model_a), _state(model_c)
    assert all(torch.equal(sa[k], sc[k]) for k in sa)
    assert [o.steps for o in ta.optimizers] == [o.steps for o in tc.optimizers]
    assert ta.analysis == tc.analysis and ta.tick == tc.tick
    with pytest.raises(ValueError, match="method"):
        Trainer(synthetic_stages("S r D r H"), "revbackprop" if method != "revbackprop" else "petra",
                **kw).load_state_dict(ta.state_dict())


# --- the CLI ---------------------------------------------------------------------------------------------

def _cli(data):
    return ["--model", "revnet18", "--dataset", "imagefolder", "--data", data, "--image-size", "4", "--batch-size", "4",
            "--epochs", "3", "--accum", "2", "--warmup-epochs", "0.5", "--threads", "1", "--no-progress", "--lr", "0.2"]


def _ckpt_model(path):
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    return ckpt["trainer"]["modules"], ckpt["trainer"]["optimizers"], ckpt["step"]


def test_cli_resume_in_a_fresh_process_continues_exactly(tmp_path):
    """A tiny image folder: 15 training images, 3 batches of 4 per epoch. 6 steps straight vs 4 steps +
    checkpoint, then a fresh process resumes from it for 2 more (from mid-epoch 2): the step-6
    checkpoints (model, optimizers, partial grads) are identical."""
    pytest.importorskip("PIL")
    _write_images(str(tmp_path / "data"), ["a", "b", "c"], 6, (6, 6))
    cli = _cli(str(tmp_path / "data"))
    a, b, c = (str(tmp_path / n) for n in "abc")
    main(cli + ["--method", "petra", "--max-steps", "6", "--checkpoint-every", "6", "--out", a])
    main(cli + ["--method", "petra", "--max-steps", "4", "--checkpoint-every", "4", "--out", b])
    proc = subprocess.run([sys.executable, "-m", "revkernels.petra.train", *cli, "--method", "petra", "--max-steps",
                           "6", "--checkpoint-every", "2", "--resume", os.path.join(b, "checkpoint.pt"), "--out", c],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (ma, oa, sa), (mc, oc, sc) = _ckpt_model(os.path.join(a, "checkpoint.pt")), _ckpt_model(os.path.join(c, "checkpoint.pt"))
    assert sa == sc == 6
    for stage_a, stage_c in zip(ma, mc):
        assert stage_a.keys() == stage_c.keys() and all(torch.equal(stage_a[k], stage_c[k]) for k in stage_a)
    for x, y in zip(oa, oc):
        assert x["steps"] == y["steps"] and x["backward_steps"] == y["backward_steps"]
        for ga, gc in zip(x["grads"], y["grads"]):
            assert (ga is None and gc is None) or torch.equal(ga, gc)
        for k, st in x["optimizer"]["state"].items():
            assert torch.equal(st["momentum_buffer"], y["optimizer"]["state"][k]["momentum_buffer"])
    # The resumed run logs epoch 2 (where it started; it ends there, after 6 = 2 * 3 batches) like the
    # uninterrupted one: the same train loss (averaged over the whole epoch) and test accuracy.
    logs = {n: [json.loads(line) for line in open(os.path.join(n, "metrics.jsonl"))] for n in (a, c)}
    assert [r["epoch"] for r in logs[c]] == [2] and [r["epoch"] for r in logs[a]] == [1, 2]
    for ra, rc in zip(logs[a][1:], logs[c]):
        assert (ra["train_loss"], ra["test_acc"], ra["step"]) == (rc["train_loss"], rc["test_acc"], rc["step"])
    bad = cli[:cli.index("--accum") + 1] + ["1"] + cli[cli.index("--accum") + 2:]
    with pytest.raises(ValueError, match="--accum"):
        main(bad + ["--method", "petra", "--resume", os.path.join(b, "checkpoint.pt"), "--out", c])


def test_cli_resume_past_max_steps_or_epochs_is_refused(tmp_path):
    """A checkpoint after batch 3 (of 2 per epoch: in epoch 2) cannot continue a run of 2 batches or of 1 epoch."""
    args = ["--dataset", "digits", "--image-size", "4", "--batch-size", "512", "--epochs", "2", "--milestones",
            "--threads", "1", "--no-progress"]
    out = str(tmp_path / "run")
    main(args + ["--max-steps", "3", "--checkpoint-every", "3", "--out", out])
    ckpt = os.path.join(out, "checkpoint.pt")
    with pytest.raises(ValueError, match="the checkpoint is at step 3, past --max-steps 2"):
        main(args + ["--max-steps", "2", "--resume", ckpt, "--out", str(tmp_path / "steps")])
    with pytest.raises(ValueError, match="the checkpoint is in epoch 2, past --epochs 1"):
        main(args + ["--epochs", "1", "--resume", ckpt, "--out", str(tmp_path / "epochs")])


def test_cli_delayed_with_analysis_logs(tmp_path):
    out = str(tmp_path / "d")
    summary = main(["--model", "revnet18", "--dataset", "digits", "--image-size", "4", "--batch-size", "16",
                    "--max-steps", "4", "--threads", "1", "--no-progress", "--method", "delayed",
                    "--analyze-every", "2", "--out", out])
    rows = list(csv.DictReader(open(os.path.join(out, "analysis.csv"))))
    recs = [json.loads(line) for line in open(os.path.join(out, "analysis.jsonl"))]
    assert len(rows) == len(recs) > 0 and {r["method"] for r in recs} == {"delayed"}
    assert all(-1 - 1e-9 <= float(r["cosine"]) <= 1 + 1e-9 for r in rows)
    assert summary["analysis_mean_cosine"] is not None
    metrics = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert metrics[-1]["mean_cosine"] is not None
    assert max(metrics[-1]["peak_buffer_bytes"][1:-1]) > 0  # reversible stages buffer under delayed


@pytest.mark.parametrize("flags, match", [(["--runtime", "distributed", "--nproc", "2", "--analyze-every", "1"],
                                           "simulate only"),
                                          (["--runtime", "distributed", "--nproc", "2", "--resume", "x"],
                                           "not a folder of rank checkpoints"),
                                          (["--checkpoint-every", "0"], "--checkpoint-every"),
                                          (["--resume", "/nonexistent/ckpt.pt"], "not a file"),
                                          (["--dataset", "cifar10"], "--data")])
def test_cli_new_flag_errors(flags, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        main(["--max-steps", "1", "--out", str(tmp_path), *flags])


# --- datasets ----------------------------------------------------------------------------------------------

def _write_images(root, classes, n, size, fmt="PNG", seed=0):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = {}
    for c in classes:
        os.makedirs(os.path.join(root, c), exist_ok=True)
        for i in range(n):
            arr = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
            ext = "png" if fmt == "PNG" else "jpg"
            path = os.path.join(root, c, f"{i}.{ext}")
            Image.fromarray(arr.numpy()).save(path, fmt)
            pixels[path] = arr
    return pixels


def test_imagefolder_reads_class_folders_exactly(tmp_path):
    pytest.importorskip("PIL")
    pixels = _write_images(str(tmp_path), ["cat", "dog", "eel"], 5, (6, 5))
    (tmp_path / "notes.txt").write_text("ignored")
    (tmp_path / "cat" / "readme.md").write_text("ignored")
    d = load_imagefolder(str(tmp_path), split_seed=0)
    assert d.num_classes == 3 and d.train_images.shape[1:] == (3, 5, 6)
    assert len(d.train_labels) + len(d.test_labels) == 15 and len(d.test_labels) == 3  # 1 per class
    # Un-normalised pixels are PIL's exactly, in sorted order: class c, file i at position 5c + i.
    images = torch.cat([d.train_images, d.test_images]) * d.std + d.mean
    order = torch.cat([d.train_index, d.test_index])
    paths = sorted(pixels, key=lambda p: (p.split(os.sep)[-2], int(os.path.basename(p)[0])))
    for pos, src in zip(order.tolist(), images):
        expect = pixels[paths[pos]].permute(2, 0, 1).float() / 255
        assert torch.allclose(src, expect, atol=1e-5)
    assert torch.equal(torch.cat([d.train_labels, d.test_labels]), torch.tensor([i // 5 for i in order.tolist()]))
    # resize, explicit train/test split, JPEG
    d8 = load_imagefolder(str(tmp_path), image_size=8)
    assert d8.train_images.shape[1:] == (3, 8, 8)
    split = tmp_path / "split"
    _write_images(str(split / "train"), ["a", "b"], 3, (4, 4))
    _write_images(str(split / "test"), ["a", "b"], 2, (4, 4), fmt="JPEG", seed=1)
    ds = load_dataset("imagefolder", path=str(split))
    assert (len(ds.train_labels), len(ds.test_labels)) == (6, 4) and ds.test_labels.tolist() == [0, 0, 1, 1]
    _write_images(str(tmp_path / "mixed" / "a"), ["x"], 1, (4, 4))
    _write_images(str(tmp_path / "mixed" / "b"), ["y"], 1, (5, 5))
    with pytest.raises(ValueError):
        load_imagefolder(str(tmp_path / "mixed" / "a"))  # one class
    with pytest.raises(ValueError, match="not a folder"):
        load_imagefolder(str(tmp_path / "missing"))


def _write_cifar(root, n_per_batch=4, batches=(1, 2)):
    g = torch.Generator().manual_seed(0)
    os.makedirs(root, exist_ok=True)
    out = {}
    for name in [f"data_batch_{i}" for i in batches] + ["test_batch"]:
        data = torch.randint(0, 256, (n_per_batch, 3072), generator=g, dtype=torch.uint8)
        labels = torch.randint(0, 10, (n_per_batch,), generator=g).tolist()
        with open(os.path.join(root, name), "wb") as f:
            pickle.dump({b"batch_label": name.encode(), b"data": data.numpy(), b"labels": labels,
                         b"filenames": [b"x.png"] * n_per_batch}, f)
        out[name] = (data, labels)
    return out


def test_cifar10_reads_the_python_batches(tmp_path):
    raw = _write_cifar(str(tmp_path / "cifar-10-batches-py"))
    d = load_cifar10(str(tmp_path))
    assert d.num_classes == 10 and d.train_images.shape == (8, 3, 32, 32) and d.test_images.shape == (4, 3, 32, 32)
    back = d.train_images * d.std + d.mean
    expect = torch.cat([raw["data_batch_1"][0], raw["data_batch_2"][0]]).view(8, 3, 32, 32).float() / 255
    assert torch.allclose(back, expect, atol=1e-5)
    assert d.train_labels.tolist() == raw["data_batch_1"][1] + raw["data_batch_2"][1]
    assert d.test_labels.tolist() == raw["test_batch"][1]
    assert load_dataset("cifar10", 8, path=str(tmp_path)).train_images.shape == (8, 3, 8, 8)
    os.remove(tmp_path / "cifar-10-batches-py" / "test_batch")
    with pytest.raises(ValueError, match="test_batch"):
        load_cifar10(str(tmp_path))


def test_cli_trains_on_cifar10_and_imagefolder_fixtures(tmp_path):
    _write_cifar(str(tmp_path / "c"), n_per_batch=8)
    pytest.importorskip("PIL")
    _write_images(str(tmp_path / "f"), ["a", "b", "c"], 6, (8, 8))
    for dataset, path in (("cifar10", tmp_path / "c"), ("imagefolder", tmp_path / "f")):
        s = main(["--model", "revnet18", "--dataset", dataset, "--data", str(path), "--image-size", "4",
                  "--batch-size", "4", "--max-steps", "2", "--threads", "1", "--no-progress", "--method", "backprop",
                  "--out", str(tmp_path / f"out_{dataset}")])
        assert 0 <= s["final_test_acc"] <= 1


def test_cli_resume_with_more_epochs_keeps_the_checkpoints_default_milestones(tmp_path):
    # (the default milestones, halfway and three quarters through --epochs, moved with a longer
    # --epochs, and the resume was refused for "other --milestones" the user never gave)
    args = ["--dataset", "digits", "--image-size", "4", "--batch-size", "512", "--threads", "1", "--no-progress"]
    out, more = str(tmp_path / "run"), str(tmp_path / "more")
    main(args + ["--epochs", "2", "--max-steps", "3", "--checkpoint-every", "3", "--out", out])
    main(args + ["--epochs", "4", "--max-steps", "4", "--resume", os.path.join(out, "checkpoint.pt"), "--out", more])
    first, resumed = (json.load(open(os.path.join(d, "config.json"))) for d in (out, more))
    assert first["milestones"] == resumed["milestones"] == [1.0, 1.5]
    assert "milestones_default" not in resumed
    with pytest.raises(ValueError, match="--milestones"):  # given explicitly, they must still agree
        main(args + ["--epochs", "4", "--milestones", "2", "3", "--resume", os.path.join(out, "checkpoint.pt"),
                     "--out", str(tmp_path / "other")])
