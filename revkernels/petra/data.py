"""Small image datasets for the PETRA trainer (`python -m revkernels.petra.train`).

- ``digits``: scikit-learn's bundled 8x8 handwritten digits (1,797 real images, 10 classes, shipped
  inside the scikit-learn package, no download). Pixels 0..16 are scaled to [0, 1], upsampled to
  ``image_size`` x ``image_size`` with bilinear interpolation, repeated to 3 channels and normalised
  with the training split's mean and std. The train/test split is stratified (``test_fraction`` of
  each class) and fixed by ``split_seed``, independent of the training seed.
- ``synthetic``: seeded Gaussian class blobs rendered as images: each class has its own blob centre,
  width and colour; each sample is its class's blob, jittered in position and amplitude, plus pixel
  noise. Normalised like ``digits``.

`load_dataset(name, image_size, ...)` returns a `Dataset` (train and test tensors, float32
``(N, 3, S, S)`` images and int64 labels,
and the split's indices into the source data). `batches(...)` yields shuffled mini-batches.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

DATASETS = ("digits", "synthetic")


@dataclass
class Dataset:
    name: str
    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor
    num_classes: int
    mean: float
    std: float
    train_index: torch.Tensor = None  # positions in the source data (scikit-learn's order for digits)
    test_index: torch.Tensor = None

    @property
    def image_size(self):
        return int(self.train_images.shape[-1])


def _check_int(value, name, minimum):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"revkernels: {name} must be an int >= {minimum}, got {value!r}")


def _split(labels, test_fraction, split_seed):
    """Stratified split: per class, a seeded permutation; the first round(fraction * n) go to test."""
    g = torch.Generator().manual_seed(split_seed)
    train, test = [], []
    for c in torch.unique(labels).tolist():
        idx = torch.nonzero(labels == c).flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        n_test = int(round(test_fraction * len(idx)))
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return torch.sort(torch.cat(train)).values, torch.sort(torch.cat(test)).values


def _finish(name, images, labels, train_idx, test_idx, num_classes):
    """Normalises with the training split's statistics and builds the `Dataset`."""
    train = images[train_idx]
    mean = train.mean().item()
    std = train.std().clamp_min(1e-8).item()
    norm = lambda x: ((x - mean) / std).contiguous()  # noqa: E731
    return Dataset(name, norm(train), labels[train_idx].clone(), norm(images[test_idx]), labels[test_idx].clone(),
                   num_classes, mean, std, train_idx.clone(), test_idx.clone())


def load_digits(image_size=16, test_fraction=0.2, split_seed=0):
    """scikit-learn's 8x8 digits, upsampled to ``image_size`` (bilinear), 3 channels, normalised."""
    _check_int(image_size, "image_size", 1)
    if not isinstance(test_fraction, float) or not 0.0 < test_fraction < 1.0:
        raise ValueError(f"revkernels: test_fraction must be a float in (0, 1), got {test_fraction!r}")
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError as e:  # pragma: no cover - scikit-learn is in scripts/setup.sh
        raise ImportError("revkernels: the 'digits' dataset needs scikit-learn (pip install scikit-learn)") from e
    raw = sk_load_digits()
    images = torch.as_tensor(raw.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
    labels = torch.as_tensor(raw.target, dtype=torch.int64)
    if image_size != images.shape[-1]:
        images = F.interpolate(images, size=(image_size, image_size), mode="bilinear", align_corners=False)
    images = images.repeat(1, 3, 1, 1)
    train_idx, test_idx = _split(labels, test_fraction, split_seed)
    return _finish("digits", images, labels, train_idx, test_idx, 10)


def make_synthetic(image_size=16, num_classes=10, num_train=1024, num_test=256, noise=0.3, seed=0):
    """Seeded Gaussian class blobs rendered as ``(N, 3, S, S)`` images (see the module docstring)."""
    _check_int(image_size, "image_size", 1)
    _check_int(num_classes, "num_classes", 2)
    _check_int(num_train, "num_train", 1)
    _check_int(num_test, "num_test", 1)
    g = torch.Generator().manual_seed(seed)
    n = num_train + num_test
    centres = 0.2 + 0.6 * torch.rand(num_classes, 2, generator=g)  # in [0.2, 0.8] of the image
    widths = 0.08 + 0.12 * torch.rand(num_classes, generator=g)
    colours = torch.rand(num_classes, 3, generator=g) + 0.2
    labels = torch.arange(n) % num_classes
    labels = labels[torch.randperm(n, generator=g)]
    centre = centres[labels] + 0.05 * torch.randn(n, 2, generator=g)
    amp = 1.0 + 0.2 * torch.randn(n, 1, 1, 1, generator=g)
    coords = (torch.arange(image_size, dtype=torch.float32) + 0.5) / image_size
    dy = coords.view(1, -1, 1) - centre[:, 0].view(-1, 1, 1)
    dx = coords.view(1, 1, -1) - centre[:, 1].view(-1, 1, 1)
    blob = torch.exp(-(dx ** 2 + dy ** 2) / (2 * widths[labels].view(-1, 1, 1) ** 2))  # (n, S, S)
    images = amp * colours[labels].view(n, 3, 1, 1) * blob.unsqueeze(1)
    images = images + noise * torch.randn(images.shape, generator=g)
    idx = torch.arange(n)
    return _finish("synthetic", images, labels, idx[:num_train], idx[num_train:], num_classes)


def load_dataset(name, image_size=None, split_seed=0):
    """`load_digits` or `make_synthetic` by name; ``image_size`` None means 16."""
    if not isinstance(name, str) or name not in DATASETS:
        raise ValueError(f"revkernels: --dataset must be one of {list(DATASETS)}, got {name!r}")
    image_size = 16 if image_size is None else image_size
    if name == "digits":
        return load_digits(image_size, split_seed=split_seed)
    return make_synthetic(image_size, seed=split_seed)


def batches(images, labels, batch_size, generator=None, shuffle=True, drop_last=True):
    """Yields ``(images, labels)`` mini-batches, shuffled with `generator` when `shuffle`."""
    _check_int(batch_size, "batch_size", 1)
    n = images.shape[0]
    order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
    stop = n - n % batch_size if drop_last else n
    for start in range(0, stop, batch_size):
        idx = order[start:start + batch_size]
        yield images[idx], labels[idx]
