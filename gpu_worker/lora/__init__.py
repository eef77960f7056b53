"""LoRA adapters on the served base model (vLLM's multi-LoRA): many adapters in one batch.

layer.py     the contract: `LoraLinearMethod` wraps a layer's base method and adds each
             token's adapter delta; `LoraMapping` says which adapter slot each token uses
adapter.py   PEFT adapter folders read and checked (adapter_config.json + safetensors)
registry.py  the adapters loaded, by name (no torch); their settings: common/lora_config.py
manager.py   adapters in memory: a CPU-side LRU cache and the slots a step can use
"""
