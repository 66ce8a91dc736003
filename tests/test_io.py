"""Tests for sparrow_jax.io: checkpoints (round trip, retention, crash safety, mismatch errors),
metric logs (JSONL, TensorBoard, resume), progress bar, plots, atomic JSON writes."""
import io
import json
import math
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sparrow_jax.io import atomic_write_json, to_jsonable
from sparrow_jax.io import checkpoint as ckpt_mod
from sparrow_jax.io.checkpoint import MARKER_NAME, CheckpointManager, CheckpointMismatchError
from sparrow_jax.io.metrics import MetricWriter, ProgressBar, bin_series, logged_bins, read_metrics
from sparrow_jax.io.plots import plot_curves, plot_p5_by_position, plot_panels

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ helpers
def make_state(seed: int = 0):
    """Tiny train state: f32 + bf16 params, adam state after one real update, LoRA, meta."""
    rng = np.random.default_rng(seed)
    params = {
        "embed": jnp.asarray(rng.normal(size=(5, 4)), jnp.float32),
        "layers": [{"w": jnp.asarray(rng.normal(size=(4, 4)), jnp.bfloat16)}, {"w": jnp.ones((4, 4), jnp.bfloat16)}],
    }
    opt = optax.adam(1e-2)
    opt_state = opt.init(params)
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
    _, opt_state = opt.update(grads, opt_state, params)
    lora = {"a": jnp.asarray(rng.normal(size=(4, 2)), jnp.float32), "b": jnp.zeros((2, 4), jnp.float32)}
    lora_opt_state = optax.sgd(1e-3, momentum=0.9).init(lora)
    key = jax.random.PRNGKey(seed + 7)
    meta = {
        "step": 3,
        "prng_key": [int(v) for v in np.asarray(key)],
        "schedule": {"tau": 0.86, "topk": [8, 12, 16]},
        "data_position": 48,
        "config_hash": "abc123",
    }
    return {"params": params, "opt_state": opt_state, "lora": lora, "lora_opt_state": lora_opt_state, "meta": meta}


def leaves_np(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def assert_tree_exact(got, want):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(leaves_np(got), leaves_np(want)):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g, w)


def run_py(code: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, "-c", code], env=env, **kw)


# ------------------------------------------------------------------ checkpoint: round trip
def test_round_trip_exact_with_target(tmp_path):
    state = make_state()
    with CheckpointManager(tmp_path / "ck") as mgr:
        assert mgr.latest_step() is None
        assert mgr.save(3, state)
        assert mgr.latest_step() == 3
        target = {k: v for k, v in state.items() if k != "meta"}
        got = mgr.restore(target=target)
    assert set(got) == {"params", "opt_state", "lora", "lora_opt_state", "meta"}
    for key in target:
        assert_tree_exact(got[key], state[key])  # namedtuples (ScaleByAdamState, ...) kept
    assert got["meta"] == state["meta"]
    # the restored adam state works with optax as is
    assert int(got["opt_state"][0].count) == 1


def test_round_trip_without_target_and_partial_target(tmp_path):
    state = make_state(1)
    mgr = CheckpointManager(tmp_path / "ck")
    mgr.save(0, {"params": state["params"], "opt_state": state["opt_state"], "meta": state["meta"]})
    raw = mgr.restore(0)
    assert set(raw) == {"params", "opt_state", "meta"}  # lora was not saved
    for g, w in zip(leaves_np(raw["opt_state"]), leaves_np(state["opt_state"])):
        np.testing.assert_array_equal(g, w)
    assert_tree_exact(raw["params"], state["params"])
    only_params = mgr.restore(target={"params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                                             state["params"])})
    assert set(only_params) == {"params", "meta"}
    assert_tree_exact(only_params["params"], state["params"])
    with pytest.raises(KeyError, match="lora"):
        mgr.restore(target={"lora": state["lora"]})
    mgr.close()


def test_round_trip_nnx_state(tmp_path):
    """Params as flax nnx.State (the split-once pattern): structure and values come back."""
    from flax import nnx

    _, params = nnx.split(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
    opt_state = optax.adam(1e-3).init(params)
    mgr = CheckpointManager(tmp_path / "ck")
    mgr.save(1, {"params": params, "opt_state": opt_state})
    zeros = jax.tree.map(jnp.zeros_like, params)
    got = mgr.restore(target={"params": zeros, "opt_state": opt_state})
    assert type(got["params"]) is type(params)
    assert_tree_exact(got["params"], params)
    bad = jax.tree.map(lambda x: jnp.zeros((*x.shape, 1)), params)
    with pytest.raises(CheckpointMismatchError, match=r"params/kernel/value: expected shape \(3, 2, 1\)"):
        mgr.restore(target={"params": bad})


def test_restore_casts_dtype_of_target(tmp_path):
    state = make_state()
    mgr = CheckpointManager(tmp_path / "ck")
    mgr.save(1, state)
    target = {"params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), state["params"])}
    got = mgr.restore(target=target)["params"]
    for g, w in zip(leaves_np(got), leaves_np(state["params"])):
        assert g.dtype == np.float32
        np.testing.assert_array_equal(g, w.astype(np.float32))  # bf16 -> f32 is exact


# ------------------------------------------------------------------ checkpoint: retention
def test_keeps_last_n_and_save_every(tmp_path):
    state = make_state()
    mgr = CheckpointManager(tmp_path / "ck", max_to_keep=2, save_every=2)
    saved = [mgr.save(s, {**state, "meta": {"step": s}}) for s in range(7)]
    assert saved == [s % 2 == 0 for s in range(7)]
    assert mgr.all_steps() == [4, 6]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["4", "6"]
    assert mgr.save(7, {**state, "meta": {"step": 7}}, force=True)
    assert mgr.all_steps() == [6, 7]
    assert mgr.restore(6)["meta"] == {"step": 6}
    # a fresh manager on the same folder sees the same committed steps
    assert CheckpointManager(tmp_path / "ck", max_to_keep=2).all_steps() == [6, 7]


def test_existing_step_needs_overwrite(tmp_path):
    state = make_state()
    mgr = CheckpointManager(tmp_path / "ck")
    mgr.save(2, state)
    with pytest.raises(ValueError, match="step 2 already exists"):
        mgr.save(2, state)
    new_params = jax.tree.map(lambda x: x + 1, state["params"])
    mgr.save(2, {"params": new_params}, overwrite=True)
    assert_tree_exact(mgr.restore(2, target={"params": state["params"]})["params"], new_params)


# ------------------------------------------------------------------ checkpoint: crash safety
_KILL_CHILD = textwrap.dedent(
    """
    import sys, numpy as np
    from sparrow_jax.io.checkpoint import CheckpointManager
    mgr = CheckpointManager({ckdir!r}, max_to_keep=10)
    for step in range(1, 1000):
        x = np.random.default_rng(step).random({n}, dtype=np.float32)  # incompressible: slow enough to catch
        mgr.save(step, {{"params": {{"x": x}}, "meta": {{"step": step}}}})
        print("SAVED", step, flush=True)
    """
)


def _kill_mid_save(ckdir: Path, n: int) -> int | None:
    """Run saves in a child, SIGKILL it while an orbax tmp dir of step >= 2 exists.

    Returns the step whose save was interrupted, or None if the kill missed the window.
    """
    errlog = open(ckdir.parent / f"{ckdir.name}.stderr", "w+b")
    child = run_py(_KILL_CHILD.format(ckdir=str(ckdir), n=n), stdout=subprocess.PIPE, stderr=errlog)
    try:
        first = child.stdout.readline()
        if first.split() != [b"SAVED", b"1"]:
            child.wait()
            errlog.seek(0)
            raise AssertionError(f"child failed before its first save: {errlog.read()[-2000:]!r}")
        deadline = time.time() + 60
        while time.time() < deadline:
            tmps = [p.name for p in ckdir.iterdir() if ".orbax-checkpoint-tmp" in p.name]
            if tmps:
                os.kill(child.pid, signal.SIGKILL)
                break
            time.sleep(0.0005)
        else:
            raise AssertionError("no orbax tmp dir appeared within 60 s")
    finally:
        child.kill()
        child.wait()
        errlog.close()
    still = [p.name for p in ckdir.iterdir() if ".orbax-checkpoint-tmp" in p.name]
    return int(still[0].split(".")[0]) if still else None


def test_sigkill_mid_save_leaves_previous_step_intact(tmp_path):
    n = 1 << 23  # 32 MB float32
    for attempt in range(3):
        ckdir = tmp_path / f"ck{attempt}"
        ckdir.mkdir()
        killed_step = _kill_mid_save(ckdir, n)
        if killed_step is not None:
            break
    else:
        pytest.fail("the SIGKILL never landed inside a save in 3 attempts")
    assert killed_step >= 2
    mgr = CheckpointManager(ckdir, max_to_keep=10)  # also removes the tmp dir (orbax cleanup)
    assert mgr.latest_step() == killed_step - 1
    assert killed_step not in mgr.all_steps()
    got = mgr.restore(target={"params": {"x": np.zeros(n, np.float32)}})
    want = np.random.default_rng(killed_step - 1).random(n, dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(got["params"]["x"]), want)
    assert got["meta"] == {"step": killed_step - 1}
    # the run can carry on and save the interrupted step again
    mgr.save(killed_step, {"params": {"x": np.ones(4, np.float32)}})
    assert mgr.latest_step() == killed_step


def test_handmade_tmp_and_unmarked_steps_are_ignored(tmp_path):
    state = make_state()
    ckdir = tmp_path / "ck"
    CheckpointManager(ckdir).save(5, state)
    # an unfinished orbax save of a later step
    junk = ckdir / "9.orbax-checkpoint-tmp-1700000000" / "params"
    junk.mkdir(parents=True)
    (junk / "garbage").write_bytes(b"\0" * 100)
    # orbax committed step 7 but the process died before our marker: copy step 5, drop marker
    import shutil

    shutil.copytree(ckdir / "5", ckdir / "7")
    (ckdir / "7" / MARKER_NAME).unlink()
    mgr = CheckpointManager(ckdir)
    assert mgr.all_steps() == [5]
    assert mgr.restore()["meta"] == state["meta"]
    with pytest.raises(FileNotFoundError, match="step 7 not found"):
        mgr.restore(7)
    # saving 7 again replaces the debris instead of failing on "step exists"
    mgr.save(7, {**state, "meta": {"step": 7}})
    assert mgr.all_steps() == [5, 7] and mgr.restore()["meta"] == {"step": 7}


def test_crash_while_deleting_old_step(tmp_path, monkeypatch):
    state = make_state()
    mgr = CheckpointManager(tmp_path / "ck", max_to_keep=1)
    mgr.save(1, state)

    def crash_after_one_file(path: Path):
        next(p for p in Path(path).rglob("*") if p.is_file()).unlink()  # delete a data file, then "die"
        raise KeyboardInterrupt("simulated crash mid-delete")

    monkeypatch.setattr(ckpt_mod, "_remove_tree", crash_after_one_file)
    with pytest.raises(KeyboardInterrupt):
        mgr.save(2, state)
    monkeypatch.undo()
    fresh = CheckpointManager(tmp_path / "ck", max_to_keep=1)
    assert fresh.all_steps() == [2]  # half-deleted step 1 lost its marker first
    assert (tmp_path / "ck" / "1").exists()
    assert_tree_exact(fresh.restore(target={"params": state["params"]})["params"], state["params"])
    fresh.save(3, state)  # next save cleans the debris
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["3"]


# ------------------------------------------------------------------ checkpoint: errors
def test_restore_mismatch_names_leaf_paths(tmp_path):
    state = make_state()
    mgr = CheckpointManager(tmp_path / "ck")
    mgr.save(4, state)
    bad = jax.tree.map(lambda x: x, state["params"])
    bad["embed"] = jnp.zeros((6, 4))
    with pytest.raises(CheckpointMismatchError) as err:
        mgr.restore(target={"params": bad})
    assert "params/embed: expected shape (6, 4) (target), found (5, 4)" in str(err.value)
    extra = {**state["params"], "head": jnp.zeros(3)}
    with pytest.raises(CheckpointMismatchError, match=r"params/head: expected shape \(3,\)"):
        mgr.restore(target={"params": extra})
    fewer = {"embed": state["params"]["embed"]}
    with pytest.raises(CheckpointMismatchError, match=r"params/layers/0/w: expected no such leaf"):
        mgr.restore(target={"params": fewer})
    wrong_opt = optax.sgd(0.1, momentum=0.9).init(state["params"])
    with pytest.raises(CheckpointMismatchError, match="opt_state/"):
        mgr.restore(target={"opt_state": wrong_opt})


def test_bad_input_errors_and_no_corruption(tmp_path):
    state = make_state()
    mgr = CheckpointManager(tmp_path / "ck")
    with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
        mgr.restore()
    mgr.save(1, state)
    with pytest.raises(ValueError, match="unknown keys \\['optimizer'\\]"):
        mgr.save(2, {"params": state["params"], "optimizer": state["opt_state"]})
    with pytest.raises(ValueError, match="params"):
        mgr.save(2, {"opt_state": state["opt_state"]})
    with pytest.raises(ValueError, match="meta/schedule/tau"):
        mgr.save(2, {**state, "meta": {"schedule": {"tau": float("nan")}}})
    with pytest.raises(TypeError, match="meta/fn"):
        mgr.save(2, {**state, "meta": {"fn": print}})
    with pytest.raises(FileNotFoundError, match=r"committed steps: \[1\]"):
        mgr.restore(3)
    with pytest.raises(ValueError, match="max_to_keep"):
        CheckpointManager(tmp_path / "x", max_to_keep=0)
    assert mgr.all_steps() == [1]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["1"]
    assert mgr.restore()["meta"] == state["meta"]


_RESHARD_CHILD = textwrap.dedent(
    """
    import sys, jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from sparrow_jax.io.checkpoint import CheckpointManager
    assert jax.device_count() == 2, jax.devices()
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    mgr = CheckpointManager(sys.argv[1])
    mgr.save(1, {"params": {"x": jax.device_put(x, jax.devices()[1])}})  # saved on one device
    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharding = NamedSharding(mesh, P("data", None))
    got = mgr.restore(target={"params": {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)}})
    y = got["params"]["x"]
    assert y.sharding == sharding, y.sharding
    assert [s.data.shape for s in y.addressable_shards] == [(4, 4), (4, 4)]
    np.testing.assert_array_equal(np.asarray(y), x)
    print("OK")
    """
)


def test_restore_onto_other_sharding(tmp_path):
    """Saved from one device, restored split over a 2-device mesh (a child with 2 CPU devices)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2")
    res = subprocess.run([sys.executable, "-c", _RESHARD_CHILD, str(tmp_path / "ck")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stderr[-2000:]


# ------------------------------------------------------------------ metrics
def read_tb_scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Independent TFRecord reader: [len u64][crc u32][event proto][crc u32] per record."""
    from tensorboardX.proto import event_pb2

    out: dict[str, list[tuple[int, float]]] = {}
    for f in sorted(tb_dir.glob("events.out.tfevents.*")):
        data = f.read_bytes()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_metrics_jsonl_and_tensorboard(tmp_path):
    with MetricWriter(tmp_path / "run") as w:
        w.write(0, {"loss": np.float32(1.5), "p5": jnp.asarray(0.875), "n_tokens": np.int64(128), "ok": True})
        w.write(1, {"loss": float("nan"), "grad_norm": float("inf"), "p5": jnp.asarray([0.75])})
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1]
    assert json.loads(lines[1]) == {"step": 1, "loss": "NaN", "grad_norm": "Infinity", "p5": 0.75}
    recs = read_metrics(tmp_path / "run")
    assert recs[0] == {"step": 0, "loss": 1.5, "p5": 0.875, "n_tokens": 128, "ok": 1}
    assert math.isnan(recs[1]["loss"]) and recs[1]["grad_norm"] == math.inf
    tb = read_tb_scalars(tmp_path / "run" / "tb")
    assert tb["loss"][0] == (0, 1.5) and tb["p5"] == [(0, 0.875), (1, 0.75)]


def test_metrics_resume_truncates(tmp_path):
    with MetricWriter(tmp_path, use_tensorboard=False) as w:
        for s in range(6):
            w.write(s, {"loss": 10.0 - s})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # a line cut short by a crash
    with MetricWriter(tmp_path, use_tensorboard=False, resume_step=3) as w:
        w.write(4, {"loss": -4.0})
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in recs] == [(0, 10.0), (1, 9.0), (2, 8.0), (3, 7.0), (4, -4.0)]
    # without resume_step, only the torn tail is repaired and lines are appended
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5')
    with MetricWriter(tmp_path, use_tensorboard=False) as w:
        w.write(5, {"loss": -5.0})
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3, 4, 5]


def test_metrics_errors_and_non_primary(tmp_path):
    MetricWriter(tmp_path / "other", is_primary=False).write(0, {"loss": 1.0})
    assert not (tmp_path / "other").exists()
    w = MetricWriter(tmp_path / "run", use_tensorboard=False)
    with pytest.raises(TypeError, match="'logits'"):
        w.write(0, {"logits": np.ones(3)})
    with pytest.raises(ValueError, match="'step'"):
        w.write(0, {"step": 1.0})
    w.close()
    with pytest.raises(RuntimeError, match="closed"):
        w.write(1, {"loss": 1.0})
    (tmp_path / "bad.jsonl").write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_metrics(tmp_path / "bad.jsonl")


def test_per_bin_metric_names_are_read_back_by_bin_start():
    records = [{"step": 1, "mismatch/count/bin_128": 5.0, "mismatch/count/bin_0": 7.0, "mismatch/alpha_p5": 0.9},
               {"step": 2, "mismatch/count/bin_1024": 3.0, "schedule/topk/bin_0": 4.0}]
    assert logged_bins(records, "mismatch/count") == [0, 128, 1024]  # numeric order, not the keys'
    assert logged_bins(records, "mismatch/alpha_p5") == []
    got = bin_series(records, "mismatch/count")
    assert list(got) == [0, 128, 1024] and got[0][0] == 7.0 and math.isnan(got[0][1]) and got[1024][1] == 3.0


def test_progress_bar():
    buf = io.StringIO()
    with ProgressBar(total=10, file=buf, mininterval=0) as bar:
        bar.update(3)
        bar.update(5, loss=0.123456, p5=np.float32(0.9))
    out = buf.getvalue()
    assert "5/10" in out and "loss=0.1235" in out and "p5=0.9" in out
    quiet = io.StringIO()
    with ProgressBar(total=10, file=quiet, disable=True) as bar:
        bar.update(5, loss=1.0)
    assert quiet.getvalue() == ""


# ------------------------------------------------------------------ plots
def _is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1024


def test_plots_write_png(tmp_path):
    bins = np.arange(0, 32768, 4096)
    table = {f"topk={k}": (bins, 0.95 - bins / (k * 20000.0)) for k in (8, 16, 32)}
    table["topk=8"][1][3] = np.nan  # an empty bin shows as a gap
    p1 = plot_p5_by_position(table, 0.86, tmp_path / "fig" / "p5.png", "p5 by position")
    steps = np.arange(20)
    p2 = plot_curves({"dense": (steps, steps * 0.1), "sparse": (steps, steps * 0.09)}, tmp_path / "r.png", "reward")
    p3 = plot_panels([("reward", "mean", {"a": (steps, steps)}), ("p5", "p5", {"b": (steps, -steps)})],
                     tmp_path / "panels.png")
    for p in (p1, p2, p3):
        assert _is_png(Path(p))
    assert sorted(os.listdir(tmp_path / "fig")) == ["p5.png"]  # no temp files left


def test_plots_bad_input_keeps_old_file(tmp_path):
    out = tmp_path / "r.png"
    out.write_bytes(b"previous")
    with pytest.raises(ValueError, match=r"series\['b'\]: x has 3 values, y has 2"):
        plot_curves({"a": ([0, 1], [0, 1]), "b": ([0, 1, 2], [0, 1])}, out, "y")
    with pytest.raises(ValueError, match=".png"):
        plot_curves({"a": ([0, 1], [0, 1])}, tmp_path / "r.jpg", "y")
    with pytest.raises(ValueError, match=r"panels\[1\]"):
        plot_panels([("t", "y", {"a": ([0], [1])}), ("only two",)], out)
    assert out.read_bytes() == b"previous"
    assert sorted(os.listdir(tmp_path)) == ["r.png"]


# ------------------------------------------------------------------ atomic JSON
def test_atomic_write_json(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "report.json"
    obj = {"speedup": np.float32(2.5), "ok": np.bool_(True), "bins": np.arange(3), "nan": float("nan"),
           "nested": {"t": (1, 2)}}
    atomic_write_json(path, obj)
    assert json.loads(path.read_text()) == {"speedup": 2.5, "ok": True, "bins": [0, 1, 2], "nan": "NaN",
                                            "nested": {"t": [1, 2]}}
    before = path.read_bytes()
    with pytest.raises(TypeError, match="<root>/bad"):
        atomic_write_json(path, {"bad": object()})
    with pytest.raises(TypeError, match="dict key 3"):
        atomic_write_json(path, {3: 1})
    with pytest.raises(ValueError, match="<root>/x"):
        atomic_write_json(path, {"x": float("inf")}, nonfinite="error")

    def crash(*a, **k):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)  # crash after the temp file is written
    with pytest.raises(OSError, match="disk gone"):
        atomic_write_json(path, {"new": 1})
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert os.listdir(path.parent) == ["report.json"]  # temp file removed
    assert to_jsonable({"n": float("-inf")}, nonfinite="null") == {"n": None}
