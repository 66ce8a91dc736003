"""Per-device memory of the train and decode steps for Qwen3 sizes, compiled on abstract shapes.

    python -m experiments.memory_report --model qwen3-4b --gen 32768 --batch 8 \
        --mesh data=1,fsdp=8,tensor=1 --hbm h200 --hbm v5p [--no-remat] [--micro-batches 2] [--f32]

Starts one process with as many fake CPU devices as the mesh needs (``--real-devices``:
this host's accelerators instead; no weights are allocated either way), compiles ``train_step`` and ``decode_step`` ahead of time and prints, per
model, the compiled bytes per device (arguments split into params / optimizer / KV cache,
temp = activations and scratch, peak) next to the closed-form estimate of
``sparrow_jax.parallel.memory``, and whether the peak fits each HBM size. ``--layers N``
compiles N and N+1 layers and extrapolates linearly to the model's depth (every layer
adds the same bytes), for when a full compile is too slow. ``--settings-table`` prints only
the estimate for remat on/off x bf16/f32 (no compile). Last line: one JSON object.

XLA:CPU's temp figure for the train step is far above what GPU/TPU need: its scheduler
does not keep rematerialisation's order (per-layer temp is the same with and without
remat) and it computes bf16 in f32; the argument figures (params, optimizer, KV cache)
are exact on every backend. Plan training memory with ``--real-devices`` on the target
or with the estimate.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from types import SimpleNamespace
from typing import Optional, Sequence

from absl import flags

from sparrow_jax.run.cli import parse_flags  # imports no JAX: the device count is set after parsing


def parse_mesh(text: str) -> dict[str, int]:
    """'data=1,fsdp=8,tensor=1' -> {'data': 1, 'fsdp': 8, 'tensor': 1} (missing axes are 1)."""
    shape = {"data": 1, "fsdp": 1, "tensor": 1}
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        if name not in shape or not value.isdigit() or int(value) < 1:
            raise SystemExit(f"--mesh: expected data=N,fsdp=N,tensor=N with N >= 1, got {part!r}")
        shape[name] = int(value)
    return shape


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_multi_string("model", None, "qwen3-0.6b|1.7b|4b|8b|14b; repeatable", flag_values=fv)
    flags.mark_flag_as_required("model", flag_values=fv)
    flags.DEFINE_integer("gen", 32768, "generated tokens per row", flag_values=fv)
    flags.DEFINE_integer("prompt", 256, "prompt tokens per row", flag_values=fv)
    flags.DEFINE_integer("batch", 8, "global rows per step", flag_values=fv)
    flags.DEFINE_string("mesh", "data=1,fsdp=8,tensor=1", "mesh axis sizes", flag_values=fv)
    flags.DEFINE_multi_string("hbm", None, "h100|h200|v5e|v5p|v6e; repeatable (default all)", flag_values=fv)
    flags.DEFINE_bool("no-remat", False, "keep every layer's activations", flag_values=fv)
    flags.DEFINE_integer("micro-batches", 1, "gradient accumulation steps", flag_values=fv)
    flags.DEFINE_bool("f32", False, "float32 activations and KV cache", flag_values=fv)
    flags.DEFINE_integer("layers", None, "compile N and N+1 layers, extrapolate to the depth", flag_values=fv)
    flags.DEFINE_bool("skip-train", False, "decode step only", flag_values=fv)
    flags.DEFINE_bool("real-devices", False, "compile for this host's accelerators (e.g. on an 8-GPU node) "
                      "instead of fake CPU devices", flag_values=fv)
    flags.DEFINE_bool("settings-table", False, "no compile: the estimate for remat x bf16 combinations, "
                      "and what fits where", flag_values=fv)


def parse_args(argv: Optional[Sequence[str]] = None) -> SimpleNamespace:
    """The flags as attributes (dashes -> underscores), plus ``remat`` / ``bf16``: not ``--no-remat`` / ``--f32``."""
    fv, _ = parse_flags(define_flags, argv, __doc__)
    args = SimpleNamespace(**{name.replace("-", "_"): fv[name].value for name in fv})
    args.remat, args.bf16 = not args.no_remat, not args.f32
    return args


def _scaled(small: dict, bigger: dict, layers: int, depth: int) -> dict:
    """Affine in the layer count: f(depth) = f(n) + (depth - n) * (f(n + 1) - f(n))."""
    return {k: small[k] + (depth - layers) * (bigger[k] - small[k]) for k in small}


def measure(model: str, settings, mesh, layers, train: bool = True) -> dict:
    """Compiled and analytic per-device bytes of the train and decode steps of one model."""
    from sparrow_jax.parallel import memory
    from sparrow_jax.rl import memory_plan as plan

    shape = dict(mesh.shape)
    depth = plan.model_config(model, settings.bf16).num_hidden_layers

    def compiled(kind: str, n: int):
        config = plan.model_config(model, settings.bf16, n)
        t0 = time.perf_counter()
        if kind == "train":
            exe, state = plan.compile_train_step(config, settings, mesh)
            parts = dict(params=memory.device_bytes(state.params), optimizer=memory.device_bytes(state.opt_state))
        else:
            exe, params, caches = plan.compile_decode_step(config, settings, mesh)
            parts = dict(params=memory.device_bytes(params), kv_cache=memory.device_bytes(caches))
        out = {**memory.compiled_bytes(exe), **parts}
        print(f"[memory_report] {model} {kind} ({n} layers) compiled in {time.perf_counter() - t0:.1f}s",
              file=sys.stderr, flush=True)
        return out

    def at_depth(kind: str) -> dict:
        if layers is None or layers >= depth:
            return compiled(kind, depth)
        return _scaled(compiled(kind, layers), compiled(kind, layers + 1), layers, depth)

    config = plan.model_config(model, settings.bf16)
    result = {"decode": {"compiled": at_depth("decode"), "analytic": memory.analytic_decode(config, settings, shape)}}
    if train:
        result["train"] = {"compiled": at_depth("train"), "analytic": memory.analytic_train(config, settings, shape)}
    return result


def settings_table(models: list[str], base, shape: dict[str, int], hbms: list[str]) -> list[dict]:
    """Closed-form train + decode peaks for remat on/off x bf16/f32 (cheap: no compile)."""
    import dataclasses

    from sparrow_jax.parallel import memory
    from sparrow_jax.rl.memory_plan import model_config

    rows = []
    print(f"estimate per device (GB), mesh {shape}, batch {base.batch}, T = {base.seq_len}, "
          f"micro_batches={base.micro_batches}")
    print(f"{'model':<11} {'remat':<6} {'act':<5} {'train':>7} {'decode':>7}  " + " ".join(f"{h:>5}" for h in hbms))
    for model in models:
        for remat in (True, False):
            for bf16 in (True, False):
                s = dataclasses.replace(base, remat=remat, bf16=bf16)
                config = model_config(model, bf16)
                train = memory.analytic_train(config, s, shape)["total"]
                decode = memory.analytic_decode(config, s, shape)["total"]
                fits = {h: max(train, decode) <= memory.HBM_GB[h] * memory.GB for h in hbms}
                rows.append(dict(model=model, remat=remat, bf16=bf16, train=train, decode=decode, fits=fits))
                print(f"{model:<11} {str(remat):<6} {'bf16' if bf16 else 'f32':<5} {train / memory.GB:7.1f} "
                      f"{decode / memory.GB:7.1f}  " + " ".join(f"{'yes' if fits[h] else 'NO':>5}" for h in hbms))
    return rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    shape = parse_mesh(args.mesh)
    devices = math.prod(shape.values())
    if "jax" in sys.modules:
        raise SystemExit("memory_report must set the fake device count before JAX starts; run it as a script")
    if not args.real_devices:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={devices}").strip()
    from sparrow_jax.parallel import make_mesh
    from sparrow_jax.parallel.memory import GB, HBM_GB, PlanSettings

    hbms = [h.lower() for h in (args.hbm or HBM_GB)]
    unknown = [h for h in hbms if h not in HBM_GB]
    if unknown:
        raise SystemExit(f"--hbm: unknown {unknown}; expected some of {sorted(HBM_GB)}")
    settings = PlanSettings(batch=args.batch, prompt_len=args.prompt, gen_len=args.gen, remat=args.remat,
                            micro_batches=args.micro_batches, bf16=args.bf16)
    if args.settings_table:
        rows = settings_table(args.model, settings, shape, hbms)
        print(json.dumps({"settings": {**settings.__dict__, "mesh": shape}, "estimates": rows}))
        return {"estimates": rows}
    mesh = make_mesh(shape)
    report = {"settings": {**settings.__dict__, "mesh": shape, "layers_compiled": args.layers}, "models": {}}
    print(f"per-device GB, mesh {shape}, batch {args.batch}, T = {settings.seq_len}, "
          f"{'bf16' if args.bf16 else 'f32'}, remat={args.remat}, micro_batches={args.micro_batches}")
    print(f"{'model':<11} {'step':<7} {'params':>7} {'optim':>7} {'kv':>7} {'temp':>7} {'peak':>7} "
          f"{'analytic':>8}  " + " ".join(f"{h:>5}" for h in hbms))
    for model in args.model:
        r = measure(model, settings, mesh, args.layers, train=not args.skip_train)
        for kind, v in r.items():
            c, a = v["compiled"], v["analytic"]
            v["fits"] = {h: c["peak"] <= HBM_GB[h] * GB for h in hbms}
            print(f"{model:<11} {kind:<7} {c['params'] / GB:7.2f} {c.get('optimizer', 0) / GB:7.2f} "
                  f"{c.get('kv_cache', 0) / GB:7.2f} {c['temp'] / GB:7.2f} {c['peak'] / GB:7.2f} "
                  f"{a['total'] / GB:8.2f}  " + " ".join(f"{'yes' if v['fits'][h] else 'NO':>5}" for h in hbms),
                  flush=True)
        report["models"][model] = r
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
