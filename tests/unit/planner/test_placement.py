"""Components off the GPU (dreamzero.placement): parsing, the loader streaming each component onto its own device,
the CPU (unpadded) and offloaded (block by block) text encoder giving the default placement's numbers, and the cost
model the planner reads.

Only a CPU is here: the serving device is the CPU, device bookkeeping is checked with the meta device standing in
for the GPU, and the offload path copies each block even onto the same device, so which blocks sit "on the device"
is visible as storage that is not the host's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from dreamzero.checkpoint import load_model, save_model
from dreamzero.checkpoint.stream import stream_into
from dreamzero.config import preset
from dreamzero.errors import ConfigError
from dreamzero.model.dreamzero import DreamZeroModel
from dreamzero.model.tokenizer import build_local_tokenizer
from dreamzero.pipeline import DreamZeroPipeline
from dreamzero.placement import Placement, text_encoder_cost, text_encoder_layer_flops, text_encoder_layer_nbytes
from dreamzero.types import ModelBatch

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

PROMPTS = ["put the cup in the bowl", "open the drawer", ""]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cfg = preset("tiny")
    model = DreamZeroModel.from_config(cfg, device="cpu", dtype=torch.float32, seed=11)
    model.text_encoder.tokenizer = build_local_tokenizer(cfg.text_encoder.vocab_size)
    return save_model(model, tmp_path_factory.mktemp("placement") / "tiny")


@pytest.fixture(scope="module")
def default(saved):
    return load_model(saved, device="cpu", dtype="float32")


# -- the dataclass ----------------------------------------------------------------------------------------------------


def test_parse_defaults_mappings_and_case():
    assert Placement.parse(None) == Placement() == Placement(text_encoder="gpu", image_encoder="gpu")
    p = Placement.parse({"text_encoder": "CPU", "dit_weights": " fp8 "})
    assert p == Placement(text_encoder="cpu", image_encoder="gpu", dit_weights="fp8")
    assert Placement.parse(p) is p
    assert p.as_dict() == {"text_encoder": "cpu", "image_encoder": "gpu", "dit_weights": "fp8"}
    assert Placement.parse(p.as_dict()) == p and not p.is_default and Placement().is_default


@pytest.mark.parametrize(
    "value, words",
    [
        ({"text_encoder": "disk"}, ["policy.placement.text_encoder", "'disk'", "'offload'"]),
        ({"image_encoder": "offload"}, ["policy.placement.image_encoder", "'gpu', 'cpu'"]),
        ({"dit_weights": "int4"}, ["policy.placement.dit_weights", "'fp8'"]),
        ({"vae": "cpu"}, ["policy.placement", "unknown key", "'vae'", "text_encoder"]),
        ({"text_encoder": 3}, ["policy.placement.text_encoder", "3"]),
        ("cpu", ["policy.placement must be a mapping", "str"]),
    ],
)
def test_bad_values_name_the_field_and_the_choices(value, words):
    with pytest.raises(ConfigError) as exc:
        Placement.parse(value)
    for w in words:
        assert w in str(exc.value)
    with pytest.raises(ConfigError, match="placement.text_encoder"):
        Placement(text_encoder="tpu")


def test_component_devices():
    serving = torch.device("cuda", 1)
    p = Placement(text_encoder="offload", image_encoder="cpu")
    assert p.devices(serving) == {
        "model": serving,
        "text_encoder": torch.device("cpu"),  # offloaded weights live on the host
        "image_encoder": torch.device("cpu"),
        "vae": serving,
    }
    assert Placement().component_device("text_encoder", "cuda:1") == serving
    with pytest.raises(ValueError, match="unknown component"):
        p.component_device("dit", serving)


# -- the loader -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    from tests.support.checkpoints import write_tiny_layouts

    return write_tiny_layouts(tmp_path_factory.mktemp("layouts"))


@pytest.mark.parametrize("layout", ["hf", "full_weights", "diffusers"])
def test_each_component_streams_onto_its_own_device(layouts, layout):
    """The meta device stands in for the GPU: the DiT and VAE land there, the CPU-placed encoders never do (each
    device's tensors are read in their own pass over the source, in every layout)."""
    from dreamzero.checkpoint.loader import _open

    path = layouts[layout]
    cfg, source, make_spec, _, _ = _open(path, layout, "tiny" if layout == "full_weights" else None)
    with torch.device("meta"):
        model = DreamZeroModel(cfg)
    devices = Placement(text_encoder="cpu", image_encoder="cpu").devices("meta")
    stream_into(model, make_spec(model), source, source.shapes(), devices, torch.float32)
    model.materialize_buffers(devices)
    for name, module in (("text_encoder", model.text_encoder), ("image_encoder", model.image_encoder)):
        tensors = [*module.parameters(), *module.buffers()]
        assert tensors and all(t.device.type == "cpu" for t in tensors), name
    for name, module in (("model", model.model), ("vae", model.vae)):  # (the VAE keeps its statistics off meta)
        assert all(p.is_meta for p in module.parameters()), name
    reference = load_model(path, device="cpu", dtype="float32", layout=layout, config=cfg)
    ref_state = reference.text_encoder.state_dict()
    assert all(torch.equal(v, ref_state[k]) for k, v in model.text_encoder.state_dict().items())


def test_cpu_encoders_give_the_default_outputs(saved, default):
    placed = load_model(saved, device="cpu", dtype="float32", placement={"text_encoder": "cpu", "image_encoder": "cpu"})
    assert placed.placement == Placement(text_encoder="cpu", image_encoder="cpu")
    assert default.placement == Placement()
    assert placed.text_encoder.trim_padding and not default.text_encoder.trim_padding
    a, b = placed.state_dict(), default.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)
    ref, rows = default.text_encoder.encode(PROMPTS), placed.text_encoder.encode(PROMPTS)
    assert rows.shape == ref.shape == (3, 512, 32)
    torch.testing.assert_close(rows, ref, rtol=1e-5, atol=1e-5)  # unpadded: only the matmul's rounding differs
    n = (rows.abs().sum(-1) > 0).sum(1)  # real tokens + </s> of each prompt
    assert n.tolist() == (ref.abs().sum(-1) > 0).sum(1).tolist() and n[2] == 1


def test_bad_placement_given_to_the_loader_names_the_field(saved):
    with pytest.raises(ConfigError, match="placement.text_encoder='ram'"):
        load_model(saved, device="cpu", dtype="float32", placement={"text_encoder": "ram"})


# -- the offloaded text encoder ---------------------------------------------------------------------------------------


def _host_storage(module) -> dict[str, int]:
    return {n: p.data_ptr() for n, p in module.named_parameters()}


def test_offload_moves_one_block_at_a_time_and_gives_the_same_rows(saved, default):
    placed = load_model(saved, device="cpu", dtype="float32", placement={"text_encoder": "offload"})
    te = placed.text_encoder
    assert te.offload_device == torch.device("cpu") and not te.trim_padding
    host = _host_storage(te)
    blocks = list(te.t5.encoder.block)
    seen = []

    def probe(module, _args):  # inside a block: which blocks' weights are device copies right now
        seen.append(
            [
                i
                for i, b in enumerate(blocks)
                if any(p.data_ptr() != host[f"t5.encoder.block.{i}.{n}"] for n, p in b.named_parameters())
            ]
        )

    hooks = [b.layer[0].register_forward_pre_hook(probe) for b in blocks]
    try:
        rows = te.encode(PROMPTS)
    finally:
        for h in hooks:
            h.remove()
    assert seen == [[i] for i in range(len(blocks))]
    assert _host_storage(te) == host  # nothing left on the device
    assert torch.equal(rows, default.text_encoder.encode(PROMPTS))
    stats = te.offload_stats
    assert stats["max_blocks_resident"] == 1
    # the cost model's bytes for one prompt, plus the other prompts' embedding rows
    cost = text_encoder_cost(placed.config, "offload", dtype=torch.float32)
    extra_rows = (len(PROMPTS) - 1) * 512 * placed.config.text_encoder.d_model * 4
    assert stats["bytes_moved"] == cost["host_to_device_bytes"] + extra_rows


def test_offload_failure_midway_leaves_the_weights_on_the_host(saved):
    placed = load_model(saved, device="cpu", dtype="float32", placement={"text_encoder": "offload"})
    te = placed.text_encoder
    host = _host_storage(te)

    def boom(module, _args):
        raise RuntimeError("out of memory (simulated)")

    hook = te.t5.encoder.block[1].layer[1].register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="simulated"):
            te.encode(PROMPTS)
    finally:
        hook.remove()
    assert _host_storage(te) == host
    te.offload_to(None)
    assert te.offload_device is None and te.encode(PROMPTS).shape == (3, 512, 32)


# -- a whole chunk ----------------------------------------------------------------------------------------------------


def _batch() -> ModelBatch:
    rng = np.random.default_rng(0)
    return ModelBatch(
        images=rng.integers(0, 256, (2, 1, 32, 64, 3), dtype=np.uint8),
        state=rng.standard_normal((2, 1, 64)).astype(np.float32),
        state_mask=np.ones((2, 1, 64), bool),
        prompts=["pick up the red block", "open the drawer"],
        session_ids=["a", "b"],
    )


@pytest.mark.parametrize("placement", [{"text_encoder": "cpu", "image_encoder": "cpu"}, {"text_encoder": "offload"}])
def test_a_chunk_with_placed_encoders_equals_the_default(saved, placement):
    fast = {"num_inference_steps": 2, "dit_step_mask": None}
    kw = dict(device="cpu", dtype="float32", overrides=fast)
    ref = DreamZeroPipeline.load(saved, **kw).generate(_batch())
    pipe = DreamZeroPipeline.load(saved, placement=placement, **kw)
    assert pipe.model.placement == Placement.parse(placement)
    out = pipe.generate(_batch())
    np.testing.assert_allclose(out.actions, ref.actions, rtol=0, atol=1e-4)


# -- the cost model ---------------------------------------------------------------------------------------------------


def test_cost_model_counts_the_real_module():
    """Bytes from the formula equal the meta-built UMT5-XXL block's; the CPU runs a 20-token prompt unpadded."""
    cfg = preset("droid_14b")
    with torch.device("meta"):
        model = DreamZeroModel(dataclasses.replace(cfg, dit=dataclasses.replace(cfg.dit, num_layers=1)))
    t5 = model.text_encoder.t5
    block = sum(p.numel() for p in t5.encoder.block[0].parameters()) * 2
    assert text_encoder_layer_nbytes(cfg.text_encoder, torch.bfloat16) == block
    total = sum(p.numel() for p in t5.parameters()) * 2
    gpu, cpu, off = (text_encoder_cost(cfg, w, tokens=20) for w in ("gpu", "cpu", "offload"))
    assert gpu["device_weight_bytes"] == total == cpu["host_weight_bytes"] == off["host_weight_bytes"]
    assert cpu["device_weight_bytes"] == off["device_weight_bytes"] == 0
    assert off["device_transient_bytes"] == 2 * block
    assert off["host_to_device_bytes"] == 24 * block + 4096 * 2 + 512 * 4096 * 2
    assert cpu["tokens_run"] == 20 and gpu["tokens_run"] == off["tokens_run"] == 512
    assert cpu["flops"] == 24 * text_encoder_layer_flops(cfg.text_encoder, 20) < gpu["flops"] / 25
    with pytest.raises(ConfigError, match="placement.text_encoder"):
        text_encoder_cost(cfg, "disk")


# -- fp8 DiT weights, quantised while streaming -----------------------------------------------------------------------


def test_fp8_dit_streamed_equals_converted_after_loading(saved):
    """Quantising each weight as it streams in gives exactly the codes and scales of converting a loaded model."""
    from dreamzero.model.fp8 import FP8_DTYPE, Fp8Linear, convert_linears_to_fp8_

    streamed = load_model(saved, device="cpu", dtype="float32", placement={"dit_weights": "fp8"})
    converted = load_model(saved, device="cpu", dtype="float32")
    n = convert_linears_to_fp8_(converted.model)
    fp8 = {name: m for name, m in streamed.model.named_modules() if isinstance(m, Fp8Linear)}
    assert n > 0 and len(fp8) == n and streamed.placement.dit_weights == "fp8"
    assert all(m.weight.dtype == FP8_DTYPE and m.weight_scale.dtype == torch.float32 for m in fp8.values())
    mine, ref = converted.model.named_modules(), dict(streamed.model.named_modules())
    for name, m in mine:
        if isinstance(m, Fp8Linear):
            assert torch.equal(ref[name].weight.view(torch.uint8), m.weight.view(torch.uint8)), name
            assert torch.equal(ref[name].weight_scale, m.weight_scale), name
    a, b = streamed.state_dict(), converted.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a if a[k].dtype == FP8_DTYPE)
    assert all(torch.equal(a[k], b[k]) for k in a if a[k].dtype != FP8_DTYPE)
    assert streamed.text_encoder.t5.shared.weight.dtype == torch.float32  # only the DiT is quantised
    fast = {"num_inference_steps": 2, "dit_step_mask": None}
    pipe = DreamZeroPipeline.load(
        saved, device="cpu", dtype="float32", overrides=fast, placement={"dit_weights": "fp8"}
    )
    assert pipe.dtype == torch.float32
    out = pipe.generate(_batch())
    assert np.isfinite(out.actions).all()


def test_cpu_time_estimate_scales_the_measured_block(monkeypatch):
    import dreamzero.placement as placement

    cfg = preset("droid_14b")
    monkeypatch.setattr(placement, "MEASURED_CPU_CORE_MS_PER_XXL_LAYER", {20: 100.0, 512: 3000.0})
    assert text_encoder_cost(cfg, "cpu", tokens=20)["cpu_ms"] == pytest.approx(24 * 100.0)
    assert text_encoder_cost(cfg, "cpu", tokens=20, cpu_cores=4)["cpu_ms"] == pytest.approx(24 * 25.0)
    flops = text_encoder_layer_flops
    ratio = flops(cfg.text_encoder, 40) / flops(cfg.text_encoder, 20)
    assert text_encoder_cost(cfg, "cpu", tokens=40)["cpu_ms"] == pytest.approx(24 * 100.0 * ratio)
    assert text_encoder_cost(cfg, "gpu")["cpu_ms"] is None
    assert text_encoder_cost(preset("tiny"), "cpu")["cpu_ms"] is None  # not the measured width
    monkeypatch.setattr(placement, "MEASURED_CPU_CORE_MS_PER_XXL_LAYER", {})
    assert text_encoder_cost(cfg, "cpu")["cpu_ms"] is None


def test_image_encoder_cost():
    from dreamzero.placement import MEASURED_CPU_CORE_MS_PER_VITH_LAYER, image_encoder_cost

    cfg = preset("droid_14b")
    gpu, cpu = image_encoder_cost(cfg, "gpu"), image_encoder_cost(cfg, "cpu", cpu_cores=2)
    assert gpu["flops"] == cpu["flops"] > 0 and gpu["cpu_ms"] is None and gpu["host_to_device_bytes"] == 0
    assert cpu["host_to_device_bytes"] == 257 * 1280 * 2
    assert cpu["cpu_ms"] == pytest.approx(32 * MEASURED_CPU_CORE_MS_PER_VITH_LAYER / 2)
    assert image_encoder_cost(preset("tiny"), "cpu")["cpu_ms"] is None  # not the measured width
    with pytest.raises(ConfigError, match="placement.image_encoder='offload'"):
        image_encoder_cost(cfg, "offload")
