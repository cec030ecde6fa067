"""Configuration of a DreamZero model: the DiT shape, the encoders, the inference-loop knobs, and named presets.

One module per concern: `networks` (the dataclasses of each network and `DreamZeroConfig`), `pipeline`
(`PipelineConfig`, the knobs of the inference loop, and the wording of a bad knob), `presets` (`preset(name)`),
`release` (a release checkpoint's `config.json` <-> `DreamZeroConfig`). The names below are the package's surface.
The server's configuration is `deployments.config`; a `--pipeline` option's parser is `dreamzero.cli_help`.
"""

from dreamzero.config.networks import DiTConfig, DreamZeroConfig, ImageEncoderConfig, TextEncoderConfig, VAEConfig
from dreamzero.config.pipeline import (
    PipelineConfig,
    apply_overrides,
    describe_errors,
    parse_pipeline_config,
    unknown_knob_message,
)
from dreamzero.config.presets import PRESETS, SLICE_VOCAB, preset
from dreamzero.config.release import from_checkpoint_config, to_checkpoint_config

__all__ = [
    "PRESETS",
    "SLICE_VOCAB",
    "DiTConfig",
    "DreamZeroConfig",
    "ImageEncoderConfig",
    "PipelineConfig",
    "TextEncoderConfig",
    "VAEConfig",
    "apply_overrides",
    "describe_errors",
    "from_checkpoint_config",
    "parse_pipeline_config",
    "preset",
    "to_checkpoint_config",
    "unknown_knob_message",
]
