"""Render docs/benchmarks.md from the JSON files tools/benchmarks/docs.py writes in docs/bench/.

Hand-written analysis lives in docs/bench/notes/*.md and is pasted in where its section is;
every number in a table comes from the JSON, so a rerun updates the page. The single-server
sections are here; the features' (scheduling, speculative decoding, peers, parallelism,
LoRA) are tools/benchmarks/docs_sections.py's, and the helpers both use
tools/benchmarks/docs_format.py's.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

from tools.benchmarks import docs_sections as features
from tools.benchmarks.docs_format import latency_table, load_line, ms, read_json, read_note


def _steps(out: Path, loads: dict[str, Any]) -> str:
    text = "## Worker alone: one decode step\n\n" + read_note(out, "step")
    tables = [
        (label, t)
        for label, name in (
            ("before (first commit of the torch backend)", "step_float32_before"),
            ("fp32", "step_float32"),
            ("bf16", "step_bfloat16"),
        )
        if (t := read_json(out, name))
    ]
    if not tables:
        return text
    batches = [r["batch"] for r in tables[0][1]["rows"]]
    text += "| B (context 300) | " + " | ".join(label for label, _ in tables) + " |\n"
    text += "|---" * (len(tables) + 1) + "|\n"
    for i, b in enumerate(batches):
        cells = [
            f"{t['rows'][i]['decode_step_ms']:.1f} ms, {t['rows'][i]['decode_tok_s']:.0f} tok/s"
            for _, t in tables
        ]
        text += f"| {b} | " + " | ".join(cells) + " |\n"
    cells = [f"{t['rows'][-1]['prefill_tok_s']:.0f} tok/s" for _, t in tables]
    text += "| prefill (512-token chunks) | " + " | ".join(cells) + " |\n\n"
    return text + load_line(loads, "step")


def _mixed(out: Path, loads: dict[str, Any]) -> str:
    fp32, bf16 = read_json(out, "mixed_fp32"), read_json(out, "mixed_bf16")
    if fp32 is None:
        return ""
    w, s = fp32["workload"], fp32["shuttle"]
    text = (
        "## Mixed workload: shuttle beside transformers\n\n"
        f"{w['num_prompts']} requests at once, prompts uniform {w['input_len']} tokens "
        f"({w['prompt_tokens']} in all), outputs uniform {w['output_len']} "
        f"({w['output_tokens']} in all), `ignore_eos`, greedy, {w['dtype']}, "
        f"{w['threads']} threads; server flags `{w['server_flags']}`.\n\n"
    )
    text += "| system | duration s | useful output tok/s | shuttle fp32 is |\n|---|---|---|---|\n"
    text += f"| shuttle fp32 | {s['duration_s']:.1f} | {s['output_tok_s']:.1f} | 1.00x |\n"
    if bf16 is not None:
        b = bf16["shuttle"]
        text += (
            f"| shuttle bf16 | {b['duration_s']:.1f} | {b['output_tok_s']:.1f} | "
            f"{s['output_tok_s'] / b['output_tok_s']:.2f}x (bf16 is "
            f"{b['output_tok_s'] / s['output_tok_s']:.2f}x fp32) |\n"
        )
    for base in fp32["baselines"]:
        note = (
            f" (measured on {base['num_requests']} of the requests, spread evenly)"
            if base.get("subset")
            else ""
        )
        ratio = s["output_tok_s"] / base["output_tok_s"]
        text += (
            f"| transformers {base['name']}{note} | {base['duration_s']:.1f} | "
            f"{base['output_tok_s']:.1f} | {ratio:.2f}x |\n"
        )
    for base in bf16.get("baselines", []) if bf16 is not None else []:
        note = (
            f" (measured on {base['num_requests']} of the requests, spread evenly)"
            if base.get("subset")
            else ""
        )
        text += (
            f"| transformers {base['name']} bf16{note} | {base['duration_s']:.1f} | "
            f"{base['output_tok_s']:.1f} | shuttle bf16 is "
            f"{b['output_tok_s'] / base['output_tok_s']:.2f}x |\n"
        )
    text += "\n" + latency_table(
        [("shuttle fp32", s)] + ([("shuttle bf16", bf16["shuttle"])] if bf16 else [])
    )
    text += load_line(loads, "mixed") + read_note(out, "mixed")
    for png in ("mixed_fp32_throughput.png", "mixed_fp32_latency_cdf.png"):
        if (out / png).is_file():
            text += f"![{png}](bench/{png})\n\n"
    return text


def _sweep(out: Path, loads: dict[str, Any]) -> str:
    r = read_json(out, "sweep_fp32")
    if r is None or not r.get("sweep"):
        return ""
    w = r["workload"]
    slo = w["slo"]
    text = (
        "## Request-rate sweep (Poisson arrivals)\n\n"
        f"{w['num_prompts']} requests per rate, prompts {w['input_len']}, outputs "
        f"{w['output_len']}, fp32. Goodput: requests meeting TTFT <= {slo['ttft_ms']:g} ms "
        f"and TPOT <= {slo['tpot_ms']:g} ms.\n\n"
    )
    text += (
        "| rate req/s | out tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms | goodput "
        "(fraction, req/s) |\n|---|---|---|---|---|\n"
    )
    for s in r["sweep"]:
        g = s.get("goodput", {})
        text += (
            f"| {s['rate']} | {s['output_tok_s']:.1f} | {ms(s['ttft_s']['median'])} / "
            f"{ms(s['ttft_s']['p99'])} | {ms(s['tpot_s']['median'])} / "
            f"{ms(s['tpot_s']['p99'])} | {g.get('fraction', 0):.0%}, "
            f"{g.get('request_rate', 0):.2f} |\n"
        )
    text += "\n" + load_line(loads, "sweep")
    for png in ("sweep_fp32_rate_sweep.png", "sweep_fp32_latency_cdf.png"):
        if (out / png).is_file():
            text += f"![{png}](bench/{png})\n\n"
    return text


def _synthetic(out: Path, loads: dict[str, Any]) -> str:
    cap, low = read_json(out, "synthetic_256"), read_json(out, "synthetic_c1")
    if cap is None or low is None:
        return ""
    text = (
        "## Synthetic model: the pipeline's own capacity\n\n"
        "`--model synthetic` computes nothing and answers every step at once "
        "(gpu_worker/runner/synthetic.py), so these figures are the five processes, their "
        "messages and HTTP/SSE alone, with the load generator on the same 2 cores.\n\n"
    )
    text += latency_table(
        [
            (
                f"{cap['workload']['num_prompts']} requests, 256 concurrent SSE streams",
                cap["shuttle"],
            ),
            ("concurrency 1", low["shuttle"]),
        ]
    )
    text += load_line(loads, "synthetic") + read_note(out, "synthetic")
    for png in ("synthetic_256_latency_cdf.png", "synthetic_c1_latency_cdf.png"):
        if (out / png).is_file():
            text += f"![{png}](bench/{png})\n\n"
    return text


def _parity(out: Path) -> str:
    r = read_json(out, "bf16_parity")
    if r is None:
        return ""
    text = (
        "## bfloat16: the parity bound\n\n"
        f"Greedy decoding of {len(r['prompt_lens'])} prompts ({r['prompt_lens']} tokens) "
        f"for {r['num_new_tokens']} tokens, scored against transformers in fp32: "
        "sequences identical throughout, and how many leading tokens agree before the "
        "first difference.\n\n| run | identical sequences | agreeing prefix per prompt |"
        "\n|---|---|---|\n"
    )
    for name in ("shuttle_fp32", "shuttle_bf16", "transformers_bf16"):
        a = r[name]
        text += (
            f"| {name.replace('_', ' ')} | {a['identical_sequences']}/{a['num_sequences']}"
            f" | {a['agreeing_prefix']} |\n"
        )
    return text + "\n" + read_note(out, "parity")


def _small(out: Path) -> str:
    """The first figures: one request, and 16 at once, beside transformers."""
    runs = [r for name in ("issue2-single", "issue2-16") if (r := read_json(out, name))]
    if not runs:
        return ""
    text = (
        "## One request, and sixteen at once\n\n"
        "Commands: `tools/bench --num-prompts 1 --input-len 128 --output-len 32 --baseline "
        "hf-sequential` and `tools/bench --num-prompts 16 --input-len 64:256 --output-len "
        "64 --baseline hf-static --hf-batch-size 16` (fp32, 2 threads, `ignore_eos`).\n\n"
        "| workload | shuttle out tok/s | TTFT p50 ms | TPOT p50 ms | transformers | "
        "its out tok/s | shuttle is |\n|---|---|---|---|---|---|---|\n"
    )
    for r in runs:
        w, sh = r["workload"], r["shuttle"]
        for base in r.get("baselines", []):
            text += (
                f"| {w['num_prompts']} x ({w['input_len']} in, {w['output_len']} out) | "
                f"{sh['output_tok_s']:.1f} | {ms(sh['ttft_s']['median'])} | "
                f"{ms(sh['tpot_s']['median'])} | {base['name']} | "
                f"{base['output_tok_s']:.1f} | "
                f"{sh['output_tok_s'] / base['output_tok_s']:.2f}x |\n"
            )
    return text + "\n" + read_note(out, "small")


def render(out: Path) -> str:
    loads = json.loads((out / "load.json").read_text()) if (out / "load.json").is_file() else {}
    head = (
        "# Benchmarks\n\nRegenerate everything on this page with `make bench-docs` "
        "(tools/benchmarks/docs.py, about 30 minutes); "
        "`python -m tools.benchmarks.docs --render` rebuilds the page from the JSON in "
        "docs/bench/.\n\n"
        f"Machine: {platform.machine()}, {platform.processor() or 'CPU'}, 2 cores shared "
        "with other work. All runs: torch CPU, 2 threads, `OMP_WAIT_POLICY=PASSIVE` "
        "(gpu_worker/__init__.py sets it for the worker; the transformers baselines run "
        "with the same setting in the same process as the load generator); runs before "
        "2026-11-30 slept at once, the worker now spins briefly first "
        "(`GOMP_SPINCOUNT=10000`; the Peers section shows both).\n\n"
    )
    body = (
        read_note(out, "summary")
        + read_note(out, "method")
        + features.peers(out, loads)
        + _steps(out, loads)
        + _small(out)
        + _mixed(out, loads)
        + _sweep(out, loads)
        + features.scheduling(out)
        + _synthetic(out, loads)
        + features.speculative(out)
        + read_note(out, "structured")
        + features.data_parallel(out)
        + features.tensor_parallel(out, loads)
        + _parity(out)
        + read_note(out, "soak")
        + read_note(out, "quantized")
        + read_note(out, "int8_linear")
        + features.lora(out, loads)
    )
    gpu = "## GPU figures\n\n" + (
        read_note(out, "gpu")
        or "tools/gpu-check has not yet run on a GPU: no device was lent to this task. Its "
        "kernel and model timings (triton backend, CUDA graphs) will be recorded here.\n\n"
    )
    return head + body + gpu
