"""How the DiT is spread over the training workers: `dreamzero-train --strategy ddp | fsdp | auto`.

- `ddp`: every worker holds the whole model, its gradients and AdamW's two moments, and the gradients are averaged
  once per optimizer step (`DistributedDataParallel`, after the step's last accumulation pass).
- `fsdp`: FSDP2 (`torch.distributed.fsdp.fully_shard`) on every DiT block and on the DiT itself. Each worker keeps
  1/N of the DiT's parameters, gradients and optimizer state; a block's parameters are all-gathered just before it
  runs and freed after it, and gradients are reduce-scattered after every pass (accumulation adds into the shards:
  unsharded gradients held across passes would cost what sharding saves). With `--dtype bfloat16` the mixed
  precision policy gathers the parameters in bf16 for compute and reduces gradients in fp32; the shards themselves
  (the master weights) and the optimizer state stay fp32. The frozen encoders are not sharded: every worker keeps
  its own copy to encode its rows.
- `auto`: `fsdp` when `ddp` would not fit one device comfortably: 16 bytes per trained parameter (fp32 weight,
  gradient, Adam's two moments) plus 4 per frozen one, more than half the smallest worker's device memory (the other
  half is for activations, the bf16 copies autocast makes and the allocator). A GPU's memory is its own; a CPU
  worker's is the machine's RAM divided by the workers on it.

One worker (no process group) trains unsharded whatever the strategy. Checkpoints are the same under every
strategy: the full DiT state and a full optimizer state keyed by parameter name are gathered to worker 0, which
writes the model in the HF release layout, so a run resumes under any strategy on any worker count. Under `fsdp` on
GPUs the workers of a node read the starting checkpoint into host memory one at a time (each shards it onto its GPU
and frees its copy before the next starts), so a node needs host memory for one full fp32 model, not one per GPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings

import torch
from torch import nn

from dreamzero.errors import ConfigError

log = logging.getLogger(__name__)

STRATEGIES = ("auto", "ddp", "fsdp")
#: `auto` shards when the unsharded footprint is above this share of one device's memory
AUTO_SHARE = 0.5


def ddp_footprint(trained: int, frozen: int) -> int:
    """Bytes one worker holds under `ddp` before activations: trained parameters in fp32 with their gradient and
    Adam's two moments (16 bytes each), frozen ones in fp32 (4)."""
    return 16 * trained + 4 * frozen


def resolve_strategy(requested: str, world: int, trained: int, frozen: int, device_bytes: int) -> str:
    """The strategy a run of `world` workers uses: "single" for one worker, else ddp / fsdp (see the module doc)."""
    if requested not in STRATEGIES:
        raise ConfigError(f"strategy: expected one of {list(STRATEGIES)}, got {requested!r}")
    if world == 1:
        return "single"
    if requested != "auto":
        return requested
    return "fsdp" if ddp_footprint(trained, frozen) > AUTO_SHARE * device_bytes else "ddp"


def device_bytes(device: torch.device) -> int:
    """Memory one worker may use: the GPU's total, or this machine's RAM over the workers on it."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(ram // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def smallest_device_bytes(device: torch.device) -> int:
    """`device_bytes` of the worker with the least, so every worker picks the same strategy."""
    mine = torch.tensor([device_bytes(device)], dtype=torch.float64, device=_collective_device(device))
    torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MIN)
    return int(mine.item())


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(trained, frozen) parameter counts of the whole model (encoders included)."""
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trained, sum(p.numel() for p in model.parameters()) - trained


@contextlib.contextmanager
def one_loader_per_node(device: torch.device):
    """On GPUs, the workers of a node take turns inside this block (each reads the model to host memory and moves it
    to its GPU before the next starts); elsewhere everyone runs it at once."""
    if device.type != "cuda":
        yield
        return
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    for turn in range(local_world):
        if turn == local_rank:
            yield
        torch.distributed.barrier()  # bounded by the process group's timeout (distributed.py sets it)


# 1. Sharding ----------------------------------------------------------------------------------------------------------


def shard_dit(dit: nn.Module, device: torch.device, compute_dtype: torch.dtype | None) -> None:
    """FSDP2 on every block of the DiT and on the DiT (its embeddings, heads and action / state projectors), in place:
    the shards land on `device`. `compute_dtype` (bf16 / fp16): the dtype parameters are gathered in for compute;
    gradients are reduced in fp32 and the shards stay fp32. None: everything fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    # the DiT never writes into a block's output in place (what the warning is about): single-process equality of
    # the sharded steps is tested (tests/unit/train/test_distributed.py)
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for block in dit.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(dit, mesh=mesh, mp_policy=policy)
    # the loss calls embed_context outside forward: it must gather the DiT's own parameters too
    register_fsdp_forward_method(dit, "embed_context")


def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def grad_norm_value(norm: torch.Tensor) -> float:
    """`clip_grad_norm_`'s total norm as a float (a DTensor for sharded gradients: its full value)."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


# 2. Full states for checkpoints ---------------------------------------------------------------------------------------


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_dit_state(dit: nn.Module) -> dict[str, torch.Tensor] | None:
    """The sharded DiT's full state on worker 0, on the CPU (every worker must call it; the others get None).
    None for an unsharded DiT (its own parameters are the full state)."""
    if not is_sharded(dit):
        return None
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(dit, options=_options(cpu_offload=True))
    return state if torch.distributed.get_rank() == 0 else None


def full_optimizer_state(dit: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's full state keyed by parameter name (the same for every strategy and worker count; under
    FSDP a collective whose result only worker 0 keeps)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(dit, optimizer, options=_options(cpu_offload=True))


def load_optimizer_state(dit: nn.Module, optimizer: torch.optim.Optimizer, state: dict | None) -> None:
    """Load a `full_optimizer_state` into this worker's optimizer. Sharded: every worker calls it, worker 0 with
    the state, which it broadcasts (the others pass None). Also reads a checkpoint written before the state was keyed
    by name (the optimizer's own numbering), unsharded only."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    sharded = is_sharded(dit)
    if state is not None and any(isinstance(k, int) for k in state.get("state", {})):
        if sharded:
            raise ConfigError("strategy: this checkpoint's optimizer state predates sharding; resume it with ddp")
        optimizer.load_state_dict(state)
        return
    broadcast = sharded and torch.distributed.get_world_size() > 1
    set_optimizer_state_dict(dit, optimizer, state or {}, options=_options(broadcast_from_rank0=broadcast))


def save_model_with(model, dit_state: dict[str, torch.Tensor] | None, path) -> None:
    """`dreamzero.checkpoint.save_model`, the DiT's tensors taken from `dit_state` (a gathered sharded DiT) when
    given: the same HF release layout, config.json and tokenizer either way."""
    import json
    from pathlib import Path

    from dreamzero.checkpoint import save_model
    from dreamzero.checkpoint.hf import CONFIG_FILE, DEFAULT_SHARD_BYTES, INDEX_FILE, save_tokenizer_of, write_shards
    from dreamzero.checkpoint.stream import owners
    from dreamzero.config import to_checkpoint_config

    if dit_state is None:
        save_model(model, path)
        return
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    by_name, _ = owners(model)
    by_name = {**by_name, **{f"model.{k}": v for k, v in dit_state.items()}}
    write_shards(path, model.release_tensors(), by_name, "model", INDEX_FILE, DEFAULT_SHARD_BYTES)
    (path / CONFIG_FILE).write_text(json.dumps(to_checkpoint_config(model.config), indent=2) + "\n")
    save_tokenizer_of(model, path)


def _collective_device(device: torch.device) -> torch.device:
    """Where a small collective's tensor lives: the GPU for NCCL, the CPU for gloo."""
    return device if torch.distributed.get_backend() == "nccl" else torch.device("cpu")
