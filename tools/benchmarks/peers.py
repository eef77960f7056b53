"""tools/bench --compare: shuttle, vLLM and llama.cpp on the same workloads, in one sitting.

    tools/bench --compare shuttle,vllm,llamacpp --json out/peers.json
    tools/bench --compare shuttle,vllm --vllm-url http://127.0.0.1:8001    # vLLM already up
    tools/bench --compare shuttle --server-flags "--no-cpu-kernels"       # shuttle alone

Each server in turn is started here (shuttle by tests/server.py, the peers by the start
scripts of `--peers-scripts`, installed by its setup.sh; see tools/peers/README.md), timed
from launch to its first 200 on /health, warmed with a few requests, loaded with every
workload below by the same load generator (load.py: streamed /v1/completions, random token
ids, `ignore_eos`), and stopped before the next one starts. A server given by --X-url is
loaded as it is (start time not measured). The machine's CPU flags and its memory read
bandwidth (a large tensor summed with the same thread count) go with the table: the
single-stream limit is the model's weight bytes over that bandwidth.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from tools.benchmarks.load import INF, run_load
from tools.benchmarks.report import summarize
from tools.benchmarks.workload import Workload, make_workload

REPO = Path(__file__).resolve().parents[2]
SERVERS = ("shuttle", "vllm", "llamacpp")
# name: (prompts, input tokens, output tokens, concurrency (0: all at once), arrivals per s)
WORKLOADS: dict[str, tuple[int, str, str, int, float]] = {
    "mixed": (64, "32:512", "16:256", 0, INF),
    "single": (8, "128", "64", 1, INF),
    "ttft": (16, "512", "32", 0, 1.0),
}
FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compare", default="", help=f"comma list of servers to compare: {','.join(SERVERS)}"
    )
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="of --compare")
    p.add_argument(
        "--peers-scripts",
        default=str(REPO / "tools" / "peers"),
        help="folder of start-vllm.sh and start-llamacpp.sh",
    )
    p.add_argument("--peers-dir", default="", help="PEERS_DIR of the peers (default: theirs)")
    p.add_argument("--vllm-url", default="", help="a running vLLM to load instead of starting")
    p.add_argument("--llamacpp-url", default="", help="a running llama-server, likewise")
    p.add_argument("--start-timeout", type=float, default=900.0, help="s for a server to start")
    p.add_argument(
        "--vllm-model",
        default="",
        help="folder vLLM serves (default: --model when it is a folder, else the converted "
        "float32 default model: vLLM's CPU backend has no GGUF)",
    )
    p.add_argument(
        "--llamacpp-model",
        default="",
        help="what llama.cpp serves: f32 | bf16 | q8_0 | FILE.gguf (default: --model when it "
        "is a GGUF file, else the --dtype's f32/bf16 file of setup.sh)",
    )


# --- the machine -----------------------------------------------------------------------------
def cpu_identity() -> dict[str, Any]:
    """{"cpu": the CPU's model name, "flags": those of FLAGS_OF_INTEREST it has}."""
    info: dict[str, Any] = {"cpu": "", "flags": []}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not info["cpu"]:
                info["cpu"] = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not info["flags"]:
                have = set(line.split(":", 1)[1].split())
                info["flags"] = [f for f in FLAGS_OF_INTEREST if f in have]
    return info


def machine(model_dir: str, dtype: str, threads: int) -> dict[str, Any]:
    """CPU model and flags, memory read bandwidth, and the single-stream decode limit."""
    import torch

    info: dict[str, Any] = cpu_identity() | {"threads": threads}
    weight_bytes = served_weight_bytes(model_dir, dtype)
    buf_bytes = max(weight_bytes, 1 << 28)  # past the last-level cache of any CPU of this kind
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(buf_bytes // 4, dtype=torch.float32)
        best = float("inf")
        for _ in range(7):
            t0 = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - t0)
        del buf
    finally:
        torch.set_num_threads(old)
    read_gb_s = buf_bytes / best / 1e9
    info |= {
        "weight_bytes": weight_bytes,
        "read_gb_s": read_gb_s,
        "single_stream_limit_ms": weight_bytes / (read_gb_s * 1e9) * 1e3,
    }
    return info


def served_weight_bytes(model: str, dtype: str) -> int:
    """The bytes of weights a decode step of one sequence reads: every tensor of a GGUF file
    or of a folder's safetensors (a float32 folder read in `dtype`; an int8 one as it is),
    but of a mixture of experts' stacked experts only the share a token routes to (top-k of
    the experts), and of an untied token embedding nothing (one row a token)."""
    path = Path(model)
    if path.suffix.lower() == ".gguf":
        from common.gguf_meta import open_gguf, read_gguf_config

        reader = open_gguf(path)
        share = _routed_share(read_gguf_config(path, reader))
        names = {t.name for t in reader.tensors}
        return int(
            sum(
                int(t.n_bytes) * (share if "_exps." in t.name else 1.0)
                for t in reader.tensors
                if t.name != "token_embd.weight" or "output.weight" not in names
            )
        )
    config = json.loads((path / "config.json").read_text())
    share = _routed_share(config)
    sizes = _safetensors_sizes(path)
    tied = "lm_head.weight" not in sizes
    stored = sum(
        n * (share if ".experts." in name else 1.0)
        for name, n in sizes.items()
        if tied or "embed_tokens" not in name
    )
    if "quantization_config" in config or dtype != "bfloat16":
        return int(stored)
    return int(stored) // 2  # a float32 folder served in bfloat16


def _routed_share(config: dict[str, Any]) -> float:
    """The share of a MoE's experts a token reads (top-k of them); 1 for a dense model."""
    top_k = int(config.get("num_experts_per_tok") or 0)
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    return top_k / experts if experts and top_k else 1.0


def _safetensors_sizes(folder: Path) -> dict[str, int]:
    """Each tensor's bytes, from the safetensors files' headers."""
    sizes: dict[str, int] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with f.open("rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, info in header.items():
            if name != "__metadata__":
                lo, hi = info["data_offsets"]
                sizes[name] = hi - lo
    return sizes


def vllm_model(args: argparse.Namespace, model: str) -> str:
    if args.vllm_model:
        return str(args.vllm_model)
    if Path(model).suffix.lower() == ".gguf":
        from common.prepare_model import prepare_default_model

        return str(prepare_default_model())
    return model


def llamacpp_weights(args: argparse.Namespace, model: str) -> str:
    if args.llamacpp_model:
        return str(args.llamacpp_model)
    if Path(model).suffix.lower() == ".gguf":
        return model
    return "bf16" if args.dtype == "bfloat16" else "f32"


# --- the servers -----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_healthy(url: str, proc: subprocess.Popen[Any], timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"it exited with {proc.returncode}: {log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)  # polling a process we do not control: no event to wait on
    raise RuntimeError(f"not healthy after {timeout:.0f} s: {log.read_text()[-3000:]}")


NO_REPACK = "--no-repack"


@contextlib.contextmanager
def peer(
    name: str, args: argparse.Namespace, model_dir: str, log: Path, notes: dict[str, str]
) -> Iterator[str]:
    """Start a peer by its script on a free port; yields its URL, stops it on exit. llama.cpp
    runs with its default weight repacking; where that start dies on a signal (libggml-cpu's
    repacked kernels fault on some AVX-512 CPUs), once more with --no-repack, and `notes`
    says so (the table and the JSON carry it)."""
    script = Path(args.peers_scripts) / ("start-vllm.sh" if name == "vllm" else "start-llamacpp.sh")
    env = {**os.environ, "MODEL_DIR": vllm_model(args, model_dir), "DTYPE": args.dtype}
    if args.peers_dir:
        env["PEERS_DIR"] = args.peers_dir
    while True:
        port = _free_port()
        cmd = ["bash", str(script), str(port)]
        if name == "llamacpp":
            cmd.append(llamacpp_weights(args, model_dir))
        with log.open("wb") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(url, proc, args.start_timeout, log)
            break
        except RuntimeError:
            retry = name == "llamacpp" and (proc.returncode or 0) < 0
            if not retry or NO_REPACK in env.get("LLAMACPP_ARGS", ""):
                raise
            notes[name] = (
                f"{NO_REPACK}: its default weight repacking died on signal {-proc.returncode}"
            )
            env["LLAMACPP_ARGS"] = f"{env.get('LLAMACPP_ARGS', '')} {NO_REPACK}".strip()
    if name == "llamacpp" and name not in notes:
        repack = NO_REPACK not in env.get("LLAMACPP_ARGS", "")
        notes[name] = "default weight repacking" if repack else f"{NO_REPACK} (as asked)"
    try:
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def server(
    name: str,
    args: argparse.Namespace,
    model_dir: str,
    flags: list[str],
    log: Path,
    notes: dict[str, str],
) -> Iterator[tuple[str, float | None]]:
    """(URL, seconds from launch to healthy, None for a server given by URL)."""
    given = {"vllm": args.vllm_url, "llamacpp": args.llamacpp_url}.get(name, "")
    if given:
        yield given.rstrip("/"), None
        return
    t0 = time.perf_counter()
    if name == "shuttle":
        from tests.server import running_server

        with running_server("--model", model_dir, *flags, timeout=args.start_timeout) as s:
            _wait_healthy(s.url, s.proc, args.start_timeout, s.log_path)
            yield s.url, time.perf_counter() - t0
        return
    with peer(name, args, model_dir, log, notes) as url:
        yield url, time.perf_counter() - t0


# --- the comparison --------------------------------------------------------------------------
def workload(name: str, vocab: int, seed: int) -> tuple[Workload, int, float]:
    n, input_len, output_len, concurrency, rate = WORKLOADS[name]
    return make_workload(n, input_len, output_len, vocab, seed), concurrency, rate


def load_server(server: str, url: str, names: list[str], vocab: int, seed: int) -> dict[str, Any]:
    """Warm-up, then every workload of `names`; their summaries (named for `server`) by name."""
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    warm = make_workload(4, "64", "8", vocab, seed + 1)
    asyncio.run(run_load(url, model, warm, 0, INF, seed))
    out: dict[str, Any] = {"model": model}
    for name in names:
        wl, concurrency, rate = workload(name, vocab, seed)
        timings, duration, peak = asyncio.run(run_load(url, model, wl, concurrency, rate, seed))
        out[name] = {**summarize(timings, duration, peak, wl, None), "name": server}
    return out


def compare(
    args: argparse.Namespace, model_dir: str, flags: list[str], threads: int
) -> dict[str, Any]:
    from common.model_paths import hf_config_of

    names = [s for s in args.compare.split(",") if s]
    unknown = set(names) - set(SERVERS)
    if unknown:
        raise SystemExit(f"--compare: unknown server(s) {sorted(unknown)}; known: {SERVERS}")
    loads = [w for w in args.workloads.split(",") if w]
    vocab = hf_config_of(model_dir)["vocab_size"]
    result: dict[str, Any] = {
        "machine": machine(model_dir, args.dtype, threads),
        "dtype": args.dtype,
        "workloads": {w: WORKLOADS[w] for w in loads},
        "servers": {},
        "notes": {},
        "weights": {
            "shuttle": model_dir,
            **({"vllm": vllm_model(args, model_dir)} if "vllm" in names else {}),
            **({"llamacpp": llamacpp_weights(args, model_dir)} if "llamacpp" in names else {}),
        },
    }
    logs = Path(tempfile.mkdtemp(prefix="compare-"))  # each server's log, kept for a look
    print(f"server logs: {logs}", flush=True)
    for name in names:
        log = logs / f"compare-{name}.log"
        try:
            with server(name, args, model_dir, flags, log, result["notes"]) as (url, start_s):
                result["servers"][name] = {
                    "start_s": start_s,
                    **load_server(name, url, loads, vocab, args.seed),
                }
        except RuntimeError as e:  # one server that does not start costs only its column
            if name == "shuttle":
                raise
            result["notes"][name] = f"did not start ({str(e)[:300]}); log {log}"
            print(f"{name}: {result['notes'][name]}", flush=True)
    return result


def table(result: dict[str, Any]) -> str:
    """The comparison as one markdown table, with shuttle's ratio to the best peer."""
    servers = result["servers"]
    names = list(servers)
    rows: list[tuple[str, str, Any]] = [
        ("mixed", "output tok/s", lambda s: s["output_tok_s"]),
        ("mixed", "TTFT p50 ms", lambda s: s["ttft_s"]["median"] * 1e3),
        ("single", "ITL p50 ms", lambda s: s["itl_s"]["median"] * 1e3),
        ("single", "output tok/s", lambda s: s["output_tok_s"]),
        ("ttft", "TTFT p50 ms", lambda s: s["ttft_s"]["median"] * 1e3),
        ("ttft", "ITL p50 ms", lambda s: s["itl_s"]["median"] * 1e3),
    ]
    higher_is_better = {"output tok/s"}
    head = "| workload | figure | " + " | ".join(names) + " | shuttle vs best peer |"
    lines = [head, "|" + "---|" * (len(names) + 3)]
    for load, label, get in rows:
        if not all(load in servers[n] for n in names):
            continue
        vals = {n: get(servers[n][load]) for n in names}
        peers = [v for n, v in vals.items() if not n.startswith("shuttle")]
        ratio = ""
        if "shuttle" in vals and peers:
            best = max(peers) if label in higher_is_better else min(peers)
            ours = vals["shuttle"]
            x = ours / best if label in higher_is_better else best / ours
            ratio = f"{x:.2f}x" + (" (faster)" if x >= 1 else " (slower)")
        cells = " | ".join(f"{vals[n]:.1f}" for n in names)
        lines.append(f"| {load} | {label} | {cells} | {ratio} |")
    starts = " | ".join(
        f"{servers[n]['start_s']:.1f}" if servers[n]["start_s"] is not None else "given"
        for n in names
    )
    lines.append(f"| start | to /health 200, s | {starts} | |")
    m = result["machine"]
    lines += [
        "",
        f"CPU: {m['cpu']}, {m['threads']} threads, flags {' '.join(m['flags'])}; "
        f"memory read {m['read_gb_s']:.1f} GB/s; weights {m['weight_bytes'] / 1e6:.0f} MB "
        f"(shuttle's, as served: {Path(result.get('weights', {}).get('shuttle', '')).name or '-'}"
        f", {result['dtype']} activations): single-stream limit "
        f"{m['single_stream_limit_ms']:.1f} ms/token.",
    ]
    lines += [f"{n}: {note}" for n, note in result.get("notes", {}).items()]
    return "\n".join(lines)
