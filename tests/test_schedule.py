"""Tests for sparrow_jax.rollout.schedule: presets, lookups, buckets, segments, JSON."""
import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.rollout.schedule import Segment, SparsitySchedule, available_presets, k_max_bucket, position_bins

# The repo copy of the paper's release (with our provenance block), read as a plain file.
PAPER_FILE = Path(__file__).resolve().parents[1] / "sparrow_jax" / "rollout" / "presets" / "paper_schedules.json"


def ref_topk(topk, bin_width, pos):
    """Plain-Python reference: bin = pos // width, clipped to the table."""
    return topk[min(max(pos, 0) // bin_width, len(topk) - 1)]


@pytest.fixture(scope="module")
def shared():
    """The released tables as a plain dict (provenance block removed)."""
    data = json.loads(PAPER_FILE.read_text(encoding="utf-8"))
    data.pop("provenance")
    return data


# ------------------------------------------------------------------ presets
def test_presets_equal_shared_tables(shared):
    assert available_presets() == sorted(shared["presets"])
    assert SparsitySchedule.available_presets() == sorted(shared["presets"])
    for name, table in shared["presets"].items():
        s = SparsitySchedule.from_preset(name)
        assert s.topk == tuple(table), name
        assert s.name == name
        assert s.page_size == shared["page_size"]
        assert s.bin_width == shared["bin_width_tokens"]
        assert s.reserved_first == shared["reserved_first_pages"]
        assert s.reserved_last == shared["reserved_last_pages"]
        assert s.dense_layers == tuple(shared["dense_layers"])
        assert s.selector == "centroid"
        assert s.meta["tau"] == float(name.rsplit("-", 1)[1])


def test_package_copy_has_provenance(shared):
    import importlib.resources
    text = importlib.resources.files("sparrow_jax").joinpath(
        "rollout", "presets", "paper_schedules.json").read_text()
    data = json.loads(text)
    prov = json.dumps(data.pop("provenance"))
    assert "2606.08446" in prov and "CC BY 4.0" in prov and "Sparrow" in prov
    assert '"/' not in prov  # no machine paths
    assert data == shared


def test_unknown_preset_lists_names():
    with pytest.raises(ValueError, match="qwen3-4b-0.86"):
        SparsitySchedule.from_preset("qwen3-4b-0.99")


# ------------------------------------------------------------------ lookups
def test_topk_at_bin_edges_hand():
    s = SparsitySchedule(topk=(3, 5, 9))
    pos = np.array([0, 1999, 2000, 3999, 4000, 5999, 6000, 10**6])
    np.testing.assert_array_equal(s.topk_at(pos), [3, 3, 5, 5, 9, 9, 9, 9])
    assert s.topk_at(pos).dtype == np.int32


def test_topk_at_preset_edges(shared):
    table = shared["presets"]["qwen3-4b-0.86"]
    s = SparsitySchedule.from_preset("qwen3-4b-0.86")
    pos = np.array([0, 1999, 2000, 39999, 40000, 123456])
    want = [table[0], table[0], table[1], table[19], table[19], table[19]]
    np.testing.assert_array_equal(s.topk_at(pos), want)


def test_topk_at_random_shapes_against_reference():
    rng = np.random.default_rng(0)
    topk = tuple(np.sort(rng.integers(0, 50, size=7)).tolist())
    s = SparsitySchedule(topk=topk, bin_width=37, page_size=8)
    pos = rng.integers(-5, 400, size=(4, 9))
    got = s.topk_at(pos)
    assert got.shape == (4, 9)
    want = np.vectorize(lambda p: ref_topk(topk, 37, int(p)))(pos)
    np.testing.assert_array_equal(got, want)
    got_jax = s.topk_at(jnp.asarray(pos, dtype=jnp.int32))
    assert isinstance(got_jax, jax.Array) and got_jax.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got_jax), want)


def test_topk_at_rejects_float_positions():
    with pytest.raises(TypeError, match="positions"):
        SparsitySchedule.fixed(4).topk_at(np.array([1.0, 2.0]))


def test_topk_at_jit():
    s = SparsitySchedule(topk=(2, 4, 4, 8), bin_width=10)
    pos = jnp.arange(-3, 60, dtype=jnp.int32)
    got = jax.jit(s.topk_at)(pos)
    want = [ref_topk(s.topk, 10, int(p)) for p in np.asarray(pos)]
    np.testing.assert_array_equal(np.asarray(got), want)

    # The schedule itself is a valid static argument (hashable).
    g = jax.jit(lambda sched, p: sched.budget_tokens_at(p), static_argnums=0)
    np.testing.assert_array_equal(np.asarray(g(s, pos)), (np.array(want) + 3) * 16)
    same = SparsitySchedule(topk=[2, 4, 4, 8], bin_width=10)
    np.testing.assert_array_equal(np.asarray(g(same, pos)), (np.array(want) + 3) * 16)


def test_hash_and_list_inputs():
    a = SparsitySchedule(topk=[1, 2], dense_layers=[0, 1])
    b = SparsitySchedule(topk=(1, 2), dense_layers=(0, 1), meta={"tau": 0.86})
    assert a == b and hash(a) == hash(b)  # meta is not part of identity
    assert isinstance(a.topk, tuple) and isinstance(a.dense_layers, tuple)
    assert a != SparsitySchedule(topk=(1, 3))


def test_budget_formula():
    s = SparsitySchedule(topk=(29, 45), bin_width=2000)
    # Hand: (29 + 1 + 2) * 16 = 512; (45 + 3) * 16 = 768.
    np.testing.assert_array_equal(s.budget_tokens_at(np.array([0, 2000])), [512, 768])
    t = SparsitySchedule(topk=(10,), page_size=32, reserved_first=2, reserved_last=1)
    assert int(t.budget_tokens_at(5)) == (10 + 3) * 32


def test_from_budget_tokens():
    # The notes' budgets: 2560 and 4096 tokens of pages of 16 -> 160 / 256 pages - 3 reserved.
    assert SparsitySchedule.from_budget_tokens(2560).topk == (157,)
    assert SparsitySchedule.from_budget_tokens([2560, 4096]).topk == (157, 253)
    assert SparsitySchedule.from_budget_tokens(2575).topk == (157,)  # floor: stays under budget
    s = SparsitySchedule.from_budget_tokens(1024, page_size=64, reserved_first=0, reserved_last=1)
    assert s.topk == (15,) and int(s.budget_tokens_at(0)) == 1024
    with pytest.raises(ValueError, match="budget"):
        SparsitySchedule.from_budget_tokens(40)  # 3 reserved pages alone need 48
    with pytest.raises(ValueError, match="page_size"):
        SparsitySchedule.from_budget_tokens(512, page_size=0)


def test_fixed():
    s = SparsitySchedule.fixed(7, page_size=8)
    np.testing.assert_array_equal(s.topk_at(np.array([0, 10**7])), [7, 7])
    assert s.page_size == 8 and s.num_bins == 1


@pytest.mark.parametrize("kw, err, field", [
    (dict(topk=()), ValueError, "topk"),
    (dict(topk=(1, -1)), ValueError, "topk"),
    (dict(topk=(5, 3)), ValueError, "topk"),
    (dict(topk=(1.5,)), TypeError, "topk"),
    (dict(topk=5), TypeError, "topk"),
    (dict(topk=(1,), bin_width=0), ValueError, "bin_width"),
    (dict(topk=(1,), bin_width=2.5), TypeError, "bin_width"),
    (dict(topk=(1,), page_size=0), ValueError, "page_size"),
    (dict(topk=(1,), reserved_first=-1), ValueError, "reserved_first"),
    (dict(topk=(1,), reserved_last=-2), ValueError, "reserved_last"),
    (dict(topk=(1,), dense_layers=(-1,)), ValueError, "dense_layers"),
    (dict(topk=(1,), dense_layers=(0, 0)), ValueError, "dense_layers"),
    (dict(topk=(1,), selector="magic"), ValueError, "selector"),
    (dict(topk=(1,), meta=[1]), TypeError, "meta"),
])
def test_validation_errors(kw, err, field):
    with pytest.raises(err, match=field):
        SparsitySchedule(**kw)


def test_bin_width_need_not_be_page_multiple():
    assert SparsitySchedule(topk=(1,), bin_width=2000, page_size=16).bin_width == 2000
    assert SparsitySchedule(topk=(1,), bin_width=7, page_size=16).bin_width == 7


# ---------------------------------------------------------------- buckets
def test_k_buckets_hand():
    s = SparsitySchedule(topk=(3, 3, 5, 9), bin_width=10)
    assert s.k_buckets(0) == ()
    assert s.k_buckets(1) == (3,)
    assert s.k_buckets(20) == (3,)
    assert s.k_buckets(21) == (3, 5)
    assert s.k_buckets(30) == (3, 5)
    assert s.k_buckets(31) == (3, 5, 9)
    assert s.k_buckets(10**6) == (3, 5, 9)
    with pytest.raises(ValueError, match="max_position"):
        s.k_buckets(-1)


def test_k_buckets_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(20):
        topk = tuple(np.sort(rng.integers(0, 6, size=rng.integers(1, 8))).tolist())
        bw = int(rng.integers(1, 9))
        s = SparsitySchedule(topk=topk, bin_width=bw)
        for m in range(0, bw * (len(topk) + 2)):
            want = tuple(sorted({ref_topk(topk, bw, p) for p in range(m)}))
            assert s.k_buckets(m) == want, (topk, bw, m)


def test_bucket_segments_hand():
    s = SparsitySchedule(topk=(3, 3, 5, 9), bin_width=10)
    # Leading row starts at 15: steps 0-4 are in bin 1 (3), 5-14 bin 2 (5), 15+ bin 3 (9).
    segs = s.bucket_segments(np.array([2, 15, 7]), 30)
    assert segs == [Segment(0, 5, 3), Segment(5, 10, 5), Segment(15, 15, 9)]
    # Bins 0 and 1 share a value, so no cut at position 10.
    assert s.bucket_segments(np.array([0]), 20) == [(0, 20, 3)]
    assert s.bucket_segments(np.array([0]), 0) == []


def test_bucket_segments_brute_force():
    rng = np.random.default_rng(2)
    for _ in range(60):
        topk = tuple(np.sort(rng.integers(0, 8, size=rng.integers(1, 9))).tolist())
        bw = int(rng.integers(1, 12))
        s = SparsitySchedule(topk=topk, bin_width=bw)
        starts = rng.integers(0, bw * (len(topk) + 1), size=rng.integers(1, 6))
        steps = int(rng.integers(0, bw * (len(topk) + 1)))
        segs = s.bucket_segments(starts, steps)
        # Per step, the max topk over rows (brute force, no monotonicity assumed).
        per_step = [max(ref_topk(topk, bw, int(b) + t) for b in starts) for t in range(steps)]
        covered = 0
        for first, n, k in segs:
            assert first == covered and n > 0
            assert k == max(per_step[first:first + n])  # every row fits, and k is tight
            covered += n
        assert covered == steps
        buckets = s.k_buckets(int(starts.max()) + steps) if steps else ()
        assert all(k in buckets for _, _, k in segs)
        ks = [k for _, _, k in segs]
        assert all(a != b for a, b in zip(ks, ks[1:]))  # merged
        assert len(segs) <= len(set(per_step))


def test_k_max_bucket_is_the_smallest_grid_value_at_or_above():
    grid = sorted({0, 1, 2, 3} | {2 ** n for n in range(12)} | {3 * 2 ** n for n in range(11)})
    for k in range(1025):
        b = k_max_bucket(k)
        assert b == min(g for g in grid if g >= k), k
        assert b <= max(3, 1.5 * k)  # at most 1.5x the pages selected
    with pytest.raises(ValueError, match="k"):
        k_max_bucket(-1)


def test_decode_segments_bucket_and_merge_bucket_segments():
    rng = np.random.RandomState(1)
    for _ in range(200):
        topk = tuple(np.sort(rng.randint(0, 40, rng.randint(1, 6))))
        s = SparsitySchedule(topk=topk, bin_width=int(rng.randint(1, 20)))
        starts, steps = rng.randint(0, 60, rng.randint(1, 4)), int(rng.randint(0, 80))
        segs = s.decode_segments(starts, steps)
        tight = s.bucket_segments(starts, steps)
        assert sum(n for _, n, _ in segs) == steps and all(a.k_max != b.k_max for a, b in zip(segs, segs[1:]))
        for first, n, k in segs:  # each bucketed segment is a union of tight ones, bucketed
            inside = [t for t in tight if first <= t.first_step < first + n]
            assert k == k_max_bucket(max(t.k_max for t in inside))


def test_schedule_is_a_pytree_with_a_traced_table():
    s = SparsitySchedule(topk=(1, 5, 7), bin_width=8, page_size=4, dense_layers=(0,), name="x", meta={"a": 1})
    leaves, tree = jax.tree.flatten(s)
    assert len(leaves) == 1 and leaves[0].dtype == np.int32 and list(leaves[0]) == [1, 5, 7]
    same_bucket = dataclasses.replace(s, topk=(2, 6, 8), name="y")
    assert jax.tree.structure(same_bucket) == tree  # k_max bucket 8 both: same compile key
    assert jax.tree.structure(dataclasses.replace(s, topk=(1, 5, 9))) != tree  # bucket 12
    assert jax.tree.structure(dataclasses.replace(s, page_size=8)) != tree  # layout is static
    pos = np.arange(40)
    traced = jax.jit(lambda sch, p: (sch.topk_at(p), sch.k_max))
    for sch in (s, same_bucket):
        got, k_max = traced(sch, jnp.asarray(pos))
        np.testing.assert_array_equal(got, sch.topk_at(pos))
        assert int(k_max) == 8 == sch.k_max
    assert traced._cache_size() == 1
    np.testing.assert_array_equal(position_bins(np.array([-3, 0, 7, 8, 100]), 8, 3), [0, 0, 0, 1, 2])


def test_bucket_segments_errors():
    s = SparsitySchedule.fixed(4)
    with pytest.raises(ValueError, match="start_positions"):
        s.bucket_segments(np.array([[0, 1]]), 4)
    with pytest.raises(ValueError, match="start_positions"):
        s.bucket_segments(np.array([], dtype=np.int64), 4)
    with pytest.raises(ValueError, match="start_positions"):
        s.bucket_segments(np.array([-1, 3]), 4)
    with pytest.raises(TypeError, match="start_positions"):
        s.bucket_segments(np.array([0.5]), 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        s.bucket_segments(np.array([0]), -1)


# ------------------------------------------------------------------ JSON
def test_json_round_trip(tmp_path):
    s = SparsitySchedule(topk=(4, 6, 6, 10), bin_width=500, page_size=32, reserved_first=0,
                         reserved_last=1, dense_layers=(0,), selector="quest", name="mine",
                         meta={"tau": 0.86, "model": "tiny", "p5": [[0, 0.9], [1, 0.87]]})
    path = tmp_path / "s.json"
    s.to_json(path)
    raw = json.loads(path.read_text())
    assert raw["format"] == "sparrow-schedule/v1" and raw["topk"] == [4, 6, 6, 10]
    t = SparsitySchedule.from_json(path)
    assert t == s and dict(t.meta) == dict(s.meta)
    assert SparsitySchedule.from_json(str(path), expected_page_size=32) == s


def test_from_json_paper_file(shared, tmp_path):
    path = tmp_path / "paper.json"
    path.write_text(json.dumps(shared))
    s = SparsitySchedule.from_json(path, name="qwen3-8b-0.86")
    assert s.topk == tuple(shared["presets"]["qwen3-8b-0.86"])
    assert s == SparsitySchedule.from_preset("qwen3-8b-0.86")
    with pytest.raises(ValueError, match="name"):
        SparsitySchedule.from_json(path)
    with pytest.raises(ValueError, match="unknown preset"):
        SparsitySchedule.from_json(path, name="nope")


def test_from_json_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.json"):
        SparsitySchedule.from_json(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad JSON"):
        SparsitySchedule.from_json(bad)
    good = SparsitySchedule(topk=(1, 2)).to_dict()
    for key in ("topk", "page_size", "selector"):
        d = dict(good)
        d.pop(key)
        p = tmp_path / f"no_{key}.json"
        p.write_text(json.dumps(d))
        with pytest.raises(ValueError, match=f"missing key.*{key}"):
            SparsitySchedule.from_json(p)
    p = tmp_path / "typo.json"
    p.write_text(json.dumps({**good, "bin_widht": 3}))
    with pytest.raises(ValueError, match="bin_widht"):
        SparsitySchedule.from_json(p)
    p = tmp_path / "fmt.json"
    p.write_text(json.dumps({**good, "format": "other/v9"}))
    with pytest.raises(ValueError, match="unknown format"):
        SparsitySchedule.from_json(p)
    p = tmp_path / "invalid.json"
    p.write_text(json.dumps({**good, "topk": [3, 1]}))
    with pytest.raises(ValueError, match="invalid.json.*topk"):
        SparsitySchedule.from_json(p)
    p = tmp_path / "ok.json"
    p.write_text(json.dumps(good))
    with pytest.raises(ValueError, match="page_size 16.*expected page size 32"):
        SparsitySchedule.from_json(p, expected_page_size=32)
