"""The embedded default model: the `tiny` preset with deterministic random weights, built locally and cached.

Used when no checkpoint is configured, so that a fresh machine serves real requests with no download of any kind.
Its actions are meaningless (random weights); every call says so loudly in the log.

Cache: `$DREAMZERO_CACHE_DIR` or `~/.cache/dreamzero`, folder `tiny-<hash>` where the hash covers the config, the
seed and the build recipe version. The folder is built in a temporary sibling and renamed into place (atomic), so two
processes racing to build it both end up with one complete copy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_ENV = "DREAMZERO_CACHE_DIR"
SEED = 1140
#: bump when the build recipe changes (init scheme, tokenizer pieces), so old caches are not reused
RECIPE_VERSION = 2  # 2: the local tokenizer gained the negative prompt's words
_COMPLETE = ".complete"
_WARNING = (
    "EMBEDDED DEFAULT MODEL IN USE: tiny DreamZero with RANDOM weights at %s. Its actions are MEANINGLESS; "
    "set model_path (serve_config.yaml), --model-path (dreamzero-eval, dreamzero-export-video) or --init "
    "(dreamzero-train) to a downloaded DreamZero checkpoint to control a robot."
)


#: trained models shipped inside the package (dreamzero/assets/models/<name>/, our HF layout + experiment_cfg/
#: metadata.json); a config names one as "embedded:<name>" wherever it takes a model_path
EMBEDDED_PREFIX = "embedded:"
SHIPPED_MODELS_DIR = Path(__file__).resolve().parent / "assets" / "models"
#: the trained model serve_config.yaml serves; also what `EmbeddedPolicy.load()`, `dreamzero-eval --policy embedded`
#: and `dreamzero-export-video` load when no model is named
SHIPPED_DEFAULT = "embedded:small-scene1"


def shipped_models() -> list[str]:
    if not SHIPPED_MODELS_DIR.is_dir():
        return []
    return sorted(p.name for p in SHIPPED_MODELS_DIR.iterdir() if (p / "config.json").is_file())


def resolve_model_path(value: str | None) -> str | None:
    """`value` with an "embedded:<name>" reference replaced by the shipped model's folder; other values unchanged."""
    from dreamzero.errors import ConfigError

    if value is None or not value.startswith(EMBEDDED_PREFIX):
        return value
    name = value[len(EMBEDDED_PREFIX) :]
    if name not in shipped_models():
        raise ConfigError(f"model_path: {value!r} names no shipped model; shipped: {shipped_models()}")
    return str(SHIPPED_MODELS_DIR / name)


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path.home() / ".cache" / "dreamzero"


def _recipe_hash() -> str:
    from dreamzero.config import preset, to_checkpoint_config

    recipe = {"config": to_checkpoint_config(preset("tiny")), "seed": SEED, "version": RECIPE_VERSION}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def build_default_model(path: str | os.PathLike, preset_name: str = "tiny") -> Path:
    """Write a preset's model (seeded random weights + locally built tokenizer) to `path` in the release layout: the
    embedded tiny default, or the starting point of a training run (`dreamzero-train --init`)."""
    import torch

    from dreamzero.checkpoint import save_model
    from dreamzero.config import preset
    from dreamzero.model.dreamzero import DreamZeroModel
    from dreamzero.model.tokenizer import build_local_tokenizer

    cfg = preset(preset_name)
    model = DreamZeroModel.from_config(cfg, device="cpu", dtype=torch.float32, seed=SEED)
    model.text_encoder.tokenizer = build_local_tokenizer(cfg.text_encoder.vocab_size)
    save_model(model, path)
    (Path(path) / "README.txt").write_text(
        f"DreamZero model ({preset_name} preset) with deterministic RANDOM weights "
        f"(seed {SEED}) and a locally built tokenizer.\nIts actions are meaningless: it exists so the serving stack "
        "runs end to end without a download, or as the start of a training run.\n"
    )
    return Path(path)


def default_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Directory of the embedded default model, building it once (a few seconds) if the cache lacks it."""
    root = cache_root(cache_dir)
    target = root / f"tiny-{_recipe_hash()}"
    if not (target / _COMPLETE).is_file():
        root.mkdir(parents=True, exist_ok=True)
        if target.exists():  # left incomplete by something else: move it aside rather than trusting it
            shutil.rmtree(target, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
        try:
            build_default_model(tmp)
            (tmp / _COMPLETE).write_text("ok\n")
            try:
                os.rename(tmp, target)  # atomic; fails if another process got there first
            except OSError:
                if not (target / _COMPLETE).is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.warning(_WARNING, target)
    return target
