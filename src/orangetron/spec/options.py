"""What the cost model is asked about: parallel degrees and the training options of one configuration."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from orangetron.spec import rules
from orangetron.spec.keys import hash_fields_once
from orangetron.spec.layout import Layout
from orangetron.spec.model import ModelSpec
from orangetron.spec.variants import CONTEXT_MODES, DISPATCHERS, SCHEDULES

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
RECOMPUTE = ("none", "selective", "full")
ATTENTION_KERNELS = ("flash", "flash2", "flash-triton", "eager")
# "delayed": Transformer Engine's per-tensor scales from an amax history; "blockwise": DeepSeek-V3's fine-grained
# scales, one per 1 x 128 activation tile and per 128 x 128 weight block (arXiv:2412.19437 section 3.3.2)
FP8_RECIPES = ("delayed", "blockwise")


# The planner prices the runtime's own layouts: one class, one set of rules.
Degrees = Layout


@dataclass(frozen=True)
class Job:
    """Training options that change memory, traffic or time. Field names match `ot.ParallelConfig`."""

    seq_len: int
    micro_batch: int = 1
    global_batch: int = 0  # sequences per step; 0: `num_microbatches` micro-batches per replica
    num_microbatches: int = 1  # used when global_batch is 0 (the runtime's ParallelConfig.microbatches)
    bucket_numel: int = 0  # gradient-reduction bucket size in elements; 0: one bucket per group
    clip_grad: bool = False  # sharded gradient clipping all-reduces one sum of squares per group
    sequence_parallel: bool = False
    cp_mode: str = "ring"
    ulysses_degree: int = 1  # for cp_mode "usp"
    dispatcher: str = "ragged"
    capacity_factor: float = 1.0
    ep_overlap_chunks: int = 1  # ragged dispatch in token chunks (one count exchange, then per-chunk rows)
    # SMs the "deepep" dispatcher's kernels occupy (Megatron-Core's moe_deepep_num_sms default; DeepSeek-V3's 20)
    ep_comm_sms: int = 20
    # Those SMs set aside from compute for the whole step (DeepSeek-V3 "allocate[s] 20 out of the 132 SMs" to
    # communication, arXiv:2412.19437 section 3.5.1); off: taken only while a transfer runs (Megatron-Core)
    ep_comm_sms_reserved: bool = False
    zero_stage: int = 0
    distributed_optimizer: bool = False
    zero3_prefetch: bool = True  # ZeRO-3 gathers the next unit while one computes (two units at the peak)
    zero3_keep_params: bool = False  # ZeRO-3 keeps forward's units until backward (one gather, whole model)
    zero3_reduce_every_microbatch: bool = False  # ZeRO-3 reduce-scatters every micro-batch (else once, after no_sync)
    param_dtype: str = "bfloat16"
    grad_dtype: str = "float32"  # main-gradient buffer (docs/data_parallel.md: fp32, 4 B)
    reduce_dtype: str = ""  # gradient reduction dtype; "" = param_dtype (docs/data_parallel.md's default)
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    # Decoder layers of each virtual stage, in order (chunk g on pipeline rank g % pp), as Megatron's
    # --pipeline-model-parallel-layout lists them; empty: the even split. Planner only
    pipeline_layout: tuple[int, ...] = ()
    recompute: str = "none"
    # Under full recompute, how many layers of each pipeline chunk replay their forward, counted from the chunk's
    # first (Megatron's block method, --recompute-num-layers); 0: every layer. Planner only
    recompute_layers: int = 0
    # "flash": the GPU's best fused kernel (FlashAttention-3 / cuDNN on Hopper), keeps no [s, s] scores;
    # "flash2": FlashAttention-2 (the same memory, its own speed); "flash-triton": FlashAttention in Triton (the
    # same memory, slower than FlashAttention-2 by the gaps `compute.TRITON_FLASH_GAP`); "eager" stores the scores
    attention_kernel: str = "flash"
    # Expert all-to-all hidden behind another micro-batch's layer (DualPipe-style pairing); off: behind the shared
    # experts only (see `timing._ep_window`)
    overlap_ep: bool = True
    # Gradient reductions hidden behind backward as buckets fill (the runtime, Megatron-Core's overlap_grad_reduce);
    # off: reduced after the last backward, as Megatron-LM (2021) and DeepSpeed's pipeline engine did. Planner only
    overlap_grad_reduce: bool = True
    # Megatron-Core's gradient path: weight gradients land in the contiguous main-gradient buffer (its fused
    # weight-gradient GEMM, or a hook adding each `.grad` as it arrives), and every reduction, the tp sums
    # included, runs where the buffer lies: one `.grad` at a time, no reduction buffers. Planner only
    grad_accumulation_fusion: bool = False
    fp8: bool = False  # FP8 linear layers (Transformer Engine style); planner only
    fp8_recipe: str = "delayed"  # how FP8 tensors are scaled (FP8_RECIPES)

    __hash__ = hash_fields_once  # keys the cost caches: hashed once

    def __post_init__(self) -> None:
        _check_choice("recompute", self.recompute, RECOMPUTE)
        CONTEXT_MODES[self.cp_mode], DISPATCHERS[self.dispatcher], SCHEDULES[self.pp_schedule]  # known names
        _check_choice("attention_kernel", self.attention_kernel, ATTENTION_KERNELS)
        _check_choice("fp8_recipe", self.fp8_recipe, FP8_RECIPES)
        rules.zero3_reduce_every_microbatch_needs_zero3(self.zero3_reduce_every_microbatch, self.zero_stage)
        if self.grad_accumulation_fusion and self.zero_stage >= 2:
            raise ValueError(f"grad_accumulation_fusion with zero_stage={self.zero_stage}: Megatron-Core's "
                             "main-gradient buffer is whole on every rank (DDP, ZeRO-1 or the distributed optimizer)")
        if self.grad_accumulation_fusion and self.reduce_dtype and self.reduce_dtype != self.main_grad_dtype:
            raise ValueError(f"grad_accumulation_fusion with reduce_dtype={self.reduce_dtype!r}: the main-gradient "
                             f"buffer is reduced where it lies, in its own dtype ({self.main_grad_dtype}); set "
                             "grad_dtype instead")
        object.__setattr__(self, "pipeline_layout", tuple(self.pipeline_layout))  # a list from JSON or TOML
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in self.pipeline_layout):
            raise ValueError(f"pipeline_layout={self.pipeline_layout}: layers per virtual stage must be integers >= 0")
        if self.recompute_layers < 0:
            raise ValueError(f"recompute_layers={self.recompute_layers}: must be >= 0 (0: every layer)")
        rules.recompute_layers_need_full(self.recompute_layers, self.recompute)
        rules.fp8_recipe_needs_fp8(self.fp8_recipe, self.fp8)
        for name in ("param_dtype", "grad_dtype"):
            _check_choice(name, getattr(self, name), tuple(DTYPE_BYTES))
        if self.reduce_dtype:
            _check_choice("reduce_dtype", self.reduce_dtype, tuple(DTYPE_BYTES))
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={self.zero_stage}: must be 0 (DDP), 1, 2 or 3")
        rules.distributed_optimizer_zero_stage(self.distributed_optimizer, self.zero_stage)
        dispatcher = DISPATCHERS[self.dispatcher]
        rules.reserved_sms_need_node_dispatch(self.ep_comm_sms_reserved, self.dispatcher, dispatcher.node_aware)
        if self.ep_comm_sms < 2 or self.ep_comm_sms % 2:
            raise ValueError(f"ep_comm_sms={self.ep_comm_sms}: DeepEP takes an even number of SMs, at least 2")
        for name in ("seq_len", "micro_batch", "virtual_stages", "num_microbatches", "ep_overlap_chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.param_dtype]

    @property
    def main_grad_dtype(self) -> str:
        """The main gradients' dtype: `grad_dtype` under mixed precision, else the parameters'."""
        return self.grad_dtype if self.mixed_precision else self.param_dtype

    @property
    def wire_dtype(self) -> str:
        """The gradient reduction's dtype: `reduce_dtype`, else the parameters' (docs/data_parallel.md), or the
        main-gradient buffer's own under `grad_accumulation_fusion` (reduced where it lies)."""
        return self.reduce_dtype or (self.main_grad_dtype if self.grad_accumulation_fusion else self.param_dtype)

    @property
    def reduce_bytes(self) -> int:
        return DTYPE_BYTES[self.wire_dtype]

    @property
    def mixed_precision(self) -> bool:
        """fp32 main params exist only when the model params are in a lower precision."""
        return DTYPE_BYTES[self.param_dtype] < 4

    @property
    def partial_recompute(self) -> bool:
        """Full recompute of only the first `recompute_layers` layers of each chunk."""
        return self.recompute == "full" and self.recompute_layers > 0

    def layer_job(self, replayed: bool) -> Job:
        """The job one layer runs under: under partial recompute a replayed layer's is full recompute and the
        others' none, so per-layer costs need only the two uniform cases; otherwise `self`."""
        return _layer_job(self, replayed) if self.partial_recompute else self

    def microbatches(self, degrees: Degrees) -> int:
        """Micro-batches per step on each data-parallel replica."""
        if not self.global_batch:
            return self.num_microbatches
        return self.global_batch // (self.micro_batch * degrees.dp)


@lru_cache(maxsize=65536)
def without_recompute(job: Job) -> Job:
    """`job` recomputing nothing: what each layer saves whole."""
    return canonical_job(replace(job, recompute="none", recompute_layers=0))


@lru_cache(maxsize=65536)
def _layer_job(job: Job, replayed: bool) -> Job:
    return canonical_job(replace(job, recompute="full" if replayed else "none", recompute_layers=0))


@lru_cache(maxsize=65536)
def canonical_job(job: Job) -> Job:
    """The first job seen equal to `job`. Cache keys built from one canonical object match by identity,
    without comparing every field (a search looks such keys up hundreds of thousands of times)."""
    return job


@lru_cache(maxsize=65536)
def without_data_parallel(job: Job) -> Job:
    """`job` with its optimizer sharding reset: the key for costs that sharding cannot change."""
    return canonical_job(replace(job, zero_stage=0, distributed_optimizer=False, zero3_reduce_every_microbatch=False))


@lru_cache(maxsize=65536)
def model_state_job(job: Job) -> Job:
    """`job` with every option reset that only sets activations, compute or the micro-batch count (sequence,
    micro-batch, global batch, recompute, cp, dispatcher, kernel): the key for the model states, their padding
    and gradient buckets. FP8 stays: a search never varies it, and its recipe is checked against it."""
    return canonical_job(replace(job, seq_len=1, micro_batch=1, global_batch=0, num_microbatches=1,
                                 sequence_parallel=False, cp_mode="ring", ulysses_degree=1, dispatcher="ragged",
                                 capacity_factor=1.0, ep_overlap_chunks=1, ep_comm_sms=20, ep_comm_sms_reserved=False,
                                 recompute="none", recompute_layers=0, attention_kernel="flash", overlap_ep=True,
                                 overlap_grad_reduce=True))


def _validate_fold(model: ModelSpec, degrees: Degrees, job: Job) -> None:
    """A folded expert mesh: experts to fold, a split their width allows, and tokens that differ per tp rank."""
    if not model.is_moe:
        raise ValueError(f"{degrees}: model {model.name} has no experts to fold")
    if model.moe_ffn_hidden_size % degrees.etp:
        raise ValueError(f"etp={degrees.etp}: moe_ffn_hidden_size={model.moe_ffn_hidden_size} is not divisible by etp")
    if degrees.tp > 1 and not job.sequence_parallel:
        raise ValueError(f"tp={degrees.tp} with folded experts needs sequence_parallel: each tp rank must route "
                         "its own tokens")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}: must be one of {', '.join(choices)}")


def _validate_layout(model: ModelSpec, chunks: int, layout: tuple[int, ...]) -> None:
    if len(layout) != chunks:
        raise ValueError(f"pipeline_layout has {len(layout)} virtual stages; pp*virtual_stages is {chunks}")
    if sum(layout) != model.num_layers:
        raise ValueError(f"pipeline_layout holds {sum(layout)} layers; {model.name} has {model.num_layers}")


def validate(model: ModelSpec, degrees: Degrees, job: Job) -> None:
    """Raise ValueError (naming the field, value and rule) for a layout the runtime could not run."""
    t, c, p = degrees.tp, degrees.cp, degrees.pp
    rules.tp_splits_heads(t, model.num_heads, model.kv_heads)
    if job.pipeline_layout:
        _validate_layout(model, p * job.virtual_stages, job.pipeline_layout)
    elif model.num_layers < p * job.virtual_stages:
        raise ValueError(f"pp={p}: num_layers={model.num_layers} < pp*virtual_stages={p * job.virtual_stages}")
    schedule, dispatcher, mode = SCHEDULES[job.pp_schedule], DISPATCHERS[job.dispatcher], CONTEXT_MODES[job.cp_mode]
    rules.virtual_stages_need_chunked_schedule(job.virtual_stages, job.pp_schedule, schedule.chunks)
    rules.ulysses_degree_only_for_its_modes(job.ulysses_degree, job.cp_mode, mode.takes_ulysses_degree)
    rules.overlap_chunks_need_chunked_dispatcher(job.ep_overlap_chunks, job.dispatcher, dispatcher.chunked)
    rules.cp_splits_sequence(c, job.seq_len)
    if job.sequence_parallel:
        rules.sp_splits_shard(t, c, job.seq_len)
    if c > 1:
        _validate_context_mode(model, degrees, job)
    rules.node_dispatch_needs_whole_experts(degrees.etp, job.dispatcher, dispatcher.node_aware)
    if degrees.expert_fold:
        _validate_fold(model, degrees, job)
    rules.ep_splits_experts(degrees.ep, model.num_experts if model.is_moe else 0)
    if job.global_batch and job.global_batch % (job.micro_batch * degrees.dp):
        raise ValueError(f"global_batch={job.global_batch} is not divisible by micro_batch*dp="
                         f"{job.micro_batch * degrees.dp}")
    schedule.check(p, job.microbatches(degrees))


def _validate_context_mode(model: ModelSpec, degrees: Degrees, job: Job) -> None:
    """The cp mode's rules: a Ulysses degree that divides cp, heads that its all-to-all can split."""
    mode, c = CONTEXT_MODES[job.cp_mode], degrees.cp
    rules.ulysses_degree_divides_cp(job.ulysses_degree, c)
    split = mode.head_split(c, job.ulysses_degree)
    if split > 1:
        rules.heads_split_by_all_to_all(split, model.num_heads // degrees.tp, max(1, model.kv_heads // degrees.tp))
