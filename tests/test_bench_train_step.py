"""experiments.bench_train_step: both sides of the train step at tiny sizes, and its FLOP model."""
import json

import numpy as np
import pytest

from experiments.bench_train_step import forward_flops, main, quickstart_model, step_flops
from sparrow_jax.rollout import SparsitySchedule


def test_bench_runs_both_sides_and_prints_the_json_line(capsys):
    summary = main(["--lengths", "64", "--tokens_per_step", "128", "--repeats", "1", "--peak_size", "64"])
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line == json.loads(json.dumps(summary))
    (entry,) = line["results"]
    assert (entry["length"], entry["rows"]) == (64, 2) and line["matmul_peak_gflops"] > 0
    assert entry["speedup"] == pytest.approx(entry["reference"]["median_s"] / entry["fast"]["median_s"])
    assert entry["fast_fraction_of_peak"] == pytest.approx(entry["fast"]["gflops"] / line["matmul_peak_gflops"])
    (peak,) = entry["matmul_peak_paired_gflops"]  # one round: the fast step over the peak timed beside it
    assert entry["fast_fraction_of_peak_paired"] == pytest.approx(entry["fast"]["gflops"] / peak)


def test_flop_model_counts_causal_pairs_and_the_sparse_budget():
    config, layout = quickstart_model()
    no_keys = forward_flops(config, 1, 8, np.zeros((config.num_hidden_layers, 8)))
    one_pair = forward_flops(config, 1, 8, np.eye(config.num_hidden_layers, 8)[:1])
    assert one_pair - no_keys == 4 * config.num_attention_heads * config.head_dim
    # with every page in the budget the sparse scorer is one more dense forward pass (the fourth;
    # the fifth with the old policy's separate pass)
    wide = SparsitySchedule(topk=(1000,), **layout)
    causal = np.broadcast_to(np.arange(1.0, 257), (config.num_hidden_layers, 256))
    extra_logits = 256 * 2 * config.hidden_size * config.vocab_size
    assert step_flops(config, 1, 256, wide) == pytest.approx(4 * forward_flops(config, 1, 256, causal) + extra_logits)
    assert step_flops(config, 1, 256, wide, old_pass=True) == pytest.approx(
        5 * forward_flops(config, 1, 256, causal) + extra_logits)
    assert step_flops(config, 1, 256, SparsitySchedule(topk=(0,), **layout)) < step_flops(config, 1, 256, wide)


def test_flop_model_leaves_out_the_prompt_positions_no_output_reads():
    """With a prompt, positions before its last token are read by no loss or statistic: the dense
    passes' last layer computes only their keys and values, the sparse scorer nothing of them."""
    config, layout = quickstart_model()
    wide = SparsitySchedule(topk=(1000,), **layout)  # every page: the sparse scorer is a dense pass
    h, d, heads, kvh = config.hidden_size, config.head_dim, config.num_attention_heads, config.num_key_value_heads
    q_o, k_v, mlp, unembed = 2 * h * heads * d, 2 * h * kvh * d, 3 * h * config.intermediate_size, h * config.vocab_size
    f = 100 - 1  # a 100-token prompt: positions 0..98 are its dense prefill
    pairs = f * (f + 1) / 2  # causal (query, key) pairs among them
    last_layer = 2 * f * (q_o + mlp + unembed) + 4 * heads * d * pairs  # queries, MLP and logits there
    whole_pass = 2 * f * (config.num_hidden_layers * (q_o + k_v + mlp) + unembed) \
        + config.num_hidden_layers * 4 * heads * d * pairs
    skipped = 3 * last_layer + whole_pass + 2 * f * unembed  # dense fwd + bwd, sparse scorer, extra logits
    assert step_flops(config, 1, 256, wide, prompt=100) == pytest.approx(step_flops(config, 1, 256, wide) - skipped)


def test_bad_flag_names_the_flag():
    with pytest.raises(SystemExit):
        main(["--repeats", "0"])
