"""Start N JAX processes on this machine, wired exactly like a multi-host job (CPU devices, gloo collectives).

    python -m experiments.launch_local --processes 2 --devices-per-process 4 -- \
        --config configs/grpo_tiny.py --config.mesh.fsdp=4 --config.mesh.tensor=2

Every process runs ``python -m experiments.run <arguments after -->`` with
``JAX_COORDINATOR_ADDRESS=localhost:<port>``, ``JAX_NUM_PROCESSES=N``, ``JAX_PROCESS_ID=i``
(``sparrow_jax.parallel.initialize_distributed`` reads them), ``--devices-per-process``
fake CPU devices each and gloo CPU collectives, so the mesh spans N x devices devices in N
address spaces: what a TPU pod slice or a multi-node GPU job does, on one machine. Output
lines are prefixed ``[p<i>]``. If one process fails the others are stopped and the exit
status is non-zero; rerunning the same command resumes from the last checkpoint.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from typing import Optional, Sequence

from absl import flags

from sparrow_jax.run.cli import parse_flags, usage_error


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def process_env(base: dict, process_id: int, processes: int, devices: int, port: int) -> dict:
    """The environment of process ``process_id``: coordinator, process count / id, CPU devices, gloo."""
    flags = " ".join(f for f in base.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count"))
    return dict(base, JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES=str(processes),
                JAX_PROCESS_ID=str(process_id), JAX_PLATFORMS="cpu", JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
                XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}".strip())


def _pump(stream, prefix: str) -> None:
    for line in iter(stream.readline, ""):
        sys.stdout.write(f"{prefix} {line}")
        sys.stdout.flush()


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGKILL the running processes: JAX's distributed runtime catches SIGTERM (preemption
    notice) and would keep waiting in a collective; checkpoints commit atomically, so a kill
    loses at most the steps since the last one."""
    for p in procs:
        if p.poll() is None:
            p.kill()


def launch(processes: int, devices: int, run_args: list[str], port: Optional[int] = None,
           module: str = "experiments.run") -> int:
    """Run ``python -m module run_args`` in ``processes`` coordinated processes; the first non-zero exit status."""
    if processes < 1 or devices < 1:
        raise ValueError(f"--processes and --devices-per-process must be >= 1, got {processes} and {devices}")
    port = port or free_port()
    procs, pumps = [], []
    for i in range(processes):
        p = subprocess.Popen([sys.executable, "-m", module, *run_args], text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, env=process_env(os.environ, i, processes, devices, port))
        procs.append(p)
        print(f"[launch_local] process {i}/{processes}: pid {p.pid}, {devices} CPU devices, "
              f"coordinator localhost:{port}", flush=True)
        pumps.append(threading.Thread(target=_pump, args=(p.stdout, f"[p{i}]"), daemon=True))
        pumps[-1].start()
    status = 0
    try:
        while None in [p.poll() for p in procs]:  # a list: poll every process each round
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed:  # a lost peer would block the others in their next collective: stop them
                status = failed[0]
                _stop(procs)
            try:
                procs[0].wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
    except KeyboardInterrupt:
        _stop(procs)
        raise
    for t in pumps:
        t.join(timeout=5)
    return status or next((p.returncode for p in procs if p.returncode), 0)


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_integer("processes", 2, "JAX processes (hosts) to start", flag_values=fv)
    flags.DEFINE_integer("devices-per-process", 4, "fake CPU devices per process", flag_values=fv)
    flags.DEFINE_integer("port", None, "coordinator port (default: a free one)", flag_values=fv)
    flags.DEFINE_string("module", "experiments.run", "entry module every process runs", flag_values=fv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # split here, not by absl: the run's own flags after -- are not ours to parse
    own, run_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args, _ = parse_flags(define_flags, own, __doc__)
    if not run_args:
        usage_error("give the run's arguments after --, e.g. -- --config configs/grpo_tiny.py")
    return launch(args.processes, args["devices-per-process"].value, run_args, args.port, args.module)


if __name__ == "__main__":
    sys.exit(main())
