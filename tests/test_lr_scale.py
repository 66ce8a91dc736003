"""`train.lr_scale_params` / `train.lr_scale`: the matched parameters' Adam update times the scale, the
others' unchanged, and a frozen parameter stays frozen whatever its scale."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

from sparrow_jax.optim import param_name
from sparrow_jax.rl.train_step import make_optimizer


def _tree():
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"norm": {"weight": jnp.ones(4)}, "layers": [{"mlp": {"kernel": jax.random.normal(k[0], (4, 3))}}]}
    grads = [jax.tree.map(lambda p, i=i: jax.random.normal(k[1 + i], p.shape), params) for i in range(2)]
    return params, grads


def _updates(optimizer, params, grads):
    """Two steps' updates (Adam's moments differ from the first step on)."""
    state, out = optimizer.init(params), []
    for g in grads:
        u, state = optimizer.update(g, state, params)
        out.append(u)
        params = optax.apply_updates(params, u)
    return out


def test_matched_parameters_move_at_scale_times_the_rate():
    params, grads = _tree()
    plain = _updates(make_optimizer(1e-3, max_grad_norm=1.0), params, grads)
    scaled = _updates(make_optimizer(1e-3, max_grad_norm=1.0, scaled=r"^norm\.", scale=50.0), params, grads)
    for p, s in zip(plain, scaled):
        np.testing.assert_allclose(s["norm"]["weight"], 50.0 * p["norm"]["weight"], rtol=1e-6)
        np.testing.assert_allclose(s["layers"][0]["mlp"]["kernel"], p["layers"][0]["mlp"]["kernel"], rtol=1e-6)
        assert float(jnp.abs(p["norm"]["weight"]).min()) > 0  # the check above is not 0 == 50 * 0


def test_a_frozen_parameter_stays_frozen_when_also_scaled():
    params, grads = _tree()
    for u in _updates(make_optimizer(1e-3, frozen="mlp", scaled="mlp|norm", scale=10.0), params, grads):
        names = {param_name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(u)[0]}
        assert float(jnp.abs(names["layers.0.mlp.kernel"]).max()) == 0.0
        assert float(jnp.abs(names["norm.weight"]).min()) > 0
