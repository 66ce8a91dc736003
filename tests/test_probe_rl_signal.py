"""experiments.probe_rl_signal: the batch gradients are the GRPO policy gradient (checked against
-mean(A * grad log p) written out by hand), the leave-one-out cosines and the flat-vector helpers
by hand, and the first-error classes of recurrence_trace completions."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.grpo_tiny import get_config
from experiments import probe_rl_signal as P
from sparrow_jax.models.forward import dense_logits
from sparrow_jax.run.context import build_run_context
from sparrow_jax.run.specs import parse_spec


def test_batch_gradients_are_the_policy_gradient(tmp_path):
    cfg = get_config()
    cfg.workdir = str(tmp_path)
    cfg.task.context_tokens, cfg.task.num_train, cfg.task.num_eval = 64, 8, 2
    cfg.rollout.max_new_tokens, cfg.rollout.prompts_per_step, cfg.rollout.group_size = 8, 2, 4
    spec = parse_spec(cfg)
    ctx = build_run_context(spec, schedule=None)
    grads, rewards, samples = P.batch_gradients(spec, ctx, 2)
    assert grads.shape == (2, P.flat(ctx.params).size) and len(rewards) == 2
    for g, (batch, examples, group) in zip(grads, samples):
        assert len(examples) * group == len(batch.tokens) == 8
        tokens, mask, adv = (jnp.asarray(x) for x in (batch.tokens, batch.mask, batch.advantages))

        def surrogate(params):  # on-policy, token-mean: the loss's gradient is -mean_t(A * grad log p)
            lp = jax.nn.log_softmax(dense_logits(ctx.model_config, params, tokens)[:, :-1], axis=-1)
            lp = jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0]
            m = mask[:, 1:]
            return -jnp.sum(adv[:, None] * lp * m) / jnp.sum(m)

        want = P.flat(jax.grad(surrogate)(ctx.params))
        assert np.abs(want).max() > 1e-4  # a batch whose groups all tie would test nothing
        np.testing.assert_allclose(g, want, atol=2e-6 * np.abs(want).max() + 1e-8, rtol=1e-3)


def test_cosines_and_flat_vectors_by_hand():
    e = np.eye(3)
    assert P.leave_one_out_cosines(e) == pytest.approx([0.0, 0.0, 0.0])
    same = np.tile([1.0, -2.0, 0.5], (4, 1))
    assert P.leave_one_out_cosines(same) == pytest.approx([1.0] * 4)
    g = np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    assert P.leave_one_out_cosines(g)[0] == pytest.approx(0.5 / np.sqrt(0.5 ** 2 + 1.0))
    tree = {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones((4,), jnp.float32)}
    back = P.unflat(P.flat(tree) * 2, tree)
    np.testing.assert_array_equal(back["a"], 2 * tree["a"]) and np.testing.assert_array_equal(back["b"], 2.0)
    assert back["b"].dtype == jnp.float32


@pytest.mark.parametrize("completion, kind, off", [
    ("00:3\n01:8\n02:1\n03:b=5", "key", 19),  # c read as b: one letter back (mod 20)
    ("00:3\n01:8\n02:1\n03:e=5", "key", 2),
    ("00:3\n01:8\n02:1\n03:c=4", "constant", None),
    ("00:3\n01:8\n02:2\n03:c=5", "local", None),
    ("00:3\n01:8\n12:1\n03:c=5", "index", None),
    ("00:3\n01:8\n02:1\n03:c=5", "none", None),
    ("00:3\n01:8", "format", None),  # stopped early
])
def test_first_error_kinds(completion, kind, off):
    reference = "00:3\n01:8\n02:1\n03:c=5"
    assert P.first_error_kinds(completion, reference) == (kind, off)


def test_sharpening_is_the_descent_directions_component_along_the_final_norm():
    params = {"embed_tokens": jnp.ones((2, 2)), "norm": {"weight": jnp.asarray([2.0, -1.0])}}
    grads = np.asarray([[9.0, 9.0, 9.0, 9.0, 0.5, 1.0], [0.0, 0.0, 0.0, 0.0, -1.0, 0.0]])  # leaf order: embed, norm
    assert P.sharpening(grads, params) == pytest.approx([-(0.5 * 2.0 - 1.0), 2.0])
    assert P.sharpening(grads[:, :4], {"embed_tokens": jnp.ones((2, 2))}) is None


def test_the_probe_samples_with_the_sparse_actor_from_a_runs_checkpoint(tmp_path):
    from sparrow_jax.io.checkpoint import CheckpointManager

    cfg = get_config()  # a fixed sparse schedule
    cfg.workdir = str(tmp_path)
    cfg.task.context_tokens, cfg.task.num_train, cfg.task.num_eval = 64, 8, 2
    cfg.rollout.max_new_tokens, cfg.rollout.prompts_per_step, cfg.rollout.group_size = 8, 2, 4
    spec = parse_spec(cfg)
    ctx = build_run_context(spec)
    trained = jax.tree.map(lambda x: x * 1.5, ctx.params)
    with CheckpointManager(tmp_path / "run" / "checkpoints") as ckpt:
        ckpt.save(3, {"loop": {"train": {"params": trained}}})
    got = P.start_params(ctx, str(tmp_path / "run"), None)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(trained)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert P.start_params(ctx, None, None) is ctx.params
    with pytest.raises(ValueError, match="no checkpoint"):
        P.start_params(ctx, str(tmp_path / "none"), None)
    with pytest.raises(ValueError, match="dense | sparse"):
        P.probe(spec, 2, [], 1, rollouts="both")
    out = P.probe(spec, 2, [], 1, rollouts="sparse", params_from=str(tmp_path / "run"))
    assert out["rollouts"] == "sparse" and len(out["sharpening"]) == 2 and len(out["grad_norms"]) == 2
    assert all(np.isfinite(out["sharpening"]))
