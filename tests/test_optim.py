"""The one optimiser chain: the RL step's and the warm-up's optimisers are the chains they
always were (same updates bit for bit, same state layout, so old checkpoints still load)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sparrow_jax.rl.train_step import make_optimizer as rl_optimizer
from sparrow_jax.sft.curriculum import make_optimizer as sft_optimizer
from sparrow_jax.sft.settings import WarmupSettings


def _updates(opt, steps=3):
    params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)}
    state, out = opt.init(params), []
    for i in range(steps):
        grads = {"w": jnp.full((2, 3), 0.5 * (i + 1)) * params["w"] + 3.0}  # norm > 1: clipping acts
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        out.append(np.asarray(params["w"]))
    return out, jax.tree_util.tree_structure(state)


def _same(a, b):
    (pa, sa), (pb, sb) = _updates(a), _updates(b)
    assert sa == sb and all(np.array_equal(x, y) for x, y in zip(pa, pb))


def test_rl_optimizer_is_clipped_adam():
    _same(rl_optimizer(1e-2, 1.0), optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)))
    _same(rl_optimizer(1e-2, max_grad_norm=0.0), optax.chain(optax.adam(1e-2)))


def test_warmup_optimizer_is_clipped_adamw_on_its_schedule():
    settings = WarmupSettings(steps=10, lr=3e-3, warmup_frac=0.2, weight_decay=0.01)
    sched = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 2, 10, end_value=3e-4)
    _same(sft_optimizer(settings), optax.chain(optax.clip_by_global_norm(1.0),
                                               optax.adamw(sched, b1=0.9, b2=0.98, weight_decay=0.01)))
    _same(sft_optimizer(dataclasses.replace(settings, max_grad_norm=0.0)),
          optax.chain(optax.adamw(sched, b1=0.9, b2=0.98, weight_decay=0.01)))


def test_rl_optimizer_warmup_scales_each_update_by_its_step():
    """The k-th update (from 1) of ``warmup_steps`` = N is the constant rate's times min(1, k / N):
    Adam's moments do not depend on the rate, so with the same gradients only the scale differs."""
    params = {"w": jnp.zeros((2, 3))}
    grads = [{"w": jnp.linspace(-2.0, 3.0, 6).reshape(2, 3) * (i + 1) + i} for i in range(6)]
    warm, const = rl_optimizer(1e-2, 1.0, warmup_steps=4), rl_optimizer(1e-2, 1.0)
    sw, sc = warm.init(params), const.init(params)
    for k, g in enumerate(grads, start=1):
        uw, sw = warm.update(g, sw, params)
        uc, sc = const.update(g, sc, params)
        np.testing.assert_allclose(uw["w"], uc["w"] * min(1.0, k / 4), rtol=1e-6, atol=1e-12)


def test_frozen_parameters_never_move_and_the_others_take_adam_on_their_own_clipped_norm():
    """``frozen`` matches dotted names (``layers.0.self_attn.q_proj.kernel``): those get zero updates;
    the others get what clipped Adam gives the tree without them (the clip sees only their norm)."""
    from sparrow_jax.optim import param_name

    params = {"layers": [{"self_attn": {"q_proj": {"kernel": jnp.ones((2, 2))}}, "mlp": {"kernel": jnp.ones((3,))}}],
              "norm": {"weight": jnp.ones((2,))}}
    names = [param_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    assert names == ["layers.0.mlp.kernel", "layers.0.self_attn.q_proj.kernel", "norm.weight"]
    grads = jax.tree.map(lambda p: jnp.arange(p.size, dtype=jnp.float32).reshape(p.shape) + 2.0, params)
    frozen = rl_optimizer(1e-2, 1.0, frozen=r"self_attn|^norm\.")
    updates, _ = frozen.update(grads, frozen.init(params), params)
    assert not np.asarray(updates["layers"][0]["self_attn"]["q_proj"]["kernel"]).any()
    assert not np.asarray(updates["norm"]["weight"]).any()
    plain = rl_optimizer(1e-2, 1.0)
    mlp_only = {"mlp": grads["layers"][0]["mlp"]}
    want, _ = plain.update(mlp_only, plain.init({"mlp": params["layers"][0]["mlp"]}))
    np.testing.assert_allclose(updates["layers"][0]["mlp"]["kernel"], want["mlp"]["kernel"], rtol=1e-6)
    assert np.asarray(updates["layers"][0]["mlp"]["kernel"]).all()
