"""Will a colocated run fit its GPU? An estimate of the memory of both phases, from the model's architecture, its dtype
and the recipe, checked before vLLM or the model loads (`ARPOTrainer` on CUDA; `arpo-trl memory-plan`).

Nothing here is measured: every number is arithmetic on `config.json` and the recipe (`ASSUMPTIONS` lists what is
assumed), the same arithmetic as the memory table of docs/one_gpu.md (`benchmarks/one_gpu_memory.py`). What it
checks, in the order a run meets it:

1. vLLM starts: its worker refuses to start when free memory is below `vllm_gpu_memory_utilization` × total
   (vLLM 0.31 and 0.22, `vllm/v1/worker/utils.py::request_memory`), and the trainer's weights already take their
   share of "free" in the same process;
2. the KV cache vLLM is left with holds one path of `max_model_len` tokens (else vLLM refuses to start);
3. the rollout phase (trainer weights and LoRA state, and vLLM's whole share, awake) fits the card;
4. the training phase (trainer weights, LoRA state, one micro-batch's activations, and what vLLM keeps while it
   sleeps, or its whole share without sleep mode) fits the card.
A setting that fails one says which field to change, and to what.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from dataclasses import replace as replace_shape

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_BYTES_PER_PARAM = 4 + 4 + 2 * 4  # fp32 weight (PEFT's autocast_adapter_dtype), its grad, AdamW m and v
LOGPROB_TOKEN_TILE, LOGPROB_VOCAB_TILE = 4096, 32768  # TRL 1.16's fused LM head tile (kernels/chunked_logprob.py)
VLLM_GRAPH_AND_NON_TORCH_BYTES = 1 * GIB  # CUDA graphs pool + non-torch memory vLLM counts in its share (assumed)
CUDA_CONTEXT_BYTES = 1 * GIB  # the training process's CUDA context and cuBLAS workspaces (assumed)
FRAGMENTATION = 0.05  # of the card, lost to the allocator (assumed)
UTILIZATION_STEP = 0.05

ASSUMPTIONS = [
    "Estimate, not a measurement: exact arithmetic on the model's config.json and the recipe. GiB = 2^30 bytes; a "
    "'24 GB' card is taken as 24 GiB.",
    "Trainer and vLLM weights at the model's dtype; embeddings tied where the config says so (one copy); no "
    "reference model (beta 0; with PEFT the reference is the adapter switched off).",
    "LoRA: r x (in + out) params per targeted linear; PEFT keeps adapters in fp32 (autocast_adapter_dtype=True): 4 "
    "(weight) + 4 (grad) + 8 (AdamW m, v) = 16 bytes/param; at vLLM's start only the 4-byte weights exist.",
    "Activations of one micro-batch of rows x (prompt + completion) tokens, padded to the longest (worst case), tree "
    "packing off (it computes shared prefixes once: less). With activation checkpointing: one checkpoint per layer "
    "(hidden) + the working set of the layer being recomputed, (14 hidden + 4 kv_heads x head_dim + 7 intermediate) "
    "values per token; without: every layer's working set. Values in bf16 under bf16/fp16 training, else at the "
    "model's dtype; + the boolean 4D attention mask rows x seq^2.",
    "Log-probabilities: TRL 1.16 projects completion positions only, in tiles of "
    f"{LOGPROB_TOKEN_TILE} tokens x {LOGPROB_VOCAB_TILE} vocab (trainer/utils.py add_fused_lm_head): the final "
    "hidden states, the gathered completion hidden states, their fp32 gradient and one tile.",
    "vLLM's share (vllm_gpu_memory_utilization x card) = its weight copy + the profile run's activations "
    "(max_num_batched_tokens x (2 intermediate + 4 hidden) values) + the sampler's logits (max_num_seqs rows x vocab "
    f"x 3 fp32 buffers) + {VLLM_GRAPH_AND_NON_TORCH_BYTES // GIB} GiB (CUDA graphs, non-torch memory) + the KV cache, "
    "which is what is left.",
    "KV bytes/token = 2 (K and V) x layers x kv_heads x head_dim x the dtype's bytes. 'Paths held' = KV tokens / "
    "(prompt + completion), with no prefix shared (forks share theirs, so more fit).",
    "Sleep mode (training phase): level 2, as arpo-trl's colocate mode sleeps: vLLM's KV cache and weight copy are "
    "freed, its fixed buffers stay.",
    f"Free memory before anything loads: measured on CUDA; for a --gpu-gib card, the card minus "
    f"{CUDA_CONTEXT_BYTES // GIB} GiB (CUDA context, cuBLAS). A phase fits within free memory minus "
    f"{FRAGMENTATION:.0%} of the card (fragmentation).",
]


@dataclass(frozen=True)
class Architecture:
    """What the estimate reads of a decoder's `config.json`."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    qkv_bias: bool = True  # Qwen2 has biases on q, k and v

    @classmethod
    def from_config(cls, config) -> Architecture:
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = config.num_attention_heads
        return cls(config.hidden_size, config.intermediate_size, config.num_hidden_layers, heads,
                   getattr(config, "num_key_value_heads", None) or heads,
                   getattr(config, "head_dim", None) or config.hidden_size // heads, config.vocab_size,
                   bool(getattr(config, "tie_word_embeddings", False)),
                   bool(getattr(config, "attention_bias", config.model_type == "qwen2")))

    def params(self) -> int:
        """All parameters: embeddings (+ an untied head), per layer q/k/v (biases if any), o, gate/up/down, two
        norms, and the final norm."""
        kv, q = self.kv_heads * self.head_dim, self.heads * self.head_dim
        attention = self.hidden * (q + 2 * kv) + q * self.hidden + (q + 2 * kv) * self.qkv_bias
        layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.layers * layer + self.hidden

    def lora_params(self, r: int, targets: tuple[str, ...] = LORA_TARGETS) -> int:
        """r x (in_features + out_features) per targeted linear, per layer (unknown module names count nothing)."""
        h, kv, q, i = self.hidden, self.kv_heads * self.head_dim, self.heads * self.head_dim, self.intermediate
        shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                  "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        if "all-linear" in targets:
            targets = LORA_TARGETS
        return self.layers * sum(r * sum(shapes[name]) for name in targets if name in shapes)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


# config.json of the models the shipped recipes name (from the Hugging Face Hub), for a plan made without the Hub
KNOWN_ARCHITECTURES = {
    "Qwen/Qwen2.5-1.5B-Instruct": Architecture(1536, 8960, 28, 12, 2, 128, 151936, True),
    "Qwen/Qwen2.5-3B-Instruct": Architecture(2048, 11008, 36, 16, 2, 128, 151936, True),
    "Qwen/Qwen2.5-7B-Instruct": Architecture(3584, 18944, 28, 28, 4, 128, 152064, False),
}


@dataclass(frozen=True)
class RunShape:
    """What the recipe asks of the card (`ARPOConfig` and TRL's `ModelConfig` fields)."""

    dtype: str  # the model's (`dtype`); vLLM gets the same
    prompt_tokens: int  # max_prompt_length
    completion_tokens: int  # max_completion_length, tool results included
    micro_batch: int  # per_device_train_batch_size
    rows_per_rollout: int  # per_device_train_batch_size x gradient_accumulation_steps
    lora_r: int | None  # None: no LoRA (full fine-tuning is not estimated)
    max_num_seqs: int  # the colocated engine's (`colocate.engine_args.batch_limits`)
    max_num_batched_tokens: int
    lora_targets: tuple[str, ...] = LORA_TARGETS
    half_precision_training: bool = True  # bf16 / fp16 autocast
    activation_checkpointing: bool = True
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None  # vllm_max_model_length; None: prompt + completion
    sleep: bool = True  # vllm_enable_sleep_mode

    @property
    def path_tokens(self) -> int:
        return self.max_model_len or self.prompt_tokens + self.completion_tokens

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


@dataclass
class MemoryPlan:
    """Bytes of each part and phase of one setting on one card, and what does not fit (`problems`: setting and
    one-line fix)."""

    total: int
    free: int
    trainer_weights: int
    lora_state: int
    vllm_request: int
    free_at_vllm_start: int
    vllm_weights: int
    vllm_fixed: int
    kv_bytes: int
    kv_tokens: int
    paths_held: int
    activations: int
    rollout_phase: int
    training_phase: int
    usable: int
    problems: list[tuple[str, str]] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems

    def verdict(self) -> str:
        """One line: what fits, or the first setting to change."""
        if self.problems:
            return f"does not fit: {self.problems[0][1]}"
        return (f"fits: vLLM {_gib(self.vllm_request)} GiB of {_gib(self.free_at_vllm_start)} free at its start "
                f"({self.kv_tokens:,} KV tokens, {self.paths_held} paths), rollout phase {_gib(self.rollout_phase)} "
                f"GiB, training phase {_gib(self.training_phase)} GiB, of {_gib(self.usable)} GiB usable")


def _gib(value: float) -> str:
    return f"{value / GIB:.1f}"


def activation_bytes(arch: Architecture, rows: int, shape: RunShape) -> int:
    """One micro-batch's training activations (`ASSUMPTIONS`)."""
    value = 2 if shape.half_precision_training else shape.dtype_bytes
    seq = shape.prompt_tokens + shape.completion_tokens
    tokens, scored = rows * seq, rows * shape.completion_tokens
    working = tokens * (14 * arch.hidden + 4 * arch.kv_heads * arch.head_dim + 7 * arch.intermediate) * value
    layers = arch.layers * tokens * arch.hidden * value + working if shape.activation_checkpointing \
        else arch.layers * working
    head = tokens * arch.hidden * value + scored * arch.hidden * (value + 4) \
        + min(scored, LOGPROB_TOKEN_TILE) * LOGPROB_VOCAB_TILE * value
    return layers + head + rows * seq * seq


def vllm_fixed_bytes(arch: Architecture, shape: RunShape) -> int:
    """vLLM's share beyond its weights and KV cache: the profile run's activations, the sampler's logits, CUDA graphs
    and non-torch memory."""
    profile = shape.max_num_batched_tokens * (2 * arch.intermediate + 4 * arch.hidden) * shape.dtype_bytes
    return profile + shape.max_num_seqs * arch.vocab * 4 * 3 + VLLM_GRAPH_AND_NON_TORCH_BYTES


def plan(arch: Architecture, shape: RunShape, total: int, free: int | None = None) -> MemoryPlan:
    """The memory of `shape` on a card of `total` bytes with `free` bytes free before anything loads (default: the
    card minus a CUDA context), and what does not fit."""
    result = budget(arch, shape, total, total - CUDA_CONTEXT_BYTES if free is None else free)
    result.problems = problems(arch, shape, result)
    return result


def budget(arch: Architecture, shape: RunShape, total: int, free: int) -> MemoryPlan:
    """The bytes of each part and phase (`MemoryPlan` without its problems)."""
    weights = arch.params() * shape.dtype_bytes
    lora = arch.lora_params(shape.lora_r, shape.lora_targets) if shape.lora_r else 0
    request = int(shape.gpu_memory_utilization * total)
    at_start = free - weights - lora * 4  # the trainer's weights and adapters are in memory when vLLM starts
    fixed = vllm_fixed_bytes(arch, shape)
    kv = max(request - weights - fixed, 0)
    kv_tokens = kv // arch.kv_bytes_per_token(shape.dtype_bytes)
    acts = activation_bytes(arch, shape.micro_batch, shape)
    trainer = weights + lora * LORA_BYTES_PER_PARAM
    return MemoryPlan(total, free, weights, lora * LORA_BYTES_PER_PARAM, request, at_start, weights, fixed, kv,
                      kv_tokens, kv_tokens // shape.path_tokens, acts, trainer + request,
                      trainer + acts + (fixed if shape.sleep else request), free - int(FRAGMENTATION * total))


def _starts(arch: Architecture, shape: RunShape, p: MemoryPlan) -> bool:
    """vLLM starts (its share is free, its KV cache holds one path) and the rollout phase fits."""
    return p.free_at_vllm_start >= p.vllm_request and p.kv_bytes >= _one_path(arch, shape) and \
        p.rollout_phase <= p.usable


def _fits(arch: Architecture, shape: RunShape, total: int, free: int) -> bool:
    p = budget(arch, shape, total, free)
    return _starts(arch, shape, p) and p.training_phase <= p.usable


def problems(arch: Architecture, shape: RunShape, p: MemoryPlan) -> list[tuple[str, str]]:
    """What does not fit, in the order a run meets it, each as (field, a sentence naming the change)."""
    found, util = [], shape.gpu_memory_utilization
    best = None if _starts(arch, shape, p) else best_utilization(arch, shape, p.total, p.free)
    if p.free_at_vllm_start < p.vllm_request:
        if shape.dtype == "float32" and _fits(arch, replace_shape(shape, dtype="bfloat16"), p.total, p.free):
            fix = (f"dtype float32: vLLM asks for {util} x {_gib(p.total)} = {_gib(p.vllm_request)} GiB but only "
                   f"{_gib(p.free_at_vllm_start)} GiB are free once the trainer's float32 weights are loaded (vLLM "
                   "refuses to start below its share; it would run float32 too, at twice the weights and KV cache "
                   "and without FlashAttention): set dtype: bfloat16")
            return [("dtype", fix)]
        start = (f"vLLM asks for {_gib(p.vllm_request)} GiB but only {_gib(p.free_at_vllm_start)} GiB are free once "
                 "the trainer's weights are loaded")
        if best is not None:
            return [("vllm_gpu_memory_utilization", f"vllm_gpu_memory_utilization {util}: {start}: set it to {best}")]
        return [("model_name_or_path", f"{start}, and no vllm_gpu_memory_utilization leaves room for one path's KV "
                                       "cache and the rollout phase: use a smaller model or a larger card")]
    if p.kv_bytes < _one_path(arch, shape):
        fix = f"set it to {best}" if best is not None else "lower max_completion_length"
        found.append(("vllm_gpu_memory_utilization", f"vllm_gpu_memory_utilization {util} leaves vLLM "
                      f"{_gib(p.kv_bytes)} GiB of KV cache, less than one path of {shape.path_tokens} tokens "
                      f"({_gib(_one_path(arch, shape))} GiB): {fix}"))
    if p.rollout_phase > p.usable:
        fix = f"set it to {best}" if best is not None else "use a smaller model or a larger card"
        found.append(("vllm_gpu_memory_utilization", f"vllm_gpu_memory_utilization {util}: the rollout phase takes "
                      f"{_gib(p.rollout_phase)} GiB of {_gib(p.usable)} GiB usable (vLLM's share and the trainer's "
                      f"LoRA state): {fix}"))
    if p.training_phase > p.usable:
        found.append(training_fix(arch, shape, p))
    return found


def _one_path(arch: Architecture, shape: RunShape) -> int:
    return shape.path_tokens * arch.kv_bytes_per_token(shape.dtype_bytes)


def best_utilization(arch: Architecture, shape: RunShape, total: int, free: int) -> float | None:
    """The largest `vllm_gpu_memory_utilization` (a multiple of the step) with which the plan fits, or None."""
    for k in range(int(round(1 / UTILIZATION_STEP)), 0, -1):
        candidate = round(k * UTILIZATION_STEP, 2)
        if _fits(arch, replace_shape(shape, gpu_memory_utilization=candidate), total, free):
            return candidate
    return None


def training_fix(arch: Architecture, shape: RunShape, p: MemoryPlan) -> tuple[str, str]:
    """The setting to change when the training phase does not fit: a smaller micro-batch (the same rows a rollout),
    sleep mode, or activation checkpointing."""
    phase = f"the training phase takes {_gib(p.training_phase)} GiB of {_gib(p.usable)} GiB usable"
    for rows in (shape.micro_batch // 2 ** k for k in range(1, 8)):
        smaller = budget(arch, replace_shape(shape, micro_batch=rows), p.total, p.free) if rows >= 1 else None
        if smaller is not None and smaller.training_phase <= p.usable:
            steps = max(1, shape.rows_per_rollout // rows)
            return ("per_device_train_batch_size", f"per_device_train_batch_size {shape.micro_batch}: {phase}: set it "
                    f"to {rows} (gradient_accumulation_steps {steps} keeps {shape.rows_per_rollout} rows a rollout)")
    if not shape.sleep:
        return "vllm_enable_sleep_mode", f"{phase} with vLLM awake: set vllm_enable_sleep_mode: true"
    return ("activation_checkpointing", f"{phase} even one row at a time: turn activation checkpointing on, or lower "
            "max_completion_length")


def model_dtype(requested, config=None) -> str:
    """The dtype `from_pretrained` loads at: `requested` (a name or a torch dtype), or for None and 'auto' the
    checkpoint's (`config.dtype`; float32 where the config names none)."""
    if requested is None or requested == "auto":
        requested = getattr(config, "dtype", None) or "float32"
    name = str(requested).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPE_BYTES)} or 'auto', got {requested!r}.")
    return name


def lora_shape(peft_config) -> tuple[int | None, tuple[str, ...]]:
    """(r, target modules) of a PEFT `LoraConfig`, (None, ()) without one."""
    if peft_config is None:
        return None, ()
    targets = peft_config.target_modules
    targets = (targets,) if isinstance(targets, str) else tuple(targets or LORA_TARGETS)
    return peft_config.r, targets


def run_shape(args, dtype: str, peft_config, prompt_tokens: int, max_num_seqs: int,
              max_num_batched_tokens: int) -> RunShape:
    """The shape of the run an `ARPOConfig` describes (`args`: its fields), with the model's dtype, the LoRA config, the
    longest prompt and the batch limits the colocated engine is given (`colocate.engine_args.batch_limits`)."""
    r, targets = lora_shape(peft_config)
    checkpointing = getattr(args, "activation_checkpointing", None)
    return RunShape(
        dtype, prompt_tokens, args.max_completion_length, args.per_device_train_batch_size,
        args.per_device_train_batch_size * args.gradient_accumulation_steps, r, max_num_seqs, max_num_batched_tokens,
        targets or LORA_TARGETS, half_precision_training=bool(args.bf16 or args.fp16),
        activation_checkpointing=bool(args.gradient_checkpointing if checkpointing is None else checkpointing),
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        max_model_len=args.vllm_max_model_length, sleep=bool(args.vllm_enable_sleep_mode))


def table(arch: Architecture, shape: RunShape, p: MemoryPlan) -> str:
    """The plan as a short markdown table of GiB, with its verdict."""
    from arpo_trl.markdown import markdown_table

    rows = [["trainer weights", _gib(p.trainer_weights), f"{arch.params() / 1e9:.2f} B params in {shape.dtype}"],
            ["LoRA weights, grads and AdamW state", _gib(p.lora_state), f"r {shape.lora_r}"],
            ["free when vLLM starts", _gib(p.free_at_vllm_start), f"of {_gib(p.free)} free before loading"],
            ["vLLM's share", _gib(p.vllm_request), f"vllm_gpu_memory_utilization {shape.gpu_memory_utilization}"],
            ["  its weights + fixed buffers", f"{_gib(p.vllm_weights)} + {_gib(p.vllm_fixed)}",
             f"max_num_seqs {shape.max_num_seqs}, max_num_batched_tokens {shape.max_num_batched_tokens}"],
            ["  its KV cache", _gib(p.kv_bytes), f"{p.kv_tokens:,} tokens, {p.paths_held} paths of "
             f"{shape.path_tokens}"],
            ["rollout phase", _gib(p.rollout_phase), f"of {_gib(p.usable)} usable"],
            ["training phase", _gib(p.training_phase), f"micro-batch {shape.micro_batch}, activations "
             f"{_gib(p.activations)}, sleep {'on' if shape.sleep else 'off'}"]]
    return markdown_table(["", "GiB", ""], rows) + f"\n\nEstimate, not a measurement: {p.verdict()}"
