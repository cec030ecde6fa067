"""Names of the release checkpoint layout, as the model modules describe themselves.

Lives with the model (not with the checkpoint readers) so that `dreamzero.model` never imports
`dreamzero.checkpoint`: the readers depend on the model's description of its tensors, never the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass

#: every tensor key of a release checkpoint (and of a training-side full state dict) starts with this
RELEASE_PREFIX = "action_head."


@dataclass(frozen=True)
class ReleaseTensor:
    """One tensor of a checkpoint layout and where it lives in our modules.

    name: key in the checkpoint (relative to the component while components describe themselves; full key, with
    `action_head.`, from `DreamZeroModel.release_tensors()`). sources: our parameter names; several sources are
    concatenated along dim 0 (CLIP's fused qkv). shape: the shape stored in the checkpoint (may differ from the
    source's by leading 1-dims, e.g. CLIP's `cls_embedding [1,1,W]` vs `class_embedding [W]`).
    """

    name: str
    sources: tuple[str, ...]
    shape: tuple[int, ...]
