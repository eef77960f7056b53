"""Perplexity over a held text, of a server or of transformers, for docs/benchmarks.md.

    python -m tools.benchmarks.perplexity --tokenizer HF_FOLDER_OR.gguf \\
        --gguf Q4_1.gguf --url http://127.0.0.1:8000 --llamacpp-url http://127.0.0.1:8080

Every source scores the same token ids: each window's tokens after its first, given the
ones before it; perplexity = exp(mean NLL over all of them). One JSON line per source
({source, windows, tokens, nll, ppl, ...}; nll is the mean, in nats per token), then, with
several sources, a table of each one's perplexity over the reference's (the first
transformers source, else the first source).

The held text: Python's own reference documentation, `pydoc_data.topics` of the standard
library (offline, on every machine): the topics HELD_TOPICS in that order joined by blank
lines. It changes with the Python minor version (3.11 here): the output names the version
and a sha256 of the token ids, so two runs compare only when those agree. It is tokenised
once with `--tokenizer` (an HF folder, or a .gguf file's own tokenizer), without special
tokens, and cut into `--windows` consecutive windows of `--window-len` tokens; when that
tokenizer puts tokens before a text (a BOS), each window starts with them and is that much
shorter in text (SmolLM2's puts none). Every source gets these ids as they are.

Sources (each flag may be repeated; `--gguf "Q4_1 dequantized=FILE"` names a source):
  --transformers FOLDER  transformers in float32; a compressed-tensors checkpoint (int8
                         W8A8) is loaded with its weights dequantized (int8 x scale) into
                         float32 linears, activations not quantized (`dequantize=True`)
  --gguf FILE            transformers dequantizing the GGUF file to float32 itself
  --act-int8 token|block32  with each transformers source, the same with every linear's
                         input rounded to int8 (per token, as W8A8 does; or per 32 values,
                         as llama.cpp does): what the activation rounding alone costs
  --url URL              a vLLM-compatible server (shuttle, vLLM): POST /v1/completions with
                         the window as a list of ids, max_tokens 1, temperature 0 and
                         `prompt_logprobs: 0`, whose answer lists each prompt token's logprob
                         given the ones before it (null for the first); --model names the
                         served model (default: the first of /v1/models)
  --llamacpp-url URL     llama.cpp's llama-server, which cannot return prompt logprobs:
                         one forced token per request (perplexity_servers.py says how)
  --runner PATH          shuttle's own runner and scheduler in this process (an HF folder
                         or a .gguf file), `prompt_logprobs: 0` as a server's; once per
                         --kv-cache-dtype given (auto, int8, fp8, fp8_e4m3, fp8_e5m2;
                         default auto): what a quantized KV cache costs on the same weights

llama.cpp's own figure, by its llama-perplexity tool on the same text (`--write-text
held.txt`; build it in its tree with `cmake --build build --target llama-perplexity`):
    llama-perplexity -m FILE.gguf -f held.txt -c 512 -b 512 --chunks 8 -t 2
tokenises the text itself, adds the BOS its vocabulary asks for, and scores only the second
half of each 512-token chunk: its absolute figure is not comparable with this tool's, its
ratio between two files of the same model (Q4_1 / f32) is.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tools.benchmarks.perplexity_servers import llamacpp_logprobs, served_model, server_logprobs

HELD_TOPICS = ("execmodel", "types", "compound")  # (naming, exceptions: in execmodel)
DEFAULT_WINDOWS = 8
DEFAULT_WINDOW_LEN = 512
ACT_BLOCKS = {"token": 0, "block32": 32}  # --act-int8: quantize_activations' `block`
LOGPROB_FLOOR = -1e30  # llama-server's log(0.0f) is -FLT_MAX: an underflow, not a logprob


def held_text() -> str:
    """The held text: HELD_TOPICS of the stdlib's pydoc_data.topics joined by blank lines."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in HELD_TOPICS)


def load_tokenizer(path: str) -> Any:
    """An HF tokenizer from a model folder, or the one inside a .gguf file."""
    from transformers import AutoTokenizer

    p = Path(path)
    if p.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    return AutoTokenizer.from_pretrained(p)


def special_prefix(tokenizer: Any) -> list[int]:
    """The ids the tokenizer puts before a text when it adds special tokens (a BOS), or []."""
    plain = tokenizer("Hello", add_special_tokens=False)["input_ids"]
    full = tokenizer("Hello")["input_ids"]
    for k in range(len(full) - len(plain) + 1):
        if full[k : k + len(plain)] == plain:
            return list(full[:k])
    raise ValueError("the tokenizer's special tokens wrap the text in a way not understood")


def make_windows(tokenizer: Any, text: str, num_windows: int, window_len: int) -> list[list[int]]:
    """`num_windows` windows of `window_len` ids: the tokenizer's special prefix (if any),
    then consecutive slices of the text's ids (tokenised once, without special tokens)."""
    prefix = special_prefix(tokenizer)
    step = window_len - len(prefix)
    if step < 2:
        raise ValueError(f"window_len {window_len} leaves fewer than 2 text tokens")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < num_windows * step:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than {num_windows} x {step}")
    return [prefix + list(ids[i * step : (i + 1) * step]) for i in range(num_windows)]


def tokens_digest(windows: list[list[int]]) -> str:
    """16 hex digits of a sha256 of the windows' ids: runs scored the same tokens when
    these agree."""
    return hashlib.sha256(json.dumps(windows).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True, slots=True)
class Score:
    """One source's result: NLL in nats per scored token (every window's tokens after the
    first), and its perplexity exp(nll)."""

    source: str
    windows: int
    tokens: int
    nll: float
    seconds: float

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    def as_json(self, **extra: Any) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "ppl": self.ppl, **extra}


def score(source: str, logprobs: list[list[float]], seconds: float = 0.0) -> Score:
    """A Score from each window's logprobs of its tokens after the first."""
    values = [v for window in logprobs for v in window]
    if any(not math.isfinite(v) or v < LOGPROB_FLOOR for v in values):
        raise ValueError(f"{source}: a logprob is not finite (an underflow?)")
    return Score(source, len(logprobs), len(values), -math.fsum(values) / len(values), seconds)


# --- transformers ------------------------------------------------------------------------


def load_transformers(path: str) -> Any:
    """transformers' model in float32 from an HF folder or a .gguf file (dequantized by
    transformers); a compressed-tensors checkpoint's weights dequantized to float32."""
    import torch
    from transformers import AutoModelForCausalLM

    p = Path(path)
    kw: dict[str, Any] = {"dtype": torch.float32}
    if p.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, **kw).eval()
    config = json.loads((p / "config.json").read_text())
    method = config.get("quantization_config", {}).get("quant_method")
    if method == "compressed-tensors":
        from transformers import CompressedTensorsConfig

        kw["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(p, **kw).eval()


def quantize_activations(model: Any, block: int = 0) -> None:
    """Round the input of every linear layer but the LM head to int8 and back, symmetric
    with scale absmax / 127 per row (`block` 0: W8A8's per-token activations, as shuttle's
    int8 method quantizes them) or per `block` consecutive values of a row (32: llama.cpp's
    Q8 activations). A diagnostic: what the activation rounding alone costs."""
    import torch

    def rounded(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        rows = x.reshape(*x.shape[:-1], -1, block) if block else x
        scale = rows.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / 127.0
        q = torch.round(rows / scale).clamp(-127, 127) * scale
        return (q.reshape(x.shape), *args[1:])

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
            module.register_forward_pre_hook(rounded)


def transformers_logprobs(model: Any, windows: list[list[int]]) -> list[list[float]]:
    """Each window's logprobs of its tokens after the first: log_softmax of the float32
    logits at the position before each, one window at a time."""
    import torch

    out = []
    with torch.no_grad():
        for window in windows:
            ids = torch.tensor([window])
            logits = model(input_ids=ids).logits[0, :-1].float()
            lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
            out.append(lp.double().tolist())
    return out


# --- the command -------------------------------------------------------------------------


def table(lines: Sequence[dict[str, Any]]) -> str:
    """A markdown table of JSON lines: each source's perplexity and its ratio to its run's
    reference (the first source of the run that measured it)."""
    out = ["| source | tokens | ppl | ratio | to |", "|---|---:|---:|---:|---|"]
    for x in lines:
        ratio = f"{x['ratio']:.4f}" if "ratio" in x else ""
        to = x.get("reference", "")
        out.append(f"| {x['source']} | {x['tokens']} | {x['ppl']:.4f} | {ratio} | {to} |")
    return "\n".join(out)


def docs_section(jsonl: Path) -> str:
    """docs/benchmarks.md's section from the JSON lines that runs of `--json FILE` appended
    (one run per weight file, each with its transformers reference first)."""
    lines = [json.loads(x) for x in jsonl.read_text().splitlines() if x.strip()]
    digests = sorted({x["tokens_sha256"] for x in lines})
    return (
        "## Quality: perplexity of quantized weights\n\n"
        "`python -m tools.benchmarks.perplexity` (its docstring has the method): "
        f"{lines[0]['windows']} windows of {lines[0]['window_len']} tokens of Python "
        f"{lines[0]['python']}'s reference documentation (pydoc_data.topics: "
        f"{', '.join(HELD_TOPICS)}), every window's tokens after its first scored, the same "
        f"ids for every source (token digest {', '.join(digests)}); ratio: perplexity over "
        "the reference's, transformers in float32 on the same weights dequantized.\n\n"
        + table(lines)
        + "\n\n"
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--tokenizer", default="", help="HF folder or .gguf (default: first source's)")
    p.add_argument("--transformers", action="append", default=[], metavar="FOLDER")
    p.add_argument("--gguf", action="append", default=[], metavar="FILE")
    p.add_argument("--url", action="append", default=[], help="a vLLM-compatible server")
    p.add_argument("--model", action="append", default=[], help="of each --url, in order")
    p.add_argument("--llamacpp-url", action="append", default=[], metavar="URL")
    p.add_argument("--runner", action="append", default=[], metavar="PATH")
    p.add_argument("--kv-cache-dtype", action="append", default=[], metavar="DTYPE")
    p.add_argument("--windows", type=int, default=DEFAULT_WINDOWS)
    p.add_argument("--window-len", type=int, default=DEFAULT_WINDOW_LEN)
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight per server")
    p.add_argument(
        "--act-int8",
        choices=sorted(ACT_BLOCKS),
        default="",
        help="also score each transformers source with int8-rounded linear inputs",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", default="", help="also append the JSON lines to this file")
    p.add_argument("--write-text", default="", help="write the held text here (for llama.cpp)")
    return p


def split_label(value: str) -> tuple[str, str]:
    """A source flag's value as (label, target): `LABEL=TARGET` names the source LABEL in
    the output (no '/' in LABEL); a bare TARGET is named after it."""
    label, sep, target = value.partition("=")
    if sep and "/" not in label and label:
        return label, target
    return "", value


def _sources(args: argparse.Namespace, windows: list[list[int]]) -> list[tuple[str, Any]]:
    """(name, a call returning each window's logprobs) of every source flag, in the order
    measured: transformers first."""
    out: list[tuple[str, Any]] = []
    for value in [*args.transformers, *args.gguf]:
        label, path = split_label(value)
        kind = "transformers-gguf" if path.endswith(".gguf") else "transformers"
        name = label or f"{kind}:{Path(path).name}"
        out.append((name, functools.partial(_transformers_run, path, windows)))
        if args.act_int8:
            call = functools.partial(_transformers_run, path, windows, ACT_BLOCKS[args.act_int8])
            out.append((f"{name}, int8 activations per {args.act_int8}", call))
    for i, value in enumerate(args.url):
        label, url = split_label(value)
        model = args.model[i] if i < len(args.model) else served_model(url)
        call = functools.partial(server_logprobs, url, model, windows, args.concurrency)
        out.append((label or f"server:{model}", call))
    for value in args.llamacpp_url:
        label, url = split_label(value)
        call = functools.partial(llamacpp_logprobs, url, windows, args.concurrency)
        out.append((label or f"llamacpp:{url}", call))
    for value in args.runner:
        label, path = split_label(value)
        for kv in args.kv_cache_dtype or ["auto"]:
            name = f"{label or 'runner:' + Path(path).name}, kv {kv}"
            out.append((name, functools.partial(runner_logprobs, path, kv, windows)))
    return out


def runner_logprobs(path: str, kv_cache_dtype: str, windows: list[list[int]]) -> list[list[float]]:
    """Each window's prompt logprobs from shuttle's runner and scheduler in this process
    (the worker's CPU kernels), with its KV cache stored as `kv_cache_dtype`."""
    from common.config import Config
    from common.messages import SamplingParams
    from gpu_worker.runner.model_runner import ModelRunner
    from gpu_worker.runner.options import RunnerOptions
    from services.scheduler.in_process import InProcessEngine

    need = max(len(w) for w in windows) * len(windows)
    options = RunnerOptions(num_blocks=need // 16 + len(windows) + 1, kv_cache_dtype=kv_cache_dtype)
    engine = InProcessEngine(ModelRunner(path, options), Config())
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
    rids = [engine.add(w, sp)[0][0] for w in windows]
    engine.run()
    found: dict[str, list[float]] = {}
    for batch in engine.batches:
        for i, rid in enumerate(batch.request_ids):
            if batch.prompt_logprob_values and batch.prompt_logprob_values[i]:
                found[rid] = [values[0] for values in batch.prompt_logprob_values[i][1:]]
    return [found[rid] for rid in rids]


def _transformers_run(
    path: str, windows: list[list[int]], act_block: int | None = None
) -> list[list[float]]:
    model = load_transformers(path)
    if act_block is not None:
        quantize_activations(model, act_block)
    return transformers_logprobs(model, windows)


def _measure(args: argparse.Namespace, windows: list[list[int]]) -> list[Score]:
    scores = []
    for name, call in _sources(args, windows):
        start = time.perf_counter()
        logprobs = call()
        scores.append(score(name, logprobs, time.perf_counter() - start))
    return scores


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    text = held_text()
    if args.write_text:
        Path(args.write_text).write_text(text)
    first = next(iter([*args.transformers, *args.gguf]), "")
    tokenizer_path = args.tokenizer or split_label(first)[1]
    if not tokenizer_path:
        print("--tokenizer is needed without a --transformers or --gguf source", file=sys.stderr)
        return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    windows = make_windows(load_tokenizer(tokenizer_path), text, args.windows, args.window_len)
    extra = {
        "window_len": args.window_len,
        "tokens_sha256": tokens_digest(windows),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }
    scores = _measure(args, windows)
    reference = scores[0]  # transformers sources are measured first
    lines = []
    for s in scores:
        line = s.as_json(**extra)
        if len(scores) > 1:
            line.update(reference=reference.source, ratio=s.ppl / reference.ppl)
        lines.append(line)
        print(json.dumps(line), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(line) + "\n")
    if len(scores) > 1:
        print(table(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
