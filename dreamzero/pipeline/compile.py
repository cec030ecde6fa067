"""Compile levels (`pipeline.compile`: none, dit, all) and the encoder networks the loop calls.

`compile_model` compiles in place (the pipeline's loop calls the model's own modules), so two pipelines that share
one model share its compiled modules. `compiled_parts` says what of a model is compiled, and `compiled_only`
runs a block of code with exactly the parts one pipeline asked for, the others eager (how the latency benchmark
runs its eager and compiled modes on one model).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from dreamzero.errors import ConfigError

DIT_BLOCKS = "dit.blocks"


def _encoder_networks(model) -> dict[str, torch.nn.Module]:
    """The networks of the encoders the loop calls (stand-in encoders without them are skipped)."""
    found = {
        "text_encoder.t5": getattr(getattr(model, "text_encoder", None), "t5", None),
        "image_encoder.clip": getattr(getattr(model, "image_encoder", None), "clip", None),
        "vae.encoder": getattr(getattr(getattr(model, "vae", None), "autoencoder", None), "encoder", None),
    }
    return {name: net for name, net in found.items() if isinstance(net, torch.nn.Module)}


def _compilable(model) -> dict[str, list[torch.nn.Module]]:
    """Every part a compile level may compile, by the name `compile_model` reports it under."""
    return {DIT_BLOCKS: list(model.model.blocks), **{name: [net] for name, net in _encoder_networks(model).items()}}


def _is_compiled(module: torch.nn.Module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None


def compile_model(model, level: str) -> list[str]:
    """Apply a `pipeline.compile` level to `model` in place; returns what was compiled.

    "dit": each DiT block (`CausalWanDiT.compile_blocks`); "all": also the T5 and CLIP networks and the VAE encoder,
    compiled where the loop calls them. Never CUDA graphs: the caches change shape every chunk.
    """
    if level == "none":
        return []
    if level not in ("dit", "all"):
        raise ConfigError(f"pipeline.compile must be none, dit or all, got {level!r}")
    model.model.compile_blocks()
    done = [DIT_BLOCKS]
    if level == "all":
        for name, net in _encoder_networks(model).items():
            if not _is_compiled(net):
                net.compile(dynamic=True)
            done.append(name)
    return done


def compiled_parts(model) -> list[str]:
    """The parts of `model` that run compiled now, named as `compile_model` names them (DiT blocks: when any is)."""
    return [name for name, modules in _compilable(model).items() if any(map(_is_compiled, modules))]


@contextmanager
def compiled_only(model, parts: Sequence[str]) -> Iterator[None]:
    """Within the block, exactly `parts` (what `compile_model` returned for a pipeline) of `model` run compiled.

    Every other compiled part runs eager meanwhile: its compiled callable is set aside and put back on exit, not
    rebuilt, so the graphs it holds stay valid and switching back compiles nothing. A part asked for that is not
    compiled is an error (the model was compiled for another pipeline and undone since)."""
    known = _compilable(model)
    missing = [p for p in parts if p not in known or not all(map(_is_compiled, known[p]))]
    if missing:
        raise RuntimeError(
            f"compiled_only: {missing} of this model are not compiled (compiled: {compiled_parts(model)})"
        )
    aside = [
        (m, m._compiled_call_impl) for name, ms in known.items() if name not in parts for m in ms if _is_compiled(m)
    ]
    for module, _ in aside:
        module._compiled_call_impl = None
    try:
        yield
    finally:
        for module, impl in aside:
            module._compiled_call_impl = impl
