"""The paper's published KV-budget schedules as shipped data (``rollout/presets/paper_schedules.json``).

A leaf: the run config's checks (``run/specs.py``) read a preset's layout from here without
importing the rollout layer, which builds the schedules (``SparsitySchedule.from_preset``).
"""
from __future__ import annotations

import functools
import importlib.resources
import json
from typing import Any

PRESET_FILE = ("rollout", "presets", "paper_schedules.json")
# a preset's layout as SparsitySchedule fields (every preset of the file shares it)
LAYOUT_KEYS = {"page_size": "page_size", "bin_width": "bin_width_tokens", "reserved_first": "reserved_first_pages",
               "reserved_last": "reserved_last_pages", "dense_layers": "dense_layers"}
PRESET_SELECTOR = "centroid"


@functools.lru_cache(maxsize=1)
def paper_presets() -> dict[str, Any]:
    """The file's JSON: ``presets`` (name -> per-bin top-k) and the shared layout keys."""
    # Resolve from the sparrow_jax package (which has an __init__) so it works whether or
    # not sparrow_jax.rollout is a regular package; the file ships via package_data.
    res = importlib.resources.files("sparrow_jax").joinpath(*PRESET_FILE)
    return json.loads(res.read_text(encoding="utf-8"))


def preset_layout(name: str) -> dict[str, Any]:
    """``{page_size, bin_width, reserved_first, reserved_last, dense_layers, selector}`` of preset
    ``name``; KeyError naming the known presets for another name."""
    data = paper_presets()
    if name not in data["presets"]:
        raise KeyError(f"unknown preset {name!r}; known presets: {sorted(data['presets'])}")
    layout = {field: data[key] for field, key in LAYOUT_KEYS.items()}
    layout["dense_layers"] = tuple(layout["dense_layers"])
    return {**layout, "selector": PRESET_SELECTOR}
