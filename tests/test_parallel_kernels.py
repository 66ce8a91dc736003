"""Sparse decode kernels on a mesh (sparrow_jax.parallel.kernels): 8 fake CPU devices in a child.

Each implementation (C++ CPU custom call, Pallas TPU / GPU kernels in interpret mode, XLA)
runs page selection + attention under ``jax.set_mesh``; the child compares with the
one-device result and records the shapes every kernel call sees (from the jaxpr, and for
the C++ custom call from the compiled HLO). The parent asserts.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# one xdist worker runs the whole module: its module-scoped fixtures are built once (pytest.ini)
pytestmark = pytest.mark.xdist_group("test_parallel_kernels")

REPO = Path(__file__).resolve().parents[1]

_CHILD = textwrap.dedent(
    r'''
    import json, re
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from sparrow_jax.attention.decode import (dense_decode_dispatch, resolve_impl, score_select_decode,
                                              select_pages_decode, sparse_decode)
    from sparrow_jax.parallel import make_mesh
    from sparrow_jax.models import tiny_config
    from sparrow_jax.models.forward import init_caches
    from sparrow_jax.parallel.kernels import place_kv_caches, rows_heads_spec

    assert jax.device_count() == 8, jax.devices()
    rng = np.random.RandomState(0)
    B, H, HKV, NP, S, D = 8, 8, 2, 8, 8, 32
    q = rng.randn(B, H, D).astype(np.float32)
    k, v = (rng.randn(B, HKV, NP, S, D).astype(np.float32) for _ in range(2))
    pos = rng.randint(S, NP * S, B).astype(np.int32)
    scores = rng.randn(B, HKV, NP).astype(np.float32)
    budget = rng.randint(1, 4, B).astype(np.int32)

    def step(q, k, v, scores, pos, budget, impl):
        idx, valid = select_pages_decode(scores, pos, budget, 3, S, impl=impl)
        return idx, valid, sparse_decode(q, k, v, idx, valid, pos, impl=impl)

    def kernel_shapes(jaxpr, names=("ffi_call", "pallas_call")):
        found = []
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in names:
                found.append([list(x.aval.shape) for x in eqn.invars])
            for p in eqn.params.values():
                inner = getattr(p, "jaxpr", p)
                if hasattr(inner, "eqns"):
                    found += kernel_shapes(inner, names)
        return found

    run = jax.jit(step, static_argnames="impl")
    out = {"auto": resolve_impl("auto")}
    meshes = {"fsdp4_tensor2": dict(data=1, fsdp=4, tensor=2), "data2_tensor4": dict(data=2, fsdp=1, tensor=4)}
    cases = [("fsdp4_tensor2", impl) for impl in ("cpu", "xla", "pallas_tpu", "pallas_gpu")]
    cases.append(("data2_tensor4", "cpu"))  # 2 KV heads cannot split 4 ways: rows only
    for mesh_name, impl in cases:
        mesh = make_mesh(meshes[mesh_name])
        ref = run(q, k, v, scores, pos, budget, impl=impl)
        with jax.set_mesh(mesh):
            spec = rows_heads_spec(mesh, B, HKV)
            args = [jax.device_put(x, NamedSharding(mesh, spec if x.ndim > 1 else P(spec[0])))
                    for x in (q, k, v, scores, pos, budget)]
            got = run(*args, impl=impl)
            jaxpr = jax.make_jaxpr(step, static_argnums=6)(*args, impl)
            hlo = run.lower(*args, impl=impl).compile().as_text() if impl == "cpu" else ""
            auto = kernel_shapes(jax.make_jaxpr(step, static_argnums=6)(*args, "auto").jaxpr)
        custom = re.findall(r'custom_call_target="(sparrow_\w+)", operand_layout_constraints=\{(.*?)\}, api_version',
                            hlo)
        out[f"{mesh_name}/{impl}"] = dict(
            idx_equal=bool(np.array_equal(ref[0], got[0]) and np.array_equal(ref[1], got[1])),
            out_diff=float(np.abs(np.asarray(ref[2]) - np.asarray(got[2])).max()),
            out_shard_shape=list(got[2].addressable_shards[0].data.shape),
            kernel_shapes=kernel_shapes(jaxpr.jaxpr), auto_kernel_shapes=auto,
            hlo_custom_calls=[[t, re.findall(r"\[([\d,]*)\]", ops)] for t, ops in custom])
    # the dense C++ kernel (the sampler's dense decode on CPU) on the same mesh
    dense = jax.jit(lambda q, k, v, pos: dense_decode_dispatch(q, k, v, pos, impl="cpu"))
    dense_ref = dense(q, k, v, pos)
    mesh = make_mesh(meshes["fsdp4_tensor2"])
    with jax.set_mesh(mesh):
        spec = rows_heads_spec(mesh, B, HKV)
        args = [jax.device_put(x, NamedSharding(mesh, spec if x.ndim > 1 else P(spec[0]))) for x in (q, k, v, pos)]
        dense_got = dense(*args)
        hlo = dense.lower(*args).compile().as_text()
    custom = re.findall(r'custom_call_target="(sparrow_\w+)", operand_layout_constraints=\{(.*?)\}, api_version', hlo)
    out["dense_cpu"] = dict(out_diff=float(np.abs(np.asarray(dense_ref) - np.asarray(dense_got)).max()),
                            out_shard_shape=list(dense_got.addressable_shards[0].data.shape),
                            hlo_custom_calls=[[t, re.findall(r"\[([\d,]*)\]", ops)] for t, ops in custom])
    # the fused C++ score + select (the decode step's selection on CPU), Quest bounds as metadata
    qg = rng.randn(B, HKV, D).astype(np.float32)
    kmin = rng.randn(B, HKV, NP, D).astype(np.float32)
    kmax = kmin + np.abs(rng.randn(B, HKV, NP, D)).astype(np.float32)
    fused = jax.jit(lambda qg, lo, hi, pos, budget: score_select_decode(qg, None, lo, hi, pos, budget, 3, S,
                                                                        selector="quest", impl="cpu"))
    fused_ref = fused(qg, kmin, kmax, pos, budget)
    with jax.set_mesh(mesh):
        args = [jax.device_put(x, NamedSharding(mesh, spec if x.ndim > 1 else P(spec[0])))
                for x in (qg, kmin, kmax, pos, budget)]
        fused_got = fused(*args)
        hlo = fused.lower(*args).compile().as_text()
    custom = re.findall(r'custom_call_target="(sparrow_\w+)", operand_layout_constraints=\{(.*?)\}, api_version', hlo)
    out["score_select_cpu"] = dict(
        idx_equal=bool(np.array_equal(fused_ref[0], fused_got[0]) and np.array_equal(fused_ref[1], fused_got[1])),
        hlo_custom_calls=[[t, re.findall(r"\[([\d,]*)\]", ops)] for t, ops in custom])
    # prefill under the mesh: prompts and lengths split over rows, so each device prefills its rows
    from sparrow_jax.models import init_params
    from sparrow_jax.models.forward import prefill
    from sparrow_jax.parallel.kernels import place_rows
    prompts = rng.randint(1, 100, (8, 32)).astype(np.int32)
    lengths = rng.randint(8, 32, 8).astype(np.int32)
    tiny = tiny_config()
    tiny_params = init_params(tiny, seed=0)
    with jax.set_mesh(make_mesh(meshes["fsdp4_tensor2"])):
        placed_prompts, placed_lengths = place_rows((prompts, lengths))
        prefill_hlo = prefill.lower(tiny, tiny_params, placed_prompts, placed_lengths,
                                    place_kv_caches(init_caches(tiny, 8, 64, page_size=8))).compile().as_text()
    entry = prefill_hlo[prefill_hlo.index("ENTRY"):].split("\n", 1)[0]
    out["prefill"] = dict(prompt_shard_shape=list(placed_prompts.addressable_shards[0].data.shape),
                          length_shard_shape=list(placed_lengths.addressable_shards[0].data.shape),
                          int_params=sorted(set(re.findall(r"s32\[[\d,]*\]", entry))))
    caches = init_caches(tiny_config(), 8, 64, page_size=8)  # 2 KV heads, 8 pages of 8, head_dim 32
    out["unplaced_kept"] = place_kv_caches(caches) is caches  # no mesh context: untouched
    with jax.set_mesh(make_mesh(meshes["fsdp4_tensor2"])):
        placed = place_kv_caches(caches)
    out["placed_shards"] = [list(placed[0].k.addressable_shards[0].data.shape),
                            list(placed[0].centroid.addressable_shards[0].data.shape)]
    print(json.dumps(out))
    '''
)


@pytest.fixture(scope="module")
def sharded_kernels():
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8")
    res = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300,
                         cwd=REPO)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


# per mesh: (rows per device, KV heads per device). tensor=4 cannot split 2 KV heads: heads stay whole.
_LOCAL = {"fsdp4_tensor2": (2, 1), "data2_tensor4": (4, 2)}
_CASES = [("fsdp4_tensor2", impl) for impl in ("cpu", "xla", "pallas_tpu", "pallas_gpu")] + [("data2_tensor4", "cpu")]


@pytest.mark.parametrize("mesh_name,impl", _CASES)
def test_sharded_kernel_equals_one_device(sharded_kernels, mesh_name, impl):
    r = sharded_kernels[f"{mesh_name}/{impl}"]
    assert r["idx_equal"], r  # page selection: same slots
    assert r["out_diff"] <= 1e-6, r
    rows, heads = _LOCAL[mesh_name]
    assert r["out_shard_shape"] == [rows, heads * 4, 32], r  # the output stays split like the rows / heads


@pytest.mark.parametrize("mesh_name,impl", [c for c in _CASES if c[1] != "xla"])
def test_each_kernel_call_sees_only_its_shard(sharded_kernels, mesh_name, impl):
    """Every custom call / Pallas call gets [B / rows-split, Hkv / heads-split, ...] operands."""
    r = sharded_kernels[f"{mesh_name}/{impl}"]
    rows, heads = _LOCAL[mesh_name]
    calls = r["kernel_shapes"]
    assert calls, r
    for operands in calls:
        paged = [s for s in operands if len(s) == 5]  # the K / V pages [B, Hkv, P, S, D]
        blocks = [s for s in operands if len(s) >= 3]  # q, pages, scores, selections: [B, heads, ...]
        assert all(s[0] == rows for s in blocks), operands
        assert all(s[:2] == [rows, heads] for s in paged), operands
    if impl == "cpu":  # the compiled program too: both C++ custom calls on local shapes
        targets = {t: ops for t, ops in r["hlo_custom_calls"]}
        assert set(targets) == {"sparrow_select_pages_cpu", "sparrow_sparse_decode_cpu"}, r
        assert targets["sparrow_select_pages_cpu"][0] == f"{rows},{heads},8"  # scores [B, Hkv, P]
        assert targets["sparrow_sparse_decode_cpu"][1] == f"{rows},{heads},8,8,32"  # k_pages


def test_fused_score_select_runs_per_shard(sharded_kernels):
    """The decode step's C++ score + select on fsdp 4 x tensor 2: the same slots as one device,
    one custom call on [2 rows, 1 KV head] of the queries and the Quest bounds."""
    r = sharded_kernels["score_select_cpu"]
    assert r["idx_equal"], r
    targets = {t: ops for t, ops in r["hlo_custom_calls"]}
    assert set(targets) == {"sparrow_score_select_cpu"}, r
    assert targets["sparrow_score_select_cpu"][:3] == ["2,1,32", "2,1,8,32", "2,1,8,32"], r  # qg, kmin, kmax


def test_prefill_runs_per_device_on_its_rows(sharded_kernels):
    """generate's prefill inputs are split over rows (fsdp 4: 2 of 8 rows per device), and the
    compiled, partitioned prefill takes [2, 32] prompts and [2] lengths per device."""
    r = sharded_kernels["prefill"]
    assert r["prompt_shard_shape"] == [2, 32] and r["length_shard_shape"] == [2], r
    assert "s32[2,32]" in r["int_params"] and "s32[8,32]" not in r["int_params"], r


def test_dense_cpu_kernel_runs_per_shard(sharded_kernels):
    """The C++ dense decode (the dense baseline and the sampler's dense path on CPU) is split too:
    equal to one device, and its one custom call gets [2 rows, 1 KV head, ...] pages on fsdp 4 x tensor 2."""
    r = sharded_kernels["dense_cpu"]
    assert r["out_diff"] <= 1e-6, r
    assert r["out_shard_shape"] == [2, 4, 32], r
    (target, operands), = r["hlo_custom_calls"]
    assert target == "sparrow_dense_decode_cpu" and operands[1] == "2,1,8,8,32", r


def test_auto_is_the_cpu_kernel_on_a_cpu_mesh(sharded_kernels):
    assert sharded_kernels["auto"] == "cpu"
    for name in ("fsdp4_tensor2/cpu", "data2_tensor4/cpu"):  # auto: the same kernel calls on the same shards
        assert sharded_kernels[name]["auto_kernel_shapes"] == sharded_kernels[name]["kernel_shapes"]


def test_sampler_caches_are_placed_like_the_kernels_read_them(sharded_kernels):
    assert sharded_kernels["unplaced_kept"]
    assert sharded_kernels["placed_shards"] == [[2, 1, 8, 8, 32], [2, 1, 8, 32]]  # rows / 4, KV heads / 2
