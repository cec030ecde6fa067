"""Fuzzing the Franka safety layer: whatever chunk arrives, nothing outside the limits is ever commanded."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from dreamzero_franka.common.limits import DROID_HOME
from dreamzero_franka.droid import safety
from tests.support.fuzz import CI, TARGETS_BY_NAME

CHUNKS = TARGETS_BY_NAME["safety_chunks"]
FILTER = TARGETS_BY_NAME["safety_filter"]


@settings(CI)
@given(CHUNKS.strategy())
def test_fuzzed_chunks_never_produce_a_command_outside_the_limits(example):
    CHUNKS.run(example)


@settings(CI)
@given(FILTER.strategy())
def test_filter_inputs_of_any_shape_raise_only_typed_errors(example):
    FILTER.run(example)


def test_the_invariant_check_catches_an_unfiltered_command(monkeypatch):
    """The property above can fail: a filter that passes targets through is caught on the first far target."""

    class PassThrough(safety.SafetyFilter):
        def filter(self, target, measured):
            return safety.SafeCommand(np.asarray(target, float), ())

    monkeypatch.setattr(safety, "SafetyFilter", PassThrough)
    chunk = np.tile([*DROID_HOME, 0.0], (2, 1))
    chunk[1, 0] += 1.0  # 1 rad in one step: far beyond the step limit
    with pytest.raises(AssertionError):
        CHUNKS.run((safety.SafetyConfig(), chunk, DROID_HOME.copy(), True))
