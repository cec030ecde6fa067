"""Fail-early GPU checks (dreamzero.device_checks), byte sizes (dreamzero.sizes), the byte-budget arithmetic
(dreamzero.pipeline.budget); the new serving config fields."""

from __future__ import annotations

import pytest
import torch

from dreamzero.checkpoint.size import checkpoint_nbytes
from dreamzero.device_checks import DeviceFacts, check_serving_device
from dreamzero.errors import ConfigError
from dreamzero.pipeline.budget import split_budget
from dreamzero.sizes import parse_bytes

H200 = DeviceFacts(cuda=True, bf16=True, total_bytes=141 * 10**9, name="NVIDIA H200")


def test_gpus_without_cuda_fail_naming_the_field():
    with pytest.raises(ConfigError, match="policy.num_gpus=1.*CUDA is not available"):
        check_serving_device(1, "cuda", None, facts=DeviceFacts(cuda=False))
    check_serving_device(0, "cpu", None, facts=DeviceFacts(cuda=False))  # the CPU default passes


def test_bf16_on_a_gpu_without_bf16_fails():
    v100 = DeviceFacts(cuda=True, bf16=False, total_bytes=32 * 2**30, name="Tesla V100")
    with pytest.raises(ConfigError, match="bfloat16 is not supported by Tesla V100"):
        check_serving_device(1, "cuda", None, facts=v100)  # bf16 is the GPU default
    check_serving_device(1, "cuda", "float16", facts=v100)


def test_checkpoint_larger_than_the_gpu_fails(tmp_path):
    from dreamzero.checkpoint import save_model
    from dreamzero.config import preset
    from dreamzero.model.dreamzero import DreamZeroModel

    model = DreamZeroModel.from_config(preset("tiny"), seed=0)
    save_model(model, tmp_path, save_tokenizer=False)
    fp32 = sum(t.numel() * t.element_size() for t in model.state_dict().values() if t.is_floating_point())
    assert checkpoint_nbytes(tmp_path, torch.float32) >= fp32 // 2  # tied / derived tensors aside
    at_bf16 = checkpoint_nbytes(tmp_path, torch.bfloat16)
    assert checkpoint_nbytes(tmp_path, torch.float32) == 2 * at_bf16  # every stored tensor is floating point
    small = DeviceFacts(cuda=True, bf16=True, total_bytes=at_bf16 - 1, name="small GPU")
    with pytest.raises(ConfigError, match="model_path .* more than the .* small GPU"):
        check_serving_device(1, "cuda", "bfloat16", tmp_path, facts=small)
    check_serving_device(1, "cuda", "bfloat16", tmp_path, facts=H200)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, None), ("auto", "auto"), (" AUTO ", "auto"), (1024, 1024), ("40GiB", 40 * 2**30), ("1.5 GB", 1.5e9)],
)
def test_parse_bytes(value, expected):
    assert parse_bytes(value) == expected


@pytest.mark.parametrize("value", ["lots", "-1GiB", 0, "3 parsecs", True])
def test_parse_bytes_rejects_nonsense(value):
    with pytest.raises(ConfigError, match="sessions.max_bytes"):
        parse_bytes(value)


def test_split_budget_keeps_activations_batch_copies_and_margin():
    g = 2**30
    one = split_budget(100 * g, 6 * g, rows=1, kv_peak_per_session=5 * g, total=141 * g, num_layers=40)
    assert 0 < one.kv_transient < g and one.margin == int(0.05 * 141 * g)  # a layer or two of one session's cache
    assert one.budget == 100 * g - 6 * g - one.kv_transient - one.margin and "session budget" in one.describe()
    four = split_budget(100 * g, 6 * g, rows=4, kv_peak_per_session=5 * g, total=141 * g, num_layers=40)
    assert one.kv_transient < four.kv_transient < 4 * g and four.budget < one.budget


def test_serving_config_fields():
    from serve_graph.config import parse_app_args

    batching = {"max_batch_rows": 4, "rows_per_request": 2}
    args = parse_app_args({"sessions": {"max_bytes": "40GiB"}, "batching": batching})
    assert args.sessions.max_bytes == 40 * 2**30 and args.batching.max_batch_rows == 4
    assert parse_app_args({}).sessions.max_bytes == "auto"
    with pytest.raises(ConfigError, match="args.sessions.max_bytes"):
        parse_app_args({"sessions": {"max_bytes": "plenty"}})
    with pytest.raises(ConfigError, match="args.batching.max_batch_rows"):
        parse_app_args({"batching": {"max_batch_rows": 0}})
