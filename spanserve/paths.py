"""Where spanserve keeps what it makes once per machine: converted weights, built kernels."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """$SPANSERVE_CACHE_DIR, else the user's cache directory (~/.cache/spanserve on Linux)."""
    if os.environ.get("SPANSERVE_CACHE_DIR"):
        return Path(os.environ["SPANSERVE_CACHE_DIR"])
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("spanserve"))
