"""The PETRA trainer CLI (`python -m revkernels.petra.train`) and its datasets: end-to-end runs of
each method on real digits with logs, the digits loader (real, shaped, normalised, stable split),
synthetic blobs, and clear errors for bad arguments and a distributed run without a launcher."""
import csv
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from revkernels.petra import METHODS
from revkernels.petra.data import batches, load_dataset, load_digits, make_synthetic
from revkernels.petra.train import SMALL_DATA_LR, cli, main, make_parser

sklearn_datasets = pytest.importorskip("sklearn.datasets")

TINY = ["--model", "revnet18", "--stem", "cifar", "--dataset", "digits", "--image-size", "8", "--epochs", "1",
        "--batch-size", "16", "--max-steps", "4", "--threads", "1", "--no-progress"]
NUM_STAGES = 10  # RevNet18: S r r D r D r D r H


# --- data ------------------------------------------------------------------------------------------

def test_digits_real_shaped_normalised():
    raw = sklearn_datasets.load_digits()
    d = load_digits(image_size=8)
    n_train, n_test = d.train_images.shape[0], d.test_images.shape[0]
    assert n_train + n_test == len(raw.target) == 1797
    assert d.train_images.shape == (n_train, 3, 8, 8) and d.test_images.shape == (n_test, 3, 8, 8)
    assert d.train_images.dtype == torch.float32 and d.train_labels.dtype == torch.int64
    assert d.num_classes == 10 and set(d.train_labels.tolist()) == set(range(10))
    # normalised with the training split's statistics
    assert abs(d.train_images.mean().item()) < 1e-4 and abs(d.train_images.std().item() - 1) < 1e-3
    # real data: un-normalised, it is scikit-learn's pixels / 16 (channels repeated) with its labels
    raw_images = torch.as_tensor(raw.images, dtype=torch.float32) / 16
    raw_labels = torch.as_tensor(raw.target, dtype=torch.int64)
    for images, labels, index in ((d.train_images, d.train_labels, d.train_index),
                                  (d.test_images, d.test_labels, d.test_index)):
        back = images * d.std + d.mean
        assert torch.equal(back[:, 0], back[:, 1]) and torch.equal(back[:, 0], back[:, 2])
        assert torch.allclose(back[:, 0], raw_images[index], atol=1e-5)
        assert torch.equal(labels, raw_labels[index])


def test_digits_upsampled_bilinear():
    raw = torch.as_tensor(sklearn_datasets.load_digits().images, dtype=torch.float32).unsqueeze(1) / 16
    d = load_digits(image_size=16)
    assert d.train_images.shape[1:] == (3, 16, 16) and d.image_size == 16
    up = F.interpolate(raw[d.test_index], size=(16, 16), mode="bilinear", align_corners=False)
    assert torch.allclose(d.test_images[:, :1] * d.std + d.mean, up, atol=1e-5)
    assert abs(d.train_images.mean().item()) < 1e-4 and abs(d.train_images.std().item() - 1) < 1e-3


def test_digits_split_stable_stratified_disjoint():
    a, b, a16 = load_digits(image_size=8), load_digits(image_size=8), load_digits(image_size=16)
    assert torch.equal(a.train_images, b.train_images) and torch.equal(a.test_images, b.test_images)
    assert torch.equal(a.test_index, a16.test_index)  # same split whatever the image size
    # pinned: a change here silently changes every reported digits accuracy (torch 2.13 CPU randperm)
    assert a.test_index[:8].tolist() == [1, 2, 6, 10, 13, 16, 22, 25]
    both = torch.cat([a.train_index, a.test_index])
    assert torch.equal(torch.sort(both).values, torch.arange(1797))  # disjoint and complete
    c = load_digits(image_size=8, split_seed=1)
    assert not torch.equal(a.test_index, c.test_index)
    assert abs(len(a.test_index) / 1797 - 0.2) < 0.01
    frac = torch.bincount(a.test_labels, minlength=10).float() / torch.bincount(
        torch.cat([a.train_labels, a.test_labels]), minlength=10).float()
    assert ((frac - 0.2).abs() < 0.02).all()  # stratified


def test_synthetic_and_batches():
    s1, s2 = make_synthetic(image_size=8, num_train=64, num_test=32), make_synthetic(image_size=8, num_train=64, num_test=32)
    assert s1.train_images.shape == (64, 3, 8, 8) and s1.test_images.shape == (32, 3, 8, 8)
    assert torch.equal(s1.train_images, s2.train_images) and torch.equal(s1.test_labels, s2.test_labels)
    assert torch.isfinite(s1.train_images).all() and abs(s1.train_images.mean().item()) < 1e-4
    assert set(s1.train_labels.tolist()) == set(range(10))
    g = torch.Generator().manual_seed(0)
    got = list(batches(s1.train_images, s1.train_labels, 10, g))
    assert len(got) == 6 and all(x.shape == (10, 3, 8, 8) and y.shape == (10,) for x, y in got)
    assert len(list(batches(s1.train_images, s1.train_labels, 10, shuffle=False, drop_last=False))) == 7


def test_dataset_errors():
    with pytest.raises(ValueError, match="--dataset"):
        load_dataset("cifar100")
    with pytest.raises(ValueError, match="image_size"):
        load_digits(image_size=0)


# --- CLI -------------------------------------------------------------------------------------------

def _read_logs(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    with open(os.path.join(out, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    return records, rows, config


@pytest.mark.parametrize("method", METHODS)
def test_cli_end_to_end_digits(method, tmp_path, capsys):
    out = str(tmp_path / method)
    summary = main(TINY + ["--method", method, "--out", out])
    records, rows, config = _read_logs(out)
    assert len(records) == 1 and len(rows) == 1
    r = records[0]
    assert r["epoch"] == 1 and r["step"] == 4
    assert r["train_loss"] is not None and 0 < r["train_loss"] < 10
    assert 0 <= r["test_acc"] <= 1 and r["images_per_s"] > 0
    assert len(r["buffer_bytes"]) == len(r["peak_buffer_bytes"]) == NUM_STAGES
    assert float(rows[0]["test_acc"]) == pytest.approx(r["test_acc"])
    assert all(f"peak_buffer_bytes_stage{i}" in rows[0] for i in range(NUM_STAGES))
    assert config["num_stages"] == NUM_STAGES and config["image_size"] == 8 and config["total_steps"] == 4
    assert summary["final_test_acc"] == r["test_acc"]
    assert os.path.exists(os.path.join(out, "summary.json"))
    printed = capsys.readouterr().out
    assert "final:" in printed and f"method={method}" in printed and "test_acc=" in printed
    if method in ("petra", "delayed"):
        kinds = config["stage_kinds"]
        # PETRA's reversible stages never buffer (delayed's buffer inputs and parameters); the stem keeps
        # the in-flight inputs; all loss from the head
        rev = [b for b, k in zip(r["peak_buffer_bytes"], kinds) if k == "reversible"]
        assert all(b == 0 for b in rev) if method == "petra" else all(b > 0 for b in rev)
        assert r["buffer_bytes"][0] > 0 and r["peak_buffer_bytes"][0] > 0
        assert r["optimizer_steps"] == 4  # the flush ran every pending backward (stage 0 stepped 4 times)
    else:
        assert all(b == 0 for b in r["peak_buffer_bytes"])


def test_cli_exact_stages_with_a_memory_budget(tmp_path, capsys):
    # --exact: the model's runs, hence its reversible stages, in exact mode; --memory-budget: some
    # reversible stages keep their inputs (a FIFO that holds bytes) and the others rebuild (none)
    out = str(tmp_path / "exact")
    main(TINY + ["--method", "petra", "--exact", "--memory-budget", "0.5", "--out", out])
    records, _, config = _read_logs(out)
    assert config["exact_stages"] is True and config["memory_budget"] == 0.5
    kinds = config["stage_kinds"]
    rev = [b for b, k in zip(records[0]["peak_buffer_bytes"], kinds) if k == "reversible"]
    assert any(b > 0 for b in rev) and any(b == 0 for b in rev), rev
    assert 0 < records[0]["train_loss"] < 10
    main(TINY + ["--method", "petra", "--out", str(tmp_path / "float")])
    assert _read_logs(str(tmp_path / "float"))[2]["exact_stages"] is False


@pytest.mark.parametrize("args, message", [
    (["--memory-budget", "1.5"], r"--memory-budget as a fraction must be in \[0, 1\], got 1.5"),
    (["--memory-budget", "0.5", "--method", "delayed"], "--memory-budget applies to --method petra only")])
def test_cli_bad_memory_budget_names_the_flag(args, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        main(["--out", str(tmp_path), *args])


def test_cli_memory_budget_is_a_fraction_up_to_1_and_bytes_above():
    from revkernels.petra.train import parse_budget

    assert [parse_budget(t) for t in ("0", "0.25", "1", "65536", "1e9")] == [0.0, 0.25, 1.0, 65536, 10**9]
    assert isinstance(parse_budget("1"), float) and isinstance(parse_budget("1e9"), int)


def test_cli_memory_budget_that_is_no_number_is_an_argparse_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path), "--memory-budget", "half"])
    assert exit_info.value.code == 2
    assert "--memory-budget: a fraction in [0, 1] or a number of bytes, got 'half'" in capsys.readouterr().err


def test_cli_schedule_in_epochs_and_synthetic(tmp_path, capsys):
    out = str(tmp_path / "syn")
    main(["--dataset", "synthetic", "--image-size", "8", "--method", "backprop", "--accum", "2", "--epochs", "2",
          "--batch-size", "16", "--warmup-epochs", "1", "--milestones", "1.5", "--max-steps", "3", "--threads", "1",
          "--no-progress", "--out", out])
    records, _, config = _read_logs(out)
    # 1024 training images / 16 = 64 batches per epoch = 32 optimizer steps (accum 2)
    assert config["batches_per_epoch"] == 64
    assert config["warmup_steps"] == 32 and config["milestone_steps"] == [48]
    assert config["peak_lr"] == pytest.approx(SMALL_DATA_LR * 16 * 2 / 256)  # the small-data default base lr
    assert len(records) == 1 and records[0]["step"] == 3 and records[0]["optimizer_steps"] == 1


@pytest.mark.parametrize("flag, value", [("--model", "resnet18"), ("--dataset", "mnist"), ("--method", "pipedream"),
                                         ("--stem", "tiny"), ("--accum", "0"), ("--batch-size", "0"),
                                         ("--max-steps", "0"), ("--milestones", "3 1"), ("--gamma", "0"),
                                         ("--weight-decay", "-1"), ("--ranks", "11")])
def test_cli_bad_args(flag, value, tmp_path):
    with pytest.raises(ValueError, match=flag):
        main(["--out", str(tmp_path), flag, *value.split()])


def test_cli_out_that_is_a_file_is_refused_before_training(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("a file")
    with pytest.raises(ValueError, match="--out .* exists and is not a folder"):
        main(TINY + ["--out", str(path)])


def test_cli_batch_size_1_names_the_flag_where_batchnorm_would_fail(tmp_path):
    """RevNet-18 ends on 1x1 feature maps at 8x8 images: a batch of one gives its last BatchNorm layers one value
    per channel. At 16x16 (2x2 maps) a batch of one trains."""
    with pytest.raises(ValueError, match="--batch-size must be >= 2 here: .* 1x1 feature map at --image-size 8"):
        main(TINY + ["--batch-size", "1", "--out", str(tmp_path / "8")])
    summary = main(TINY + ["--image-size", "16", "--batch-size", "1", "--max-steps", "2", "--out", str(tmp_path / "16")])
    assert summary["step"] == 2


def test_cli_resume_of_a_file_that_is_no_checkpoint(tmp_path, capsys):
    path = tmp_path / "notes.txt"
    path.write_text("not a checkpoint")
    with pytest.raises(SystemExit) as e:
        cli(TINY + ["--resume", str(path), "--out", str(tmp_path / "run")])
    assert e.value.code == 2
    assert f"--resume {str(path)!r} is not a revkernels.petra.train checkpoint" in capsys.readouterr().err


def test_cli_more_workers_than_stages_names_the_flag(tmp_path, monkeypatch):
    # --nproc: refused before any process starts; under torchrun, by every rank before it joins the group
    with pytest.raises(ValueError, match=f"--nproc must be at most the number of stages \\({NUM_STAGES} in revnet18\\)"):
        main(TINY + ["--runtime", "distributed", "--nproc", "11", "--out", str(tmp_path)])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "11")
    with pytest.raises(ValueError, match=r"the world size \(torchrun --nproc-per-node\) must be at most"):
        main(TINY + ["--runtime", "distributed", "--out", str(tmp_path)])


def test_help_states_the_thread_condition_and_the_image_size_defaults():
    parser = make_parser()
    assert "bit-identical to --runtime simulate --ranks R with the same --threads" in parser.epilog
    image_size = next(a.help for a in parser._actions if "--image-size" in a.option_strings)
    assert "digits, synthetic: default 16; cifar10, imagefolder: resized to S x S, by default kept at their own " \
           "size" in image_size


def test_cli_distributed_needs_a_launcher(tmp_path, capsys):
    # Without torchrun's environment nor --nproc, a clear error (the runtime itself: tests/petra/test_distributed.py).
    with pytest.raises(ValueError, match="torchrun --nproc-per-node"):
        main(["--runtime", "distributed", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--method petra or delayed only"):
        main(["--runtime", "distributed", "--method", "backprop", "--nproc", "2", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--nproc needs --runtime distributed"):
        main(["--nproc", "2", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        cli(["--runtime", "distributed", "--out", str(tmp_path)])
    assert e.value.code == 2
    assert "--nproc" in capsys.readouterr().err


def test_python_m_entry_point_errors_clearly():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-m", "revkernels.petra.train", "--runtime", "distributed"],
                          capture_output=True, text=True, cwd=root, timeout=60)
    assert proc.returncode == 2
    assert "torchrun --nproc-per-node" in proc.stderr and "Traceback" not in proc.stderr
