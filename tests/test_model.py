"""Qwen3 model: parity with HF transformers, cache decode, checkpoint I/O, configs."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from hf_utils import make_hf_model
from sparrow_jax.models import (CheckpointError, Qwen3Config, decode_step, dense_logits, init_caches,
                                init_params, load_hf, prefill, save_hf, tiny_config)

PARITY_CONFIGS = {
    # untied, GQA ratio 2, head_dim (24) != hidden / heads (16)
    "untied_gqa2": dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=24, intermediate_size=96,
                        tie_word_embeddings=False, rope_theta=10000.0),
    # tied, GQA ratio 1, head_dim (32) != hidden / heads (12)
    "tied_mha": dict(vocab_size=80, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=4, head_dim=32, intermediate_size=64,
                     tie_word_embeddings=True, rope_theta=1_000_000.0),
}


@pytest.mark.parametrize("name", sorted(PARITY_CONFIGS))
def test_logits_match_hf_transformers(tmp_path, name):
    torch = pytest.importorskip("torch")
    hf_model, path = make_hf_model(tmp_path, max_position_embeddings=512, **PARITY_CONFIGS[name])
    config, params = load_hf(path)
    assert config.tie_word_embeddings == PARITY_CONFIGS[name]["tie_word_embeddings"]
    tokens = np.random.RandomState(1).randint(0, config.vocab_size, (2, 70))
    with torch.no_grad():
        ref = hf_model(torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(dense_logits(config, params, jnp.asarray(tokens)))
    assert np.abs(ours - ref).max() <= 1e-4


def test_prefill_then_decode_reproduces_full_logits():
    config = tiny_config()
    params = init_params(config, seed=3)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (3, 45), 0, config.vocab_size)
    full = dense_logits(config, params, tokens)
    lengths = jnp.array([5, 17, 30])  # ragged prompts, right-padded
    caches = prefill(config, params, tokens[:, :30], lengths, init_caches(config, 3, 48, page_size=8))
    step = jax.jit(lambda t, p, c: decode_step(config, params, t, p, c))
    pos = lengths
    for _ in range(14):
        logits, caches = step(tokens[jnp.arange(3), pos], pos, caches)
        expected = full[jnp.arange(3), pos]
        assert float(jnp.abs(logits - expected).max()) <= 1e-4
        pos = pos + 1


def test_bfloat16_forward_close_to_float32():
    config = tiny_config()
    params = init_params(config, seed=0)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 20), 0, config.vocab_size)
    ref = dense_logits(config, params, tokens)
    cfg16 = config.replace(dtype="bfloat16", param_dtype="bfloat16")
    p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    out = dense_logits(cfg16, p16, tokens)
    assert out.dtype == jnp.float32
    assert float(jnp.abs(out - ref).max()) < 0.05


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tied", [False, True])
def test_save_load_round_trip_is_bit_exact(tmp_path, dtype, tied):
    config = tiny_config(tie_word_embeddings=tied, param_dtype=jnp.dtype(dtype).name)
    params = jax.tree.map(lambda x: x.astype(dtype), init_params(config, seed=1))
    save_hf(tmp_path, config, params, max_shard_bytes=20_000)  # forces several shards
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    config2, params2 = load_hf(tmp_path, dtype=dtype)
    assert config2 == config
    leaves = jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)) and a.dtype == b.dtype,
                                          params, params2))
    assert all(leaves) and len(leaves) == len(jax.tree.leaves(params))


def _saved_single(tmp_path):
    config = tiny_config()
    save_hf(tmp_path, config, init_params(config))
    return tmp_path / "model.safetensors", load_file(tmp_path / "model.safetensors")


def test_missing_tensor_is_named(tmp_path):
    f, tensors = _saved_single(tmp_path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, f)
    with pytest.raises(CheckpointError, match=r"missing tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf(tmp_path)


def test_unexpected_tensor_is_named(tmp_path):
    f, tensors = _saved_single(tmp_path)
    tensors["model.layers.9.extra.weight"] = np.zeros(3, np.float32)
    save_file(tensors, f)
    with pytest.raises(CheckpointError, match=r"unexpected.*model\.layers\.9\.extra\.weight"):
        load_hf(tmp_path)


def test_shape_mismatch_names_tensor_and_shapes(tmp_path):
    f, tensors = _saved_single(tmp_path)
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((60, 64), np.float32)
    save_file(tensors, f)
    with pytest.raises(CheckpointError, match=r"k_proj\.weight: expected shape \(64, 64\), found \(60, 64\)"):
        load_hf(tmp_path)


def test_unsupported_architecture_and_missing_files(tmp_path):
    with pytest.raises(ValueError, match="unsupported architecture"):
        Qwen3Config.from_hf_dict({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config().to_hf_dict()))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf(tmp_path)


def test_invalid_config_fields_fail_with_name():
    with pytest.raises(ValueError, match="num_attention_heads"):
        tiny_config(num_attention_heads=3)
    with pytest.raises(ValueError, match="dtype"):
        tiny_config(dtype="float8")


def test_presets_match_published_configs():
    # public config.json facts of the Qwen3 family, kept in the repo so a clean clone checks them
    ref = json.load(open(os.path.join(os.path.dirname(__file__), "data", "qwen3_configs.json")))
    for name, facts in ref.items():
        if name == "about":
            continue
        cfg = Qwen3Config.preset(name)
        for key, value in facts.items():
            assert getattr(cfg, key) == value, (name, key)
    # Qwen3-0.6B has ~0.6B parameters (tied embeddings), Qwen3-8B ~8.2B.
    assert 0.55e9 < Qwen3Config.preset("Qwen3-0.6B").num_params() < 0.65e9
    assert 8.0e9 < Qwen3Config.preset("Qwen3-8B").num_params() < 8.4e9


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_linear_cpu_backward_matches_autodiff(dtype, tol):
    """The linear layers' hand-written CPU backward against jax's autodiff of ``x @ w``: values equal
    bit for bit, gradients within f32 summation order (bf16: its rounding), relative to each
    gradient's largest entry, for token axes of any rank."""
    from sparrow_jax.models.linear import linear

    r = np.random.RandomState(1)
    for x_shape in [(3, 37, 16), (41, 16), (2, 3, 5, 16)]:
        x, w, c = (jnp.asarray(r.randn(*s), dtype) for s in (x_shape, (16, 24), (*x_shape[:-1], 24)))
        loss = lambda f: lambda a, b: jnp.sum((f(a, b) * c).astype(jnp.float32))  # noqa: E731
        np.testing.assert_array_equal(np.asarray(linear(x, w), np.float32), np.asarray(jnp.dot(x, w), np.float32))
        got = jax.grad(loss(linear), argnums=(0, 1))(x, w)
        ref = jax.grad(loss(jnp.dot), argnums=(0, 1))(x, w)
        for g, e in zip(got, ref):
            assert g.dtype == e.dtype and g.shape == e.shape
            e32 = np.asarray(e, np.float32)
            assert np.max(np.abs(np.asarray(g, np.float32) - e32)) <= tol * np.max(np.abs(e32))


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_swiglu_cpu_backward_matches_autodiff(dtype, tol):
    """The MLP's hand-written CPU backward against jax's autodiff of the same forward: values equal
    bit for bit, gradients within f32 summation order (bf16: its rounding), relative to each
    gradient's largest entry."""
    from sparrow_jax.models.swiglu import swiglu, swiglu_reference

    r = np.random.RandomState(0)
    x, wg, wu, wd, w = (jnp.asarray(r.randn(*s) * c, dtype) for s, c in
                        [((3, 37, 16), 1.0), ((16, 24), 0.3), ((16, 24), 0.3), ((24, 16), 0.3), ((3, 37, 16), 1.0)])
    loss = lambda f: lambda *a: jnp.sum((f(*a) * w).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(swiglu(x, wg, wu, wd), np.float32),
                                  np.asarray(swiglu_reference(x, wg, wu, wd), np.float32))
    got = jax.grad(loss(swiglu), argnums=(0, 1, 2, 3))(x, wg, wu, wd)
    ref = jax.grad(loss(swiglu_reference), argnums=(0, 1, 2, 3))(x, wg, wu, wd)
    for g, e in zip(got, ref):
        assert g.dtype == e.dtype and g.shape == e.shape
        e32 = np.asarray(e, np.float32)
        assert np.max(np.abs(np.asarray(g, np.float32) - e32)) <= tol * np.max(np.abs(e32))
