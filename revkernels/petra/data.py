"""Small image datasets for the PETRA trainer (`python -m revkernels.petra.train`).

- ``digits``: scikit-learn's bundled 8x8 handwritten digits (1,797 real images, 10 classes, shipped
  inside the scikit-learn package, no download). Pixels 0..16 are scaled to [0, 1], upsampled to
  ``image_size`` x ``image_size`` with bilinear interpolation, repeated to 3 channels and normalised
  with the training split's mean and std. The train/test split is stratified (``test_fraction`` of
  each class) and fixed by ``split_seed``, independent of the training seed.
- ``synthetic``: seeded Gaussian class blobs rendered as images: each class has its own blob centre,
  width and colour; each sample is its class's blob, jittered in position and amplitude, plus pixel
  noise. Normalised like ``digits``.
- ``imagefolder`` (``path``): a folder with one subfolder per class (sorted names = class ids 0..C-1)
  of PNG/JPEG/BMP/GIF images read with PIL (no torchvision), converted to RGB, resized to
  ``image_size`` (bilinear; None keeps the size if every image has the same one), scaled to [0, 1],
  normalised like ``digits``. If ``path`` has ``train/`` and ``test/`` (or ``val/``) subfolders those are
  the split (the test classes must be among the train ones); else a stratified split as for ``digits``.
- ``cifar10`` (``path``): the standard python-pickle CIFAR-10 batches (``data_batch_1`` ..
  ``data_batch_5`` = train, ``test_batch`` = test) from a local folder (or its
  ``cifar-10-batches-py/`` subfolder); no download. Whichever ``data_batch_*`` exist are used (at least
  one, and ``test_batch``). 32x32 RGB uint8 scaled to [0, 1], resized if ``image_size`` is not 32 (or
  None), normalised like ``digits``.

`load_dataset(name, image_size, ...)` returns a `Dataset` (train and test tensors, float32
``(N, 3, S, S)`` images and int64 labels,
and the split's indices into the source data). `batches(...)` yields shuffled mini-batches.
"""
import os
import pickle
from dataclasses import dataclass

import torch
import torch.nn.functional as F

DATASETS = ("digits", "synthetic", "imagefolder", "cifar10")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif")


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


def _resize(images, image_size):
    if image_size is None or tuple(images.shape[-2:]) == (image_size, image_size):
        return images
    return F.interpolate(images, size=(image_size, image_size), mode="bilinear", align_corners=False)


def _read_class_folders(root, classes=None):
    """(images list of (3, H, W) float tensors in [0, 1], labels, class names) from class subfolders."""
    try:
        from PIL import Image
    except ImportError as e:  # pragma: no cover - Pillow is a torch dependency in practice
        raise ImportError("revkernels: --dataset imagefolder needs Pillow (pip install pillow)") from e
    names = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    if classes is None:
        classes = names
    elif any(n not in classes for n in names):
        raise ValueError(f"revkernels: imagefolder: {root} has classes not in the training split: "
                         f"{sorted(set(names) - set(classes))}")
    if len(classes) < 2:
        raise ValueError(f"revkernels: imagefolder: {root} needs at least 2 class subfolders, found {names}")
    images, labels = [], []
    for c, name in enumerate(classes):
        folder = os.path.join(root, name)
        if not os.path.isdir(folder):
            continue
        for f in sorted(os.listdir(folder)):
            if not f.lower().endswith(IMAGE_EXTENSIONS):
                continue
            with Image.open(os.path.join(folder, f)) as im:
                rgb = im.convert("RGB")
                t = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).view(rgb.height, rgb.width, 3)
            images.append(t.permute(2, 0, 1).float() / 255.0)
            labels.append(c)
    if not images:
        raise ValueError(f"revkernels: imagefolder: no images ({', '.join(IMAGE_EXTENSIONS)}) under {root}")
    return images, labels, classes


def _stack(images, image_size, root):
    if image_size is None:
        sizes = {tuple(t.shape[-2:]) for t in images}
        if len(sizes) != 1:
            raise ValueError(f"revkernels: imagefolder: images under {root} have several sizes {sorted(sizes)}: "
                             f"pass --image-size")
        return torch.stack(images)
    return torch.cat([_resize(t.unsqueeze(0), image_size) for t in images])


def load_imagefolder(path, image_size=None, test_fraction=0.2, split_seed=0):
    """Class-subfolder images (module docstring) as a `Dataset`."""
    if image_size is not None:
        _check_int(image_size, "image_size", 1)
    if not path or not os.path.isdir(path):
        raise ValueError(f"revkernels: imagefolder: {path!r} is not a folder")
    test_dir = next((os.path.join(path, d) for d in ("test", "val") if os.path.isdir(os.path.join(path, d))), None)
    if os.path.isdir(os.path.join(path, "train")) and test_dir is not None:
        train, train_labels, classes = _read_class_folders(os.path.join(path, "train"))
        test, test_labels, _ = _read_class_folders(test_dir, classes)
        train, test = _stack(train, image_size, path), _stack(test, image_size, path)
        if image_size is None and train.shape[-2:] != test.shape[-2:]:
            raise ValueError("revkernels: imagefolder: train and test images differ in size: pass --image-size")
        images = torch.cat([train, test])
        labels = torch.tensor(train_labels + test_labels, dtype=torch.int64)
        idx = torch.arange(len(labels))
        return _finish("imagefolder", images, labels, idx[:len(train_labels)], idx[len(train_labels):], len(classes))
    images, labels, classes = _read_class_folders(path)
    images = _stack(images, image_size, path)
    labels = torch.tensor(labels, dtype=torch.int64)
    train_idx, test_idx = _split(labels, test_fraction, split_seed)
    if len(train_idx) == 0 or len(test_idx) == 0:
        raise ValueError(f"revkernels: imagefolder: too few images under {path} for a train/test split")
    return _finish("imagefolder", images, labels, train_idx, test_idx, len(classes))


def _cifar_batch(file):
    with open(file, "rb") as f:
        d = pickle.load(f, encoding="bytes")
    data = d.get(b"data", d.get("data"))
    labels = d.get(b"labels", d.get("labels"))
    if data is None or labels is None:
        raise ValueError(f"revkernels: cifar10: {file} is not a CIFAR-10 python batch (no data/labels)")
    data = torch.as_tensor(data, dtype=torch.uint8).reshape(-1, 3, 32, 32)
    return data, torch.as_tensor(list(labels), dtype=torch.int64)


def load_cifar10(path, image_size=None):
    """The python-pickle CIFAR-10 batches in `path` (module docstring) as a `Dataset`."""
    if image_size is not None:
        _check_int(image_size, "image_size", 1)
    if path and os.path.isdir(os.path.join(path, "cifar-10-batches-py")):
        path = os.path.join(path, "cifar-10-batches-py")
    if not path or not os.path.isdir(path):
        raise ValueError(f"revkernels: cifar10: {path!r} is not a folder")
    train_files = [os.path.join(path, f"data_batch_{i}") for i in range(1, 6)
                   if os.path.isfile(os.path.join(path, f"data_batch_{i}"))]
    test_file = os.path.join(path, "test_batch")
    if not train_files or not os.path.isfile(test_file):
        raise ValueError(f"revkernels: cifar10: {path} needs data_batch_1..5 and test_batch (the python version of "
                         f"CIFAR-10; no download is attempted)")
    parts = [_cifar_batch(f) for f in train_files]
    train = torch.cat([p[0] for p in parts])
    train_labels = torch.cat([p[1] for p in parts])
    test, test_labels = _cifar_batch(test_file)
    images = _resize(torch.cat([train, test]).float() / 255.0, image_size)
    labels = torch.cat([train_labels, test_labels])
    idx = torch.arange(len(labels))
    return _finish("cifar10", images, labels, idx[:len(train_labels)], idx[len(train_labels):], 10)


def load_dataset(name, image_size=None, split_seed=0, path=None):
    """`load_digits`, `make_synthetic`, `load_imagefolder` or `load_cifar10` by name; ``image_size``
    None means 16 for digits/synthetic and the images' own size for the others."""
    if not isinstance(name, str) or name not in DATASETS:
        raise ValueError(f"revkernels: --dataset must be one of {list(DATASETS)}, got {name!r}")
    if name == "imagefolder":
        return load_imagefolder(path, image_size, split_seed=split_seed)
    if name == "cifar10":
        return load_cifar10(path, image_size)
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
