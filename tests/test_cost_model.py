"""Cost model: formulas against hand computations, optimiser against brute force, report I/O."""
import itertools
import json

import numpy as np
import pytest

from sparrow_jax import cost_model as cm
from sparrow_jax.models.config import Qwen3Config
from sparrow_jax.rollout.schedule import SparsitySchedule

# A model small enough to count by hand:
#   attn = h*dh*(2H + 2KV) + 2*dh = 4*2*(4+2) + 4 = 52, mlp = 3*h*I = 96, layer = 52+96+2h = 156,
#   params = 2*156 + vocab*h (tied: once) + h = 312 + 40 + 4 = 356; kv width = KV*dh = 2.
HAND = Qwen3Config(vocab_size=10, hidden_size=4, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=2, intermediate_size=8, tie_word_embeddings=True)
# peak 1000 FLOP/s, 100 B/s, 1 byte per element -> I = 1000*1/100 = 10
HW = cm.Hardware("hand", peak_flops=1000.0, mem_bandwidth=100.0, bytes_per_element=1)


def test_param_counts_by_hand():
    assert HAND.num_params() == 356
    assert cm.matmul_params(HAND) == 356  # tied: the embedding is the LM head
    untied = HAND.replace(tie_word_embeddings=False)
    assert untied.num_params() == 396  # second vocab*h matrix
    assert cm.matmul_params(untied) == 356  # the input lookup is not a matmul
    assert cm.kv_width(HAND) == 2


def test_dense_cost_by_hand():
    # N=1, prompt 2, gen 3 -> decode steps at positions 2, 3 attending over 3, 4 tokens.
    # step flops = 2*356 + L*4*H*dh*ctx = 712 + 32*ctx            -> 808, 840
    # step bytes = 356 (weights) + 4 (embed row) + 2*kvw*L (KV write) = 368, + L*2*kvw*ctx = 8*ctx
    #            -> 392, 400
    # prefill flops = 2*356*2 + 16*L*(1+2) = 1424 + 96 = 1520; bytes = 356 + 2*2*kvw*L = 372
    c = cm.dense_rollout_cost(HAND, num_samples=1, prompt_len=2, gen_len=3, hardware=HW)
    assert c.flops == pytest.approx(808 + 840 + 1520)
    assert c.bytes == pytest.approx(392 + 400 + 372)
    assert c.kv_bytes == pytest.approx(8 * 3 + 8 * 4)
    assert c.compute_time_s == pytest.approx((808 + 840) / 1000)
    assert c.memory_time_s == pytest.approx((392 + 400) / 100)
    assert c.prefill_time_s == pytest.approx(3.72)  # memory-bound: 372 / 100
    assert c.decode_time_s == pytest.approx(3.92 + 4.00)  # max per step: memory-bound
    assert c.time_s == pytest.approx(3.72 + 7.92)
    assert c.tokens == 3
    s = cm.dense_rollout_cost(HAND, num_samples=1, prompt_len=2, gen_len=3, hardware=HW, combine="sum")
    assert s.decode_time_s == pytest.approx(0.808 + 3.92 + 0.840 + 4.00)


def test_step_time_matches_rollout_sum():
    # dense steps of test_dense_cost_by_hand: 3.92 s and 4.00 s (memory-bound)
    np.testing.assert_allclose(cm.step_time_s(HAND, None, [2, 3], num_samples=1, hardware=HW), [3.92, 4.00])
    sched = SparsitySchedule((1,), page_size=2, dense_layers=(0,))
    np.testing.assert_allclose(cm.step_time_s(HAND, sched, [9, 10, 11], num_samples=1, hardware=HW),
                               [4.60, 4.70, 4.78])


def test_relative_rollout_cost_by_hand():
    # prompt 10, gen 3: decode steps at positions 10, 11. Sparse (topk 1, page 2, layer 0 dense) step times
    # 4.70, 4.78 s (test_step_time_matches_rollout_sum); dense 368 + 8*ctx bytes, ctx 11, 12 -> 4.56, 4.64 s.
    # Prefill (both): flops 2*356*10 + 4*H*dh*L*10*11/2 = 7120 + 1760 = 8880 -> 8.88 s (compute-bound).
    sched = SparsitySchedule((1,), page_size=2, dense_layers=(0,))
    kw = dict(num_samples=1, prompt_len=10, gen_len=3, hardware=HW)
    assert cm.relative_rollout_cost(HAND, sched, **kw) == pytest.approx((8.88 + 4.70 + 4.78) / (8.88 + 4.56 + 4.64))
    assert cm.relative_rollout_cost(HAND, None, **kw) == 1.0
    with pytest.raises(ValueError, match="gen_len"):
        cm.relative_rollout_cost(HAND, None, num_samples=1, prompt_len=10, gen_len=0)


def test_weights_amortised_kv_per_sequence():
    # Doubling the batch doubles KV traffic but not weight traffic.
    kw = dict(prompt_len=2, gen_len=3, hardware=HW)
    one = cm.dense_rollout_cost(HAND, num_samples=1, **kw)
    two = cm.dense_rollout_cost(HAND, num_samples=2, **kw)
    assert two.weight_bytes == one.weight_bytes == 3 * 356
    assert two.kv_bytes == pytest.approx(2 * one.kv_bytes)
    # per decode step bytes: 356 + N*(12 + 8*ctx)
    assert two.memory_time_s == pytest.approx(sum(356 + 2 * (12 + 8 * c) for c in (3, 4)) / 100)


def test_schedule_bins_and_tokens_read_by_hand():
    s = SparsitySchedule((1, 2, 3), bin_width=10, page_size=2, dense_layers=())
    np.testing.assert_array_equal(s.topk_at(np.array([0, 9, 10, 25, 100])), [1, 1, 2, 3, 3])
    np.testing.assert_array_equal(s.budget_tokens_at(np.array([0, 10])), [8, 10])  # (k+3)*2
    # topk 1, page 2: ctx 10 -> 5 pages (last holds 2): first + 1 + 1 full + 2 = 8 tokens
    # ctx 11 -> 6 pages (last holds 1): 6 + 1 = 7; ctx 12 -> 8; ctx 8 -> 4 pages <= 4: dense = 8
    pos = np.array([9, 10, 11, 7, 3])
    s1 = SparsitySchedule((1,), page_size=2, dense_layers=())
    np.testing.assert_array_equal(cm.sparse_tokens_read(s1, pos), [8, 7, 8, 8, 4])
    np.testing.assert_array_equal(cm.scored_pages(s1, pos), [2, 3, 3, 0, 0])


def test_sparse_cost_by_hand():
    # page 2, topk 1 (+3 reserved), layer 0 dense, layer 1 sparse; N=1, prompt 9, gen 4
    # decode positions 9, 10, 11: ctx 10, 11, 12; sparse reads 8, 7, 8; scored pages 2, 3, 3
    # attended tokens over layers = ctx + read = 18, 18, 20
    # flops = 712 + 16*tok + pages*2*kvw = 1008, 1012, 1044
    # bytes = 368 + 2*kvw*tok + pages*(kvw*1 + 2*4*KV) = 368 + 4*tok + 10*pages = 460, 470, 478
    sched = SparsitySchedule((1,), page_size=2, dense_layers=(0,))
    c = cm.sparse_rollout_cost(HAND, sched, num_samples=1, prompt_len=9, gen_len=4, hardware=HW)
    assert c.compute_time_s == pytest.approx((1008 + 1012 + 1044) / 1000)
    assert c.memory_time_s == pytest.approx((460 + 470 + 478) / 100)
    assert c.score_bytes == pytest.approx(80)
    assert c.kv_bytes == pytest.approx(4 * (18 + 18 + 20))
    assert c.decode_time_s == pytest.approx((460 + 470 + 478) / 100)
    # prefill is dense and shared with the dense rollout
    d = cm.dense_rollout_cost(HAND, num_samples=1, prompt_len=9, gen_len=4, hardware=HW)
    assert c.prefill_time_s == d.prefill_time_s
    # Quest scoring reads two vectors per page and doubles scoring FLOPs
    q = cm.sparse_rollout_cost(HAND, sched, num_samples=1, prompt_len=9, gen_len=4, hardware=HW,
                               selector="quest")
    assert q.score_bytes == pytest.approx((2 + 3 + 3) * (2 * 2 + 8))


def test_budget_covering_context_equals_dense():
    cfg = Qwen3Config.preset("Qwen3-1.7B")
    kw = dict(num_samples=4, prompt_len=100, gen_len=500, hardware="H100")
    big = cm.fixed_budget_schedule(1000)  # 16K tokens > 600 context
    assert cm.sparse_rollout_cost(cfg, big, **kw).time_s == pytest.approx(cm.dense_rollout_cost(cfg, **kw).time_s)
    assert cm.predicted_speedup(cfg, big, **kw) == pytest.approx(1.0)
    # all layers dense: also dense, whatever the budget
    all_dense = cm.fixed_budget_schedule(1, dense_layers=range(cfg.num_hidden_layers))
    assert cm.predicted_speedup(cfg, all_dense, **kw) == pytest.approx(1.0)


def test_speedup_grows_with_length_and_batch():
    cfg = Qwen3Config.preset("Qwen3-4B")
    sched = cm.fixed_budget_schedule(61)
    sp = [cm.predicted_speedup(cfg, sched, num_samples=n, prompt_len=150, gen_len=g)
          for n, g in ((8, 4096), (8, 16384), (32, 16384))]
    assert 1.0 < sp[0] < sp[1] < sp[2]  # KV share grows with length and with batch (weights amortised)


def test_paper_formulas_by_hand():
    # P = 356, D = kvw*L = 4, r = 2, I = 10; N = 2, Lin = 3, Lout = 4
    # comp = 2*356*2*4 + 2*(6+4)*4*2*4 = 5696 + 640; mem = 2*3*4*4 + 2*16*4 = 96 + 128
    kw = dict(num_samples=2, prompt_len=3, gen_len=4, hardware=HW)
    assert cm.paper_dense_cost(HAND, **kw) == pytest.approx(6336 + 10 * 224)
    # B = 5, S = 2: noscore = 5696 + 2*2*2*4*5*4 + 2*10*2*4*5*4 = 5696 + 640 + 3200
    # scoring = 2*2*3*4*4 + 2*2*4*16/4 + 2*10*3*4*4 + 10*2*4*16/4 = 192 + 64 + 960 + 320
    assert cm.paper_sparse_cost(HAND, budget_tokens=5, page_size=2, **kw) == pytest.approx(9536 + 1536)
    # a schedule generalises B*Lout to the sum of nominal budgets over decode positions (3 steps)
    sched = cm.fixed_budget_schedule(1, page_size=2)  # budget 8 tokens; sum = 24 = (24/4)*Lout
    assert cm.paper_sparse_cost(HAND, sched, **kw) == pytest.approx(
        cm.paper_sparse_cost(HAND, budget_tokens=6, page_size=2, **kw))
    assert HW.flops_per_element_load == 10


def test_paper_presets_and_table2_acceptance():
    sched = cm.paper_schedule("qwen3-4b-0.86")
    assert list(sched.topk)[:4] == [29, 45, 61, 77]
    assert (sched.page_size, sched.bin_width, sched.reserved, sched.dense_layers) == (16, 2000, 3, (0, 1))
    measured = {"1.7B": 2.21, "4B": 2.41, "8B": 2.06, "14B": 1.49}
    pred = {m: cm.predicted_speedup(Qwen3Config.preset(f"Qwen3-{m}"), cm.paper_schedule(f"qwen3-{m.lower()}-0.86"),
                                    num_samples=8, prompt_len=150, gen_len=32768, hardware="H200")
            for m in measured}
    for m in measured:
        assert 1 / 1.5 <= pred[m] / measured[m] <= 1.5, (m, pred[m], measured[m])
    assert pred["4B"] > pred["8B"] > pred["14B"]


def _brute_force(cfg, table, tau, **kw):
    ks = sorted(table)
    nb = len(table[ks[0]])
    cost = cm.bin_costs(cfg, ks, nb, **kw)
    best = None
    for combo in itertools.product(range(len(ks)), repeat=nb):
        if any(combo[i] > combo[i + 1] for i in range(nb - 1)):
            continue
        if any(table[ks[j]][b] < tau for b, j in enumerate(combo)):
            continue
        t = sum(cost[j, b] for b, j in enumerate(combo))
        if best is None or t < best[0] - 1e-15:
            best = (t, tuple(ks[j] for j in combo))
    return best


def test_optimiser_matches_brute_force_and_forward_cost():
    cfg = Qwen3Config.preset("Qwen3-1.7B")
    kw = dict(num_samples=8, prompt_len=150, gen_len=6000, hardware="H200", bin_width=1500)
    # p5 rises with budget and falls with position; bin 2 is noisy (topk 61 better than 93)
    table = {29: [0.90, 0.84, 0.80, 0.70], 61: [0.95, 0.88, 0.87, 0.80],
             93: [0.97, 0.92, 0.85, 0.86], 125: [0.98, 0.95, 0.93, 0.90]}
    for tau in (0.80, 0.86, 0.89):
        sched, t = cm.optimise_schedule(cfg, table, tau, **kw)
        bt, btopk = _brute_force(cfg, table, tau, **kw)
        assert sched.topk == btopk and t == pytest.approx(bt)
        assert list(sched.topk) == sorted(sched.topk)
        fwd = cm.sparse_rollout_cost(cfg, sched, num_samples=8, prompt_len=150, gen_len=6000, hardware="H200")
        assert fwd.decode_time_s == pytest.approx(t)  # bin costs add up to the forward model
    # tau 0.86 by hand: bin 0 -> 29 (0.90); bin 1 -> 61 (0.88); bin 2 -> 61 (0.87; 93 fails at 0.85);
    # bin 3 -> 93 (0.86)
    assert cm.optimise_schedule(cfg, table, 0.86, **kw)[0].topk == (29, 61, 61, 93)
    # monotonicity binds: with 61 failing bin 1, bin 1 needs 93, so bin 2 cannot go back to 61 and
    # 93 fails there (0.85): 125; bin 3 then stays at 125
    table[61][1] = 0.84
    assert cm.optimise_schedule(cfg, table, 0.86, **kw)[0].topk == (29, 93, 125, 125)
    assert _brute_force(cfg, table, 0.86, **kw)[1] == (29, 93, 125, 125)


def test_optimiser_errors():
    cfg = HAND
    kw = dict(num_samples=1, prompt_len=4, gen_len=40, hardware=HW, page_size=2, bin_width=10, dense_layers=())
    with pytest.raises(ValueError, match="bin 1"):
        cm.optimise_schedule(cfg, {1: [0.9, 0.5], 2: [0.9, 0.6]}, 0.8, **kw)
    with pytest.raises(ValueError, match="non-decreasing"):  # bin 0 needs 2, bin 1 only 1 works
        cm.optimise_schedule(cfg, {1: [0.5, 0.9], 2: [0.9, 0.5]}, 0.8, **kw)
    with pytest.raises(ValueError, match="same number of bins"):
        cm.optimise_schedule(cfg, {1: [0.9], 2: [0.9, 0.9]}, 0.8, **kw)
    with pytest.raises(ValueError, match="empty"):
        cm.optimise_schedule(cfg, {}, 0.8, **kw)


def test_pareto_page_sizes():
    cfg = Qwen3Config.preset("Qwen3-1.7B")
    kw = dict(num_samples=8, prompt_len=150, gen_len=4000, hardware="H200", dense_layers=(0, 1))
    # same budgets in tokens (128*k pages of 16 ~ 16*k pages of 128); page 16 has better p5
    calib = {16: {13: [0.85, 0.80], 29: [0.92, 0.88]},
             64: {1: [0.70, 0.65], 5: [0.86, 0.81]}}
    res = cm.pareto_page_sizes(cfg, calib, taus=(0.8, 0.87, 0.99), **kw)
    pts = res["points"]
    assert len(pts) == 4
    for p in pts:  # independent Pareto check
        dominated = any(q["time_s"] <= p["time_s"] and q["p5_min"] >= p["p5_min"]
                        and (q["time_s"] < p["time_s"] or q["p5_min"] > p["p5_min"]) for q in pts)
        assert p["pareto"] == (not dominated)
        assert p["budget_tokens"] == (p["topk"] + 3) * p["page_size"]
    assert res["by_tau"][0.99]["best"] is None
    assert res["by_tau"][0.87]["time_s"][64] is None and res["by_tau"][0.87]["best"] == 16
    t80 = res["by_tau"][0.8]["time_s"]
    assert res["by_tau"][0.8]["best"] == min(t80, key=t80.get)
    owners = {p["page_size"] for p in pts if p["pareto"]}
    assert res["dominant"] == (owners.pop() if len(owners) == 1 else None)
    with pytest.raises(ValueError, match="calibration"):
        cm.pareto_page_sizes(cfg, {}, **kw)


def test_bad_inputs_name_the_field(tmp_path):
    sched = cm.fixed_budget_schedule(1)
    with pytest.raises(ValueError, match="unknown hardware"):
        cm.dense_rollout_cost(HAND, num_samples=1, prompt_len=2, gen_len=3, hardware="A100x")
    with pytest.raises(ValueError, match="gen_len"):
        cm.dense_rollout_cost(HAND, num_samples=1, prompt_len=2, gen_len=0, hardware=HW)
    with pytest.raises(ValueError, match="num_samples"):
        cm.sparse_rollout_cost(HAND, sched, num_samples=0, prompt_len=2, gen_len=3, hardware=HW)
    with pytest.raises(ValueError, match="dense_layers"):  # HAND has 2 layers; (0, 1) ok, 5 not
        cm.sparse_rollout_cost(HAND, cm.fixed_budget_schedule(1, dense_layers=(5,)), num_samples=1,
                               prompt_len=2, gen_len=3, hardware=HW)
    with pytest.raises(ValueError, match="combine"):
        cm.dense_rollout_cost(HAND, num_samples=1, prompt_len=2, gen_len=3, hardware=HW, combine="avg")
    with pytest.raises(ValueError, match="selector"):
        cm.sparse_rollout_cost(HAND, sched, num_samples=1, prompt_len=2, gen_len=3, hardware=HW, selector="x")
    with pytest.raises(ValueError, match="page_size"):
        SparsitySchedule((1,), page_size=0)
    with pytest.raises(ValueError, match="peak_flops"):
        cm.Hardware("x", 0.0, 1.0)
    with pytest.raises(ValueError, match="qwen3-4b-0.99"):
        cm.paper_schedule("qwen3-4b-0.99")


def test_hardware_presets():
    for name in ("H200", "H100", "TPU v5e", "TPU v6e", "cpu"):
        hw = cm.HARDWARE[name]
        assert hw.peak_flops > 0 and hw.mem_bandwidth > 0
    assert cm.HARDWARE["H200"].mem_bandwidth > cm.HARDWARE["H100"].mem_bandwidth
    cpu = cm.cpu_hardware(50e9, 10e9)
    assert cpu.bytes_per_element == 4 and cpu.flops_per_element_load == pytest.approx(20.0)


def test_cost_report_reads_bench_json(tmp_path, capsys):
    from experiments import cost_report
    bench = tmp_path / "bench_rollout.json"
    bench.write_text(json.dumps({"dense_tok_s": 100.0, "sparse_tok_s": 250.0, "sparse_over_dense": 2.5}) + "\n")
    out = cost_report.main(["--bench_json", str(bench)])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["cpu"]["measured"] == 2.5 and last == json.loads(json.dumps(out))
    assert last["cpu"]["ratio"] == pytest.approx(last["cpu"]["predicted"] / 2.5, rel=1e-2)
    assert [r["model"] for r in last["paper"]] == ["Qwen3-1.7B", "Qwen3-4B", "Qwen3-8B", "Qwen3-14B"]
    for r in last["paper"]:
        assert r["ratio"] == pytest.approx(r["predicted"] / r["measured"], rel=1e-2)
    out = cost_report.main(["--bench_json", str(tmp_path / "missing.json")])
    assert out["cpu"]["measured"] is None and "missing.json" in out["cpu"]["note"]
