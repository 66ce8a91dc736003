"""Calibration's survival rule (``calibration.min_survival``): the per-bin counts of traces that reach
a bin and break there, against a position-by-position reference, and the rule in the schedule."""
import dataclasses

import jax
import numpy as np
import pytest

from sparrow_jax.mismatch import calibrate as C
from sparrow_jax.models import init_params, tiny_config
from sparrow_jax.rollout import SamplingParams, SparsitySchedule

CFG = tiny_config(num_hidden_layers=2)
BASE = SparsitySchedule(topk=(0,), bin_width=64, page_size=8, dense_layers=(0,))


def _survival_reference(loss, comp, width, n_bins):
    """Walk each row token by token: the bins its loss tokens' query positions fall in, and the bin
    of its last loss token when the completion goes on past it."""
    reached, ended = [0] * n_bins, [0] * n_bins
    for row_loss, row_comp in zip(loss.tolist(), comp.tolist()):
        completion = [t for t, c in enumerate(row_comp) if c]
        if not completion:
            continue
        lost = [t for t in completion if row_loss[t]]
        bins = {(t - 1) // width for t in lost} if lost else {(completion[0] - 1) // width}
        for b in bins:
            if b < n_bins:
                reached[b] += 1
        last = lost[-1] if lost else completion[0] - 1
        if last < completion[-1]:
            b = (max(last, completion[0]) - 1) // width
            if b < n_bins:
                ended[b] += 1
    return np.array(reached), np.array(ended)


def test_horizon_survival_matches_a_token_walk():
    rng = np.random.RandomState(0)
    b, t, width = 40, 50, 8
    starts = rng.randint(1, 20, b)
    stops = np.minimum(t, starts + rng.randint(0, 35, b))  # some rows have no completion
    horizons = starts + rng.randint(0, 40, b)  # some past the stop: the whole completion is loss
    pos = np.arange(t)[None, :]
    comp = (pos >= starts[:, None]) & (pos < stops[:, None])
    loss = comp & (pos < horizons[:, None])
    loss[3] = False  # a row whose loss is empty breaks at its first token
    comp[3, 10:14] = True
    for n_bins in (7, 4):  # every bin, and bins cut short
        got = C.horizon_survival(loss, comp, width, n_bins)
        want = _survival_reference(loss, comp, width, n_bins)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    assert got[1].sum() > 0 and got[0].sum() > got[1].sum()
    # by hand: a completion at tokens 9..24 (query positions 8..23) whose loss ends at token 17
    one_comp = np.zeros((1, 30), bool)
    one_comp[0, 9:25] = True
    one_loss = one_comp & (np.arange(30) < 18)
    reached, ended = C.horizon_survival(one_loss, one_comp, 8, 4)
    assert reached.tolist() == [0, 1, 1, 0] and ended.tolist() == [0, 0, 1, 0]
    reached, ended = C.horizon_survival(one_comp, one_comp, 8, 4)  # whole completion: not broken
    assert reached.tolist() == [0, 1, 1, 0] and ended.tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="one \\[B, T\\] shape"):
        C.horizon_survival(one_loss, one_comp[:, :10], 8, 4)


def _derive(survival, min_survival, p5=None, unmeasured="free"):
    survival = np.array(survival, float)
    p5 = np.full(survival.shape, 0.99) if p5 is None else np.array(p5, float)
    return C.derive_topk(CFG, (1, 2, 4), p5, np.full(p5.shape, 50), 0.86, BASE, min_count=10, num_samples=4,
                         prompt_len=8, gen_len=4 * 64, survival=survival, min_survival=min_survival,
                         survival_unmeasured=unmeasured)


def test_survival_rule_raises_budgets_that_break_traces():
    nan = np.nan
    # bins:        0     1     2     3 (largest budget unmeasured: no constraint)
    survival = [[0.99, 0.50, nan, nan],   # top-k 1: half the traces that reach bin 1 break there
                [0.99, 0.90, 0.70, nan],  # top-k 2
                [0.99, 0.95, 0.90, nan]]  # top-k 4, the reference
    assert _derive(survival, 0.0)["topk"] == [1, 1, 1, 1]  # off: p5 alone
    assert _derive(survival, 0.9)["topk"] == [1, 2, 4, 4]  # 0.90 >= 0.9 * 0.95; 0.70 < 0.9 * 0.90
    assert _derive(survival, 0.5)["topk"] == [1, 1, 2, 2]  # bin 2's top-k 1: too few rows (NaN) never meets it
    # a bin too few rows reach at the largest budget: the largest budget when its survival is unknown
    assert _derive(survival, 0.9, unmeasured="largest")["topk"] == [1, 2, 4, 4]
    assert _derive(survival, 0.5, unmeasured="largest")["topk"] == [1, 1, 2, 4]
    # the rule adds to p5: a budget that keeps traces but misses tau stays out
    p5 = [[0.99, 0.99, 0.99, 0.99], [0.99, 0.99, 0.80, 0.99], [0.99, 0.99, 0.99, 0.99]]
    assert _derive(survival, 0.5, p5)["topk"] == [1, 1, 4, 4]


def test_survival_rule_rejects_bad_input():
    with pytest.raises(ValueError, match="min_survival: expected a value in \\[0, 1\\]"):
        _derive([[1.0]] * 3, 1.5)
    with pytest.raises(ValueError, match="survival_unmeasured: expected one of"):
        _derive([[1.0]] * 3, 0.9, unmeasured="dense")
    with pytest.raises(ValueError, match="needs survival of shape"):
        C.derive_topk(CFG, (1, 2, 4), np.full((3, 1), 0.99), np.full((3, 1), 50), 0.86, BASE, min_count=10,
                      min_survival=0.9)
    with pytest.raises(ValueError, match="needs horizon_mask"):
        C.calibrate(CFG, None, [[3, 4]], (1,), 0.86, BASE, SamplingParams(max_new_tokens=4), 1,
                    jax.random.PRNGKey(0), min_survival=0.9)


def test_calibrate_counts_survival_from_the_horizon_mask():
    """A horizon 10 tokens into every completion: every row reaches the bins those tokens are in and
    breaks in the last one, at every budget; a bin's share is measured where >= 16 rows reach it."""
    config = tiny_config(num_hidden_layers=2, vocab_size=64)
    params = init_params(config, seed=3)
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(3, 64, n)) for n in (20, 60, 100, 120) * 5]  # 20 prompts
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0)

    def first_ten(rollout, first):
        comp = rollout.completion_mask
        return comp & (np.cumsum(comp, axis=1) <= 10)

    res = C.calibrate(config, params, prompts, (0, 32), 0.5, BASE, sampling, 2, jax.random.PRNGKey(0),
                      min_count=10, min_survival=0.9, horizon_mask=first_ten)
    table = res["table"]
    lens = np.array([len(p) for p in prompts])
    # the 10 loss tokens sit at query positions len-1 .. len+8: bins of 64
    want_reached = np.zeros(len(table["bin_starts"]), int)
    for n in lens:
        for b in sorted({q // 64 for q in range(n - 1, n + 9)}):
            want_reached[b] += 2
    want_ended = 2 * np.bincount((lens + 8) // 64, minlength=len(want_reached))
    for i in range(2):
        assert table["reached"][i] == want_reached.tolist()
        share = [None if r < C.MIN_SURVIVAL_ROWS else 1.0 - e / r for r, e in zip(want_reached, want_ended)]
        assert table["survival"][i] == pytest.approx(share)
    # 40 rows: 20 reach bin 0 and 10 break there; 30 reach bin 1 and 20 break there
    assert table["survival"][0][:2] == pytest.approx([0.5, 1 / 3])
    assert res["schedule"].meta["min_survival"] == 0.9


def test_calibrate_counts_survival_on_one_greedy_trace_of_each_survival_prompt():
    """With ``survival_prompts`` the counts come from one greedy trace of each of them, decoded by the
    sparse actor (not the tail's sampled rows, twice each): horizons of 3 / 13 / 23 tokens by row
    give the counts by hand, whatever the batch split (the mask reads each batch's first row), and
    the table grows to the bin the survival rows reach beyond the tail's."""
    from sparrow_jax.rollout import generate

    config = tiny_config(num_hidden_layers=2, vocab_size=64)
    params, actor = init_params(config, seed=3), init_params(config, seed=4)
    rng = np.random.RandomState(1)
    prompts = [list(rng.randint(3, 64, n)) for n in (20, 30) * 4]  # the tail: positions < 64, bin 0 only
    survival_prompts = [list(rng.randint(3, 64, (40, 60, 100)[i % 3])) for i in range(36)]
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0)
    horizon = lambda row: 3 + 10 * ((row // 3) % 3)  # noqa: E731  every (length, horizon) pair, 4 rows each
    traces = []

    def first_tokens(rollout, first):
        traces.append((first, np.asarray(rollout.tokens)))
        comp = rollout.completion_mask
        rows = first + np.arange(comp.shape[0])[:, None]
        return comp & (np.cumsum(comp, axis=1) <= horizon(rows))

    res = C.calibrate(config, params, prompts, (0, 32), 0.5, BASE, sampling, 2, jax.random.PRNGKey(0),
                      min_count=10, min_survival=0.9, horizon_mask=first_tokens, survival_prompts=survival_prompts,
                      batch_size=8, sparse_params=actor)
    table = res["table"]
    assert table["bin_starts"] == [0, 64]  # bin 1: the survival rows' only
    want_reached, want_ended = np.zeros(2, int), np.zeros(2, int)
    for row, p in enumerate(survival_prompts):  # loss tokens at query positions len-1 .. len+h-2
        n, h = len(p), horizon(row)
        for b in sorted({q // 64 for q in range(n - 1, n + h - 1)}):
            want_reached[b] += 1
        want_ended[(n + h - 2) // 64] += 1  # every horizon ends before the 24-token completion
    assert want_reached.tolist() == [24, 20] and want_ended.tolist() == [16, 20]
    for i in range(2):
        assert table["reached"][i] == want_reached.tolist()
        assert table["survival"][i] == pytest.approx([1 / 3, 0.0])
    assert res["schedule"].meta["survival_decoding"] == "greedy"
    # the traces are the sparse actor's greedy ones under each budget, in row order
    greedy = dataclasses.replace(sampling, temperature=0.0)
    for j, k in enumerate((0, 32)):
        for first, tokens in traces[j * 5:(j + 1) * 5]:
            want = generate(config, actor, survival_prompts[first:first + 8], jax.random.PRNGKey(9), greedy,
                            schedule=C.fixed_schedule(BASE, k))
            np.testing.assert_array_equal(tokens, want.tokens)
    # another batch split counts the same
    one = C.measure_survival(config, actor, survival_prompts, C.fixed_schedule(BASE, 0), sampling, first_tokens,
                             batch_size=64)
    assert one["reached"][:2].tolist() == want_reached.tolist() and one["ended"][:2].tolist() == want_ended.tolist()
    with pytest.raises(ValueError, match="survival_prompts needs horizon_mask"):
        C.calibrate(config, params, prompts, (0,), 0.5, BASE, sampling, 1, jax.random.PRNGKey(0),
                    survival_prompts=survival_prompts)
    with pytest.raises(ValueError, match="at least one prompt"):
        C.measure_survival(config, params, [], BASE, sampling, first_tokens)


def test_a_bin_without_tail_tokens_keeps_the_budgets_the_survival_rule_allows():
    """Bin 2 has no tail tokens (inherited) but its survival is measured: the rule still raises it;
    bin 3, measured by neither, inherits bin 2's budget."""
    nan = np.nan
    survival = np.array([[0.99, 0.99, 0.50, nan], [0.99, 0.99, 0.90, nan], [0.99, 0.99, 0.95, nan]])
    count = np.array([[50, 50, 0, 0]] * 3)
    got = C.derive_topk(CFG, (1, 2, 4), np.full((3, 4), 0.99), count, 0.86, BASE, min_count=10, num_samples=4,
                        prompt_len=8, gen_len=4 * 64, survival=survival, min_survival=0.9)
    assert got["topk"] == [1, 1, 2, 2] and got["inherited_bins"] == [2, 3]
    off = C.derive_topk(CFG, (1, 2, 4), np.full((3, 4), 0.99), count, 0.86, BASE, min_count=10, num_samples=4,
                        prompt_len=8, gen_len=4 * 64, survival=survival, min_survival=0.0)
    assert off["topk"] == [1, 1, 1, 1]
