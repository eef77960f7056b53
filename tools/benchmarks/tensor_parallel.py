"""Tensor parallelism on this host: decode tok/s at TP=1 vs TP=N, and what the ranks say.

    .venv/bin/python -m tools.benchmarks.tensor_parallel --tp-sizes 1,3 --batch-sizes 1,4

    .venv/bin/python -m tools.benchmarks.tensor_parallel --tp-sizes 1,2 --smol-shaped 8

SmolLM2 (9 heads, 3 KV heads) splits over 1 or 3 ranks only: TP=2 is refused for it.
`--smol-shaped H` builds (once, under /tmp) SmolLM2 cut to its first H query heads and H / 4
KV heads (30 layers, hidden 576, MLP 1536, vocabulary 49152, tied, as SmolLM2), so TP=2 can
be timed on nearly the same compute.

For each size N it starts N processes forming a gloo group (as the worker ranks do), each
building the shipped ModelRunner on its shard with cores / N threads and driving it with the
same StepPlans (tools/benchmarks/step.py's driver; deterministic, so no broadcast is
needed). B requests are prefilled to --context tokens, then --steps decode steps are timed
on rank 0 (median), with the time and bytes of rank 0's collectives (the all-reduces after
the embedding, o_proj and down_proj, and the all-gather of the logits) over those steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from queue import Empty
from typing import Any


def _rank(rank: int, size: int, addr: str, args: argparse.Namespace, out: Any) -> None:
    from gpu_worker.distributed.sharding import threads_per_rank
    from gpu_worker.distributed.tensor_parallel import join_group
    from gpu_worker.runner.model_runner import ModelRunner
    from gpu_worker.runner.options import RunnerOptions
    from tools.benchmarks.step import start_batch

    tp = join_group(rank, size, addr, "cpu")
    options = RunnerOptions(
        num_threads=threads_per_rank(len(os.sched_getaffinity(0)), size),
        kv_cache_memory_gib=0.5,
        cpu_kernels=not args.no_cpu_kernels,
    )
    runner = ModelRunner(args.model, options, tp=tp)
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        drv, rids, _ = start_batch(runner, batch, args.context, 512, batch)
        drv.step({}, [(r, 1) for r in rids])  # warm-up
        tp.comm_s, tp.comm_bytes, tp.num_collectives = 0.0, 0, 0
        times = [drv.step({}, [(r, 1) for r in rids]) for _ in range(args.steps)]
        drv.finish(rids)
        step = statistics.median(times)
        rows.append(
            {
                "model": os.path.basename(args.model.rstrip("/")),
                "tp": size,
                "batch": batch,
                "decode_step_ms": step * 1e3,
                "decode_tok_s": batch / step,
                "comm_ms_per_step": tp.comm_s / args.steps * 1e3,
                "comm_share": tp.comm_s / sum(times),
                "collectives_per_step": tp.num_collectives / args.steps,
                "bytes_per_token": tp.comm_bytes / args.steps / batch,
            }
        )
    if rank == 0:
        out.put(rows)


def run_size(size: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    from services.worker_group import free_loopback_addr

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    addr = free_loopback_addr()
    procs = [ctx.Process(target=_rank, args=(r, size, addr, args, queue)) for r in range(size)]
    for p in procs:
        p.start()
    rows: list[dict[str, Any]] | None = None
    while rows is None:
        try:
            rows = queue.get(timeout=1.0)
        except Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise RuntimeError(f"a rank of TP={size} failed (its traceback is above)") from None
    for p in procs:
        p.join()
    return rows


def smol_shaped(num_heads: int) -> str:
    """SmolLM2 cut to `num_heads` query heads and num_heads / 4 KV heads (its first ones):
    the same sizes otherwise, and real weights (a random init decays into subnormal floats,
    which are many times slower on the CPU). Built once under /tmp; only for timing."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from common.prepare_model import prepare_default_model

    folder = Path(f"/tmp/shuttle-smol-shaped-{num_heads}h")
    if (folder / "model.safetensors").is_file():
        return str(folder)
    source = prepare_default_model()
    config = json.loads((source / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    q_rows, kv_rows = num_heads * head_dim, num_heads // 4 * head_dim
    weights = {}
    for path in sorted(source.glob("*.safetensors")):
        for name, t in load_file(str(path)).items():
            if name.endswith("q_proj.weight"):
                t = t[:q_rows]
            elif name.endswith(("k_proj.weight", "v_proj.weight")):
                t = t[:kv_rows]
            elif name.endswith("o_proj.weight"):
                t = t[:, :q_rows]
            weights[name] = t.contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"))
    config.update(
        num_attention_heads=num_heads, num_key_value_heads=num_heads // 4, head_dim=head_dim
    )
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="", help="HF folder (default: SmolLM2)")
    p.add_argument("--tp-sizes", default="1,3")
    p.add_argument("--batch-sizes", default="1,4")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--no-cpu-kernels", action="store_true")
    p.add_argument("--smol-shaped", type=int, default=0, help="heads of a SmolLM2-sized model")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if args.smol_shaped:
        args.model = smol_shaped(args.smol_shaped)
    if not args.model:
        from common.prepare_model import prepare_default_model

        args.model = str(prepare_default_model())
    load = os.getloadavg()[0]
    rows = []
    for size in (int(n) for n in args.tp_sizes.split(",")):
        start = time.perf_counter()
        for row in run_size(size, args):
            rows.append(row)
            print(
                f"TP={row['tp']} B={row['batch']:3d}: {row['decode_step_ms']:7.1f} ms/step, "
                f"{row['decode_tok_s']:7.1f} tok/s; collectives {row['comm_ms_per_step']:6.2f} "
                f"ms/step ({row['comm_share']:.0%}, {row['collectives_per_step']:.0f} calls), "
                f"{row['bytes_per_token']:.0f} B/token sent by rank 0",
                flush=True,
            )
        print(f"(TP={size} run took {time.perf_counter() - start:.0f} s)", flush=True)
    print(f"load average before: {load:.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_average": load, "context": args.context, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
