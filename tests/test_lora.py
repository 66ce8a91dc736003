"""LoRA pytree transform: identity at b = 0, exact merge, gradient isolation, adapter I/O."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from sparrow_jax.models import CheckpointError, dense_logits, init_params, load_hf, save_hf, tiny_config
from sparrow_jax.models.lora import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, ALL_TARGETS, BLOCK_OF, LoraConfig,
                                     init_lora, load_lora, lora_param_count, merge_lora, save_lora, with_lora)

CONFIG = tiny_config()


@pytest.fixture(scope="module")
def params():
    return init_params(CONFIG, seed=0)


def _kernel_paths(params):
    return [(i, BLOCK_OF[n], n) for i in sorted(params["layers"]) for n in ALL_TARGETS]


def _random_b(lora, seed=1):
    """Same tree with b ~ N(0, 0.05^2) (a copy; ``lora`` untouched)."""
    rng = np.random.RandomState(seed)
    return jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.asarray(rng.normal(0, 0.05, x.shape), x.dtype) if p[-1].key == "b" else x, lora)


def _tokens(seed=3, shape=(2, 12)):
    return jnp.asarray(np.random.RandomState(seed).randint(0, CONFIG.vocab_size, shape), jnp.int32)


# ---- config ---------------------------------------------------------------------------------

def test_config_defaults_and_validation():
    cfg = LoraConfig()
    assert (cfg.rank, cfg.alpha, cfg.targets, cfg.scale) == (8, 16.0, ALL_TARGETS, 2.0)
    assert hash(LoraConfig(targets=["q_proj"])) == hash(LoraConfig(targets=("q_proj",)))  # list -> tuple
    with pytest.raises(ValueError, match=r"unknown name\(s\) \['qproj', 'lm_head'\]"):
        LoraConfig(targets=("q_proj", "qproj", "lm_head"))
    with pytest.raises(ValueError, match="rank"):
        LoraConfig(rank=0)
    with pytest.raises(ValueError, match="alpha"):
        LoraConfig(alpha=-1.0)
    with pytest.raises(ValueError, match="empty"):
        LoraConfig(targets=())
    with pytest.raises(ValueError, match="string"):
        LoraConfig(targets="q_proj")
    with pytest.raises(ValueError, match="repeats"):
        LoraConfig(targets=("q_proj", "q_proj"))
    with pytest.raises(ValueError, match="init"):
        LoraConfig(init="zeros")


# ---- init -------------------------------------------------------------------------------------

def test_init_shapes_dtype_and_distribution(params):
    cfg = LoraConfig(rank=4)
    lora = init_lora(params, cfg, jax.random.key(0))
    expected_count = 0
    for i, block, name in _kernel_paths(params):
        d_in, d_out = params["layers"][i][block][name]["kernel"].shape
        ab = lora["layers"][i][block][name]
        assert ab["a"].shape == (d_in, 4) and ab["b"].shape == (4, d_out)
        assert ab["a"].dtype == ab["b"].dtype == jnp.float32
        assert not np.any(np.asarray(ab["b"]))
        bound = 1 / np.sqrt(d_in)  # PEFT's kaiming_uniform(a=sqrt(5)) bound on lora_A
        a = np.asarray(ab["a"])
        assert np.abs(a).max() <= bound and np.abs(a).max() > 0.8 * bound
        expected_count += 4 * (d_in + d_out)
    assert lora_param_count(lora) == expected_count
    # Different (layer, target) factors are independent draws.
    a0 = lora["layers"][0]["self_attn"]["q_proj"]["a"]
    assert not np.array_equal(a0, lora["layers"][1]["self_attn"]["q_proj"]["a"])
    assert not np.array_equal(a0, lora["layers"][0]["self_attn"]["k_proj"]["a"])
    gauss = init_lora(params, LoraConfig(rank=4, init="gaussian"), jax.random.key(0))
    allg = np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(gauss) if x.shape[1] == 4])
    assert abs(allg.std() - 1 / 4) < 0.02


def test_init_only_targets(params):
    cfg = LoraConfig(targets=("v_proj", "down_proj"))
    lora = init_lora(params, cfg, jax.random.key(0))
    for i in params["layers"]:
        assert set(lora["layers"][i]) == {"self_attn", "mlp"}
        assert set(lora["layers"][i]["self_attn"]) == {"v_proj"}
        assert set(lora["layers"][i]["mlp"]) == {"down_proj"}


# ---- with_lora ----------------------------------------------------------------------------------

@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_zero_b_is_identity_bit_exact(param_dtype):
    config = tiny_config(param_dtype=param_dtype)
    params = init_params(config, seed=0)
    cfg = LoraConfig()
    lora = init_lora(params, cfg, jax.random.key(1))
    eff = with_lora(params, lora, cfg)
    assert jax.tree.structure(eff) == jax.tree.structure(params)
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(eff)):
        assert x.dtype == y.dtype
        assert np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
    if param_dtype == "float32":  # (bf16: identical leaves, so identical logits; skip the compile)
        tokens = _tokens()
        assert np.array_equal(np.asarray(dense_logits(config, params, tokens)),
                              np.asarray(dense_logits(config, eff, tokens)))
    # Same under jit.
    eff_jit = jax.jit(with_lora, static_argnums=2)(params, lora, cfg)
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(eff_jit)):
        assert np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


@pytest.mark.parametrize("targets", [ALL_TARGETS, ("q_proj", "up_proj")])
def test_nonzero_b_changes_exactly_targets(params, targets):
    cfg = LoraConfig(rank=3, alpha=12.0, targets=targets)
    lora = _random_b(init_lora(params, cfg, jax.random.key(2)))
    eff = with_lora(params, lora, cfg)
    assert eff is not params and eff["layers"] is not params["layers"]
    flat_p = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    flat_e = dict(jax.tree_util.tree_flatten_with_path(eff)[0])
    assert flat_p.keys() == flat_e.keys()
    changed = 0
    for path, x in flat_p.items():
        keys = [getattr(k, "key", None) for k in path]
        y = flat_e[path]
        if keys[0] == "layers" and keys[-2] in targets and keys[-1] == "kernel":
            ab = lora["layers"][keys[1]][keys[2]][keys[3]]
            ref = np.asarray(x, np.float64) + 4.0 * (np.asarray(ab["a"], np.float64) @ np.asarray(ab["b"], np.float64))
            np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-6, atol=1e-7)
            assert not np.array_equal(np.asarray(y), np.asarray(x))
            changed += 1
        else:
            assert y is x  # passed through, not copied
    assert changed == len(targets) * CONFIG.num_hidden_layers
    # params itself was not mutated.
    assert flat_p == dict(jax.tree_util.tree_flatten_with_path(params)[0])
    assert merge_lora is with_lora
    # The model output moves.
    tokens = _tokens()
    assert np.abs(np.asarray(dense_logits(CONFIG, eff, tokens))
                  - np.asarray(dense_logits(CONFIG, params, tokens))).max() > 1e-3


def test_bfloat16_kernel_gets_float32_delta_then_cast():
    config = tiny_config(param_dtype="bfloat16")
    params = init_params(config, seed=0)
    cfg = LoraConfig(rank=2, targets=("o_proj",))
    lora = _random_b(init_lora(params, cfg, jax.random.key(0)))
    eff = with_lora(params, lora, cfg)
    w = params["layers"][1]["self_attn"]["o_proj"]["kernel"]
    ab = lora["layers"][1]["self_attn"]["o_proj"]
    ref = (np.asarray(w, np.float32) + 8.0 * (np.asarray(ab["a"]) @ np.asarray(ab["b"]))).astype(jnp.bfloat16)
    got = eff["layers"][1]["self_attn"]["o_proj"]["kernel"]
    assert got.dtype == jnp.bfloat16
    # float32 rounding of the delta can flip at most the last bf16 ulp.
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=2 ** -7)


def test_with_lora_structure_errors(params):
    cfg = LoraConfig(rank=2)
    lora = init_lora(params, cfg, jax.random.key(0))
    with pytest.raises(ValueError, match=r"layers.0.self_attn.q_proj.a: expected shape \(64, 4\), found \(64, 2\)"):
        with_lora(params, lora, LoraConfig(rank=4))
    with pytest.raises(ValueError, match="LoraConfig.targets"):
        with_lora(params, lora, LoraConfig(rank=2, targets=("q_proj",)))
    short = {"layers": {0: lora["layers"][0]}}
    with pytest.raises(ValueError, match=r"lora has layers \[0\], params has layers \[0, 1\]"):
        with_lora(params, short, cfg)
    with pytest.raises(ValueError, match="'layers'"):
        with_lora(params, {}, cfg)


# ---- gradients ----------------------------------------------------------------------------------

def _loss(params, tokens):
    logits = dense_logits(CONFIG, params, tokens)
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], -1))


def test_gradient_isolation_and_chain_rule(params):
    cfg = LoraConfig(rank=2, alpha=6.0)
    lora = _random_b(init_lora(params, cfg, jax.random.key(0)))
    tokens = _tokens()

    # Dense policy loss never sees lora: zero gradient for every adapter leaf.
    g_lora = jax.grad(lambda p, l: _loss(p, tokens), argnums=1)(params, lora)
    assert jax.tree.structure(g_lora) == jax.tree.structure(lora)
    assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(g_lora))

    # Sparse-actor loss with theta frozen (DistillSparse step 6): zero gradient for params.
    sparse = lambda p, l: _loss(with_lora(jax.lax.stop_gradient(p), l, cfg), tokens)
    g_p, g_l = jax.jit(jax.grad(sparse, argnums=(0, 1)))(params, lora)
    assert jax.tree.structure(g_p) == jax.tree.structure(params)
    assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(g_p))

    # ... and the lora gradient follows the chain rule through W = W0 + s a b:
    # dL/da = s dL/dW b^T, dL/db = s a^T dL/dW (hand derivation, numpy in float64).
    g_w = jax.jit(jax.grad(_loss))(with_lora(params, lora, cfg), tokens)
    for i, block, name in _kernel_paths(params):
        ab, got = lora["layers"][i][block][name], g_l["layers"][i][block][name]
        gw = np.asarray(g_w["layers"][i][block][name]["kernel"], np.float64)
        a, b = np.asarray(ab["a"], np.float64), np.asarray(ab["b"], np.float64)
        for part, ref in (("a", 3.0 * gw @ b.T), ("b", 3.0 * a.T @ gw)):
            assert np.abs(np.asarray(got[part])).max() > 0, (i, name, part)
            np.testing.assert_allclose(np.asarray(got[part]), ref, rtol=1e-4, atol=1e-6 * np.abs(ref).max())


# ---- adapter checkpoint ---------------------------------------------------------------------------

def test_save_load_round_trip_bit_exact(tmp_path, params):
    cfg = LoraConfig(rank=3, alpha=7.5, targets=("k_proj", "o_proj", "up_proj"), init="gaussian")
    lora = _random_b(init_lora(params, cfg, jax.random.key(4)))
    save_lora(tmp_path, lora, cfg)
    assert sorted(os.listdir(tmp_path)) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]  # adapter only, no temp files
    got, got_cfg = load_lora(tmp_path, params=params)
    assert got_cfg == cfg
    assert jax.tree.structure(got) == jax.tree.structure(lora)
    for x, y in zip(jax.tree.leaves(lora), jax.tree.leaves(got)):
        assert x.dtype == y.dtype and np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
    got2, _ = load_lora(tmp_path)  # without params: layer count from the file
    assert jax.tree.structure(got2) == jax.tree.structure(lora)


def test_saved_layout_is_peft_like(tmp_path, params):
    cfg = LoraConfig(rank=2, targets=("q_proj", "down_proj"))
    lora = _random_b(init_lora(params, cfg, jax.random.key(0)))
    save_lora(tmp_path, lora, cfg)
    with open(tmp_path / ADAPTER_CONFIG) as f:
        meta = json.load(f)
    assert meta["peft_type"] == "LORA" and meta["r"] == 2 and meta["lora_alpha"] == 16.0
    assert meta["target_modules"] == ["q_proj", "down_proj"]
    tensors = load_file(tmp_path / ADAPTER_WEIGHTS)
    assert len(tensors) == 2 * 2 * CONFIG.num_hidden_layers
    ab = lora["layers"][1]["mlp"]["down_proj"]
    a_t = tensors["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"]
    b_t = tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    assert a_t.shape == (2, CONFIG.intermediate_size) and b_t.shape == (CONFIG.hidden_size, 2)  # [r, in], [out, r]
    np.testing.assert_array_equal(a_t, np.asarray(ab["a"]).T)
    np.testing.assert_array_equal(b_t, np.asarray(ab["b"]).T)


def test_adapter_applied_peft_style_to_hf_weights_matches(tmp_path, params):
    """Independent check of the layout: PEFT's W_hf[out, in] += alpha/r * B @ A on the HF
    checkpoint written by save_hf, read back with load_hf, equals with_lora's kernels."""
    cfg = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"))
    lora = _random_b(init_lora(params, cfg, jax.random.key(5)))
    save_hf(tmp_path / "base", CONFIG, params)
    save_lora(tmp_path / "adapter", lora, cfg)
    base = load_file(tmp_path / "base" / "model.safetensors")
    adapter = load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS)
    merged = dict(base)
    for name, a in adapter.items():
        if ".lora_A." in name:
            b = adapter[name.replace("lora_A", "lora_B")]
            target = name.replace("base_model.model.", "", 1).replace(".lora_A.weight", ".weight")
            merged[target] = (base[target].astype(np.float64) + 2.0 * b.astype(np.float64) @ a).astype(np.float32)
    os.makedirs(tmp_path / "merged")
    save_file(merged, tmp_path / "merged" / "model.safetensors")
    with open(tmp_path / "merged" / "config.json", "w") as f:
        json.dump(CONFIG.to_hf_dict(), f)
    _, ref = load_hf(tmp_path / "merged")
    ours = with_lora(params, lora, cfg)
    n_changed = 0
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(ref)[0], jax.tree.leaves(ours)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-6, atol=1e-7, err_msg=str(path))
        n_changed += not np.array_equal(np.asarray(x), np.asarray(_get(params, path)))
    assert n_changed == len(cfg.targets) * CONFIG.num_hidden_layers


def _get(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


def test_load_errors(tmp_path, params):
    cfg = LoraConfig(rank=2, targets=("q_proj", "v_proj"))
    lora = init_lora(params, cfg, jax.random.key(0))
    with pytest.raises(FileNotFoundError, match=ADAPTER_CONFIG):
        load_lora(tmp_path / "nothing")
    save_lora(tmp_path, lora, cfg)

    # Shape mismatch against params: the tensor, expected and found shapes are named.
    other = init_params(tiny_config(hidden_size=32), seed=0)
    with pytest.raises(CheckpointError, match=r"tensor base_model\.model\.model\.layers\.0\.self_attn\.q_proj"
                                              r"\.lora_A\.weight: expected shape \(2, 32\), found \(2, 64\)"):
        load_lora(tmp_path, params=other)
    # More adapter layers than params layers.
    with pytest.raises(CheckpointError, match="params has 1 layers"):
        load_lora(tmp_path, params=init_params(tiny_config(num_hidden_layers=1), seed=0))

    weights = load_file(tmp_path / ADAPTER_WEIGHTS)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / ADAPTER_CONFIG).write_text((tmp_path / ADAPTER_CONFIG).read_text())
    missing_name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    save_file({k: v for k, v in weights.items() if k != missing_name}, bad / ADAPTER_WEIGHTS)
    with pytest.raises(CheckpointError, match=f"missing tensor {missing_name}"):
        load_lora(bad)
    save_file({**weights, "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": np.zeros((2, 64), np.float32)},
              bad / ADAPTER_WEIGHTS)
    with pytest.raises(CheckpointError, match="adapts up_proj, which is not in target_modules"):
        load_lora(bad)
    save_file({**weights, "base_model.model.lm_head.lora_A.weight": np.zeros((2, 64), np.float32)},
              bad / ADAPTER_WEIGHTS)
    with pytest.raises(CheckpointError, match="unexpected tensor base_model.model.lm_head"):
        load_lora(bad)
    # Rank in the file disagrees with r in the config.
    save_file({**weights, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((3, 64), np.float32)},
              bad / ADAPTER_WEIGHTS)
    with pytest.raises(CheckpointError, match=r"q_proj\.lora_A\.weight: expected rank 2 on axis 0.*found shape \(3, 64\)"):
        load_lora(bad)
    # Unsupported config fields.
    save_file(weights, bad / ADAPTER_WEIGHTS)
    meta = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    for change, msg in ((dict(use_dora=True), "use_dora"), (dict(target_modules=".*proj"), "regex"),
                        (dict(target_modules=["q_proj", "wq"]), r"unknown name\(s\) \['wq'\]"),
                        (dict(peft_type="IA3"), "peft_type")):
        (bad / ADAPTER_CONFIG).write_text(json.dumps({**meta, **change}))
        with pytest.raises(CheckpointError, match=msg):
            load_lora(bad)
    os.remove(bad / ADAPTER_WEIGHTS)
    with pytest.raises(FileNotFoundError, match=ADAPTER_WEIGHTS):
        load_lora(bad)
