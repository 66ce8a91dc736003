"""Where warm-ups live: the cache key of their settings, the cache and shipped directories,
and the atomic write of a finished one.

Shipped checkpoints: ``sparrow_jax/sft/checkpoints/<name>/`` holds warm-up directories (same
layout, ``key`` in the meta file) trained by this code; a run whose settings hash to a shipped
key loads it instead of training, so every machine gets the same model.

Cache layout (``cache_dir/warmup-<hash>/``): ``config.json`` + ``model.safetensors`` (see
:func:`sparrow_jax.models.save_hf`) and ``sparrow_warmup.json`` (tokenizer name, task knobs,
training settings, accuracy table, ``"complete": true``). The hash covers the architecture,
the task knobs and every training setting; a directory is built under a temporary name and
renamed when complete, so an interrupted warm-up is never mistaken for a finished one.

Imports models and :mod:`settings`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from typing import Any

from sparrow_jax.models.config import Qwen3Config
from sparrow_jax.models.hf_io import save_hf
from sparrow_jax.models.qwen3 import Params
from sparrow_jax.sft.settings import SLIP_LAYOUT_DEFAULTS, WarmupSettings

META_FILE = "sparrow_warmup.json"
DEFAULT_CACHE_DIR = "runs/cache"
TOKENIZER_NAME = "builtin"
FORMAT = "sparrow-warmup/v1"
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints")


def warmup_key(config: Qwen3Config, knobs: dict[str, Any], settings: WarmupSettings) -> str:
    """Hex digest naming the cache directory: architecture, task knobs and training settings."""
    train = dataclasses.asdict(settings)
    if not train["curriculum"]:  # settings from before the field existed keep their cache key
        del train["curriculum"]
    for name in ("lookup_every", "lookup_weight"):  # likewise at the task's look-up rate and no look-up weight
        if not train[name]:
            del train[name]
    if not train["refine_sparse_weight"]:  # likewise without the refine phase's sparse loss
        del train["refine_sparse_weight"], train["refine_sparse_topk"]
    for name, default in SLIP_LAYOUT_DEFAULTS.items():
        if train[name] == default:  # likewise with the slip run's sparse loss the refine's
            del train[name]
    for phase in ("refine", "slip", "preamble"):  # likewise without a refine, slip or preamble phase
        if not train[f"{phase}_steps"]:
            for name in ("steps", "lr", "batch_size") + (("prob",) if phase == "slip" else ()):
                del train[f"{phase}_{name}"]
    blob = json.dumps(dict(format=FORMAT, arch=dataclasses.asdict(config), task=knobs, train=train), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def shipped_checkpoint(key: str, root: str = SHIPPED_DIR) -> str | None:
    """The shipped warm-up directory whose meta ``key`` is ``key``, else None."""
    if not os.path.isdir(root):
        return None
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if is_complete(path) and read_warmup_meta(path).get("key") == key:
            return path
    return None


def is_complete(path: str) -> bool:
    """True when ``path`` holds a finished warm-up (weights, config and a complete meta file)."""
    meta = os.path.join(path, META_FILE)
    if not (os.path.isfile(meta) and os.path.isfile(os.path.join(path, "config.json"))):
        return False
    if not (os.path.isfile(os.path.join(path, "model.safetensors"))
            or os.path.isfile(os.path.join(path, "model.safetensors.index.json"))):
        return False
    try:
        with open(meta) as f:
            return bool(json.load(f).get("complete"))
    except (OSError, json.JSONDecodeError):
        return False


def read_warmup_meta(path: str) -> dict[str, Any]:
    """The ``sparrow_warmup.json`` of a warm-up directory. Training settings added to
    :class:`WarmupSettings` since it was written read as their defaults: it was trained without
    them, and :func:`warmup_key` leaves them out at their defaults."""
    with open(os.path.join(path, META_FILE)) as f:
        meta = json.load(f)
    if "train" in meta:
        meta["train"] = {**json.loads(json.dumps(dataclasses.asdict(WarmupSettings()))), **meta["train"]}
    return meta


def find_warmup(key: str, path: str, use_shipped: bool, progress: bool) -> str | None:
    """The shipped warm-up of ``key`` (with ``use_shipped``), else ``path`` when it is complete, else None."""
    shipped = shipped_checkpoint(key, SHIPPED_DIR) if use_shipped else None
    for found in (shipped, path if is_complete(path) else None):
        if found:
            if progress:
                print(f"[warmup] {'shipped' if found == shipped else 'cached'}: {found}", flush=True)
            return found
    return None


def write_warmup(path: str, config: Qwen3Config, params: Params, meta: dict[str, Any]) -> None:
    """Save the model and its meta file at ``path``: built under a temporary name and renamed when
    complete, never a half-written cache entry."""
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf(tmp, config, params)
    with open(os.path.join(tmp, META_FILE), "w") as f:
        json.dump(meta, f, indent=1)
    shutil.rmtree(path, ignore_errors=True)  # an incomplete leftover under the final name
    os.replace(tmp, path)
