"""BatchNorm2d with the ReLU fused in, on the fused op ``revkernels::batch_norm_act``.

`BatchNormAct2d` is a drop-in for ``nn.BatchNorm2d`` (optionally followed by a ReLU): it subclasses
it, so it has the same parameters, buffers and state_dict keys (weight, bias, running_mean,
running_var, num_batches_tracked) and everything that recognises a BatchNorm (``isinstance`` checks,
`revkernels.engine.structure.recompute_context`) keeps working. One exception: a module with
``relu=True`` is not a plain BatchNorm, and ``nn.SyncBatchNorm.convert_sync_batchnorm`` would
replace it by a SyncBatchNorm and drop the ReLU.

Training mode (or no running statistics): batch statistics through the fused op (forward and
backward each one op); the running statistics are updated from the op's mean and rstd, with the
unbiased variance ``(1 / rstd^2 - eps) * M / (M - 1)`` as nn.BatchNorm2d does, only when
``track_running_stats`` is True (the reversible engines' recompute turns it off, so a batch is
counted once). Recovering the variance from rstd costs relative precision when the variance is far
below eps (about 1e-7 * eps / var in fp32). Eval mode: the running statistics, through
``F.batch_norm`` (+ ReLU).
"""
import torch
import torch.nn.functional as F
from torch import nn

from revkernels.ops.batch_norm import batch_norm_act


class BatchNormAct2d(nn.BatchNorm2d):
    """``relu(BatchNorm2d(x))`` (or ``BatchNorm2d(x)`` with ``relu=False``) in one fused op."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, relu=True, affine=True, track_running_stats=True,
                 device=None, dtype=None):
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine,
                         track_running_stats=track_running_stats, device=device, dtype=dtype)
        self.relu = bool(relu)

    def extra_repr(self):
        return super().extra_repr() + f", relu={self.relu}"

    def forward(self, x):
        self._check_input_dim(x)
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        if not bn_training:
            out = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
            return torch.relu(out) if self.relu else out

        F._verify_batch_size(x.size())  # as nn.BatchNorm2d: more than one value per channel
        weight, bias = self.weight, self.bias
        if weight is None:  # affine=False
            weight = torch.ones(self.num_features, dtype=x.dtype, device=x.device)
            bias = torch.zeros(self.num_features, dtype=x.dtype, device=x.device)
        if torch._C._are_functorch_transforms_active():
            # Under torch.func (the steps of revkernels.engine.compiled) the fused op's registered
            # autograd is unavailable: the values of the fused op (so a recompute is bitwise the
            # forward) with the gradient of nn.BatchNorm2d's composition.
            with torch.no_grad():
                fused = batch_norm_act(x.detach(), weight.detach(), bias.detach(), self.eps, self.relu)[0]
            out = super().forward(x)
            out = torch.relu(out) if self.relu else out
            return fused + (out - out.detach())
        out, mean, rstd = batch_norm_act(x, weight, bias, self.eps, self.relu)
        if self.training and self.track_running_stats and self.running_mean is not None:
            self._update_running_stats(mean, rstd, x.numel() // x.shape[1])
        return out

    @torch.no_grad()
    def _update_running_stats(self, mean, rstd, count):
        self.num_batches_tracked.add_(1)
        if count == 0:  # an empty batch (mean and rstd NaN): counted, statistics kept, as ATen's batch_norm
            return
        if self.momentum is None:  # cumulative moving average
            factor = 1.0 / float(self.num_batches_tracked)
        else:
            factor = self.momentum
        var = (1.0 / rstd.double().square() - self.eps).clamp_min(0.0) * (count / (count - 1))
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(var.to(self.running_var.dtype), alpha=factor)
