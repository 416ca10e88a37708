"""`partition(model, groups=R, balance=...)`: the min-max contiguous split against brute force over every
split, the per-stage profile (`stage_costs`) leaving the model untouched, a time-balanced tiny RevNet
whose groups, timed as whole ticks, are balanced where the count split is not, and clear errors."""
import itertools
import math
import random

import numpy as np
import pytest
import torch

from revkernels.models import revnet18
from revkernels.petra import balanced_sizes, group_sizes, partition, stage_costs
from tests.petra.test_context import _batches as context_batches, _model as context_model
from tests.petra.test_simulate import synthetic_stages


def _brute_force(costs, groups):
    """Every split of `costs` into `groups` contiguous non-empty groups: (its largest group sum, sizes)."""
    n = len(costs)
    out = []
    for cuts in itertools.combinations(range(1, n), groups - 1):
        bounds = (0,) + cuts + (n,)
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        out.append((max(math.fsum(costs[a:b]) for a, b in zip(bounds, bounds[1:])), sizes))
    return out


def test_balanced_sizes_is_the_optimal_split_by_brute_force():
    rng = random.Random(0)
    for trial in range(300):
        n = rng.randint(1, 9)
        if trial % 3 == 0:  # small integers: many ties
            costs = [rng.randint(0, 4) for _ in range(n)]
        else:
            costs = [rng.uniform(0, 10) ** 2 for _ in range(n)]
        groups = rng.randint(1, n)
        splits = _brute_force(costs, groups)
        best = min(v for v, _ in splits)
        sizes = balanced_sizes(costs, groups)
        # the optimum, and among the optimal splits the lexicographically smallest sizes
        assert sizes == min(s for v, s in splits if v == best), (costs, groups)
        assert balanced_sizes(tuple(costs), groups) == sizes


def test_balanced_sizes_by_hand():
    assert balanced_sizes([1, 1, 1, 1], 2) == [2, 2]
    assert balanced_sizes([10, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert balanced_sizes([1, 1, 1, 1, 1, 10], 2) == [5, 1]
    assert balanced_sizes([0, 5, 0], 2) == [1, 2]  # tie: the shorter first group
    assert balanced_sizes([3], 1) == [1]


def test_partition_groups_count_and_given_costs():
    model = synthetic_stages("S r D r r H")
    flat = partition(model)
    for balance, kwargs, sizes in (("count", {}, [2, 2, 2]), ("time", {"costs": [1, 1, 1, 9, 1, 1]}, [3, 1, 2]),
                                   ("time", {"costs": [9, 1, 1, 1, 1, 1]}, [1, 1, 4])):
        groups = partition(model, groups=3, balance=balance, **kwargs)
        assert [len(g) for g in groups] == sizes == group_sizes(model, 3, balance, **kwargs)
        assert [s.index for g in groups for s in g] == list(range(6))
        assert [s.module for g in groups for s in g] == [s.module for s in flat]  # the model's own modules
    assert [len(g) for g in partition(model, groups=4)] == [2, 2, 1, 1]  # today's split, the larger first


def test_partition_group_errors():
    model = synthetic_stages("S r D H")
    with pytest.raises(ValueError, match="balance must be one of"):
        partition(model, groups=2, balance="flops")
    with pytest.raises(ValueError, match="groups must be an int in"):
        partition(model, groups=5)
    with pytest.raises(ValueError, match="groups must be an int in"):
        partition(model, groups=True)
    with pytest.raises(ValueError, match="exactly one of costs"):
        partition(model, groups=2, balance="time")
    with pytest.raises(ValueError, match="exactly one of costs"):
        partition(model, groups=2, balance="time", costs=[1] * 4, example=torch.randn(2, 8))
    with pytest.raises(ValueError, match=r"costs must have one entry per stage \(4\)"):
        partition(model, groups=2, balance="time", costs=[1, 2, 3])
    with pytest.raises(ValueError, match="costs must be finite non-negative"):
        partition(model, groups=2, balance="time", costs=[1, -2, 3, 4])
    with pytest.raises(ValueError, match='costs, example and context apply to balance="time" only'):
        partition(model, groups=2, costs=[1, 2, 3, 4])
    with pytest.raises(ValueError, match="apply to partition.model, groups=R. only"):
        partition(model, balance="time", costs=[1, 2, 3, 4])


def test_given_costs_may_be_any_sequence_of_real_numbers():
    model = synthetic_stages("S r D r r H")
    want = [len(g) for g in partition(model, groups=3, balance="time", costs=[1, 1, 1, 9, 1, 1])]
    for costs in (np.array([1, 1, 1, 9, 1, 1]), np.array([1, 1, 1, 9, 1, 1], dtype=np.float32),
                  torch.tensor([1.0, 1.0, 1.0, 9.0, 1.0, 1.0]), (c for c in [1, 1, 1, 9, 1, 1])):
        assert [len(g) for g in partition(model, groups=3, balance="time", costs=costs)] == want
    for costs in (["1"] * 6, [True] * 6, 7):
        with pytest.raises(ValueError, match="costs must be"):
            partition(model, groups=3, balance="time", costs=costs)


def test_time_balance_of_stages_that_take_context():
    # (stages needing a mask could not be timed: the keywords never reached them)
    model = context_model()
    x, _, context = context_batches(1)[0]
    costs = stage_costs(model, x, warmup=0, reps=1, context=context)
    assert len(costs) == len(model) and all(math.isfinite(c) and c > 0 for c in costs)
    groups = partition(model, groups=2, balance="time", example=x, context=context)
    assert [s.index for g in groups for s in g] == list(range(len(model)))
    with pytest.raises(ValueError, match="context applies to timing an example"):
        partition(model, groups=2, balance="time", costs=[1] * len(model), context=context)


def test_stage_costs_leaves_the_model_and_rng_untouched():
    torch.manual_seed(0)
    model = synthetic_stages("S r D r H")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 8)
    rng = torch.get_rng_state()
    costs = stage_costs(model, x, warmup=0, reps=2)
    assert len(costs) == 5 and all(c > 0 for c in costs)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # BatchNorm statistics too
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    with pytest.raises(ValueError, match="reps >= 1, got 1 and 0"):
        stage_costs(model, torch.randn(4, 8), reps=0)
    with pytest.raises(ValueError, match="accum_k must be an int >= 1"):
        stage_costs(model, x, accum_k=0)


@pytest.mark.serial  # times the stages
def test_balance_time_balances_a_tiny_revnet():
    """RevNet-18 at 8x8: the deep stages (512 channels) cost most, so the count split (0-4 | 5-9) is
    far off balance. The time split is the min-max split of the measured stage costs, and by those
    costs its slowest group costs well under the count split's. (Timing the groups' ticks again would
    make this a timing assertion, which a busy machine can fail.)"""
    torch.manual_seed(0)
    model = revnet18(num_classes=10, stem="cifar")
    x = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    costs = stage_costs(model, x, reps=9)
    timed = partition(model, groups=2, balance="time", costs=costs)
    counted = partition(model, groups=2, balance="count")
    assert [len(grp) for grp in counted] == [5, 5]
    assert [len(grp) for grp in timed] == balanced_sizes(costs, 2) != [5, 5]

    def slowest(groups):
        return max(sum(costs[s.index] for s in group) for group in groups)

    assert slowest(timed) < 0.9 * slowest(counted), costs


def test_trainer_balance_flag_writes_the_grouping_to_config(tmp_path):
    """``--balance time`` times the stages on the first training batch and writes the grouping (the optimal split
    of those times) and the times to config.json; ``--balance count`` splits by count; bad values fail clearly."""
    import json

    from revkernels.petra.train import main

    args = ["--model", "revnet18", "--dataset", "synthetic", "--image-size", "8", "--epochs", "1", "--batch-size", "8",
            "--max-steps", "2", "--threads", "1", "--no-progress", "--ranks", "2"]
    configs = {}
    for balance in ("time", "count"):
        main(args + ["--balance", balance, "--out", str(tmp_path / balance)])
        with open(tmp_path / balance / "config.json") as f:
            configs[balance] = json.load(f)
    timed, counted = configs["time"], configs["count"]
    assert timed["balance"] == "time" and len(timed["stage_costs_s"]) == 10
    sizes = balanced_sizes(timed["stage_costs_s"], 2)
    assert [len(g) for g in timed["groups"]] == sizes and sum(timed["groups"], []) == list(range(10))
    assert counted["groups"] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]] and counted["stage_costs_s"] is None
    with pytest.raises(ValueError, match="--balance must be one of"):
        main(args + ["--balance", "flops"])
    with pytest.raises(ValueError, match="--balance time needs --ranks R"):
        main(args[:-2] + ["--balance", "time"])
