"""train.adv_baseline="prefix": per-token advantages whose baseline is the mean reward of the group's
rows that share the token's prefix, against the definition written out as loops, and the property
that makes them worth having: a token every row of the group shares gets no net update."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sparrow_jax.models.config import tiny_config
from sparrow_jax.models.qwen3 import init_params
from sparrow_jax.rl.advantages import group_advantages, prefix_advantages
from sparrow_jax.rl.train_step import Batch, StepOptions, init_train_state, train_step

PROMPT, T, G = 5, 24, 4


def _group_rows(rng, partings, vocab=50):
    """[G, T] rows of one prompt: a shared base, row i rewritten from ``partings[i]`` on (None: kept)."""
    base = rng.randint(1, vocab, T)
    rows = np.tile(base, (len(partings), 1))
    for i, start in enumerate(partings):
        if start is not None:  # every token from the parting on differs from the base's
            rows[i, start:] = (base[start:] + rng.randint(1, vocab, T - start)) % vocab
    return rows


def _reference(rewards, tokens, mask, group_size, mode, eps=1e-6):
    n, t = tokens.shape
    out = np.zeros((n, t))
    for i in range(n):
        members = range(i // group_size * group_size, (i // group_size + 1) * group_size)
        r = [rewards[k] for k in members]
        std = np.std(r, ddof=1) + eps if mode == "grpo" else 1.0
        for pos in range(t):
            same = [rewards[k] for k in members if (tokens[k, :pos] == tokens[i, :pos]).all()]
            out[i, pos] = (rewards[i] - np.mean(same)) / std * (mask[i, pos] > 0)
    return out


def _case(seed=0):
    rng = np.random.RandomState(seed)
    tokens = np.concatenate([_group_rows(rng, [None, 12, 12, 18]), _group_rows(rng, [7, 9, 20, None]),
                             _group_rows(rng, [5, 5, 5, 5])])
    mask = np.zeros(tokens.shape, np.float32)
    mask[:, PROMPT:] = 1
    mask[3, 21:] = 0  # a completion that ended early
    rewards = np.asarray([0.9, 0.2, 0.4, 0.6, 0.1, 0.7, 0.3, 0.3, 0.5, 0.5, 0.5, 0.5], np.float32)
    return rewards, tokens, mask


@pytest.mark.parametrize("mode", ["grpo", "drgrpo"])
def test_prefix_advantages_follow_their_definition(mode):
    rewards, tokens, mask = _case()
    got = prefix_advantages(rewards, tokens, mask, G, mode=mode)
    np.testing.assert_allclose(got, _reference(rewards, tokens, mask, G, mode), rtol=1e-5, atol=1e-6)
    # at the first completion token every row shares the prompt: the group baseline's advantages
    np.testing.assert_allclose(got[:, PROMPT], np.asarray(group_advantages(jnp.asarray(rewards), G, mode)),
                               rtol=1e-5, atol=1e-6)
    assert not got[mask == 0].any()
    assert not got[8:].any()  # equal rewards: no signal
    # row 0 of the first group is alone past position 18 (rows 1 and 2 left at 12, row 3 at 18)
    assert not got[0, 19:].any() and got[0, 18] != 0


def test_prefix_advantages_refuse_bad_shapes():
    rewards, tokens, mask = _case()
    with pytest.raises(ValueError, match="dividing N=12"):
        prefix_advantages(rewards, tokens, mask, 5)
    with pytest.raises(ValueError, match=r"mask \[N, T\]"):
        prefix_advantages(rewards, tokens, mask[:, :-1], G)
    with pytest.raises(ValueError, match="mode"):
        prefix_advantages(rewards, tokens, mask, G, mode="gspo")


def test_only_the_tokens_where_rows_part_move_the_policy():
    """The policy-gradient update with prefix advantages equals the one with those advantages kept
    only at parting tokens (where some row on the same prefix takes another token): the rows on one
    prefix that take the same token have identical gradients there and advantages that sum to zero.
    The group baseline's advantages do not cancel so once a row has left the prefix."""
    config = tiny_config()
    rewards, tokens, mask = _case()
    tokens = tokens % config.vocab_size
    adv = prefix_advantages(rewards, tokens, mask, G)
    parting = np.zeros(tokens.shape, bool)  # some row on row i's prefix [:t] takes another token at t
    for i in range(len(tokens)):
        group = tokens[i // G * G:(i // G + 1) * G]
        for t in range(T):
            on_prefix = (group[:, :t] == tokens[i, :t]).all(1)
            parting[i, t] = (group[on_prefix, t] != tokens[i, t]).any()
    group_adv = np.broadcast_to(np.asarray(group_advantages(jnp.asarray(rewards), G))[:, None], tokens.shape)
    assert (adv[~parting] != 0).any()  # the cancelling terms exist
    optimizer = optax.sgd(1.0)
    params = init_params(config, seed=1)
    opts = StepOptions(tis_cap=0.0)  # on-policy: the ratio is 1, the update is -sum A grad log p

    def step(advantages):
        batch = Batch(tokens=jnp.asarray(tokens, jnp.int32), mask=jnp.asarray(mask), logp_sampler=jnp.zeros(tokens.shape),
                      advantages=jnp.asarray(advantages), prompt_lens=jnp.full((len(tokens),), PROMPT, jnp.int32))
        state = init_train_state(jax.tree.map(jnp.copy, params), optimizer)
        return train_step(state, batch, None, None, None, config=config, optimizer=optimizer, opts=opts)[0].params

    delta = lambda new: [np.asarray(a) - np.asarray(p) for a, p in zip(jax.tree.leaves(new), jax.tree.leaves(params))]
    full, parted = delta(step(adv)), delta(step(np.where(parting, adv, 0.0)))
    for a, b in zip(full, parted):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-7)
    assert max(float(np.abs(a).max()) for a in full) > 1e-4  # the parting tokens do move the policy
    group_full, group_parted = delta(step(group_adv)), delta(step(np.where(parting, group_adv, 0.0)))
    assert max(float(np.abs(a - b).max()) for a, b in zip(group_full, group_parted)) > 1e-4


def test_a_run_with_the_prefix_baseline_updates_on_its_batch_s_prefix_advantages(tmp_path, monkeypatch):
    """In the loop: the same rollouts as the group baseline's run, and the update's advantages are
    the prefix ones of that run's GRPO advantages (the baseline is affine in the rewards)."""
    from configs.grpo_tiny import get_config
    from sparrow_jax.rl import trainer
    from sparrow_jax.run.context import build_run_context
    from sparrow_jax.run.specs import parse_spec

    batches = {}
    real_update = trainer.update

    def spy(name):
        def update(loop, state, batch):
            batches[name] = jax.tree.map(np.asarray, batch)
            return real_update(loop, state, batch)
        return update

    def spec(name):
        cfg = get_config()
        cfg.workdir, cfg.steps, cfg.eval_every, cfg.checkpoint_every = str(tmp_path / name), 1, 0, 1
        cfg.schedule.kind = "dense"
        cfg.train.adv_baseline = name
        return parse_spec(cfg)

    ctx = build_run_context(spec("group"))
    for name in ("group", "prefix"):
        monkeypatch.setattr(trainer, "update", spy(name))
        trainer.train(spec(name), ctx, progress=False)
    group, prefix = batches["group"], batches["prefix"]
    np.testing.assert_array_equal(prefix.tokens, group.tokens)
    assert group.advantages.ndim == 1 and prefix.advantages.shape == prefix.tokens.shape
    g = get_config().rollout.group_size
    want = prefix_advantages(group.advantages, prefix.tokens, prefix.mask, g, mode="drgrpo")
    np.testing.assert_allclose(prefix.advantages, want, rtol=1e-4, atol=1e-5)
    assert np.abs(group.advantages).max() > 0
