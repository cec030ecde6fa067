"""benchmarks/gpu_sizing.py: the GPU check's batch sizes come from the memory planner for the card's memory (issue 44),
so the check passes on an 80 GB H100 as on a 141 GB H200. The real 14B is planned from its config alone (a
meta-device build, no weights): the sizes differ between the two cards, every size timed fits, one past them is
recorded as not fitting, and the old fixed 1/2/4/8 is caught on the 80 GB card."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu_sizing import fleet_sizes, judge, largest_rows, tier_sizes
from dreamzero.config import preset

G = 2**30
H100, H200 = 80 * G, 141 * G


@pytest.fixture(scope="module")
def droid():
    return preset("droid_14b")


def check(config, capacity: int, sizes) -> list[int]:
    """The sizes of `sizes` the planner says do not fit `capacity`: what the tier's planner test asserts is empty."""
    return [n for n in sizes if not judge(config, capacity, torch.bfloat16, n).fits]


@pytest.mark.parametrize("capacity", [H100, H200])
def test_the_tier_times_only_what_fits_and_records_one_size_past_it(droid, capacity):
    cases = tier_sizes(droid, capacity, torch.bfloat16)
    top, _ = largest_rows(droid, capacity, torch.bfloat16)
    fitting = [c.rows for c in cases if c.fits]
    assert fitting and max(fitting) == top and check(droid, capacity, fitting) == []
    assert [c.fits for c in cases][-1] is False and "does not fit" in cases[-1].why


def test_the_two_cards_get_their_own_sizes_and_the_fixed_list_is_caught(droid):
    small = [c.rows for c in tier_sizes(droid, H100, torch.bfloat16) if c.fits]
    large = [c.rows for c in tier_sizes(droid, H200, torch.bfloat16) if c.fits]
    assert max(small) < max(large)
    assert check(droid, H100, (1, 2, 4, 8)) != []  # the old fixed sizes: a batch of 8 does not fit 80 GB
    assert fleet_sizes(droid, H100, torch.bfloat16)[-1] < fleet_sizes(droid, H200, torch.bfloat16)[-1]
    assert fleet_sizes(droid, None, torch.bfloat16) == [1, 2, 4]  # a plain CPU: no memory to plan
