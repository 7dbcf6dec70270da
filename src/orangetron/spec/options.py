"""What the cost model is asked about: parallel degrees and the training options of one configuration.

`Job` is the runtime's `ParallelConfig` (spec/parallel_config.py) with the fields only the planner prices: the
sequence and batch, the kernels, FP8, overlaps the runtime does not choose. A `ParallelConfig` the runtime runs
prices as `Job(**values_of(ParallelConfig, config), seq_len=..., micro_batch=...)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from orangetron.spec import rules
from orangetron.spec.keys import hash_fields_once
from orangetron.spec.layout import Layout
from orangetron.spec.model import ModelSpec
from orangetron.spec.parallel_config import DTYPE_BYTES, ParallelConfig, check_choice
from orangetron.spec.variants import CONTEXT_MODES, DISPATCHERS, SCHEDULES

ATTENTION_KERNELS = ("flash", "flash2", "flash-triton", "eager")
# "delayed": Transformer Engine's per-tensor scales from an amax history; "current": per-tensor scales from each
# tensor's own amax, taken just before its cast (Transformer Engine's Float8CurrentScaling, Megatron's "FP8-CS");
# "blockwise": DeepSeek-V3's fine-grained scales, one per 1 x 128 activation tile and per 128 x 128 weight block
# (arXiv:2412.19437 section 3.3.2; also how Blackwell's MXFP8, 1 x 32 tiles, is priced: plan/fp8.py)
FP8_RECIPES = ("delayed", "current", "blockwise")
# Modules whose forward replays in backward from their input instead of keeping their outputs (Megatron-Core's
# --recompute-modules, beside `recompute="selective"`, its "core_attn"): "layernorm" the outputs of the norms
# that stand alone (MLA's input norm, a MoE layer's pre-MLP norm),
# "mla_up_proj" MLA's up-projections and RoPE (Q, K, V), "mlp" a dense layer's MLP, "moe_act" the routed
# experts' activation (the down projection's input). Priced in plan/activations.py (module_replay_bytes).
# "alternate_mm" is torchtitan's op-level selective checkpointing instead (its `selective_ac_option = "op"`):
# in each layer every op's output replays except the fused attention's and every odd matmul's in the order the
# layer runs them (Q, K, V, O, gate, up, down: K, O and up replay). Alone, on a dense SwiGLU layer with plain
# attention, unbiased, at tp 1 and cp 1 (`alternate_mm_layout`); priced in plan/activations.py (alternate_mm_bytes)
RECOMPUTE_MODULES = ("layernorm", "mla_up_proj", "mlp", "moe_act", "alternate_mm")


# The planner prices the runtime's own layouts: one class, one set of rules.
Degrees = Layout


class DocLengths(tuple):
    """Packed documents' lengths, checked (integers >= 1) when made and hashed once: a Job is copied for every
    candidate the planner weighs, with up to 1,000,000 lengths."""

    def __new__(cls, lengths: Sequence[int] = ()) -> DocLengths:
        made = super().__new__(cls, lengths)
        if made and (set(map(type, made)) != {int} or min(made) < 1):  # in C
            raise ValueError("doc_lengths: document lengths must be integers >= 1")
        return made

    def __hash__(self) -> int:
        if "hash" not in self.__dict__:
            self.__dict__["hash"] = super().__hash__()
        return self.__dict__["hash"]


@dataclass(frozen=True, kw_only=True)
class Job(ParallelConfig):
    """Training options that change memory, traffic or time: the shared `ParallelConfig` fields, and the
    planner's own below (keyword-only)."""

    seq_len: int
    micro_batch: int = 1
    global_batch: int = 0  # sequences per step; 0: `microbatches` micro-batches per replica
    param_dtype: str = "bfloat16"  # the planner's default: bf16 weights with fp32 main copies, as clusters train
    clip_grad: bool = False  # sharded gradient clipping all-reduces one sum of squares per group
    # SMs the "deepep" dispatcher's kernels occupy (Megatron-Core's moe_deepep_num_sms default; DeepSeek-V3's 20)
    ep_comm_sms: int = 20
    # Those SMs set aside from compute for the whole step (DeepSeek-V3 "allocate[s] 20 out of the 132 SMs" to
    # communication, arXiv:2412.19437 section 3.5.1); off: taken only while a transfer runs (Megatron-Core)
    ep_comm_sms_reserved: bool = False
    grad_dtype: str = "float32"  # main-gradient buffer (docs/data_parallel.md: fp32, 4 B)
    # Decoder layers of each virtual stage, in order (chunk g on pipeline rank g % pp), as Megatron's
    # --pipeline-model-parallel-layout lists them; empty: the even split. Planner only
    pipeline_layout: tuple[int, ...] = ()
    # "flash": the GPU's best fused kernel (FlashAttention-3 / cuDNN on Hopper), keeps no [s, s] scores;
    # "flash2": FlashAttention-2 (the same memory, its own speed); "flash-triton": FlashAttention in Triton (the
    # same memory, slower than FlashAttention-2 by the gaps `compute.TRITON_FLASH_GAP`); "eager" stores the scores
    attention_kernel: str = "flash"
    # Expert all-to-all hidden behind another micro-batch's layer (DualPipe-style pairing); off: behind the shared
    # experts only (see `timing._ep_window`)
    overlap_ep: bool = True
    # Without that pairing, the shared experts run beside the all-to-all (DeepSeek-V2; Megatron-Core's
    # --moe-shared-expert-overlap); off: the all-to-all blocks the layer, as Megatron-Core runs it by default.
    # Planner only
    overlap_shared_experts: bool = True
    # Gradient reductions hidden behind backward as buckets fill (the runtime, Megatron-Core's overlap_grad_reduce);
    # off: reduced after the last backward, as Megatron-LM (2021) and DeepSpeed's pipeline engine did. Planner only
    overlap_grad_reduce: bool = True
    # Megatron-Core's gradient path: weight gradients land in the contiguous main-gradient buffer (its fused
    # weight-gradient GEMM, or a hook adding each `.grad` as it arrives), and every reduction, the tp sums
    # included, runs where the buffer lies: one `.grad` at a time, no reduction buffers. Planner only
    grad_accumulation_fusion: bool = False
    fp8: bool = False  # FP8 linear layers (Transformer Engine style); planner only
    fp8_recipe: str = "delayed"  # how FP8 tensors are scaled (FP8_RECIPES)
    # Packed documents' lengths in tokens, in the order they are packed into sequences of seq_len (a document
    # continued into the next sequence restarts there), micro_batch consecutive sequences a micro-batch, whose
    # rows the runtime shards together (plan/packed.py); empty: one document per sequence. Planner only
    doc_lengths: tuple[int, ...] = ()
    # The documents of a step's micro-batches, one entry per micro-batch of this rank: per row, the [start, stop)
    # of each document, from 0 to seq_len (the end-of-run table prices a run's own last step so); empty: priced
    # from doc_lengths. Planner only
    doc_batches: tuple[tuple[tuple[tuple[int, int], ...], ...], ...] = ()
    # The tokens of each sequence that are data where seq_len is that length padded at its end for cp, as the
    # trainer pads it (ignored labels); 0: all seq_len are. Time and memory are the padded sequence's, tokens/s and
    # model FLOPs these tokens' (`data_tokens`). Planner only
    data_seq_len: int = 0
    # Adam's two moments kept in this dtype (Megatron-Core's precision-aware optimizer, `--exp-avg-dtype bf16
    # --exp-avg-sq-dtype bf16`); None: the main parameters' dtype, as the runtime keeps them. Planner only
    optimizer_state_dtype: str | None = None
    # Partial gradients (sequence parallel's replicated norms, kv heads fewer than tp, QK-norm) summed over tp in
    # the data-parallel reduction's own pass, unit by unit, as Megatron-Core (`finalize_model_grads`) and
    # torchtitan (FSDP2 with DTensor) do: the sums commute, so nothing waits for the step. Off: the runtime sums
    # them over tp first and holds every data-parallel reduction, and each `.grad`, to the step. Planner only
    tp_sum_with_reduction: bool = False
    # Gradients waiting unsharded across micro-batches (ZeRO-2/3 without a reduction per micro-batch, or held to
    # the step) are accumulated in the reduce dtype, as FSDP2 upcasts them (`FSDPParam.to_accumulated_grad_if_
    # needed`); off: in the parameter dtype, as the runtime's `.grad`. No effect where the two dtypes are one.
    # Planner only
    accumulate_in_reduce_dtype: bool = False
    # The loss upcasts the logits and runs torch's unfused cross-entropy (torchtitan's
    # `cross_entropy(pred.flatten(0, 1).float(), labels)`): its backward holds three float32 copies of the
    # logits (the log-softmax it saved, the gradient nll_loss writes, log-softmax's input gradient) where the
    # runtime's fused loss holds one. Planner only
    eager_fp32_loss: bool = False
    # Modules replayed in backward (RECOMPUTE_MODULES), in any order; not with full recompute. Planner only
    recompute_modules: tuple[str, ...] = ()
    # DeepSeek-V3's low-precision activations (arXiv:2412.19437 section 3.3.3), with the blockwise recipe: the
    # attention output kept once, in a 12-bit format (E5M6) with its tile scales, for both the attention's
    # backward and the output projection's; a MoE layer's SwiGLU inputs (gate and up) kept as FP8 casts with
    # their tile scales. Planner only
    fp8_cached_activations: bool = False
    # Tensor-parallel traffic run in chunks beside the GEMMs that produce or consume it (Transformer Engine's
    # userbuffers overlap: Megatron's --tp-comm-overlap, NeMo's ub_tp_comm_overlap); off: each all-gather and
    # reduce-scatter blocks its GEMM, as the runtime runs them. Needs sequence parallelism. Planner only
    tp_comm_overlap: bool = False

    __hash__ = hash_fields_once  # keys the cost caches: hashed once

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("attention_kernel", self.attention_kernel, ATTENTION_KERNELS)
        check_choice("fp8_recipe", self.fp8_recipe, FP8_RECIPES)
        check_choice("grad_dtype", self.grad_dtype, tuple(DTYPE_BYTES))
        if self.optimizer_state_dtype is not None:
            check_choice("optimizer_state_dtype", self.optimizer_state_dtype, tuple(DTYPE_BYTES))
        self._check_grad_accumulation_fusion()
        object.__setattr__(self, "pipeline_layout", tuple(self.pipeline_layout))  # a list from JSON or TOML
        if type(self.doc_lengths) is not DocLengths:  # a copy of a Job keeps its lengths, checked and hashed once
            object.__setattr__(self, "doc_lengths", DocLengths(self.doc_lengths))
        object.__setattr__(self, "doc_batches", tuple(tuple(tuple(tuple(piece) for piece in row) for row in batch)
                                                      for batch in self.doc_batches))  # hashable, as lists are not
        self._check_recompute_modules()
        if isinstance(self.data_seq_len, bool) or not isinstance(self.data_seq_len, int) or self.data_seq_len < 0:
            raise ValueError(f"data_seq_len={self.data_seq_len!r}: must be an integer >= 0 (0: all seq_len)")
        self._check_doc_batches()
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in self.pipeline_layout):
            raise ValueError(f"pipeline_layout={self.pipeline_layout}: layers per virtual stage must be integers >= 0")
        rules.fp8_recipe_needs_fp8(self.fp8_recipe, self.fp8)
        if self.tp_comm_overlap and not self.sequence_parallel:
            raise ValueError("tp_comm_overlap=True needs sequence_parallel=True (--sequence-parallel): the overlap "
                             "splits sequence parallelism's all-gathers and reduce-scatters into chunks")
        if self.fp8_cached_activations and not (self.fp8 and self.fp8_recipe == "blockwise"):
            raise ValueError("fp8_cached_activations=True needs fp8=True with fp8_recipe='blockwise' (--fp8 "
                             "--fp8-recipe blockwise): the cached tensors keep one scale per 1 x 128 tile")
        dispatcher = DISPATCHERS[self.dispatcher]
        rules.reserved_sms_need_node_dispatch(self.ep_comm_sms_reserved, self.dispatcher, dispatcher.node_aware)
        if self.ep_comm_sms < 2 or self.ep_comm_sms % 2:
            raise ValueError(f"ep_comm_sms={self.ep_comm_sms}: DeepEP takes an even number of SMs, at least 2")
        for name in ("seq_len", "micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")

    def _check_recompute_modules(self) -> None:
        if isinstance(self.recompute_modules, str):
            raise ValueError(f"recompute_modules={self.recompute_modules!r}: a list of module names, not a string")
        for name in self.recompute_modules:
            check_choice("recompute_modules", name, RECOMPUTE_MODULES)
        modules = tuple(sorted(set(self.recompute_modules)))  # a list from JSON or TOML; order does not matter
        if modules and self.recompute == "full":
            raise ValueError(f"recompute_modules={list(modules)} with recompute='full': full recompute already "
                             "replays every module of a replayed layer")
        if "alternate_mm" in modules and (len(modules) > 1 or self.recompute != "none"):
            raise ValueError(f"recompute_modules={list(modules)} with recompute={self.recompute!r}: alternate_mm "
                             "decides what every op of a layer keeps, so it stands alone, with recompute='none'")
        object.__setattr__(self, "recompute_modules", modules)

    def _check_grad_accumulation_fusion(self) -> None:
        if self.grad_accumulation_fusion and self.zero_stage >= 2:
            raise ValueError(f"grad_accumulation_fusion with zero_stage={self.zero_stage}: Megatron-Core's "
                             "main-gradient buffer is whole on every rank (DDP, ZeRO-1 or the distributed optimizer)")
        if self.grad_accumulation_fusion and self.reduce_dtype and self.reduce_dtype != self.main_grad_dtype:
            raise ValueError(f"grad_accumulation_fusion with reduce_dtype={self.reduce_dtype!r}: the main-gradient "
                             f"buffer is reduced where it lies, in its own dtype ({self.main_grad_dtype}); set "
                             "grad_dtype instead")

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
    def partial_recompute(self) -> bool:
        """Full recompute of only the first `recompute_layers` layers of each chunk."""
        return self.recompute == "full" and self.recompute_layers > 0

    def layer_job(self, replayed: bool) -> Job:
        """The job one layer runs under: under partial recompute a replayed layer's is full recompute and the
        others' none, so per-layer costs need only the two uniform cases; otherwise `self`."""
        return _layer_job(self, replayed) if self.partial_recompute else self

    def replica_microbatches(self, degrees: Degrees) -> int:
        """Micro-batches per step on each data-parallel replica: `microbatches`, or those `global_batch` makes."""
        if not self.global_batch:
            return self.microbatches
        return self.global_batch // (self.micro_batch * degrees.dp)

    @property
    def packed(self) -> bool:
        """Whether the sequences hold packed documents (`doc_lengths` or `doc_batches`)."""
        return bool(self.doc_lengths or self.doc_batches)

    def _check_doc_batches(self) -> None:
        """Each micro-batch of `doc_batches` holds rows, each covering [0, seq_len) with documents in order, none
        empty."""
        for batch in self.doc_batches:
            if not batch:
                raise ValueError("doc_batches: a micro-batch holds at least one row")
            for row in batch:
                ends = [0] + [stop for _, stop in row]
                if [start for start, _ in row] != ends[:-1] or ends[-1] != self.seq_len or \
                        any(a >= b for a, b in zip(ends, ends[1:], strict=False)):
                    raise ValueError(f"doc_batches: a row's documents {row[:4]}{'...' if len(row) > 4 else ''} "
                                     f"must cover [0, seq_len={self.seq_len}) in order, none empty")

    @property
    def data_tokens(self) -> int:
        """Tokens of each sequence that are data: `data_seq_len`, else the whole `seq_len`."""
        return self.data_seq_len or self.seq_len

    def to_json(self) -> dict[str, Any]:
        """The `job` object of `estimate --json` and of each `plan --json` row (`PUBLISHED_FIELDS`)."""
        return {PUBLISHED_AS.get(name, name): _published(name, getattr(self, name)) for name in PUBLISHED_FIELDS}

    @classmethod
    def from_json(cls, published: dict[str, Any]) -> Job:
        """The job a `to_json` object describes (a `job` read back from `estimate --json` or `plan --json`)."""
        names = {PUBLISHED_AS.get(name, name): name for name in PUBLISHED_FIELDS}
        unknown = sorted(set(published) - set(names))
        if unknown:
            raise ValueError(f"job keys {', '.join(unknown)}: not keys of the published job object")
        values = {names[key]: value for key, value in published.items()}
        for name in _EMPTY_IS_NONE:
            if values.get(name) == "":
                values[name] = None
        return cls(**values)


# The `job` object's fields in the order `estimate --json` has printed them (a contract with the scripts that read
# it), and the keys of the two printed under the names they had before the runtime's options became the job's.
# `reduce_dtype` None prints as "" (the parameters' dtype), as it always has, and so does `optimizer_state_dtype`
# None (the main parameters'); it and the three keys after it were added last, in that order; `drop_policy` is
# not priced and not printed; `recompute_modules` came after them, then `fp8_cached_activations`, then
# `overlap_shared_experts`, then `tp_comm_overlap`.
PUBLISHED_FIELDS = ("seq_len", "micro_batch", "global_batch", "microbatches", "grad_bucket_numel", "clip_grad",
                    "sequence_parallel", "cp_mode", "ulysses_degree", "dispatcher", "capacity_factor",
                    "ep_overlap_chunks", "ep_comm_sms", "ep_comm_sms_reserved", "zero_stage", "distributed_optimizer",
                    "zero3_prefetch", "zero3_keep_params", "zero3_reduce_every_microbatch", "param_dtype",
                    "grad_dtype", "reduce_dtype", "pp_schedule", "virtual_stages", "pipeline_layout", "recompute",
                    "recompute_layers", "attention_kernel", "overlap_ep", "overlap_grad_reduce",
                    "grad_accumulation_fusion", "fp8", "fp8_recipe", "optimizer_state_dtype",
                    "tp_sum_with_reduction", "accumulate_in_reduce_dtype", "eager_fp32_loss", "recompute_modules",
                    "fp8_cached_activations", "overlap_shared_experts", "tp_comm_overlap")
PUBLISHED_AS = {"microbatches": "num_microbatches", "grad_bucket_numel": "bucket_numel"}
_EMPTY_IS_NONE = ("reduce_dtype", "optimizer_state_dtype")  # None prints as "": the default dtype


def _published(name: str, value: object) -> object:
    if name in _EMPTY_IS_NONE and value is None:
        return ""
    return list(value) if isinstance(value, tuple) else value


@lru_cache(maxsize=65536)
def without_recompute(job: Job) -> Job:
    """`job` recomputing nothing: what each layer saves whole."""
    return canonical_job(replace(job, recompute="none", recompute_layers=0, recompute_modules=()))


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
    return canonical_job(replace(job, seq_len=1, micro_batch=1, global_batch=0, microbatches=1, doc_batches=(),
                                 sequence_parallel=False, cp_mode="ring", ulysses_degree=1, dispatcher="ragged",
                                 capacity_factor=1.0, drop_policy="probs", ep_overlap_chunks=1, ep_comm_sms=20,
                                 ep_comm_sms_reserved=False, recompute="none", recompute_layers=0, recompute_modules=(),
                                 attention_kernel="flash", overlap_ep=True, overlap_shared_experts=True,
                                 overlap_grad_reduce=True, tp_comm_overlap=False))


def _validate_fold(model: ModelSpec, degrees: Degrees, job: Job) -> None:
    """A folded expert mesh: experts to fold, a split their width allows, and tokens that differ per tp rank."""
    if not model.is_moe:
        raise ValueError(f"{degrees}: model {model.name} has no experts to fold")
    if model.moe_ffn_hidden_size % degrees.etp:
        raise ValueError(f"etp={degrees.etp}: moe_ffn_hidden_size={model.moe_ffn_hidden_size} is not divisible by etp")
    if degrees.tp > 1 and not job.sequence_parallel:
        raise ValueError(f"tp={degrees.tp} with folded experts needs sequence_parallel: each tp rank must route "
                         "its own tokens")


def _validate_layout(model: ModelSpec, chunks: int, layout: tuple[int, ...]) -> None:
    if len(layout) != chunks:
        raise ValueError(f"pipeline_layout has {len(layout)} virtual stages; pp*virtual_stages is {chunks}")
    if sum(layout) != model.num_layers:
        raise ValueError(f"pipeline_layout holds {sum(layout)} layers; {model.name} has {model.num_layers}")


def validate(model: ModelSpec, degrees: Degrees, job: Job) -> None:
    """Raise ValueError (naming the field, value and rule) for a layout the runtime could not run. The rules among
    the options alone ran when `job` was built (`ParallelConfig`)."""
    t, c, p = degrees.tp, degrees.cp, degrees.pp
    rules.tp_splits_heads(t, model.num_heads, model.kv_heads)
    if job.pipeline_layout:
        _validate_layout(model, p * job.virtual_stages, job.pipeline_layout)
    elif model.num_layers < p * job.virtual_stages:
        raise ValueError(f"pp={p}: num_layers={model.num_layers} < pp*virtual_stages={p * job.virtual_stages}")
    schedule, dispatcher = SCHEDULES[job.pp_schedule], DISPATCHERS[job.dispatcher]
    rules.cp_splits_sequence(c, job.seq_len)
    if job.sequence_parallel:
        rules.sp_splits_shard(t, c, job.seq_len)
    if c > 1:
        _validate_context_mode(model, degrees, job)
    rules.node_dispatch_needs_whole_experts(degrees.etp, job.dispatcher, dispatcher.node_aware)
    if degrees.expert_fold:
        _validate_fold(model, degrees, job)
    rules.ep_splits_experts(degrees.ep, model.num_experts if model.is_moe else 0, model.num_moe_layers)
    if job.global_batch and job.global_batch % (job.micro_batch * degrees.dp):
        raise ValueError(f"global_batch={job.global_batch} is not divisible by micro_batch*dp="
                         f"{job.micro_batch * degrees.dp}")
    schedule.check(p, job.replica_microbatches(degrees))
    _validate_recompute_modules(model, job)
    alternate_mm_layout(degrees, job)


def replayable_modules(model: ModelSpec, job: Job | None = None) -> tuple[str, ...]:
    """Megatron-Core's modules `Job.recompute_modules` may name for `model` (RECOMPUTE_MODULES in order), and under
    `job`'s FP8 recipe: the norms that stand alone (MLA's input norm, a MoE layer's pre-MLP norm; the others are
    fused into the GEMM after them), MLA's up-projections, a dense layer's MLP, routed experts' activation. Not
    alternate_mm, another framework's policy, which no module list joins."""
    present = {"layernorm": model.kv_lora_rank > 0 or model.is_moe, "mla_up_proj": model.kv_lora_rank > 0,
               "mlp": model.num_layers > model.num_moe_layers, "moe_act": model.is_moe}
    refused = _recast_under_delayed(job, RECOMPUTE_MODULES) if job else []
    return tuple(name for name in RECOMPUTE_MODULES if present.get(name) and name not in refused)


def _recast_under_delayed(job: Job, names: Sequence[str]) -> list[str]:
    """Of `names`, those Megatron-Core refuses under FP8 with delayed scaling: their replays free an output an
    FP8 GEMM reads only if the GEMM keeps that 16-bit output instead of its cast, which Transformer Engine
    cannot do under delayed scaling."""
    if not (job.fp8 and job.fp8_recipe == "delayed"):
        return []
    return [name for name in names if name in ("layernorm", "moe_act")]


def _validate_recompute_modules(model: ModelSpec, job: Job) -> None:
    """Each replayed module exists in the model, and FP8 can free what it replays."""
    replayable = replayable_modules(model) + (("alternate_mm",) if _llama_block(model) else ())
    missing = [name for name in job.recompute_modules if name not in replayable]
    if missing:
        raise ValueError(f"recompute_modules={list(job.recompute_modules)}: model {model.name} has no "
                         f"{', '.join(_MODULE_NAMES[name] for name in missing)}")
    recast = _recast_under_delayed(job, job.recompute_modules)
    if recast:
        raise ValueError(f"recompute_modules={recast} under fp8_recipe='delayed': the GEMM after the replayed "
                         "module would keep its FP8 cast, which delayed scaling cannot replace by the 16-bit "
                         "input; use fp8_recipe='blockwise' (--fp8-recipe blockwise) or leave them out")


_MODULE_NAMES = {"layernorm": "norm outside a fused GEMM (neither MLA nor experts)",
                 "mla_up_proj": "multi-head latent attention (kv_lora_rank 0)", "mlp": "dense layer",
                 "moe_act": "experts", "alternate_mm": "Llama block (dense SwiGLU layers with plain attention, "
                 "no biases), whose matmuls alternate_mm counts"}


def _llama_block(model: ModelSpec) -> bool:
    """Layers whose matmuls run in torchtitan's Llama order, each an unbiased `mm` (a bias makes it `addmm`,
    which its op-level checkpointing does not keep): Q, K, V, O, gate, up, down."""
    return not (model.is_moe or model.kv_lora_rank or model.bias or model.qkv_bias) and model.mlp == "swiglu"


def alternate_mm_layout(degrees: Degrees, job: Job) -> None:
    """alternate_mm's layout: the matmul count is torchtitan's on whole layers, one sequence block, 16-bit
    GEMMs and a fused attention kernel; its tensor- and context-parallel blocks save other ops."""
    if "alternate_mm" not in job.recompute_modules:
        return
    if degrees.tp > 1 or degrees.cp > 1 or job.fp8 or job.attention_kernel == "eager":
        raise ValueError(f"recompute_modules=['alternate_mm'] at tp={degrees.tp}, cp={degrees.cp}, fp8={job.fp8}, "
                         f"attention_kernel={job.attention_kernel!r}: priced at tp 1 and cp 1 with 16-bit GEMMs "
                         "and a fused attention kernel only, as torchtitan's Llama runs it under FSDP")


def _validate_context_mode(model: ModelSpec, degrees: Degrees, job: Job) -> None:
    """The cp mode's rules: a Ulysses degree that divides cp, heads that its all-to-all can split."""
    mode, c = CONTEXT_MODES[job.cp_mode], degrees.cp
    rules.ulysses_degree_divides_cp(job.ulysses_degree, c)
    split = mode.head_split(c, job.ulysses_degree)
    if split > 1:
        heads, kv_heads = model.num_heads // degrees.tp, max(1, model.kv_heads // degrees.tp)
        rules.heads_split_by_all_to_all(split, heads, kv_heads, mode.head_split_field)
