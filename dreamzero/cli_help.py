"""What our command lines share: the `--help` format (each option's default after its help, said once) and the
parser of a `--pipeline` option (`pipeline_overrides_arg`).

argparse's `ArgumentDefaultsHelpFormatter` appends `(default: ...)` to every option, also when the help already says
its default in words ("(default: the env's, 450) (default: None)") and when there is nothing to say (None, False,
an empty list). This one appends it only where it adds something, and keeps a description's own line breaks.
"""

from __future__ import annotations

import argparse
import copy
import json
from typing import Any

from dreamzero.config import PipelineConfig, unknown_knob_message


def _says_nothing(default) -> bool:
    return default is None or default is False or default is argparse.SUPPRESS or default == [] or default == ()


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    def add_argument(self, action: argparse.Action) -> None:
        if action.help is None and action.option_strings and not _says_nothing(action.default):
            action = copy.copy(action)  # argparse shows no line at all for an option without help: give it one
            action.help = "default: %(default)s"
        super().add_argument(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or _says_nothing(action.default) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def pipeline_overrides_arg(text: str) -> dict[str, Any]:
    """argparse type of a `--pipeline` option: a JSON object of knobs. Names are checked here, so a typo fails before
    any work; values are checked with the model's own pipeline, where they apply."""
    try:
        overrides = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err})") from None
    if not isinstance(overrides, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object of pipeline knobs, got {text!r}")
    for name in overrides:
        if name not in PipelineConfig.model_fields:
            raise argparse.ArgumentTypeError(unknown_knob_message(name))
    return overrides
