"""experiments.launch_local: N coordinated JAX processes on one machine (gloo CPU collectives).

A tiny probe module (not the trainer: a full grpo_tiny launch takes minutes, see
docs/scale_out.md for its figures) checks what the trainer relies on across processes:
one mesh over all processes' devices, host data placed as global arrays, process-spanning
arrays read back with ``host_array``; and that a failing process stops the run.
"""
import json
import os
import textwrap
from pathlib import Path

import pytest

from experiments.launch_local import launch, main, process_env

REPO = Path(__file__).resolve().parents[1]

_PROBE = textwrap.dedent(
    '''
    import json, os
    from sparrow_jax.parallel import initialize_distributed
    initialize_distributed()
    import jax, jax.numpy as jnp, numpy as np
    from jax.experimental import multihost_utils
    from sparrow_jax.parallel import host_array, is_primary, make_mesh, shard_batch
    jax.devices()  # both processes are up
    if os.environ.get("PROBE_FAIL") == os.environ["JAX_PROCESS_ID"]:
        os._exit(3)  # this process dies (no clean shutdown); the other waits in the barrier below
    multihost_utils.sync_global_devices("probe_start")
    mesh = make_mesh(dict(data=1, fsdp=4, tensor=2))
    rows = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    x = shard_batch(rows, mesh)  # rows over fsdp: each process holds half of them
    total = float(jax.jit(jnp.sum)(x))
    # process-local rows: this process's block of an 8-row batch in groups of 2, a global array from
    # the blocks, and a gather of per-row host values
    from sparrow_jax.parallel.process_rows import gather_rows, process_rows, rows_to_global
    start, stop = process_rows(mesh, 8, 2)
    built = rows_to_global(rows[start:stop], mesh, 8)
    try:
        process_rows(mesh, 8, 8)
        split_error = ""
    except ValueError as e:
        split_error = str(e)
    print("PROBE " + json.dumps(dict(pid=jax.process_index(), count=jax.process_count(), devices=jax.device_count(),
                                     local=jax.local_device_count(), addressable=x.is_fully_addressable,
                                     gathered_equal=bool(np.array_equal(host_array(x), rows)), total=total,
                                     primary=is_primary(), block=[start, stop],
                                     built_equal=bool(np.array_equal(host_array(built), rows)),
                                     built_sharding_equal=built.sharding == x.sharding,
                                     gathered_rows=gather_rows(rows[start:stop, 0]).tolist(),
                                     split_error=split_error)), flush=True)
    '''
)


@pytest.fixture()
def probe(tmp_path, monkeypatch):
    (tmp_path / "launch_probe.py").write_text(_PROBE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(REPO)]))
    monkeypatch.chdir(REPO)
    return "launch_probe"


def test_two_processes_share_one_mesh(probe, capfd):
    assert launch(2, 4, ["unused"], module=probe) == 0
    lines = [json.loads(line.split("PROBE ", 1)[1]) for line in capfd.readouterr().out.splitlines() if "PROBE " in line]
    assert sorted(r["pid"] for r in lines) == [0, 1]
    rows_col0 = [float(6 * i) for i in range(8)]
    for r in lines:
        assert (r["count"], r["devices"], r["local"]) == (2, 8, 4)
        assert not r["addressable"] and r["gathered_equal"]  # spans processes; an explicit gather reads it
        assert r["total"] == float(sum(range(48)))
        assert r["primary"] == (r["pid"] == 0)
        # each process holds one half of the rows: samples them, then builds the global batch from the halves
        assert r["block"] == [4 * r["pid"], 4 * r["pid"] + 4]
        assert r["built_equal"] and r["built_sharding_equal"]
        assert r["gathered_rows"] == rows_col0 and "splits groups of 8" in r["split_error"]


def test_a_failing_process_stops_the_run(probe, monkeypatch):
    monkeypatch.setenv("PROBE_FAIL", "1")
    # process 0 does not hang in its barrier: it is stopped (or JAX's coordination service aborts it)
    assert launch(2, 4, ["unused"], module=probe) != 0


def test_process_env_and_arguments():
    env = process_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --foo", "A": "1"}, 1, 2, 4, 1234)
    assert env["XLA_FLAGS"] == "--foo --xla_force_host_platform_device_count=4"
    assert (env["JAX_COORDINATOR_ADDRESS"], env["JAX_NUM_PROCESSES"], env["JAX_PROCESS_ID"]) == ("localhost:1234", "2", "1")
    assert env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] == "gloo" and env["A"] == "1"
    with pytest.raises(SystemExit):
        main(["--processes", "2"])  # no run arguments after --
    with pytest.raises(ValueError, match="--processes"):
        launch(0, 4, ["x"])
