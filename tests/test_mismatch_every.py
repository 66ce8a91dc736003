"""train.mismatch_every: a run whose sparse actor's statistics skip steps trains the same policy as
one that scores every step (TIS reads the sampler's log-probs either way) and logs the statistics on
the scored steps only."""
import jax
import numpy as np

from sparrow_jax.io.metrics import read_histograms


def test_skipped_steps_train_the_same_policy_and_log_no_statistics(tmp_path):
    from configs.grpo_tiny import get_config
    from sparrow_jax.rl.trainer import train
    from sparrow_jax.run.context import build_run_context
    from sparrow_jax.run.specs import parse_spec

    def spec(name, every):
        cfg = get_config()  # sparse rollouts (a fixed top-k) on a tiny random model
        cfg.workdir, cfg.steps, cfg.eval_every, cfg.checkpoint_every = str(tmp_path / name), 3, 0, 3
        cfg.train.mismatch_every = every
        return parse_spec(cfg)

    ctx = build_run_context(spec("every", 1))
    every = train(spec("every", 1), ctx, progress=False)
    skip = train(spec("skip", 2), ctx, progress=False)
    p5 = lambda h: [k for k in h if k.startswith("mismatch/alpha_p5/bin_")]
    assert all(p5(h) for h in every.history)
    assert [bool(p5(h)) for h in skip.history] == [True, False, True]  # the first and third steps
    for h_every, h_skip in zip(every.history, skip.history):
        for k in ("reward_mean", "loss", "actor/pg_loss"):
            np.testing.assert_allclose(h_skip[k], h_every[k], rtol=1e-5, atol=1e-7, err_msg=k)
    for k in p5(skip.history[2]):  # a scored step's statistics are the every-step run's
        np.testing.assert_allclose(skip.history[2][k], every.history[2][k], rtol=1e-5, err_msg=k)
    for a, b in zip(jax.tree.leaves(every.state.train.params), jax.tree.leaves(skip.state.train.params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    scored = lambda run: [h["step"] for h in run.history if p5(h)]  # the histograms' steps: the scored ones
    assert [step for step, _ in read_histograms(str(tmp_path / "skip"))] == scored(skip) == scored(every)[::2]
    assert [step for step, _ in read_histograms(str(tmp_path / "every"))] == scored(every)
