"""Adapters in memory: the loaded ones by name, their tensors in a host-side LRU cache, and
each model version's `max_loras` slots that a step's rows point into.

    LoadLora(name, path) -> registry (spec: path, hash, rank) + tensors in the host cache
                            (at most max_cpu_loras; an evicted one is read again, its hash
                            checked, when a step needs it)
    a step's adapters    -> LoraSlots.assign: resident ones keep their slot (LRU touched);
                            the others take a free slot or the least recently used one not
                            in this step, copied into every LoRA layer's slot buffers in the
                            fused layout (q|k|v, gate|up), scaling already in B
                         -> the model's LoraMapping: each token's slot (-1: base)

A model version's slots belong to its layers (`enable_lora` on that model): a hot-swapped
version has slots of its own, and an adapter whose shapes do not fit it is refused for it.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable, Sequence

import torch
from torch import nn

from common.lora_config import LoraConfig
from gpu_worker.attention import AttentionMetadata
from gpu_worker.lora.adapter import (
    AdapterSpec,
    LoraAdapter,
    LoraAdapterError,
    ModelShape,
    load_adapter,
    read_weights,
    shard_module,
)
from gpu_worker.lora.layer import (
    TARGET_SLICES,
    LoraLinearMethod,
    LoraMapping,
    enable_lora,
    lora_layers,
)
from gpu_worker.lora.registry import LoadedAdapterSpecs
from gpu_worker.models.llama import LlamaModel, OneCallStepProtocol
from gpu_worker.models.llama_config import LlamaConfig

Target = tuple[LoraLinearMethod, int]  # a fused layer's method and the module's slice in it


def model_shape(config: LlamaConfig) -> ModelShape:
    """The sizes adapters are checked against, from our model config."""
    return ModelShape(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        q_size=config.num_heads * config.head_dim,
        kv_size=config.num_kv_heads * config.head_dim,
        intermediate_size=config.intermediate_size,
    )


class SkipWhenLoraActive:
    """The model's one-call step (a C kernel that runs every layer itself, without the
    layers' methods) for steps with no adapter row only: with one, the model runs its layers,
    whose LoraLinearMethod adds the deltas. The one place that keeps the fast path from
    silently dropping adapters."""

    def __init__(self, inner: OneCallStepProtocol, mapping: LoraMapping) -> None:
        self.inner = inner
        self.mapping = mapping

    def forward(
        self,
        model: LlamaModel,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        if self.mapping.active:
            return None
        return self.inner.forward(model, input_ids, positions, kv_cache, meta)


class LoraSlots:
    """One model version's `max_loras` adapter slots (the LoraLinearMethod buffers of its
    layers) and its LoraMapping. Slot contents are keyed by (name, weights hash), so an
    adapter reloaded with other weights is copied in again."""

    def __init__(self, model: nn.Module, mapping: LoraMapping, max_loras: int) -> None:
        self.mapping = mapping
        self.max_loras = max_loras
        self.methods: list[LoraLinearMethod] = []
        self.targets: dict[tuple[int, str], Target] = {}
        for name, layer, _ in lora_layers(model):
            method = layer.method
            assert isinstance(method, LoraLinearMethod)
            self.methods.append(method)
            index = int(name.split("layers.")[1].split(".")[0])
            fused = name.rsplit(".", 1)[1]
            for module, (target, s) in TARGET_SLICES.items():
                if target == fused:
                    self.targets[(index, module)] = (method, s)
        self.resident: collections.OrderedDict[tuple[str, str], int] = collections.OrderedDict()
        self.free = list(range(max_loras))

    def slots_for(
        self,
        specs: Sequence[AdapterSpec],
        adapter: Callable[[str], LoraAdapter],
        tp: tuple[int, int] = (0, 1),
    ) -> dict[str, int]:
        """A slot for each of the step's adapters (distinct, at most max_loras), copying in
        those not resident; `adapter(name)` gives the tensors, `tp` is (rank, world)."""
        if len(specs) > self.max_loras:
            raise ValueError(
                f"a step uses {len(specs)} LoRA adapters, more than --max-loras "
                f"{self.max_loras} (the scheduler bounds distinct adapters per step)"
            )
        keys = [(s.name, s.weights_hash) for s in specs]
        out: dict[str, int] = {}
        for key in keys:
            if key in self.resident:
                self.resident.move_to_end(key)
                out[key[0]] = self.resident[key]
        for key in keys:
            if key[0] not in out:
                slot = self._take_slot(keep=set(keys))
                try:
                    self._fill(slot, adapter(key[0]), tp)
                except BaseException:  # refused (or unreadable): the slot is free, not lost
                    self.free.append(slot)
                    raise
                self.resident[key] = slot
                out[key[0]] = slot
        return out

    def evict(self, name: str) -> None:
        """Forget the slot contents of every version of adapter `name`."""
        for key in [k for k in self.resident if k[0] == name]:
            self.free.append(self.resident.pop(key))

    def _take_slot(self, keep: set[tuple[str, str]]) -> int:
        if self.free:
            return self.free.pop(0)
        victim = next(k for k in self.resident if k not in keep)  # LRU first
        return self.resident.pop(victim)

    def _fill(self, slot: int, adapter: LoraAdapter, tp: tuple[int, int]) -> None:
        """Copy the adapter's (sharded) A and B into `slot` of every layer; the rest of the
        slot (untargeted modules, ranks below max) zero. Checks every shape first, so a
        refused adapter leaves the slot as it was."""
        copies = []
        for (layer, module), (a, b) in adapter.weights.items():
            method, s = self.targets.get((layer, module), (None, 0))
            if method is None:
                raise LoraAdapterError(f"{adapter.spec.path}: no layer {layer} {module} here")
            a, b = shard_module(module, a, b, *tp)
            lo, hi = method.slice_bounds[s], method.slice_bounds[s + 1]
            _, _, max_rank, n_in = method.lora_a.shape
            if a.shape[0] > max_rank or a.shape[1] != n_in or b.shape[0] != hi - lo:
                raise LoraAdapterError(
                    f"{adapter.spec.path}: layer {layer} {module} (A {list(a.shape)}, B "
                    f"{list(b.shape)}) does not fit this model version's layer "
                    f"(in {n_in}, out {hi - lo}, rank <= {max_rank})"
                )
            copies.append((method, s, lo, hi, a, b))
        with torch.no_grad():
            for method in self.methods:
                method.lora_a[slot].zero_()
                method.lora_b[slot].zero_()
            for method, s, lo, hi, a, b in copies:
                r = a.shape[0]
                method.lora_a[slot, s, :r].copy_(a)
                method.lora_b[slot, lo:hi, :r].copy_(b)


class LoraManager:
    """The runner's adapters: the registry of loaded ones, their tensors in an LRU host
    cache of `max_cpu_loras`, and the slots of each model version (`attach`)."""

    def __init__(
        self, options: LoraConfig, config: LlamaConfig, tp: tuple[int, int] = (0, 1)
    ) -> None:
        self.options = options
        self.registry = LoadedAdapterSpecs(options, model_shape(config))
        self.tp = tp  # (rank, world): each rank keeps its shard in its slots
        self.cache: collections.OrderedDict[str, LoraAdapter] = collections.OrderedDict()
        self._slots: weakref.WeakKeyDictionary[nn.Module, LoraSlots] = weakref.WeakKeyDictionary()

    # adapters by name ------------------------------------------------------------------------
    def load(self, name: str, path: str) -> AdapterSpec:
        """Read and check the folder, keep it under `name` (replacing an adapter of that
        name: its slots are freed); a LoraAdapterError leaves everything as it was."""
        spec = self.registry.check(name, path)
        if self.registry.specs.get(name) == spec:  # the same files again: nothing changes
            return spec
        adapter = read_weights(spec)
        self._forget(name)
        self.registry.add(adapter.spec)
        self._cache_put(adapter)
        return adapter.spec

    def unload(self, name: str) -> None:
        """Forget `name`: its spec, tensors and slots (a KeyError when not loaded)."""
        self.registry.remove(name)
        self._forget(name)

    def adapter(self, name: str) -> LoraAdapter:
        """The tensors of a loaded adapter: from the cache, else read again from its folder
        (refused if its files changed since it was loaded)."""
        if name in self.cache:
            self.cache.move_to_end(name)
            return self.cache[name]
        spec = self.registry.spec(name)
        adapter = load_adapter(name, spec.path, self.registry.shape, self.options.max_lora_rank)
        if adapter.spec.weights_hash != spec.weights_hash:
            raise LoraAdapterError(
                f"{spec.path}: the adapter {name!r} changed on disk since it was loaded "
                f"(hash {adapter.spec.weights_hash}, loaded {spec.weights_hash}): load it again"
            )
        self._cache_put(adapter)
        return adapter

    def _cache_put(self, adapter: LoraAdapter) -> None:
        self.cache[adapter.name] = adapter
        self.cache.move_to_end(adapter.name)
        while len(self.cache) > self.options.cpu_loras:
            self.cache.popitem(last=False)

    def _forget(self, name: str) -> None:
        self.cache.pop(name, None)
        for slots in self._slots.values():
            slots.evict(name)

    # model versions and steps ----------------------------------------------------------------
    def attach(self, model: nn.Module, max_tokens: int, kernel: str = "torch") -> LoraSlots:
        """Give a freshly loaded model (a version) its LoRA layers and slots; its one-call
        step, if any, then runs only steps without adapter rows."""
        mapping = enable_lora(
            model,
            max_loras=self.options.max_loras,
            max_rank=self.options.max_lora_rank,
            max_tokens=max_tokens,
            kernel=kernel,
            dtype=None
            if self.options.lora_dtype == "auto"
            else getattr(torch, self.options.lora_dtype),
        )
        inner = model.get_submodule("model")
        # the one-call step adds the deltas of the "cpu" kernel's slots itself (lora.c); for
        # the other kernels it must leave steps with adapter rows to the layers
        if isinstance(inner, LlamaModel) and inner.one_call_step is not None and kernel != "cpu":
            inner.one_call_step = SkipWhenLoraActive(inner.one_call_step, mapping)
        slots = LoraSlots(model, mapping, self.options.max_loras)
        self._slots[model] = slots
        return slots

    def slots(self, model: nn.Module) -> LoraSlots:
        """The slots of a model `attach` was given."""
        return self._slots[model]

    def set_step(self, model: nn.Module, rows: Sequence[tuple[str, int]]) -> None:
        """Point `model`'s mapping at this step's adapters: `rows` are (adapter name or "",
        number of tokens) in the packed order of the forward's input."""
        slots = self._slots[model]
        names = sorted({name for name, _ in rows if name})
        if not names:
            slots.mapping.clear()
            return
        slot_of = slots.slots_for([self.registry.spec(n) for n in names], self.adapter, self.tp)
        tokens: list[int] = []
        for name, count in rows:
            tokens += [slot_of[name] if name else -1] * count
        slots.mapping.set(tokens)
