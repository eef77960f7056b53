"""Regenerate docs/benchmarks.md: run every benchmark it reports, then render it.

    make bench-docs                                   # everything (about 30 minutes)
    .venv/bin/python -m tools.benchmarks.docs --only synthetic,parity
    .venv/bin/python -m tools.benchmarks.docs --render     # the page from the JSON already there

Each step writes docs/bench/<step>.json (and PNG plots beside it) with the machine's load
average before and after, since this CPU is shared and its figures move with the load;
tools/benchmarks/docs_render.py turns the JSON files into the page.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "docs" / "bench"
MIXED = ["--num-prompts", "64", "--input-len", "32:512", "--output-len", "16:256", "--seed", "0"]
SWEEP = ["--num-prompts", "24", "--input-len", "64:256", "--output-len", "32:128", "--seed", "1"]


def _bench(name: str, argv: list[str]) -> dict[str, Any]:
    from tools.benchmarks import cli

    out = OUT / f"{name}.json"
    cli.main([*argv, "--json", str(out), "--no-progress"])
    result = json.loads(out.read_text())
    from tools.benchmarks.plots import plot_result

    plot_result(result, OUT, prefix=f"{name}_")
    return result


def step_times() -> dict[str, Any]:
    """ms per decode step at B = 1, 16, 64 (context 300), fp32 and bf16, worker alone."""
    import subprocess

    rows = {}
    for dtype in ("float32", "bfloat16"):
        path = OUT / f"step_{dtype}.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "tools.benchmarks.step",
                "--batch-sizes",
                "1,16,64",
                "--steps",
                "8",
                "--dtype",
                dtype,
                "--json",
                str(path),
            ],
            check=True,
            cwd=REPO,
        )
        rows[dtype] = json.loads(path.read_text())
    return rows


def mixed() -> dict[str, Any]:
    return _bench(
        "mixed_fp32",
        [
            *MIXED,
            "--threads",
            "2",
            "--baseline",
            "hf-static,hf-sequential",
            "--hf-sequential-subset",
            "8",
        ],
    )


def mixed_bf16() -> dict[str, Any]:
    return _bench(
        "mixed_bf16",
        [
            *MIXED,
            "--threads",
            "2",
            "--dtype",
            "bfloat16",
            "--baseline",
            "hf-static,hf-sequential",
            "--hf-sequential-subset",
            "8",
        ],
    )


def sweep() -> dict[str, Any]:
    return _bench(
        "sweep_fp32",
        [
            *SWEEP,
            "--threads",
            "2",
            "--sweep-rates",
            "0.5,1,2,4",
            "--slo-ttft-ms",
            "2000",
            "--slo-tpot-ms",
            "250",
        ],
    )


def synthetic() -> dict[str, Any]:
    flags = "--model synthetic --max-num-seqs 256 --max-num-batched-tokens 8192"
    capacity = _bench(
        "synthetic_256",
        [
            "--server-flags",
            flags,
            "--num-prompts",
            "512",
            "--concurrency",
            "256",
            "--input-len",
            "32",
            "--output-len",
            "256",
            "--threads",
            "2",
        ],
    )
    low = _bench(
        "synthetic_c1",
        [
            "--server-flags",
            flags,
            "--num-prompts",
            "100",
            "--concurrency",
            "1",
            "--input-len",
            "32",
            "--output-len",
            "16",
            "--threads",
            "2",
        ],
    )
    return {
        "capacity": capacity["shuttle"]["output_tok_s"],
        "ttft_p50_ms": low["shuttle"]["ttft_s"]["median"] * 1e3,
    }


def peers(dtype: str = "float32", name: str = "") -> dict[str, Any]:
    """shuttle, vLLM and llama.cpp on the same workloads (needs tools/peers/setup.sh)."""
    from tools.benchmarks import cli

    out = OUT / f"{name or ('peers' if dtype == 'float32' else 'peers_bf16')}.json"
    args = ["--compare", "shuttle,vllm,llamacpp", "--threads", "2", "--dtype", dtype]
    cli.main([*args, "--json", str(out)])
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def peers_bf16() -> dict[str, Any]:
    """The same three servers in bfloat16 (each one's best dtype on a CPU with avx512_bf16)."""
    return peers("bfloat16")


def peers_avx2() -> dict[str, Any]:
    """The float32 comparison on a CPU without AVX-512 (the machine kind issue 16 came from),
    kept beside the AVX-512 sitting's: the same machine kind, a different CPU."""
    from common.cpu_features import cpu_flags

    if "avx512f" in cpu_flags():
        raise SystemExit("peers_avx2: this CPU has AVX-512 (run `--only peers` here)")
    return peers("float32", "peers_avx2")


def parity() -> dict[str, Any]:
    from tools.benchmarks import bf16_parity

    result = bf16_parity.measure()
    (OUT / "bf16_parity.json").write_text(json.dumps(result, indent=2))
    return result


def data_parallel() -> dict[str, Any]:
    """2 replicas: prefix routing (bounds 1.25 and 2) against round-robin, one sitting."""
    from tools.benchmarks import data_parallel as dp

    out = OUT / "data_parallel.json"
    dp.main(["--load-bounds", "1.25,2", "--json", str(out)])
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def tensor_parallel() -> dict[str, Any]:
    """TP=1 vs 3 on SmolLM2, TP=1 vs 2 on a SmolLM2-sized 8-head model; collectives timed."""
    from tools.benchmarks import tensor_parallel as tp

    path, rows = OUT / "tensor_parallel.json", []
    for flags in (["--tp-sizes", "1,3"], ["--tp-sizes", "1,2", "--smol-shaped", "8"]):
        tp.main([*flags, "--batch-sizes", "1,4", "--json", str(path)])
        rows += json.loads(path.read_text())["rows"]
    result = {**json.loads(path.read_text()), "rows": rows}
    path.write_text(json.dumps(result, indent=2))
    return result


def lora() -> dict[str, Any]:
    """8 adapters of rank 16 round-robin against the base model, one server, one sitting."""
    from tools.benchmarks import lora as lora_bench

    out = OUT / "lora_serving.json"
    lora_bench.main(["--adapters", "8", "--rank", "16", "--json", str(out)])
    result: dict[str, Any] = json.loads(out.read_text())
    return result


STEPS: dict[str, Callable[[], dict[str, Any]]] = {
    "step": step_times,
    "mixed": mixed,
    "mixed_bf16": mixed_bf16,
    "sweep": sweep,
    "synthetic": synthetic,
    "parity": parity,
    "peers": peers,
    "peers_bf16": peers_bf16,
    "peers_avx2": peers_avx2,
    "data_parallel": data_parallel,
    "tensor_parallel": tensor_parallel,
    "lora": lora,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help=f"comma list of steps: {','.join(STEPS)}")
    p.add_argument("--render", action="store_true", help="only render the page from JSON")
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    OUT.mkdir(parents=True, exist_ok=True)
    loads: dict[str, Any] = {}
    loads_path = OUT / "load.json"
    if loads_path.is_file():
        loads = json.loads(loads_path.read_text())
    if not args.render:
        default = [n for n in STEPS if n != "peers_avx2"]  # its own machine: --only
        for name in [n for n in args.only.split(",") if n] or default:
            before, start = os.getloadavg(), time.time()
            print(f"== {name}", flush=True)
            STEPS[name]()
            loads[name] = {
                "load_before": before,
                "load_after": os.getloadavg(),
                "minutes": round((time.time() - start) / 60, 1),
                "date": time.strftime("%Y-%m-%d %H:%M"),
            }
            loads_path.write_text(json.dumps(loads, indent=2))
    from tools.benchmarks.docs_render import render

    (REPO / "docs" / "benchmarks.md").write_text(render(OUT))
    print(f"wrote {REPO / 'docs' / 'benchmarks.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
