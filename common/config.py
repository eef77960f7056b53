"""One frozen dataclass tree for every process; each field is a flag and a SHUTTLE_* env var.

Precedence: command-line flag > environment (`SHUTTLE_MAX_NUM_SEQS=32`) > default. Flags are
named as vLLM names them where it has one (`--max-num-seqs`, `--block-size`, ...). The
supervisor writes the resolved tree to `<run_dir>/config.json` and every child process reads
it back, so all processes agree on one config.

The sections of one feature live beside it, with the helpers of common/config_base.py:
speculative decoding (common/speculative_config.py), tensor and data parallelism
(common/parallel_config.py) and LoRA (common/lora_config.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

# ConfigError is re-exported: every caller names it common.config.ConfigError
from common.config_base import ConfigError as ConfigError
from common.config_base import check_field, config_field
from common.cpu_features import auto_dtype
from common.lora_config import LoraConfig
from common.messages.types import POOLING_KINDS
from common.parallel_config import DataParallelConfig, ParallelConfig
from common.speculative_config import SpeculativeConfig

_ENV_PREFIX = "SHUTTLE_"


_field = config_field
_check = check_field


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model: str = _field("", "Hugging Face folder of a Llama-family model (default: SmolLM2)")
    served_model_name: str = dataclasses.field(
        default="",
        metadata={
            "help": "name(s) clients use (default: the folder's name); several, as in "
            "`--served-model-name a b` or `a,b`, are aliases: requests may name any, the "
            "first is the one reported",
            "nargs": "+",
        },
    )
    dtype: str = _field(
        "float32",
        "weights and KV dtype: float32 | bfloat16 | auto (bfloat16 on CUDA and on CPUs with "
        "avx512_bf16 or AMX, float32 elsewhere)",
    )
    device: str = _field("cpu", "cpu | cuda")
    max_model_len: int = _field(0, "longest prompt + output in tokens (0: the model's own)")
    seed: int = _field(0, "seed for unseeded sampling")
    num_threads: int = _field(0, "torch threads in the worker (0: all cores)")
    attention_backend: str = _field("auto", "auto | torch | triton (auto: triton on CUDA)")
    enforce_eager: bool = _field(False, "never capture CUDA graphs")
    cpu_kernels: bool = _field(
        True,
        "on the CPU, C kernels for linear layers over a few rows (decode of 1-8 sequences); "
        "--no-cpu-kernels: torch only, the reference path",
    )
    cpu_packed_weights: bool = _field(
        True,
        "on the CPU, float32 linear weights also pre-packed for oneDNN, for prefill chunks and "
        "decode batches over 8 rows (a second copy of them in memory; "
        "--no-cpu-packed-weights: torch's GEMM there)",
    )
    cpu_huge_pages: bool = _field(
        True,
        "on the CPU, the weights and the KV cache in transparent huge pages where the kernel "
        "has them (fewer TLB misses as a decode step streams them); --no-cpu-huge-pages: "
        "torch's allocator",
    )
    quantization: str = _field(
        "",
        "quantize a float checkpoint's linear layers at load: '' (serve the weights as "
        "stored; GGUF files and int8 checkpoints are served as they are) | int8 (W8A8: int8 "
        "weights with a scale per output channel, activations quantized per token)",
    )
    max_graph_batch_size: int = _field(64, "largest decode batch captured as a CUDA graph")
    generation_config: str = _field(
        "auto",
        "auto: sampling fields a request leaves unset (temperature, top_p, top_k, min_p, "
        "repetition_penalty) take the model's generation_config.json; vllm: ignore the file",
    )

    def __post_init__(self) -> None:
        _check(self.dtype in ("float32", "bfloat16", "auto"), "dtype", "float32, bfloat16 or auto")
        _check(self.generation_config in ("auto", "vllm"), "generation_config", "auto or vllm")
        _check(self.quantization in ("", "int8"), "quantization", "'' or int8")
        _check(self.device in ("cpu", "cuda"), "device", "cpu or cuda")
        _check(self.max_model_len >= 0, "max_model_len", ">= 0")
        _check(self.num_threads >= 0, "num_threads", ">= 0")
        names = self.served_model_names
        _check(len(set(names)) == len(names), "served_model_name", "names without repeats")
        _check(
            self.attention_backend in ("auto", "torch", "triton"),
            "attention_backend",
            "auto, torch or triton",
        )

    @property
    def resolved_dtype(self) -> str:
        """float32 or bfloat16: --dtype, with auto decided by the device and the CPU."""
        return auto_dtype(self.device) if self.dtype == "auto" else self.dtype

    @property
    def served_model_names(self) -> list[str]:
        """--served-model-name as a list (comma-separated in the config): the first name is
        the one responses report, the others are aliases. Empty: the folder's name."""
        return [n.strip() for n in self.served_model_name.split(",") if n.strip()]


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    block_size: int = _field(16, "tokens per KV block")
    kv_cache_memory: float = _field(1.0, "KV cache size in GiB on CPU")
    gpu_memory_utilization: float = _field(0.9, "fraction of GPU memory for weights + KV")
    swap_space: float = _field(1.0, "host memory in GiB for swapped-out KV (preemption swap)")
    kv_cache_dtype: str = _field(
        "auto",
        "KV cache storage: auto (the model's dtype) | int8 (a scale per token and head) | "
        "fp8 (= fp8_e4m3) | fp8_e4m3 | fp8_e5m2 (scale 1)",
    )
    enable_prefix_caching: bool = _field(True, "share KV of common prompt prefixes")
    # the prefix cache's lower tiers (gpu_worker/kv_tiers.py, services/scheduler/kv_tiers.py)
    kv_offload_memory: float = _field(
        0.0, "GiB of host memory for prefix-cache blocks evicted from the KV pool (0: off)"
    )
    kv_offload_dir: str = _field(
        "", "folder for prefix-cache blocks evicted from host memory; survives restarts"
    )
    kv_offload_disk: float = _field(0.0, "GiB of files under --kv-offload-dir")

    def __post_init__(self) -> None:
        _check(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size", "a power of 2 <= 128"
        )
        _check(self.kv_cache_memory > 0, "kv_cache_memory", "> 0")
        _check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "in (0, 1]")
        _check(self.swap_space >= 0, "swap_space", ">= 0")
        _check(self.kv_offload_memory >= 0, "kv_offload_memory", ">= 0")
        _check(self.kv_offload_disk >= 0, "kv_offload_disk", ">= 0")
        _check(
            bool(self.kv_offload_dir) == (self.kv_offload_disk > 0),
            "kv_offload_dir",
            "set together with --kv-offload-disk > 0",
        )
        _check(
            not self.kv_offload_dir or self.kv_offload_memory > 0,
            "kv_offload_dir",
            "used with --kv-offload-memory > 0 (disk blocks are read up through host memory)",
        )
        _check(
            not self.kv_offload_memory or self.enable_prefix_caching,
            "kv_offload_memory",
            "0 without prefix caching (the tiers hold prefix-cache blocks)",
        )
        _check(
            self.kv_cache_dtype in ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"),
            "kv_cache_dtype",
            "auto, int8, fp8, fp8_e4m3 or fp8_e5m2",
        )


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = _field(64, "most sequences in one step")
    max_num_batched_tokens: int = _field(512, "token budget of one step (chunked prefill)")
    max_waiting: int = _field(1024, "most queued requests before overload (429)")
    scheduling_policy: str = _field("fcfs", "fcfs | priority (lower `priority` first)")
    preemption_mode: str = _field("recompute", "recompute | swap (KV to host memory)")
    batch_policy: str = _field("continuous", "continuous | static | dynamic")
    batch_window: float = _field(0.05, "dynamic batching: seconds to collect a batch")
    static_batch_timeout: float = _field(
        1.0, "static batching: most seconds to wait for a full batch"
    )
    async_scheduling: bool = _field(True, "plan step N+1 while the worker runs step N")

    def __post_init__(self) -> None:
        _check(
            self.scheduling_policy in ("fcfs", "priority"), "scheduling_policy", "fcfs or priority"
        )
        _check(
            self.preemption_mode in ("recompute", "swap"), "preemption_mode", "recompute or swap"
        )
        _check(
            self.batch_policy in ("continuous", "static", "dynamic"),
            "batch_policy",
            "continuous, static or dynamic",
        )
        _check(
            self.batch_window >= 0 and self.static_batch_timeout >= 0,
            "batch_window",
            ">= 0 (and --static-batch-timeout too)",
        )
        _check(self.max_num_seqs >= 1, "max_num_seqs", ">= 1")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1")
        _check(self.max_waiting >= 1, "max_waiting", ">= 1")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = _field("127.0.0.1", "HTTP bind address")
    port: int = _field(8000, "HTTP port (0: pick a free one)")
    api_key: str = _field("", "clients must send 'Authorization: Bearer KEY' when set")
    grpc_port: int = _field(-1, "gRPC port on --host (-1: no gRPC server, 0: pick a free one)")
    model_root: str = _field(
        "", "hot swap loads only folders under this one (empty: any local folder)"
    )
    admin_token: str = _field(
        "",
        "admin API (HTTP /admin, gRPC Admin) wants 'Authorization: "
        "Bearer TOKEN'; empty: admin calls are refused",
    )
    num_tokenizers: int = _field(1, "tokenizer processes")
    gateway_processes: int = _field(
        0,
        "gateway processes serving the one HTTP (and gRPC) port, so a dying one loses only its "
        "own connections (0: 2 where there are 2 cores or more, else 1)",
    )
    run_dir: str = _field("", "folder for ipc sockets and the resolved config (default: temp)")
    ready_timeout: float = _field(600.0, "seconds to wait for every process to be ready")
    shutdown_timeout: float = _field(
        30.0, "on SIGTERM: seconds in-flight requests may take to finish (new ones get 503)"
    )
    max_restarts: int = _field(5, "restarts of one process per minute before giving up")
    resume_timeout: float = _field(
        120.0,
        "seconds a stream waits, paused, for a dead worker, scheduler, tokenizer or detokenizer "
        "to come back and resume it before it fails with a retryable 503 (0: it fails at once)",
    )
    max_request_bytes: int = _field(4 * 1024 * 1024, "largest HTTP request body (larger: 413)")
    request_body_timeout: float = _field(
        30.0, "seconds a client may pause while sending a request body (longer: 408)"
    )
    http_keep_alive_timeout: int = _field(
        75,
        "seconds an idle HTTP keep-alive connection stays open; longer than client pools keep "
        "idle connections (httpx 5 s, aiohttp 15 s), so a client never reuses one the server "
        "is closing and loses its request without a response",
    )
    max_prompt_chars: int = _field(
        1_000_000,
        "most characters in a prompt (all chat messages together), checked before tokenising",
    )
    log_level: str = _field("info", "debug | info | warning | error")
    chat_template: str = _field(
        "",
        "chat template for every chat request instead of the model's own: a Jinja file, or "
        "the template itself; it stays across hot-swaps (it renders for whatever model serves)",
    )
    trust_request_chat_template: bool = _field(
        False, "accept a request's own `chat_template` (as vLLM; otherwise refused with a 400)"
    )
    tool_call_parser: str = _field(
        "hermes",
        "how tool calls are read from the output: hermes (<tool_call>{json}</tool_call> "
        "blocks, the built-in tool template's format) or json (the whole output is a call)",
    )
    ignore_unknown_fields: bool = _field(
        False,
        "log request fields no API defines as a warning and ignore them, instead of a 400 "
        "naming them (as vLLM's --ignore-unknown-fields)",
    )
    reasoning_parser: str = _field(
        "",
        "how a chat answer's reasoning is read apart (to reasoning_content): deepseek_r1 or "
        "qwen3 (text between <think> tags); empty: none",
    )
    access_log: bool = _field(
        True, "one info log line per HTTP request (id, route, status, tokens, TTFT, time)"
    )
    metrics_vllm_names: bool = _field(
        False,
        "GET /metrics under vLLM's own names (vllm:*) instead of shuttle:*, so dashboards "
        "and autoscalers written for vLLM read shuttle unchanged",
    )
    pooling: str = _field(
        "last",
        "how /v1/embeddings pools the prompt's final-normed hidden states: last (the last "
        "token's, as Qwen3-Embedding) or mean (over every token; such requests take no "
        "prefix-cache hits)",
    )
    embedding_normalize: bool = _field(
        True,
        "L2-normalise embeddings (vLLM's pooler `normalize`; a request's `normalize` "
        "overrides it); --no-embedding-normalize: the pooled vectors as they are",
    )

    def __post_init__(self) -> None:
        _check(0 <= self.port < 65536, "port", "0..65535")
        _check(-1 <= self.grpc_port < 65536, "grpc_port", "-1 (off) or 0..65535")
        _check(self.max_request_bytes >= 1024, "max_request_bytes", ">= 1024")
        _check(self.request_body_timeout > 0, "request_body_timeout", "> 0")
        _check(self.http_keep_alive_timeout > 0, "http_keep_alive_timeout", "> 0")
        _check(self.max_prompt_chars >= 1, "max_prompt_chars", ">= 1")
        _check(self.num_tokenizers >= 1, "num_tokenizers", ">= 1")
        _check(self.gateway_processes >= 0, "gateway_processes", ">= 0 (0: by the cores)")
        _check(self.resume_timeout >= 0, "resume_timeout", ">= 0")
        _check(self.tool_call_parser in ("hermes", "json"), "tool_call_parser", "hermes or json")
        _check(self.pooling in POOLING_KINDS, "pooling", " or ".join(POOLING_KINDS))
        _check(
            self.reasoning_parser in ("", "deepseek_r1", "qwen3"),
            "reasoning_parser",
            "deepseek_r1, qwen3 or empty",
        )
        _check(
            self.log_level in ("debug", "info", "warning", "error"),
            "log_level",
            "debug, info, warning or error",
        )


@dataclasses.dataclass(frozen=True)
class AddressConfig:
    """Inbox address of each actor. Empty: `ipc://<run_dir>/<name>.sock` on this host."""

    gateway_addr: str = _field(
        "",
        "gateway inbox (e.g. tcp://gateway:5550); with --gateway-processes N > 1, N of them "
        "comma-separated",
    )
    scheduler_addr: str = _field("", "scheduler inbox")
    worker_addr: str = _field("", "worker inbox")
    detokenizer_addr: str = _field("", "detokenizer inbox")
    tokenizer_addrs: str = _field("", "comma-separated tokenizer inboxes")
    supervisor_addr: str = _field("", "supervisor inbox (ready and health reports)")
    zmq_bind_host: str = _field(
        "",
        "host an actor binds its tcp:// inbox on (e.g. 0.0.0.0 in "
        "a container, where the address names the service); "
        "empty: the address's own host",
    )
    curve_dir: str = _field(
        "",
        "folder of ZeroMQ CURVE keys (python -m common.curve keygen "
        "DIR); set: tcp:// links are encrypted and only key holders "
        "may send",
    )


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = dataclasses.field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    server: ServerConfig = dataclasses.field(default_factory=ServerConfig)
    addresses: AddressConfig = dataclasses.field(default_factory=AddressConfig)
    data_parallel: DataParallelConfig = dataclasses.field(default_factory=DataParallelConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)

    def addr(self, name: str) -> str:
        """Inbox address of actor `name` (gateway, scheduler, worker, detokenizer, supervisor)."""
        explicit = getattr(self.addresses, f"{name}_addr", "")
        return explicit or self._ipc(name)

    def tokenizer_addrs(self) -> list[str]:
        if self.addresses.tokenizer_addrs:
            return [a.strip() for a in self.addresses.tokenizer_addrs.split(",") if a.strip()]
        return [self._ipc(f"tokenizer-{i}") for i in range(self.server.num_tokenizers)]

    def bind_addr(self, addr: str) -> str:
        """Where an actor binds the inbox others reach at `addr`: the same address, or for
        tcp:// with --zmq-bind-host that host (a container binds 0.0.0.0 while its peers
        connect to tcp://SERVICE:PORT, a name it cannot bind)."""
        host = self.addresses.zmq_bind_host
        if not host or not addr.startswith("tcp://"):
            return addr
        port = addr.rpartition(":")[2]
        return f"tcp://{host}:{port}"

    def _ipc(self, name: str) -> str:
        if not self.server.run_dir:
            raise ConfigError(f"no address for {name}: set --run-dir or --{name}-addr")
        return f"ipc://{self.server.run_dir}/{name}.sock"

    def to_json(self) -> bytes:
        return orjson.dumps(dataclasses.asdict(self), option=orjson.OPT_INDENT_2)

    @classmethod
    def from_json(cls, data: bytes) -> Config:
        return from_mapping(orjson.loads(data))

    def replace(self, **sections: Mapping[str, Any]) -> Config:
        """A copy with some leaf fields changed: cfg.replace(server={"port": 0})."""
        return dataclasses.replace(
            self,
            **{s: dataclasses.replace(getattr(self, s), **v) for s, v in sections.items()},
        )


def _sections() -> list[tuple[str, type]]:
    hints = typing.get_type_hints(Config)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(Config)]


def _leaf_type(section: type, name: str) -> type:
    return typing.get_type_hints(section)[name]


def from_mapping(data: Mapping[str, Mapping[str, Any]]) -> Config:
    return Config(**{name: sec(**data.get(name, {})) for name, sec in _sections()})


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add one flag per config field (defaults are resolved later, env included)."""
    parser.add_argument(
        "--config-file",
        type=Path,
        default=None,
        help="start from this JSON config (as written by the supervisor)",
    )
    for sec_name, sec in _sections():
        group = parser.add_argument_group(sec_name)
        for f in dataclasses.fields(sec):
            flag = "--" + f.name.replace("_", "-")
            typ = _leaf_type(sec, f.name)
            help_text = (
                f"{f.metadata.get('help', '')} (default: {f.default!r}; "
                f"env {_ENV_PREFIX}{f.name.upper()})"
            )
            kwargs: dict[str, Any] = {
                "dest": f"{sec_name}.{f.name}",
                "default": argparse.SUPPRESS,
                "help": help_text,
            }
            if typ is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = typ
            if "nargs" in f.metadata:  # a list flag, kept comma-separated in the config
                kwargs["nargs"] = f.metadata["nargs"]
            group.add_argument(flag, **kwargs)


def from_args(ns: argparse.Namespace, env: Mapping[str, str] | None = None) -> Config:
    """Resolve: config file, then SHUTTLE_* env, then flags."""
    env = os.environ if env is None else env
    cfg_file = getattr(ns, "config_file", None)
    data: dict[str, dict[str, Any]] = orjson.loads(Path(cfg_file).read_bytes()) if cfg_file else {}
    flags = vars(ns)
    for sec_name, sec in _sections():
        values = data.setdefault(sec_name, {})
        for f in dataclasses.fields(sec):
            typ = _leaf_type(sec, f.name)
            env_val = env.get(_ENV_PREFIX + f.name.upper())
            if env_val is not None and not cfg_file:
                values[f.name] = _parse(typ, env_val, f.name)
            if f"{sec_name}.{f.name}" in flags:
                value = flags[f"{sec_name}.{f.name}"]
                sep = f.metadata.get("sep", ",")  # (--lora-modules: JSON entries hold commas)
                values[f.name] = sep.join(value) if isinstance(value, list) else value
    return from_mapping(data)


def _parse(typ: Any, raw: str, name: str) -> Any:
    if isinstance(typ, types.UnionType):
        typ = next(t for t in typing.get_args(typ) if t is not type(None))
    try:
        if typ is bool:
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        return typ(raw)
    except ValueError:
        raise ConfigError(
            f"{_ENV_PREFIX}{name.upper()}={raw!r} is not a valid {typ.__name__}"
        ) from None
