"""`orangetron estimate` and `orangetron plan`: argparse wiring and text/JSON output.

Every user error is raised as ValueError with one line naming the field; `orangetron.cli.main` prints it
and exits 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

from orangetron.cli.presets import add_presets_command, count_params
from orangetron.cli.wording import (
    BYTE_UNITS,
    FLOP_RATE_UNITS,
    SECOND_UNITS,
    counted,
    flag_named,
    flags_of,
    typed_flags,
    unit_for,
)
from orangetron.plan.chart import sharding_label
from orangetron.plan.estimate import Estimate, estimate
from orangetron.plan.memory import busiest_stage
from orangetron.plan.overhead import DEFAULT_OVERHEAD, MemoryOverhead, fixed_overhead
from orangetron.plan.params import sums_first
from orangetron.plan.search import BUCKET_NUMEL, SearchSpace, candidate_degrees, divisors, search
from orangetron.plan.traffic import reduce_rounds
from orangetron.spec import rules
from orangetron.spec.categories import ESTIMATED_TENSORS, TRANSIENT
from orangetron.spec.hardware import GIB, Cluster, gpu_names, load_gpu, make_cluster
from orangetron.spec.hf_config import is_hf_folder
from orangetron.spec.model import DualEncoderSpec, ModelSpec, load_model
from orangetron.spec.options import ATTENTION_KERNELS, FP8_RECIPES, RECOMPUTE_MODULES, Degrees, Job, validate
from orangetron.spec.parallel_config import DTYPE_BYTES, RECOMPUTE
from orangetron.spec.sharding import cp_padded_len
from orangetron.spec.stages import longest_chunk
from orangetron.spec.variants import CONTEXT_MODES, DISPATCHERS, SCHEDULES

# How far down the ranking `--emit-config` looks for a row the trainer runs when none of the --top rows is one:
# a few hundred rows price in seconds, and the rows passed over differ from a runnable one by an option or two
# the trainer lacks (FP8, a planner-only schedule or dispatcher).
EMIT_DEPTH = 200


def add_plan_commands(sub: argparse._SubParsersAction) -> None:
    """Add `estimate`, `plan` and `schedule` to the `orangetron` subcommands."""
    _add_schedule_command(sub)
    add_presets_command(sub)
    est = sub.add_parser("estimate", help="memory, communication, step time and MFU of one configuration",
                         description="Price one configuration: memory per GPU by category, bytes per collective "
                                     "per step, step time and MFU.")
    _common(est, model_required=False)
    est.add_argument("--config", metavar="FILE.toml",
                     help="price the configuration of a run's config file (`plan --emit-config`'s, or a run folder's "
                          "config.toml): its model, layout, parallel options, seq_len and batch; the cluster flags "
                          "(--gpu, --gpus-per-node, ...) and the planner-only ones still apply (the expert "
                          "overlaps no more than the trainer runs them), the layout and option flags the file holds "
                          "are refused; without --gpu, the GPU `plan` priced the file for")
    for dim in ("tp", "cp", "pp", "dp", "ep"):
        est.add_argument(f"--{dim}", type=int, default=None if dim == "dp" else 1,
                         help=f"{dim} degree" + (" (default: gpus / (tp*cp*pp))" if dim == "dp" else ""))
    est.add_argument("--etp", type=int, default=1,
                     help="expert tensor parallel degree: 1 (experts whole on every tp rank) or tp; any divisor "
                          "of tp*cp*dp with --edp")
    est.add_argument("--edp", type=int, default=None,
                     help="fold the experts over their own mesh (MoE parallel folding, planner only): "
                          "etp x ep x edp must equal tp*cp*dp, and ep need not divide dp*cp")
    est.add_argument("--virtual-stages", type=int, default=1, help="interleaved pipeline chunks per stage")
    est.add_argument("--pipeline-layout", type=_layout, default=(), metavar="N[xK][,N...]",
                     help="decoder layers of each virtual stage in order (chunk g on pipeline rank g %% pp), NxK for "
                          "K stages of N, as Megatron's --pipeline-model-parallel-layout places them (planner "
                          "only; default: the even split). DeepSeek-V3 at pp 16 as Megatron-Bridge: 4x15,1")
    est.add_argument("--micro-batch", type=int, default=1)
    _doc_lengths_flag(est, "; with --config, a run that packs documents: those of its data")
    est.add_argument("--recompute", choices=RECOMPUTE, default="none")
    est.add_argument("--recompute-layers", type=int, default=0, metavar="N",
                     help="--recompute full: replay only the first N layers of each pipeline chunk (Megatron's "
                          "block method; planner only); 0: every layer")
    est.add_argument("--recompute-modules", type=_names, nargs="+", default=[()], metavar="M[,M...]",
                     help=f"replay these modules (comma- or space-separated) in backward instead of keeping their "
                          f"outputs "
                          f"(planner only; Megatron-Core's --recompute-modules): {', '.join(RECOMPUTE_MODULES)}; "
                          "not with --recompute full; under --fp8, layernorm and moe_act need --fp8-recipe "
                          "blockwise. alternate_mm, alone, is torchtitan's op-level selective checkpointing of a "
                          "dense Llama layer at tp 1 and cp 1: every output replays but the fused attention's and "
                          "every second matmul's")
    est.add_argument("--sequence-parallel", action="store_true")
    est.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=0)
    est.add_argument("--distributed-optimizer", action="store_true")
    est.add_argument("--cp-mode", choices=CONTEXT_MODES.names(), default="ring")
    est.add_argument("--ulysses-degree", type=int, default=1, metavar="N",
                     help="--cp-mode usp: the all-to-all factor of cp (the rest is a ring), as `train`")
    est.add_argument("--capacity-factor", type=float, default=1.0)
    est.add_argument("--ep-overlap-chunks", type=int, default=1, metavar="N",
                     help="ragged dispatch in N token chunks, each chunk's all-to-all overlapping the other "
                          "chunks' experts, as `train`")
    est.add_argument("--reduce-dtype", choices=tuple(DTYPE_BYTES), default=None,
                     help="gradient reduction dtype (default: the param dtype, as docs/data_parallel.md's tables)")
    est.add_argument("--zero3-reduce-every-microbatch", action="store_true",
                     help="--zero-stage 3: reduce-scatter every micro-batch, as `train` (default: once per step)")
    est.add_argument("--zero3-prefetch", action=argparse.BooleanOptionalAction, default=True,
                     help="--zero-stage 3: start gathering the next unit while the current one computes, as `train`")
    est.add_argument("--zero3-keep-params", action="store_true",
                     help="--zero-stage 3: keep the forward's gathered units until their backward, as `train`")
    est.add_argument("--grad-bucket-numel", type=int, default=0, metavar="N",
                     help="gradient buckets of about N elements reduced during backward, as `train` (default 0: "
                          "one reduction after backward, every parameter's .grad kept until then)")
    est.add_argument("--optimizer-state-dtype", choices=tuple(DTYPE_BYTES), default=None,
                     help="Adam's two moments in this dtype (planner only; Megatron-Core's precision-aware "
                          "optimizer, e.g. bfloat16; default: the main parameters' dtype, as `train`)")
    est.add_argument("--grad-accumulation-fusion", action="store_true",
                     help="price Megatron-Core's gradient path (planner only): gradients land in the main-gradient "
                          "buffer, one .grad at a time, and are reduced where they lie")
    est.add_argument("--tp-comm-overlap", action="store_true",
                     help="tensor-parallel traffic in chunks beside the GEMMs that produce or consume it (planner "
                          "only; Transformer Engine's userbuffers overlap, Megatron's --tp-comm-overlap); needs "
                          "--sequence-parallel")
    est.add_argument("--tp-sum-with-reduction", action="store_true",
                     help="price a framework that sums partial gradients over tp in the data-parallel reduction's "
                          "own pass, and a tied embedding's two pipeline copies after it (planner only; "
                          "Megatron-Core, torchtitan): no reduction waits for the step")
    est.add_argument("--accumulate-in-reduce-dtype", action="store_true",
                     help="gradients waiting across micro-batches accumulate in --reduce-dtype (planner only; "
                          "FSDP2; no effect when that is the parameters' dtype)")
    est.add_argument("--eager-fp32-loss", action="store_true",
                     help="the loss upcasts the logits and runs torch's unfused cross-entropy (planner only; "
                          "torchtitan): three float32 copies of the logits at its backward")
    est.add_argument("--no-overlap-ep", action="store_true",
                     help="no paired micro-batch overlap: only shared experts hide the expert all-to-all")
    est.add_argument("--no-overlap-shared-experts", action="store_true",
                     help="the shared experts do not run beside the expert all-to-all either (planner only; "
                          "Megatron-Core without --moe-shared-expert-overlap)")
    est.add_argument("--no-overlap-grad-reduce", action="store_true",
                     help="reduce gradients after the last backward instead of behind it (Megatron-LM 2021, "
                          "DeepSpeed's pipeline engine)")
    est.add_argument("--pp-schedule", choices=SCHEDULES.names(), default=None,
                     help="default: interleaved when --virtual-stages > 1, else 1f1b; zb-h1 (zero bubble with "
                          "deferred weight gradients) is priced here only")
    # A configuration that does not fit is always reported now; the flag stays so old scripts keep working.
    est.add_argument("--allow-oom", action="store_true", help=argparse.SUPPRESS)
    est.set_defaults(run=run_estimate)

    plan = sub.add_parser("plan", help="search layouts for a model on a cluster and rank them",
                          description="Search tp, cp, pp, virtual stages, dp, ep, ZeRO stage, recompute, cp mode, "
                                      "dispatcher and micro-batch; print the fastest configurations that fit. "
                                      "Dual-encoder models get a DistMM plan instead.")
    _common(plan, gpus_required=True)
    plan.add_argument("--top", type=int, default=10, help="rows to show")
    _doc_lengths_flag(plan, "")
    plan.add_argument("--memory-fraction", type=float, default=1.0,
                      help="share of GPU memory a configuration's need (tensors and the overhead the fit check "
                           "counts) may take; below 1 keeps headroom")
    plan.add_argument("--chart", metavar="FILE.png", help="bar chart of the best configurations")
    plan.add_argument("--overwrite", action="store_true",
                      help="move an existing --chart file, or an --emit-config file that `plan` did not write "
                           "unedited, aside to FILE.previous-N instead of refusing it")
    plan.add_argument("--emit-config", metavar="FILE.toml",
                      help="write the fastest configuration the trainer runs as a run's config file, which "
                           "`train --config` starts and `estimate --config` prices")
    plan.add_argument("--pp-schedule", choices=SCHEDULES.names(), action="append", default=None,
                      help="pipeline schedules to search (repeatable; default: 1f1b, and interleaved with virtual "
                           "stages)")
    plan.add_argument("--pipeline-layout", type=_layout, default=(), metavar="N[xK][,N...]",
                      help="decoder layers of each virtual stage, as `estimate --pipeline-layout` (planner only): "
                           "the search keeps pp to the divisors of its length, with the rest as virtual stages")
    plan.add_argument("--no-overlap-ep", action="store_true",
                      help="rank layouts without paired micro-batch overlap (Megatron-Core's default)")
    plan.add_argument("--no-overlap-shared-experts", action="store_true",
                      help="nor shared experts beside the expert all-to-all (Megatron-Core's default; planner only)")
    plan.add_argument("--no-partial-recompute", action="store_true",
                      help="full recompute replays every layer (default: only as many leading layers per chunk as "
                           "the memory needs, Megatron's block method; shown as full/N)")
    plan.add_argument("--grad-bucket-numel", type=int, default=BUCKET_NUMEL, metavar="N",
                      help="also search data-parallel layouts (not ZeRO-3) reducing gradients in buckets of N elements "
                           "during backward, shown as +b (default 40000000, Megatron-Core's; 0: reduce after the "
                           "last backward only)")
    for dim in ("tp", "cp", "pp", "ep"):
        plan.add_argument(f"--{dim}", type=_int_list, default=None, metavar="N[,N...]",
                          help=f"only these {dim} degrees (default: every sensible value)")
    plan.set_defaults(run=run_plan)


def _doc_lengths_flag(p: argparse.ArgumentParser, default_with_config: str) -> None:
    p.add_argument("--doc-lengths", type=_doc_lengths, default=(), metavar="FILE",
                   help="packed documents: a file of document lengths in tokens, one per line, or LENGTH COUNT "
                        "(a histogram; at most 1,000,000 documents); attention and the ring are priced on the "
                        "busiest cp rank of the sharding packed batches get, balanced by document (default: one "
                        f"document per sequence{default_with_config})")


def _common(p: argparse.ArgumentParser, gpus_required: bool = False, model_required: bool = True) -> None:
    p.add_argument("--model", required=model_required,
                   help="preset name (see `orangetron presets`, e.g. llama3-8b), a model .toml file, or a Hugging "
                        "Face model folder (or its config.json)")
    from_file = "" if model_required else "; with --config, the one `plan` priced the file for"  # estimate's
    p.add_argument("--gpu", default=None, help=f"GPU preset ({', '.join(gpu_names())}) or .toml file (default "
                   f"{DEFAULT_GPU}{from_file})")
    p.add_argument("--gpus", type=int, required=gpus_required, default=None, help="GPUs in the cluster"
                   + ("" if gpus_required else " (default: tp*cp*pp*dp)"))
    p.add_argument("--gpus-per-node", type=int, default=None, help="default: the GPU preset's node size")
    p.add_argument("--nic-gbps", type=float, default=None, help="inter-node NIC line rate per GPU, Gbit/s")
    p.add_argument("--transport", choices=("proxy", "ibgda"), default="proxy",
                   help="who posts inter-node work: a CPU proxy thread or the GPU (IBGDA)")
    p.add_argument("--seq", type=int, default=4096, help="sequence length (default: 4096)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per step (default: one micro-batch per replica)")
    p.add_argument("--param-dtype", choices=tuple(DTYPE_BYTES), default="bfloat16")
    p.add_argument("--attention-kernel", choices=ATTENTION_KERNELS, default="flash",
                   help="flash: the GPU's best fused kernel; flash2: FlashAttention-2; flash-triton: FlashAttention in "
                        "Triton; eager: stored scores")
    p.add_argument("--fp8", action="store_true",
                   help="FP8 linear layers: FP8 GEMM peak, FP8 weight copies and scale tensors")
    p.add_argument("--fp8-recipe", choices=FP8_RECIPES, default=None,
                   help="with --fp8: delayed (the default: per-tensor scales from an amax history, Transformer "
                        "Engine), current (per-tensor scales from each tensor's own amax, Megatron's FP8-CS) or "
                        "blockwise (1x128 activation tiles, 128x128 weight blocks, DeepSeek-V3; Blackwell's MXFP8 "
                        "is priced as it)")
    p.add_argument("--fp8-cached-activations", action="store_true",
                   help="with --fp8 --fp8-recipe blockwise: DeepSeek-V3's low-precision activations, the attention "
                        "output kept once in 12 bits and a MoE layer's SwiGLU inputs in FP8")
    p.add_argument("--dispatcher", choices=DISPATCHERS.names(), default="ragged",
                   help="expert dispatch; deepep (planner only): a token crosses to each remote node once, then "
                        "NVLink")
    p.add_argument("--ep-comm-sms", type=int, default=20, metavar="N",
                   help="--dispatcher deepep: SMs its kernels take from the compute they overlap (default 20)")
    p.add_argument("--ep-comm-sms-reserved", action="store_true",
                   help="--dispatcher deepep: those SMs are set aside from compute for the whole step (DeepSeek-V3), "
                        "not only while a transfer runs")
    p.add_argument("--overhead-gib", type=float, default=None,
                   help="fixed memory overhead per GPU: CUDA context, library workspaces, NCCL buffers (default: "
                        "1 GiB plus 0.5 GiB per communicator of the layout)")
    p.add_argument("--overhead-fraction", type=float, default=None,
                   help="allocator fragmentation as a share of activations and transient buffers, in the reported "
                        "total (default 0.19); the fit check counts at most 0.02 of them, what the allocator keeps "
                        "once it has released its cache")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")


DEFAULT_GPU = "h100"


def _cluster(args: argparse.Namespace, gpus: int) -> Cluster:
    """The cluster priced on; without --gpus its size is the layout's, and a layout that is not whole nodes is
    said so (make_cluster's refusal names --gpus, which was not given)."""
    per_node = args.gpus_per_node or load_gpu(args.gpu or DEFAULT_GPU).gpus_per_node
    if args.gpus is None and gpus > per_node and gpus % per_node:
        raise ValueError(f"the layout's {gpus} GPUs (tp*cp*pp*dp) are not whole nodes of {per_node}: give degrees "
                         "whose product is a multiple of it, or --gpus-per-node")
    return make_cluster(args.gpu or DEFAULT_GPU, gpus, args.gpus_per_node, args.nic_gbps, args.transport)


def _overhead(args: argparse.Namespace) -> MemoryOverhead:
    if args.overhead_gib is None and args.overhead_fraction is None:
        return DEFAULT_OVERHEAD
    if args.overhead_gib is not None and not 0 <= args.overhead_gib < math.inf:  # named by flag, not by field
        raise ValueError(f"--overhead-gib={args.overhead_gib}: must be >= 0 and finite")
    if args.overhead_fraction is not None and not 0 <= args.overhead_fraction < 1:
        raise ValueError(f"--overhead-fraction={args.overhead_fraction}: must be >= 0 and < 1 (a share of the "
                         "dynamic allocations)")
    fraction = DEFAULT_OVERHEAD.fraction if args.overhead_fraction is None else args.overhead_fraction
    if args.overhead_gib is None:
        return replace(DEFAULT_OVERHEAD, fraction=fraction)
    return fixed_overhead(args.overhead_gib, fraction)


def _positive(name: str, value: float | None) -> None:
    if value is not None and not value > 0:  # a count below 1 (or a rate at or below 0) prices nothing real
        raise ValueError(f"--{name.replace('_', '-')}={value}: must be {'>= 1' if isinstance(value, int) else '> 0'}")


def _degrees(args: argparse.Namespace) -> Degrees:
    for name in ("tp", "cp", "pp", "dp", "ep", "gpus", "gpus_per_node", "micro_batch", "virtual_stages", "seq",
                 "global_batch", "nic_gbps"):
        _positive(name, getattr(args, name, None))
    model_par = args.tp * args.cp * args.pp
    dp = args.dp
    if dp is None:
        gpus = args.gpus or model_par
        if gpus % model_par:
            raise ValueError(f"--gpus={gpus} is not divisible by tp*cp*pp={model_par}")
        dp = gpus // model_par
    deg = _expert_mesh(args, {"tp": args.tp, "cp": args.cp, "pp": args.pp, "dp": dp, "ep": args.ep})
    if args.gpus and args.gpus != deg.world_size:
        raise ValueError(f"--gpus={args.gpus} but tp*cp*pp*dp = {deg.world_size}; leave --dp out (dp then takes "
                         f"the GPUs tp*cp*pp leaves) or give --gpus {deg.world_size}")
    return deg


def _expert_mesh(args: argparse.Namespace, dims: dict[str, int]) -> Degrees:
    """The degrees `dims` with the flags' expert tensor parallelism (`--etp`) and fold (`--edp`): planner-only
    degrees, which a run's config file does not hold, so `estimate --config` takes them from its command line."""
    fold = getattr(args, "edp", None) is not None
    deg = Degrees(**dims, etp=args.etp, expert_fold=fold)
    if fold and args.edp * deg.ep * deg.etp != deg.tp * deg.cp * deg.dp:
        raise ValueError(f"--edp={args.edp}: etp x ep x edp = {deg.etp * deg.ep * args.edp} must equal "
                         f"tp*cp*dp = {deg.tp * deg.cp * deg.dp}, the ranks of a stage the experts fold over")
    return deg


def _decoder(name: str) -> ModelSpec:
    spec = load_model(name)
    if isinstance(spec, DualEncoderSpec):
        raise ValueError(f"model {spec.name} is a dual encoder: use `orangetron plan --model {name}` (DistMM)")
    return spec


# `estimate`'s flags for what a run's config file holds: with --config the file sets them.
_FILE_OWNED = ("model", "seq", "global_batch", "param_dtype", "tp", "cp", "pp", "dp", "ep",
               "virtual_stages", "micro_batch", "recompute", "recompute_layers", "sequence_parallel", "zero_stage",
               "distributed_optimizer", "cp_mode", "ulysses_degree", "capacity_factor", "ep_overlap_chunks",
               "dispatcher", "reduce_dtype", "zero3_reduce_every_microbatch", "zero3_prefetch", "zero3_keep_params",
               "grad_bucket_numel", "pp_schedule")


def run_estimate(args: argparse.Namespace) -> int:
    if args.config:
        from orangetron.cli.run_config import TRAINER_OVERLAPS, estimate_job, trainer_overlaps

        given = [flag for flag, dest in typed_flags(args.own_parser).items() if dest in _FILE_OWNED]
        if given:
            raise ValueError(f"--config {args.config} sets the layout and options; {' '.join(given)} would be "
                             "ignored: edit the file, or leave --config out")
        model, deg, job = estimate_job(args.config)
        deg = _expert_mesh(args, deg.degrees())
        model = model if isinstance(model, ModelSpec) else _decoder(model)
        if job.seq_len > model.max_seq_len:
            raise ValueError(f"--config {args.config}: seq_len={job.seq_len} is longer than the model's max_seq_len="
                             f"{model.max_seq_len}, which `orangetron train` refuses")
        job = _padded_as_train_pads(job, deg, "seq_len")
        if args.gpu is None:
            args.gpu = _config_gpu(args.config)
        if args.gpus is not None and args.gpus != deg.world_size:
            raise ValueError(f"--gpus {args.gpus}: the layout of --config {args.config} ({deg}) has "
                             f"{deg.world_size} GPUs; leave --gpus out, or edit the file")
        job = replace(job, **_planner_only(args))  # the planner-only options, from the flags
        if not args.doc_lengths:
            job = _run_documents(args.config, job)
        job = replace(job, **trainer_overlaps({name: getattr(job, name) for name in TRAINER_OVERLAPS}))
        validate(model, deg, job)  # the layout's own rules before the cluster's: tp 3 is not a --gpus problem
        est = estimate(model, deg, job, _cluster(args, deg.world_size), overhead=_overhead(args))
    elif args.model is None:
        raise ValueError("--model is required (or --config FILE)")
    else:
        model, deg, job = _decoder(args.model), _degrees(args), _job(args)
        _note_longer_than_the_model("estimate", args.model, model, job.seq_len)
        job = _padded_as_train_pads(job, deg, "--seq")
        validate(model, deg, job)
        est = estimate(model, deg, job, _cluster(args, deg.world_size), overhead=_overhead(args))
    for note in _no_effect_notes(model, deg, job):
        print(f"orangetron estimate: note: {note}", file=sys.stderr)
    if not est.fits:
        from orangetron.plan.fit_advice import explain

        print(f"orangetron estimate: warning: {explain(est, _overhead(args))}", file=sys.stderr)
    if args.json:
        print(json.dumps(est.to_json()))
    else:
        print(format_estimate(est))
    return 0


def _run_documents(path: str, job: Job) -> Job:
    """`job` priced on the documents the run of `path` packs (`run_config.packed_documents`), said on standard
    error; as it is where the run packs none."""
    from orangetron.cli.run_config import packed_documents

    found = packed_documents(path, MAX_DOCUMENTS)
    if found is None:
        return job
    lengths, named = found
    if not lengths:
        print(f"orangetron estimate: note: {named}: priced one document per sequence; --doc-lengths FILE "
              "prices its documents", file=sys.stderr)
        return job
    print(f"orangetron estimate: note: the run packs documents: priced on {named} ({min(lengths):,} to "
          f"{max(lengths):,} tokens); --doc-lengths FILE prices others", file=sys.stderr)
    return replace(job, doc_lengths=lengths)


def _padded_as_train_pads(job: Job, deg: Degrees, name: str) -> Job:
    """`job` at the length its sequences run at under cp: the trainer pads one that the cp ranks cannot split
    (train/step.py), and prices the padded length; said on standard error."""
    padded = cp_padded_len(job.seq_len, deg.cp, deg.tp, job.sequence_parallel)
    if padded == job.seq_len:
        return job
    given = f"{name} {job.seq_len}" if name.startswith("--") else f"{name}={job.seq_len}"
    print(f"orangetron estimate: note: {given} runs padded to {padded} under cp={deg.cp}, as train pads it "
          "(ignored labels at its end): time and memory are priced padded, tokens/s and MFU count its "
          f"{job.seq_len} tokens", file=sys.stderr)
    return replace(job, seq_len=padded, data_seq_len=job.seq_len)


def _config_gpu(path: str) -> str:
    """The GPU `estimate --config` prices on without --gpu: the preset `plan` priced the file for, or the default
    for a run's own config, which names no GPU; said on standard error."""
    from orangetron.cli.run_config import planned_gpu

    planned = planned_gpu(path)
    if planned is not None and planned not in gpu_names():
        raise ValueError(f"--config {path} was planned for the GPU {planned!r}, which is not a preset: give "
                         "--gpu (that GPU's .toml file)")
    why = "the GPU `plan` priced the file for" if planned else "the default: a run's config names no GPU"
    print(f"orangetron estimate: note: priced on {planned or DEFAULT_GPU}, {why} (--gpu chooses)", file=sys.stderr)
    return planned or DEFAULT_GPU


_MAX_SEQ_LEN_DEFAULT = ModelSpec.__dataclass_fields__["max_seq_len"].default


def _note_longer_than_the_model(command: str, name: str, model: ModelSpec, seq_len: int) -> None:
    """A Hugging Face folder states the longest sequence its model was made for (max_position_embeddings, the
    runtime's max_seq_len, which `train` enforces), as does a preset or model file that sets max_seq_len; the
    schema's default is not such a statement."""
    if seq_len <= model.max_seq_len:
        return
    if is_hf_folder(name):
        stated = f"{name}'s max_position_embeddings"
    elif model.max_seq_len != _MAX_SEQ_LEN_DEFAULT:
        stated = f"{model.name}'s max_seq_len"
    else:
        return
    print(f"orangetron {command}: note: --seq {seq_len} is longer than {stated} {model.max_seq_len}: priced as "
          "asked, but `orangetron train` and `plan --emit-config` refuse such a run", file=sys.stderr)


def _idle_options(model: ModelSpec, deg: Degrees, job: Job) -> list[str]:
    """A line for each option set away from its default for a dimension of size 1 or a variant this layout does
    not use, as `train` warns of its own (`TrainConfig.ineffective_options`)."""
    default = Job(seq_len=job.seq_len)
    no_dp = deg.dp * deg.cp == 1
    longest = longest_chunk(model.num_layers, deg.pp, job.virtual_stages, job.pipeline_layout)
    idle = {
        "sequence_parallel": (deg.tp == 1, "needs --tp > 1"),
        "cp_mode": (deg.cp == 1, "needs --cp > 1"),
        "ulysses_degree": (deg.cp == 1, "needs --cp > 1"),
        "virtual_stages": (deg.pp == 1, "needs --pp > 1"),
        "pp_schedule": (deg.pp == 1 and job.virtual_stages == 1, "needs --pp > 1"),  # else said of the stages
        "dispatcher": (deg.ep == 1, "needs --ep > 1"),
        "capacity_factor": (deg.ep == 1 or not DISPATCHERS[job.dispatcher].pads,
                            "needs --dispatcher capacity with --ep"),
        "ep_comm_sms": (deg.ep == 1, "needs --ep > 1"),
        "ep_comm_sms_reserved": (deg.ep == 1, "needs --ep > 1"),
        "zero_stage": (no_dp and job.zero_stage != 3, "needs --dp or --cp > 1: nothing to shard"),  # as train says
        "distributed_optimizer": (no_dp, "needs --dp or --cp > 1: nothing to shard"),
        "reduce_dtype": (no_dp, "needs --dp or --cp > 1: no gradient reduction"),
        "zero3_prefetch": (job.zero_stage != 3, "needs --zero-stage 3"),
        "zero3_keep_params": (job.zero_stage != 3, "needs --zero-stage 3"),
        "recompute_layers": (job.recompute_layers >= longest, f"is not below the {longest} layers of the longest "
                             "pipeline chunk: every layer replays, as with 0"),
    }
    return [f"--{name.replace('_', '-')} has no effect here: {why}" for name, (unused, why) in idle.items()
            if unused and getattr(job, name) != getattr(default, name)]


def _no_effect_notes(model: ModelSpec, deg: Degrees, job: Job) -> list[str]:
    """A line for each option asked for that changes nothing in this layout, with the reason."""
    notes = _idle_options(model, deg, job)
    if job.zero3_reduce_every_microbatch and reduce_rounds(model, deg, job) == 1:
        why = ("a replica runs one micro-batch" if job.replica_microbatches(deg) == 1 else "gradients summed "
               "first (partial ones over tp under sequence parallelism, kv heads fewer than tp or QK-norm, or a tied "
               "embedding's two pipeline copies) hold every reduction to the step (unless --tp-sum-with-reduction)")
        notes.append(f"zero3_reduce_every_microbatch has no effect here: {why}")
    if job.tp_sum_with_reduction and not sums_first(model, deg, replace(job, tp_sum_with_reduction=False)):
        notes.append("--tp-sum-with-reduction has no effect here: no gradients are summed before the reduction (it "
                     "needs tp > 1 with sequence parallelism, QK-norm or kv heads fewer than tp, or a tied embedding "
                     "under --pp)")
    if job.accumulate_in_reduce_dtype and job.wire_dtype == job.param_dtype:
        notes.append(f"--accumulate-in-reduce-dtype has no effect here: gradients are reduced in the parameters' "
                     f"dtype ({job.param_dtype}); FSDP2 upcasts only to a wider --reduce-dtype")
    return notes


def _job(args: argparse.Namespace) -> Job:
    schedule = args.pp_schedule or ("interleaved" if args.virtual_stages > 1 else "1f1b")
    return Job(seq_len=args.seq, micro_batch=args.micro_batch, global_batch=args.global_batch or 0,
              sequence_parallel=args.sequence_parallel, cp_mode=args.cp_mode, ulysses_degree=args.ulysses_degree,
              dispatcher=args.dispatcher, capacity_factor=args.capacity_factor,
              ep_overlap_chunks=args.ep_overlap_chunks, zero_stage=args.zero_stage,
              distributed_optimizer=args.distributed_optimizer, param_dtype=args.param_dtype,
              pp_schedule=schedule, virtual_stages=args.virtual_stages,
              recompute=args.recompute, recompute_layers=args.recompute_layers, reduce_dtype=args.reduce_dtype,
              grad_bucket_numel=args.grad_bucket_numel,
              zero3_reduce_every_microbatch=args.zero3_reduce_every_microbatch,
              zero3_prefetch=args.zero3_prefetch, zero3_keep_params=args.zero3_keep_params, **_planner_only(args))


def _planner_only(args: argparse.Namespace) -> dict[str, object]:
    """The job's planner-only options (the runtime has none of them), from the flags: `estimate --config` takes
    these from its command line, and every other option from the file."""
    return {"attention_kernel": args.attention_kernel, "fp8": args.fp8, "fp8_recipe": _recipe_flag(args),
            "optimizer_state_dtype": args.optimizer_state_dtype, "tp_sum_with_reduction": args.tp_sum_with_reduction,
            "accumulate_in_reduce_dtype": args.accumulate_in_reduce_dtype, "eager_fp32_loss": args.eager_fp32_loss,
            "grad_accumulation_fusion": args.grad_accumulation_fusion, "overlap_ep": not args.no_overlap_ep,
            "overlap_shared_experts": not args.no_overlap_shared_experts,
            "overlap_grad_reduce": not args.no_overlap_grad_reduce, "pipeline_layout": args.pipeline_layout,
            "ep_comm_sms": args.ep_comm_sms, "ep_comm_sms_reserved": args.ep_comm_sms_reserved,
            "doc_lengths": args.doc_lengths,
            "recompute_modules": tuple(name for names in args.recompute_modules for name in names),
            "fp8_cached_activations": args.fp8_cached_activations, "tp_comm_overlap": args.tp_comm_overlap}


def _recipe_flag(args: argparse.Namespace) -> str:
    """The FP8 recipe asked for ("delayed" when none was); a recipe given without --fp8 would price nothing."""
    if args.fp8_recipe is not None:
        rules.fp8_recipe_needs_fp8(args.fp8_recipe, args.fp8, asked=True)
    return args.fp8_recipe or "delayed"


def _parameters(model: ModelSpec | DualEncoderSpec) -> str:
    """"8.0B parameters", with a MoE model's "1.2B active" (those one token runs through)."""
    total = model.total_params()
    active = model.active_params() if isinstance(model, ModelSpec) and model.is_moe else total
    return f"{count_params(total)} parameters" + (f", {count_params(active)} active" if active != total else "")


def _seq_text(job: Job) -> str:
    """The sequence length as priced: "250 (run padded to 256)" where cp pads it."""
    return f"{job.data_tokens} (run padded to {job.seq_len})" if job.data_seq_len else str(job.seq_len)


def format_estimate(est: Estimate) -> str:
    """Human-readable report of one estimate, each table in the unit its largest tensor or step reads in."""
    d, mem, t = est.degrees, est.memory, est.time
    unit, size = unit_for(max(mem.get(k, 0) for k in ESTIMATED_TENSORS), BYTE_UNITS)
    lines = [f"{est.model.name} ({_parameters(est.model)}) on {d.world_size} x {est.cluster.gpu.name} "
             f"({est.cluster.nodes} node(s) of {est.cluster.gpus_per_node}): {d}, seq {_seq_text(est.job)}, "
             f"micro-batch {est.job.micro_batch}, "
             f"{est.job.replica_microbatches(d)} micro-batch(es) per step",
             _options_line(est), f"memory per GPU ({unit}){_memory_stage(est)}:"]
    for key in (*ESTIMATED_TENSORS, "overhead", "total"):
        if key in mem:  # fp8 only under --fp8, as in the JSON
            lines.append(f"  {key:<12} {mem[key] / size:10.2f}")
        if key == "buffers":  # the transient categories it sums, each measured on its own by the runtime
            lines += [f"    {part:<16} {mem[part] / size:8.2f}" for part in TRANSIENT if mem.get(part)]
    lines.append(f"  needed       {mem['needed'] / size:10.2f}  (what must fit: the tensors, and the overhead the "
                 "allocator keeps when short of memory)")
    lines.append(f"  capacity     {est.cluster.gpu.memory_bytes / size:10.2f}" + ("" if est.fits else
                                                                                   "  (does NOT fit)"))
    unit, size = unit_for(max((row["sent"] for row in est.comm.values()), default=0), BYTE_UNITS)
    lines.append(f"communication per step ({unit} sent by one rank of stage 0):")
    for key, row in est.comm.items():
        lines.append(f"  {key:<22} {row['sent'] / size:10.3f}  ({counted(row['calls'], 'call')})")
    unit, size = unit_for(t.step_s, SECOND_UNITS)
    exposed = " ".join(f"{dim} {getattr(t, dim + '_s') / size:.3f}" for dim in ("tp", "cp", "ep", "pp", "dp"))
    lines.append(f"step time {t.step_s / size:.3f} {unit}: compute {t.compute_s / size:.3f}, bubble "
                 f"{t.bubble_s / size:.3f}, exposed comm {exposed}, optimizer {t.optimizer_s / size:.3f}")
    tokens = est.tokens_per_step / t.step_s / est.degrees.world_size
    rate, size = unit_for(t.tflops_per_gpu * 1e12, FLOP_RATE_UNITS)  # a tiny model's is not "0.0 TFLOP/s"
    lines.append(f"{tokens:,.0f} tokens/s per GPU, {t.tflops_per_gpu * 1e12 / size:.1f} {rate} per GPU, "
                 f"MFU {100 * t.mfu:.1f}% "
                 f"(attention counted whole; causal half {100 * t.mfu_causal:.1f}%; HFU {100 * t.hfu:.1f}%)")
    return "\n".join(lines)


# The flags DistMM's plan of a dual encoder reads (`plan.distmm.plan_distmm`); it refuses the others by name.
_DISTMM_FLAGS = ("model", "gpu", "gpus", "gpus_per_node", "nic_gbps", "transport", "global_batch", "param_dtype",
                 "json")


def _refuse_empty_search(args: argparse.Namespace, spec: ModelSpec, cluster: Cluster, space: SearchSpace,
                         global_batch: int) -> NoReturn:
    """Why no configuration was enumerated: no degrees the restrictions allow, or degrees whose data-parallel
    ranks cannot split the global batch into whole micro-batches."""
    asked = " ".join(f"--{d} {','.join(map(str, getattr(args, d)))}" for d in ("tp", "cp", "pp", "ep")
                     if getattr(args, d))
    experts_refuse = [_ep_refusal(ep, spec) for ep in args.ep or ()]
    if experts_refuse and all(experts_refuse):  # the model's experts, not the GPUs, rule out every ep asked
        raise ValueError(f"no layout of {args.gpus} GPUs has {asked}: {experts_refuse[0]}")
    dps = sorted({deg.dp for deg in candidate_degrees(spec, cluster, space, args.seq)})
    if dps and all(global_batch % dp for dp in dps):
        raise ValueError(f"no layout of {args.gpus} GPUs{' with ' + asked if asked else ''} splits the global batch "
                         f"of {global_batch} sequences over its dp ({', '.join(map(str, dps))}): each data-parallel "
                         f"rank takes whole micro-batches; give --global-batch a multiple of {dps[0]}, or allow a "
                         "larger tp, cp or pp")
    raise ValueError(f"no layout of {args.gpus} GPUs has {asked}: tp*cp*pp must divide the GPU count and ep "
                     "the data-parallel ranks; change the restriction or the GPU count")


def _ep_refusal(ep: int, spec: ModelSpec) -> str:
    """Why the model's experts cannot split over `ep` ranks, or "" where they can."""
    try:
        rules.ep_splits_experts(ep, spec.num_experts, spec.num_moe_layers)
    except rules.RuleError as err:
        return str(err)
    return ""


def run_plan(args: argparse.Namespace) -> int:
    if args.chart:
        _check_chart_path(args.chart, "--chart", args.overwrite)
    for name in ("gpus", "gpus_per_node", "seq", "top", "global_batch", "nic_gbps"):
        _positive(name, getattr(args, name))
    if not args.gpus:
        raise ValueError("--gpus is required for plan")
    if args.emit_config:
        from orangetron.cli.run_config import check_emit_path

        check_emit_path(args.emit_config, args.overwrite)  # before the search, not after it
    spec = load_model(args.model)
    if isinstance(spec, ModelSpec):
        _note_longer_than_the_model("plan", args.model, spec, args.seq)
        if args.emit_config and args.seq > spec.max_seq_len:  # the file would start ranks only to be refused
            raise ValueError(f"--seq {args.seq}: longer than the model's max_seq_len={spec.max_seq_len}, which "
                             "`orangetron train` refuses, so --emit-config cannot write it; give a shorter --seq or "
                             "raise max_seq_len in a model file")
    cluster = _cluster(args, args.gpus)
    if isinstance(spec, DualEncoderSpec):
        from orangetron.plan.distmm import format_plan, plan_distmm

        ignored = [flag for flag, dest in typed_flags(args.own_parser).items() if dest not in _DISTMM_FLAGS]
        if ignored:  # they were taken and ignored, unsaid (--chart wrote nothing, --emit-config no file)
            takes = ", ".join("--" + dest.replace("_", "-") for dest in _DISTMM_FLAGS)
            raise ValueError(f"--model {args.model} is a dual encoder, planned by DistMM, which takes none of "
                             f"{' '.join(ignored)} (it takes {takes})")
        batch = args.global_batch or 32 * args.gpus
        plan = plan_distmm(spec, cluster, batch, param_dtype=args.param_dtype)
        print(json.dumps(plan.to_json()) if args.json else format_plan(plan))
        return 0
    global_batch = args.global_batch or args.gpus
    overlaps = _plan_overlaps(args, spec)
    base = Job(seq_len=args.seq, param_dtype=args.param_dtype, attention_kernel=args.attention_kernel, fp8=args.fp8,
               fp8_recipe=_recipe_flag(args), fp8_cached_activations=args.fp8_cached_activations,
               dispatcher=args.dispatcher, ep_comm_sms=args.ep_comm_sms,
               ep_comm_sms_reserved=args.ep_comm_sms_reserved, pipeline_layout=args.pipeline_layout,
               doc_lengths=args.doc_lengths, **overlaps)
    if args.fp8:
        cluster.gpu.peak_flops("float8")  # ValueError when the GPU has no FP8 tensor cores
    if args.grad_bucket_numel < 0:
        raise ValueError(f"--grad-bucket-numel {args.grad_bucket_numel}: must be >= 0 (0: no buckets)")
    if not 0 < args.memory_fraction <= 1:  # above 1 would admit layouts the GPU cannot hold
        raise ValueError(f"--memory-fraction={args.memory_fraction}: must be > 0 and <= 1 (a share of GPU memory)")
    space = SearchSpace(tp=args.tp, cp=args.cp, pp=args.pp, ep=args.ep, dispatcher=(args.dispatcher,),
                        partial_recompute=not args.no_partial_recompute,
                        grad_bucket_numel=tuple(sorted({0, args.grad_bucket_numel})))
    if args.pp_schedule:
        space = replace(space, pp_schedule=tuple(args.pp_schedule))
    if args.pipeline_layout:
        space = replace(space, pp=_layout_pipeline_degrees(spec, args.pipeline_layout, args.pp, args.gpus,
                                                           space.pp_schedule))
    if args.attention_kernel != "eager":
        space = replace(space, recompute=("none", "full"))  # selective equals none when flash keeps no scores
    start = time.perf_counter()
    result = search(spec, cluster, args.seq, global_batch, space, base, args.top, args.memory_fraction,
                    _overhead(args))
    elapsed = time.perf_counter() - start
    if not result.considered:
        _refuse_empty_search(args, spec, cluster, space, global_batch)
    if result.refused:  # every configuration broke a rule: memory is not why none is ranked
        raise ValueError(f"no configuration of {args.gpus} GPUs searched can run {spec.name}; the first refused: "
                         f"{flag_named(result.refused, flags_of(args.own_parser))}")
    if not result.ranked:
        raise ValueError(f"no layout of {args.gpus} x {cluster.gpu.name} fits {spec.name} with seq {args.seq} and "
                         f"global batch {global_batch} in {args.memory_fraction:.0%} of "
                         f"{cluster.gpu.memory_gib:.0f} GiB; add GPUs or shorten the sequence")
    print(f"priced {result.evaluated} fitting of {result.considered} configurations in {elapsed:.2f} s",
          file=sys.stderr)
    padded = sorted({row.job.seq_len for row in result.ranked} - {args.seq})
    if padded:  # `search.candidate_jobs`: cp ranks that cannot split the sequence run it padded
        print(f"orangetron plan: note: --seq {args.seq} runs padded to {' or '.join(map(str, padded))} on the rows "
              "whose cp ranks cannot split it, as train pads it (ignored labels at its end): time and memory are "
              f"priced padded, tokens/s and MFU count its {args.seq} tokens",
              file=sys.stderr)
    if args.chart:
        from orangetron.plan.chart import breakdown_chart

        moved = _claim_chart(args.chart, "--chart", args.overwrite)
        breakdown_chart(result.ranked[: min(5, len(result.ranked))], args.chart)
        print(f"chart written to {args.chart}{moved}", file=sys.stderr)
    if args.json:
        print(json.dumps({"model": spec.name, "gpu": cluster.gpu.name, "gpus": args.gpus,
                          "evaluated": result.evaluated, "considered": result.considered,
                          "search_s": elapsed, "ranked": [e.to_json() for e in result.ranked]}))
    else:
        shown = overlaps if spec.num_experts else _asked_overlaps(args)  # a dense model's: as typed
        print(_plan_header(args, spec.name, cluster.gpu.name, global_batch, len(result.ranked), shown))
        print(format_ranking(result.ranked))
    if args.emit_config:  # after the ranking, which stays on screen when the trainer runs none of it
        from orangetron.cli.run_config import emit_config, trainer_runs

        ranked = result.ranked
        if len(ranked) < min(result.evaluated, EMIT_DEPTH) and not any(trainer_runs(row) for row in ranked):
            ranked = search(spec, cluster, args.seq, global_batch, space, base, min(result.evaluated, EMIT_DEPTH),
                            args.memory_fraction, _overhead(args)).ranked  # further down than --top shows
        moved: list[Path] = []
        folder = _hf_folder(args.model)
        rank, passed_over = emit_config(ranked, args.emit_config, args.overwrite, moved, folder)
        skipped = f"; the trainer does not run {'; '.join(passed_over)}" if passed_over else ""
        skipped += f"; the run starts from the weights of {folder}" if folder else ""
        aside = f" (the former file moved to {moved[0]})" if moved else ""
        below = f" (below the {len(result.ranked)} shown)" if rank > len(result.ranked) else ""
        print(f"wrote {args.emit_config}{aside}: configuration #{rank}{below}{skipped}", file=sys.stderr)
        if args.doc_lengths:  # the file names no data: packing is the data's, as train settles it
            print("orangetron plan: note: ranked on the packed documents of --doc-lengths; the file leaves packing "
                  "to the run's data: a prepared dataset packs its documents, text files need --pack-documents",
                  file=sys.stderr)
    return 0


def _hf_folder(model: str) -> str | None:
    """The Hugging Face folder `--model` names (the folder or its config.json) when it holds weights, which an
    emitted run then starts from; else None (a preset, a model file, a folder with its config.json alone)."""
    from orangetron.hf.folder import weight_files

    path = Path(model)
    path = path.parent if path.name == "config.json" and path.is_file() else path
    try:
        return str(path.resolve()) if is_hf_folder(path) and weight_files(path) else None
    except FileNotFoundError:  # no weights: the file trains the folder's shape from seeded values
        return None


def _plan_overlaps(args: argparse.Namespace, spec: ModelSpec) -> dict[str, bool]:
    """The expert all-to-all's overlaps `plan` ranks with: the flags', and for `--emit-config` no more than the
    trainer runs (its file is priced so, `estimate --config`), said on standard error where that drops one."""
    asked = _asked_overlaps(args)
    if not args.emit_config:
        return asked
    from orangetron.cli.run_config import trainer_overlaps

    ranked = trainer_overlaps(asked)
    dropped = [flag for flag in _no_overlap_flags(**ranked) if flag not in _no_overlap_flags(**asked)]
    if spec.num_experts and dropped:
        shared = ", and its shared experts hide the forward combine only" if spec.num_shared_experts else ""
        print(f"orangetron plan: note: --emit-config ranks as the trainer overlaps the expert all-to-all "
              f"({' '.join(dropped)}): it pairs no micro-batches{shared}", file=sys.stderr)
    return ranked


def _asked_overlaps(args: argparse.Namespace) -> dict[str, bool]:
    return {"overlap_ep": not args.no_overlap_ep, "overlap_shared_experts": not args.no_overlap_shared_experts}


def _plan_header(args: argparse.Namespace, model: str, gpu: str, global_batch: int, rows: int,
                 overlaps: dict[str, bool]) -> str:
    layout = args.pipeline_layout and ", layers per virtual stage " + ",".join(map(str, args.pipeline_layout))
    fp8 = f", fp8 ({_fp8_recipe(_recipe_flag(args), args.fp8_cached_activations)})" if args.fp8 else ""
    no_overlaps = "".join(f", {flag}" for flag in _no_overlap_flags(**overlaps))
    fastest = "the fastest layout that fits" if rows == 1 else f"the {rows} fastest layouts that fit"
    return (f"{model} on {args.gpus} x {gpu}, seq {args.seq}, global batch {global_batch} sequences, "
            f"{args.param_dtype}{fp8}{layout or ''}{no_overlaps}: {fastest} (sequence parallel where tp > 1)")


def _no_overlap_flags(overlap_ep: bool, overlap_shared_experts: bool) -> list[str]:
    """The flags that turned the expert all-to-all's overlaps off, as `estimate` and `plan` print them."""
    return [flag for flag, on in (("--no-overlap-ep", overlap_ep),
                                  ("--no-overlap-shared-experts", overlap_shared_experts)) if not on]


def _fp8_recipe(recipe: str, cached_activations: bool) -> str:
    """The FP8 recipe as `estimate` and `plan` print it."""
    return recipe + (", cached activations" if cached_activations else "")


# Planner-only options that price a framework's own path (docs/planner.md, section 3, 'Framework paths')
_FRAMEWORK_PATHS = ("grad_accumulation_fusion", "tp_sum_with_reduction", "accumulate_in_reduce_dtype",
                    "eager_fp32_loss", "tp_comm_overlap")


def _options_line(est: Estimate) -> str:
    """The options priced besides the degrees, in the words of the plan table and the flags."""
    d, j = est.degrees, est.job
    fp8 = f" with fp8 ({_fp8_recipe(j.fp8_recipe, j.fp8_cached_activations)})" if j.fp8 else ""
    parts = [sharding_label(j), j.param_dtype + fp8,
             f"attention {j.attention_kernel}", f"recompute {_recompute(j)}"]
    if j.reduce_dtype and j.reduce_dtype != j.param_dtype:
        parts.append(f"reduce in {j.reduce_dtype}")
    if j.optimizer_state_dtype:
        parts.append(f"adam moments in {j.optimizer_state_dtype}")
    if d.tp > 1 and j.sequence_parallel:
        parts.append("sequence parallel")
    if d.cp > 1:
        parts.append(f"cp {j.cp_mode}")
    if d.pp > 1:
        layout = f" layout {','.join(map(str, j.pipeline_layout))}" if j.pipeline_layout else ""
        parts.append(f"{j.pp_schedule}{f' v={j.virtual_stages}' if j.virtual_stages > 1 else ''}{layout}")
    if est.model.num_experts:
        parts.append(", ".join([f"dispatcher {j.dispatcher}", *_no_overlap_flags(j.overlap_ep,
                                                                                 j.overlap_shared_experts)]))
    if not j.overlap_grad_reduce:
        parts.append("--no-overlap-grad-reduce")
    parts += ["--" + name.replace("_", "-") for name in _FRAMEWORK_PATHS if getattr(j, name)]
    return "options: " + ", ".join(parts)


def _memory_stage(est: Estimate) -> str:
    """Which pipeline stage the memory figures are of, when there are several: the busiest, which a change of
    options can move."""
    if est.degrees.pp == 1:
        return ""
    return f", pipeline stage {busiest_stage(est.model, est.degrees, est.job)} of {est.degrees.pp}, the busiest"


def _recompute(job: Job) -> str:
    """none, selective, full, or full/r: the first r layers of each chunk replayed; then +m for each replayed
    module m."""
    modules = "".join(f"+{name}" for name in job.recompute_modules)
    return (f"full/{job.recompute_layers}" if job.partial_recompute else job.recompute) + modules


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated list of names (checked where they are used)."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def format_ranking(ranked: list[Estimate]) -> str:
    """The ranked layouts, a row each; the step time in the unit the slowest reads in."""
    unit, size = unit_for(max((e.time.step_s for e in ranked), default=0), SECOND_UNITS)
    head = (f"{'#':>2} {'tp':>3} {'cp':>3} {'pp':>3} {'v':>2} {'schedule':<11} {'dp':>4} {'ep':>3} {'mb':>3} "
            f"{'zero':<9} {'recomp':<9} {'cp mode':<9} {'need GiB':>8} {'step ' + unit:>8} {'MFU %':>6}")
    rows = [head]
    for i, e in enumerate(ranked, 1):
        d, j = e.degrees, e.job
        zero, mode, recompute = sharding_label(j), j.cp_mode if d.cp > 1 else "-", _recompute(j)
        schedule = j.pp_schedule if d.pp > 1 else "-"
        rows.append(f"{i:>2} {d.tp:>3} {d.cp:>3} {d.pp:>3} {j.virtual_stages:>2} {schedule:<11} {d.dp:>4} {d.ep:>3} "
                    f"{j.micro_batch:>3} {zero:<9} {recompute:<9} {mode:<9} {e.memory['needed'] / GIB:>8.1f} "
                    f"{e.time.step_s / size:>8.3f} {100 * e.time.mfu:>6.1f}")
    return "\n".join(rows)


MAX_DOCUMENTS = 1_000_000  # --doc-lengths: a sample of a corpus prices it as well, in seconds not hours


def _doc_lengths(path: str) -> tuple[int, ...]:
    """A file of document lengths, one per line, or `LENGTH COUNT` lines (a histogram), in packing order."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise argparse.ArgumentTypeError(f"{path}: cannot read document lengths ({err})") from None
    lengths: list[int] = []
    for number, line in enumerate(lines, 1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) > 2 or not all(f.isdigit() and int(f) >= 1 for f in fields):
            raise argparse.ArgumentTypeError(f"{path}:{number}: expected LENGTH or LENGTH COUNT (integers >= 1), "
                                             f"not {line.strip()!r}")
        count = int(fields[1]) if len(fields) == 2 else 1
        if len(lengths) + count > MAX_DOCUMENTS:
            raise argparse.ArgumentTypeError(f"{path}:{number}: more than {MAX_DOCUMENTS:,} documents; give a sample "
                                             "of them (the price is a mean over the sequences they fill)")
        lengths += [int(fields[0])] * count
    if not lengths:
        raise argparse.ArgumentTypeError(f"{path}: no document lengths")
    return tuple(lengths)


def _layout(text: str) -> tuple[int, ...]:
    """'4x15,1' -> fifteen 4s and a 1."""
    out: list[int] = []
    for item in text.split(","):
        layers, cross, times = item.partition("x")
        if not layers.isdigit() or (cross and not (times.isdigit() and int(times) >= 1)):
            raise argparse.ArgumentTypeError(f"{text!r}: each item must be N or NxK (N >= 0 layers, K >= 1 "
                                             f"virtual stages), not {item!r}")
        out += [int(layers)] * (int(times) if cross else 1)
    return tuple(out)


def _layout_pipeline_degrees(spec: ModelSpec, layout: tuple[int, ...], asked: tuple[int, ...] | None,
                             gpus: int, schedules: tuple[str, ...]) -> tuple[int, ...]:
    """The pipeline degrees `plan --pipeline-layout` searches: those (of `asked`, if given) that divide both the
    layout's virtual stages and the GPU count, more than one rank unless the layout has one stage, and leave
    one virtual stage a rank where a searched schedule runs one chunk, several where one interleaves."""
    if sum(layout) != spec.num_layers:
        raise ValueError(f"--pipeline-layout holds {sum(layout)} layers; {spec.name} has {spec.num_layers}")
    chunks, chunked = len(layout), {SCHEDULES[s].chunks for s in schedules}
    degrees = tuple(p for p in asked or divisors(chunks) if chunks % p == 0 and gpus % p == 0
                    and (p > 1 or chunks == 1) and (p < chunks) in chunked)
    if not degrees:
        raise ValueError(f"--pipeline-layout has {chunks} virtual stages: pp{' (of --pp)' if asked else ''} must "
                         f"divide both them and {gpus} GPUs, be more than 1, and leave one virtual stage a rank "
                         f"for a one-chunk schedule or several for an interleaved one ({', '.join(schedules)} "
                         "searched); none does")
    return degrees


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: degrees must be >= 1")
    return values


def _add_schedule_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("schedule", help="simulate and draw a pipeline schedule",
                       description="Order of forward and backward passes on every pipeline rank, simulated with "
                                   "backward = 2 x forward: bubble fraction, peak activations in flight per rank, "
                                   "and a timeline chart.")
    p.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    p.add_argument("--microbatches", type=int, required=True, help="micro-batches per step")
    p.add_argument("--schedule", dest="pp_schedule", choices=SCHEDULES.names(), default="1f1b",
                   help="zb-h1 splits each backward into B and W (W = half of it here) (default: %(default)s)")
    p.add_argument("--virtual-stages", type=int, default=1, help="model chunks per rank (interleaved)")
    p.add_argument("-o", "--output", metavar="FILE.png", help="draw the timeline")
    p.add_argument("--overwrite", action="store_true",
                   help="move an existing -o file aside to FILE.previous-N instead of refusing it")
    p.add_argument("--measured", action="store_true",
                   help="run the schedule for one step of a small model on --pp local CPU ranks and report (and "
                   "draw) that run's timeline instead of the simulation, with the simulated bubble beside it")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line of standard output")
    p.set_defaults(run=run_schedule)


def run_schedule(args: argparse.Namespace) -> int:
    from orangetron.spec.schedule import actions, bubble_fraction, peak_in_flight, simulate

    if args.output:
        _check_chart_path(args.output, "-o", args.overwrite)
    slots = simulate(args.pp, args.microbatches, args.pp_schedule, args.virtual_stages)
    simulated = bubble_fraction(slots, args.pp)
    if args.measured:
        from orangetron.train.timeline import measured_slots  # the runtime, only when asked for

        slots = measured_slots(args.pp, args.microbatches, args.pp_schedule, args.virtual_stages)
    result = {
        "pp": args.pp, "microbatches": args.microbatches, "schedule": args.pp_schedule,
        "virtual_stages": args.virtual_stages, "bubble_fraction": bubble_fraction(slots, args.pp),
        "measured": args.measured, "simulated_bubble_fraction": simulated,
        "formula_bubble_fraction": _formula_bubble(args.pp, args.microbatches, args.pp_schedule, args.virtual_stages),
        "makespan": max(s.end for s in slots),
        "peak_in_flight": [peak_in_flight(slots, r) for r in range(args.pp)],
        "order": [[f"{a.kind}{a.microbatch}" + (f".{a.chunk}" if args.virtual_stages > 1 else "") for a in rank]
                  for rank in actions(args.pp, args.microbatches, args.pp_schedule, args.virtual_stages)],
    }
    title = (f"{args.pp_schedule}, pp={args.pp}, {counted(args.microbatches, 'micro-batch', 'micro-batches')}"
             + (f", {args.virtual_stages} chunks" if args.virtual_stages > 1 else "")
             + f": {'measured' if args.measured else 'simulated'} bubble {result['bubble_fraction']:.1%}"
             + (f" (simulated {simulated:.1%})" if args.measured else ""))
    out = sys.stdout if not args.json else sys.stderr
    print(title, file=out)
    for rank, order in enumerate(result["order"]):
        print(f"  rank {rank} (holds {result['peak_in_flight'][rank]} at peak): {' '.join(order)}", file=out)
    if args.output:
        from orangetron.plan.chart import schedule_chart

        moved = _claim_chart(args.output, "-o", args.overwrite)
        schedule_chart(slots, args.pp, title, args.output)
        print(f"chart written to {args.output}{moved}", file=out)
    if args.json:
        print(json.dumps(result))
    return 0


def _formula_bubble(pp: int, microbatches: int, schedule: str, virtual_stages: int) -> float:
    """The cost model's bubble fraction at the simulation's costs (forward 1, backward 2, W half of it)."""
    from orangetron.spec.schedule import zero_bubble_h1_bubble

    if SCHEDULES[schedule].split_backward:
        idle = zero_bubble_h1_bubble(pp, 1.0, 1.0, 1.0)
        return idle / (3.0 * microbatches + idle)
    return (pp - 1) / (virtual_stages * microbatches + pp - 1)


def _check_chart_path(path: str, flag: str, overwrite: bool) -> None:
    """Refuse, before any work, a chart matplotlib cannot write, and a file already there unless `overwrite`
    (every command that writes keeps that rule: train/outputs.py)."""
    try:
        # The package is imported first, so that an absent one is found absent even where a submodule is loaded.
        import matplotlib.backend_bases as backend_bases
    except ImportError:
        raise ValueError("charts need matplotlib, an orangetron dependency: pip install matplotlib") from None
    from orangetron.train.outputs import check_claim

    suffix = Path(path).suffix.lower().lstrip(".")
    formats = backend_bases.FigureCanvasBase.get_supported_filetypes()
    if Path(path).is_dir():
        raise ValueError(f"{flag} {path}: a folder; name the chart's file")
    if suffix not in formats:  # none: matplotlib would write NAME.png, past the check of NAME
        raise ValueError(f"{flag} {path}: " + (f"no chart is written as .{suffix}" if suffix else "no suffix names "
                         "the chart's format") + f"; name a .png (or one of "
                         f"{', '.join('.' + name for name in sorted(formats))})")
    if not Path(path).absolute().parent.is_dir():  # found before the work, not by the write after it
        raise ValueError(f"{flag} {path}: no such folder {str(Path(path).parent)!r}")
    check_claim(Path(path), flag, overwrite)


def _claim_chart(path: str, flag: str, overwrite: bool) -> str:
    """Move what is at `path` aside (checked before the work), returning the note that says where."""
    from orangetron.train.outputs import claim_output

    moved = claim_output(Path(path), flag, overwrite)
    return f" (the former file moved to {moved})" if moved else ""
