"""Crash-safe training checkpoints on top of orbax.

One checkpoint = one step directory `<directory>/<step>/` holding one orbax item per
state entry:
    params, opt_state, lora, lora_opt_state   pytrees of arrays (orbax StandardSave)
    loop                                      the RL loop's whole state pytree (rl/trainer.LoopState)
    meta                                      JSON dict (orbax JsonSave): step, PRNG key
                                              as a list of ints, schedule state, data
                                              iterator position, config hash, ...
    sparrow_commit.json                       our commit marker, written last

Crash safety (a crash or SIGKILL must never leave a checkpoint that loads but is wrong):
  * orbax writes into `<step>.orbax-checkpoint-tmp-<ts>/` and renames it on commit;
    orbax itself never lists tmp directories as steps.
  * on top of that a step only counts once our marker exists (written atomically after
    orbax returned). That covers a crash between orbax's commit and the marker, and
    a crash while an old step is being deleted: we delete the marker first (orbax's own
    garbage collection deletes files in place, so it is turned off and done here).
  * steps without a marker are debris: ignored by `all_steps`/`latest_step`/`restore`,
    removed at the next save.
  * a committed step that no longer loads (a file corrupted or lost since) is skipped by
    `restore_latest`, which warns, uncommits it (removed at the next save, so the resumed run
    can save that step again) and restores the newest step that loads.
Saves are blocking (simple and safe; the step is durable when `save` returns).

Multi-host: every process calls `save`/`restore` (orbax coordinates array writes);
only the primary process writes markers and deletes, followed by a barrier.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sparrow_jax.io import atomic_write_json, to_jsonable
from sparrow_jax.io.closing import Closing

PYTREE_KEYS = ("params", "opt_state", "lora", "lora_opt_state", "loop")
META_KEY = "meta"
MARKER_NAME = "sparrow_commit.json"
MARKER_FORMAT = "sparrow_jax.checkpoint/1"
_MAX_LISTED_MISMATCHES = 12


class CheckpointMismatchError(ValueError):
    """The restore target's tree structure or shapes differ from the stored checkpoint."""


def _is_primary() -> bool:
    return jax.process_index() == 0


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _is_local(path: epath.Path) -> bool:
    return "://" not in str(path)


def _remove_tree(path: epath.Path) -> None:
    """Delete a directory tree (a module-level hook so tests can simulate a crash mid-delete)."""
    if _is_local(path):
        shutil.rmtree(path)
    else:
        path.rmtree()


def _write_marker(path: epath.Path, marker: dict) -> None:
    if _is_local(path):
        atomic_write_json(path, marker)  # temp file + fsync + rename
    else:  # object stores (gs://...) publish an object atomically on upload
        path.write_text(json.dumps(marker))


def _key_str(entry: Any) -> str:
    """One path element as orbax names it: dict key, namedtuple field, or list index."""
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _path_str(path: tuple) -> str:
    return "/".join(_key_str(e) for e in path) or "<root>"


def _replicated_sharding() -> NamedSharding:
    """Sharding for target leaves that carry none (numpy arrays, bare ShapeDtypeStructs)."""
    devices = np.asarray(jax.devices())
    return NamedSharding(Mesh(devices, ("replica",)), PartitionSpec())


def _abstract_leaf(leaf: Any, fallback: NamedSharding) -> jax.ShapeDtypeStruct:
    """Leaf of a restore target -> ShapeDtypeStruct with an explicit sharding."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        sharding = leaf.sharding if leaf.sharding is not None else fallback
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    if isinstance(leaf, jax.Array):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    arr = np.asarray(leaf)
    return jax.ShapeDtypeStruct(arr.shape, arr.dtype, sharding=fallback)


def _is_array_metadata(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


class CheckpointManager(Closing):
    """Keeps the last `max_to_keep` committed checkpoints of a training run in `directory`.

    Args:
      directory: root folder; one subfolder per step.
      max_to_keep: number of newest committed steps kept (None: keep all).
      save_every: `save(step, ...)` only writes when `step % save_every == 0` (or force=True).
    """

    def __init__(self, directory: str | os.PathLike, max_to_keep: int | None = 3, save_every: int = 1):
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"max_to_keep: expected an int >= 1 or None, got {max_to_keep!r}")
        if not isinstance(save_every, int) or save_every < 1:
            raise ValueError(f"save_every: expected an int >= 1, got {save_every!r}")
        directory = str(directory)
        # local paths are made absolute (orbax wants that); gs://... and other URLs are kept
        self.directory = epath.Path(directory if "://" in directory else os.path.abspath(directory))
        self.max_to_keep = max_to_keep
        self.save_every = save_every
        handlers: dict[str, Any] = {k: ocp.StandardCheckpointHandler() for k in PYTREE_KEYS}
        handlers[META_KEY] = ocp.JsonCheckpointHandler()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None,  # we delete old steps ourselves, marker first (see module doc)
            save_interval_steps=1,  # `save_every` is applied here, not by orbax
            enable_async_checkpointing=False,
            cleanup_tmp_directories=True,  # drop tmp dirs left by a crashed save
            create=True,
        )
        self._mngr = ocp.CheckpointManager(self.directory, item_handlers=handlers, options=options)

    # ------------------------------------------------------------------ listing
    def _step_dir(self, step: int) -> epath.Path:
        return self.directory / str(step)

    def _read_marker(self, step: int) -> dict | None:
        try:
            marker = json.loads((self._step_dir(step) / MARKER_NAME).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(marker, dict) or marker.get("step") != step or marker.get("format") != MARKER_FORMAT:
            return None
        return marker

    def _orbax_steps(self) -> list[int]:
        self._mngr.reload()  # re-list from disk: another run or a crash may have changed it
        return sorted(int(s) for s in self._mngr.all_steps())

    def all_steps(self) -> list[int]:
        """Committed steps (orbax-finalised and marked), ascending."""
        return [s for s in self._orbax_steps() if self._read_marker(s) is not None]

    def latest_step(self) -> int | None:
        """Newest committed step, or None if there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        return step % self.save_every == 0

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: Mapping[str, Any], *, force: bool = False, overwrite: bool = False) -> bool:
        """Write `state` as checkpoint `step`; returns False if skipped by `save_every`.

        state: {'params': pytree, 'opt_state': pytree, 'lora': pytree | None,
                'lora_opt_state': pytree | None, 'loop': pytree | None, 'meta': JSON dict}.
                'params' or 'loop' is required.
        force: save even if `step % save_every != 0`.
        overwrite: replace an existing committed checkpoint at `step` (else ValueError).
        Blocking: when it returns True the checkpoint is committed.
        """
        if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step: expected an int >= 0, got {step!r}")
        step = int(step)
        items, meta = self._validate_state(state)
        if not force and not self.should_save(step):
            return False

        if step in self.all_steps():
            if not overwrite:
                raise ValueError(
                    f"checkpoint step {step} already exists in {self.directory}; pass overwrite=True to replace it"
                )
            self._delete_steps([step])
        elif step in self._orbax_steps():  # debris of a crash before our marker: replace it
            self._delete_steps([step])

        args = {k: ocp.args.StandardSave(v) for k, v in items.items()}
        args[META_KEY] = ocp.args.JsonSave(meta)
        if not self._mngr.save(step, args=ocp.args.Composite(**args), force=True):
            raise RuntimeError(f"orbax declined to save step {step} in {self.directory}")
        self._mngr.wait_until_finished()
        if not self._step_dir(step).is_dir():
            raise RuntimeError(f"orbax saved step {step} but {self._step_dir(step)} does not exist")

        if _is_primary():
            marker = {"format": MARKER_FORMAT, "step": step, "items": sorted(items)}
            _write_marker(self._step_dir(step) / MARKER_NAME, marker)
        _barrier(f"sparrow_ckpt_commit_{step}")
        self._garbage_collect()
        return True

    @staticmethod
    def _validate_state(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict]:
        if not isinstance(state, Mapping):
            raise TypeError(f"state: expected a dict, got {type(state).__name__}")
        unknown = sorted(set(state) - set(PYTREE_KEYS) - {META_KEY})
        if unknown:
            raise ValueError(f"state: unknown keys {unknown}; allowed {list(PYTREE_KEYS) + [META_KEY]}")
        if state.get("params") is None and state.get("loop") is None:
            raise ValueError("state['params']: required (or a whole 'loop' state), got nothing")
        items = {k: state[k] for k in PYTREE_KEYS if state.get(k) is not None}
        for key, tree in items.items():
            if not jax.tree_util.tree_leaves(tree):
                raise ValueError(f"state[{key!r}]: pytree has no array leaves; pass None to omit it")
        meta = state.get(META_KEY) or {}
        if not isinstance(meta, Mapping):
            raise TypeError(f"state['meta']: expected a dict, got {type(meta).__name__}")
        # strict: NaN in meta would not round-trip as the same value
        meta = to_jsonable(dict(meta), nonfinite="error", where="meta")
        return items, meta

    def _delete_steps(self, steps: list[int]) -> None:
        """Uncommit (marker first, atomic) and then delete step directories."""
        if _is_primary():
            for step in steps:
                step_dir = self._step_dir(step)
                (step_dir / MARKER_NAME).unlink(missing_ok=True)
                if step_dir.exists():
                    _remove_tree(step_dir)
        _barrier(f"sparrow_ckpt_delete_{'_'.join(map(str, steps))}")
        self._mngr.reload()

    def _garbage_collect(self) -> None:
        committed = self.all_steps()
        doomed = [s for s in self._orbax_steps() if s not in committed]  # uncommitted debris
        if self.max_to_keep is not None and len(committed) > self.max_to_keep:
            doomed += committed[: len(committed) - self.max_to_keep]
        if doomed:
            self._delete_steps(sorted(doomed))

    # ------------------------------------------------------------------ restore
    def restore(self, step: int | None = None, target: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Load checkpoint `step` (default: latest committed).

        target: optional example state {'params': tree, 'opt_state': tree, ...} whose leaves
          are jax.Arrays, numpy arrays or jax.ShapeDtypeStructs. Only its keys are restored
          (plus 'meta', always), into its tree structure (namedtuples kept), dtypes and
          shardings: a jax.Array / ShapeDtypeStruct leaf's sharding is used as is, so a
          checkpoint saved on one mesh restores onto another; leaves without a sharding are
          replicated over all devices. Shapes and tree paths must match the checkpoint,
          else CheckpointMismatchError naming the leaf paths. dtypes may differ (cast).
          Without a target, every stored item is returned as orbax reads it (namedtuples
          become dicts, tuples lists).
        Returns {'params': ..., ..., 'meta': dict}.
        """
        committed = self.all_steps()
        if step is None:
            if not committed:
                raise FileNotFoundError(f"no committed checkpoint in {self.directory}")
            step = committed[-1]
        elif step not in committed:
            raise FileNotFoundError(
                f"checkpoint step {step} not found (or not committed) in {self.directory}; "
                f"committed steps: {committed}"
            )
        marker = self._read_marker(step)
        assert marker is not None
        stored = list(marker["items"])

        if target is None:
            args = {k: ocp.args.StandardRestore() for k in stored}
        else:
            if not isinstance(target, Mapping):
                raise TypeError(f"target: expected a dict, got {type(target).__name__}")
            keys = [k for k in target if k != META_KEY and target[k] is not None]
            unknown = sorted(set(keys) - set(PYTREE_KEYS))
            if unknown:
                raise ValueError(f"target: unknown keys {unknown}; allowed {list(PYTREE_KEYS) + [META_KEY]}")
            missing = [k for k in keys if k not in stored]
            if missing:
                raise KeyError(
                    f"target keys {missing} are not in checkpoint step {step} ({self.directory}); it holds {stored}"
                )
            fallback = _replicated_sharding()
            args = {}
            for key in keys:
                abstract = jax.tree.map(lambda x: _abstract_leaf(x, fallback), target[key])
                self._check_against_stored(step, key, abstract)
                args[key] = ocp.args.StandardRestore(abstract)
        args[META_KEY] = ocp.args.JsonRestore()
        restored = self._mngr.restore(step, args=ocp.args.Composite(**args))
        return {k: restored[k] for k in args}

    def restore_latest(self, target: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
        """:meth:`restore` of the newest committed step that loads; None when nothing is committed.

        A step that fails to load is skipped with a warning naming it and the step restored
        instead, and uncommitted. A target that does not match (CheckpointMismatchError) is an
        error, not corruption: it is raised. When no step loads, the newest step's error is raised.
        """
        bad: list[tuple[int, Exception]] = []
        for step in reversed(self.all_steps()):
            try:
                restored = self.restore(step, target)
            except CheckpointMismatchError:
                raise
            except Exception as err:  # orbax / tensorstore raise ValueError, OSError, ... on a corrupted file
                bad.append((step, err))
                continue
            if bad:
                detail = "; ".join(f"step {s}: {type(e).__name__}: {str(e).splitlines()[0][:200]}" for s, e in bad)
                warnings.warn(f"checkpoint step {bad[0][0]} in {self.directory} does not load ({detail}); restored "
                              f"step {step}, the newest committed step that does; step(s) "
                              f"{[s for s, _ in bad]} uncommitted", RuntimeWarning, stacklevel=2)
                self._uncommit([s for s, _ in bad])
            return restored
        if bad:
            raise bad[0][1]
        return None

    def _uncommit(self, steps: list[int]) -> None:
        """Remove the markers of ``steps``: debris from now on, deleted at the next save."""
        if _is_primary():
            for step in steps:
                (self._step_dir(step) / MARKER_NAME).unlink(missing_ok=True)
        _barrier(f"sparrow_ckpt_uncommit_{'_'.join(map(str, steps))}")

    def _check_against_stored(self, step: int, key: str, abstract: Any) -> None:
        """Compare target tree paths and shapes with the stored metadata of item `key`."""
        item_md = self._mngr.item_metadata(step)[key]
        tree_md = getattr(item_md, "tree", item_md)
        stored = {
            _path_str(p): tuple(m.shape)
            for p, m in jax.tree_util.tree_flatten_with_path(tree_md, is_leaf=_is_array_metadata)[0]
        }
        wanted = {_path_str(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
        problems = []
        for path in sorted(set(wanted) | set(stored)):
            if path not in stored:
                problems.append(f"  {key}/{path}: expected shape {wanted[path]} (target), found no such leaf in checkpoint")
            elif path not in wanted:
                problems.append(f"  {key}/{path}: expected no such leaf (not in target), found shape {stored[path]}")
            elif wanted[path] != stored[path]:
                problems.append(f"  {key}/{path}: expected shape {wanted[path]} (target), found {stored[path]}")
        if problems:
            shown = problems[:_MAX_LISTED_MISMATCHES]
            more = len(problems) - len(shown)
            raise CheckpointMismatchError(
                f"restore target does not match checkpoint step {step} in {self.directory} "
                f"({len(problems)} mismatching leaves):\n" + "\n".join(shown) + (f"\n  ... {more} more" if more else "")
            )

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        self._mngr.close()


def run_policy_params(workdir: str | os.PathLike, like, step: int | None = None) -> tuple[Any, int] | None:
    """The policy params of an RL run's checkpoint (``<workdir>/checkpoints``, step ``step``, default
    the newest committed) as ``(params, step)``, in the tree, shapes and dtypes of ``like`` (the
    model's params); None when the run has no checkpoint. Raises ValueError when the stored
    params do not fit ``like`` (another model's run in that workdir)."""
    directory = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(directory):
        return None
    with CheckpointManager(directory) as ckpt:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            return None
        stored = ckpt.restore(step)["loop"]["train"]["params"]  # untargeted: orbax's keys are strings
    by_path = {_tree_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(stored)[0]}

    def leaf(path, ref):
        x = by_path.get(_tree_path(path))
        if x is None or tuple(x.shape) != tuple(ref.shape):
            raise ValueError(f"{directory} step {step}: its params do not match the config's model at "
                             f"{_tree_path(path)} (another model's run in this workdir?)")
        return jax.numpy.asarray(x, ref.dtype)

    return jax.tree_util.tree_map_with_path(leaf, like), int(step)


def _tree_path(path) -> str:
    """A pytree path as ``a/b/0``, the same for int keys and the strings orbax restores them as."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
