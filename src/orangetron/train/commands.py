"""`orangetron train`: flags -> TrainConfig -> train() -> progress on stderr, JSON on stdout."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

from orangetron.cli.wording import counted
from orangetron.spec.variants import CONTEXT_MODES, DISPATCHERS, SCHEDULES, Registry
from orangetron.train.config_file import config_keys

DEFAULTS_NOTE = "With no flags: the small-moe model on the embedded stdlib corpus, on one CPU rank."


def add_train_commands(sub: Any) -> None:
    """Register the `train` subcommand on an argparse subparsers object."""
    from orangetron.model.config import MODEL_PRESETS
    from orangetron.train.config import PARAM_DTYPES, TrainConfig
    from orangetron.train.run_folder import CHANGEABLE_ON_RESUME_TEXT

    fields = TrainConfig.__dataclass_fields__
    p = sub.add_parser(
        "train",
        help="train a model on local ranks (CPU or --device cuda), or under torchrun",
        description="Train a transformer (from scratch or from a Hugging Face folder) and report losses, memory and "
        "communication. " + DEFAULTS_NOTE + " Ctrl-C (SIGINT) or SIGTERM stops every rank after the step it is "
        "taking, checkpointed with --out, and exits 130 or 143; a second Ctrl-C aborts at once.",
    )

    def option(flag: str, text: str, **kwargs: Any) -> None:
        # Defaults come from TrainConfig, so the CLI and the Python API cannot drift apart.
        name = flag[2:].replace("-", "_")
        p.add_argument(flag, default=fields[name].default, help=text + " (default: %(default)s)", **kwargs)

    option("--model", "model: a train preset (" + ", ".join(MODEL_PRESETS) + "), a planner preset or a .toml model "
           "file; fields the runtime cannot build yet are refused by name")
    option("--steps", "optimizer steps", type=int)
    option("--seq-len", "tokens per sample", type=int)
    option("--batch-size", "samples per step", type=int)
    option("--lr", "peak learning rate, reached after the warmup", type=float)
    option("--warmup", "linear warmup steps", type=int)
    option("--seed", "seed for init and batch order; the same seed gives identical losses", type=int)
    option("--eval-every", "also evaluate held-out loss every N steps; 0: only at the end", type=int)
    p.add_argument("--param-dtype", "--dtype", dest="param_dtype", default=fields["param_dtype"].default,
                   choices=list(PARAM_DTYPES),
                   help="parameter dtype; bfloat16 keeps float32 main params (default: %(default)s)")
    option("--threads", "CPU threads for torch ops; 1 stays fast when other processes share the cores",
           type=int)
    option("--timeout-s", "seconds a rank waits for the others in a collective; then every rank stops and the "
           "one that stopped responding is named", type=float)
    p.add_argument("--hf-model", metavar="DIR", default=None,
                   help="start from a Hugging Face model folder (config.json and safetensors): its config is the "
                   "model and its weights the start, on any layout, each rank reading only its own share; its "
                   "tokenizer is the run's unless --tokenizer says otherwise")
    _add_data_flags(p)
    p.add_argument("--out", metavar="DIR", default=None,
                   help="run folder: metrics.jsonl, and checkpoints/ with one after the last step")
    p.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="also write a checkpoint every N steps (default: only after the last step)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --out, on whatever layout this run has; every "
                   "option not given comes from the run's config.toml, and one given that differs is refused "
                   f"unless it may change ({CHANGEABLE_ON_RESUME_TEXT})")
    p.add_argument("--new-data", action="store_true",
                   help="with --resume and --data: continue on data whose text differs from the run's record; "
                   "the change is logged in the run folder's changes.jsonl")
    p.add_argument("--overwrite", action="store_true",
                   help="a new run into an --out folder that holds another run moves that run aside to "
                   "OUT.previous-N (never deleted) instead of refusing")
    p.add_argument("--extend", action="store_true",
                   help="with --resume: allow --steps past the checkpointed run's total; the cosine keeps its "
                   "span (--schedule-steps, recorded) and the learning rate then holds its last value")
    p.add_argument("--schedule-steps", type=int, default=None, metavar="N",
                   help="steps the warmup and cosine span; past them the rate holds its last value (default: "
                   "--steps; an extended run records its old span here, so --config repeats it)")
    p.add_argument("--stop-after", type=int, default=0, metavar="N",
                   help="end after step N with a checkpoint, on the schedule of --steps, to continue later "
                   "with --resume (needs --out; default 0: run all --steps)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object with the results as the last line of standard output")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar or logs on standard error (its warnings, and a stopped run's way to "
                        "continue, still print there)")
    p.add_argument("--min-lr", type=float, default=None,
                   help="floor of the cosine decay, reached at the last step (default: lr/10)")
    option("--weight-decay", "AdamW weight decay, on matrices only (betas 0.9 and 0.95, eps 1e-8)", type=float)
    option("--grad-clip", "largest global gradient norm (gradients scaled by clip / (norm + 1e-6), as "
           "torch.nn.utils.clip_grad_norm_); 0 disables clipping", type=float)
    option("--eval-batches", "batches of held-out data per evaluation", type=int)
    option("--eval-fraction", "share of the token stream, from its end, held out for evaluation", type=float)
    option("--corpus-bytes", "bytes of the stdlib corpus to train on when --data is not given", type=int)
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=False,
                   help="torch's deterministic algorithms (and cuBLAS's on cuda), so a rerun is bitwise equal; an op "
                   "without a deterministic kernel then stops the run naming it")
    _add_device_flag(p)
    _add_packing_flag(p, "(default: on for a prepared dataset, which keeps a document index; off for text)")
    _add_layout_flags(p)
    _add_config_flag(p)
    p.set_defaults(run=run_train)
    _add_verify_command(sub, config_keys(p))


def _add_device_flag(p: argparse.ArgumentParser) -> None:
    from orangetron.train.placement import DEVICES  # torch-free: fast --help

    p.add_argument("--device", default=None, choices=DEVICES,
                   help="where every rank computes: cpu (gloo), or cuda (one GPU per local rank, NCCL for device "
                   "tensors and gloo for host bookkeeping) (default: cuda when torch sees a GPU, else cpu)")


def _add_packing_flag(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--pack-documents", action=argparse.BooleanOptionalAction, default=None,
                   help="attend within each document only (one file of text or of the stdlib corpus, or a "
                   "prepared dataset's document), RoPE positions restarting at 0 in each, and no loss on the "
                   f"label after a document's last token {default}")


def _add_layout_flags(p: argparse.ArgumentParser) -> None:
    from orangetron.spec.parallel_config import DROP_POLICIES, RECOMPUTE, ParallelConfig  # torch-free: fast --help

    defaults = ParallelConfig.__dataclass_fields__  # the variants' defaults live once, in the options type
    p.add_argument("--dp", type=int, default=1,
                   help="data-parallel degree: ranks that split each batch, started for you (default: %(default)s)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree: ranks that split every weight matrix (default: %(default)s)")
    p.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=False,
                   help="with --tp: norms on sequence shards, TP's all-reduces become reduce-scatter + all-gather")
    p.add_argument("--cp", type=int, default=1,
                   help="context-parallel degree: local ranks that split every sequence, head-tail (packed documents: "
                        "balanced by document) (default: %(default)s)")
    p.add_argument("--cp-mode", default=defaults["cp_mode"].default, choices=CONTEXT_MODES.names(runtime=True),
                   help="context-parallel attention (default: %(default)s): " + _summaries(CONTEXT_MODES))
    p.add_argument("--ulysses-degree", type=int, default=1, metavar="N",
                   help="--cp-mode usp: all-to-all over N ranks, ring over cp/N (default: %(default)s)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline-parallel degree: ranks that each run a contiguous share of the layers "
                        "(default: %(default)s)")
    p.add_argument("--pp-schedule", default=defaults["pp_schedule"].default, choices=SCHEDULES.names(runtime=True),
                   help="pipeline schedule with --pp, as `orangetron schedule` draws it (default: %(default)s)")
    p.add_argument("--microbatches", type=int, default=1,
                   help="micro-batches per step; gradients accumulate over them (default: %(default)s)")
    p.add_argument("--virtual-stages", type=int, default=1,
                   help="model chunks per pipeline rank, with --pp-schedule interleaved (default: %(default)s)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel degree: the dp ranks split the routed experts into ep blocks "
                        "(default: %(default)s)")
    p.add_argument("--dispatcher", default=defaults["dispatcher"].default, choices=DISPATCHERS.names(runtime=True),
                   help="expert dispatch with --ep (default: %(default)s): " + _summaries(DISPATCHERS))
    p.add_argument("--capacity-factor", type=float, default=1.0,
                   help="--dispatcher capacity: slots per expert as a multiple of the fair share (default: 1.0)")
    p.add_argument("--drop-policy", default=defaults["drop_policy"].default, choices=DROP_POLICIES,
                   help="--dispatcher capacity: which tokens past an expert's capacity are dropped: the lowest "
                   "routing probabilities or the latest positions (default: %(default)s)")
    p.add_argument("--reduce-dtype", default=None, choices=("float32", "float64", "bfloat16"),
                   help="dtype gradients are reduced in over data-parallel ranks (default: the parameters')")
    p.add_argument("--ep-overlap-chunks", type=int, default=1,
                   help="--dispatcher ragged: dispatch in this many token chunks, one chunk's all-to-all "
                   "overlapping another's expert compute (default: 1, no overlap)")
    p.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3),
                   help="0: DDP; 1: shard optimizer state; 2: and gradients; 3: and parameters (over dp ranks) "
                   "(default: %(default)s)")
    p.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction, default=False,
                   help="ZeRO-1 sharding with the parameter all-gather right after the step (Megatron)")
    p.add_argument("--grad-bucket-numel", type=int, default=0, metavar="N",
                   help="reduce gradients in buckets of about N elements during backward: DDP all-reduces them, "
                   "ZeRO-1/2 and --distributed-optimizer reduce-scatter them (default: once after backward)")
    p.add_argument("--zero3-prefetch", action=argparse.BooleanOptionalAction, default=True,
                   help="--zero-stage 3: gather the next unit while the current one computes (default: on)")
    p.add_argument("--zero3-keep-params", action=argparse.BooleanOptionalAction, default=False,
                   help="--zero-stage 3: keep forward's gathered units until their backward (no second gather, "
                   "more memory)")
    p.add_argument("--zero3-reduce-every-microbatch", action=argparse.BooleanOptionalAction, default=False,
                   help="--zero-stage 3: reduce-scatter every micro-batch's gradients into the sharded main buffer "
                   "(one unit's .grad at a time, m times the reduce-scatters; default: accumulate whole in .grad)")
    p.add_argument("--recompute", default=defaults["recompute"].default, choices=RECOMPUTE,
                   help="activation recompute (default: %(default)s): full keeps each replayed layer's input only "
                   "and replays its forward (and its collectives) in backward; selective (the attention core) "
                   "keeps what none keeps here, since every attention kernel the runtime runs already recomputes "
                   "its scores in backward")
    p.add_argument("--recompute-layers", type=int, default=defaults["recompute_layers"].default, metavar="N",
                   help="--recompute full: replay only the first N layers of each pipeline chunk, keep the others' "
                   "activations (Megatron's block method; default: %(default)s, every layer)")


def _summaries(registry: Registry) -> str:
    """'name: what it does; ...' for every variant the runtime runs (%% escaped for argparse)."""
    return "; ".join(f"{r.name}: {r.summary}" for r in registry if r.runtime).replace("%", "%%")


def _add_data_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", nargs="+", metavar="FILE", default=None,
                   help="UTF-8 text files to train on, or one folder `orangetron prepare-data` wrote (read through a "
                   "memory map, never whole) (default: the Python standard library's sources)")
    p.add_argument("--tokenizer", metavar="DIR|FILE", default=None,
                   help="byte, or a tokenizer folder or tokenizer.json (Hugging Face tokenizers; BOS/EOS from "
                   "tokenizer_config.json) (default: a prepared dataset's, else the --hf-model folder's, else byte)")


def _add_config_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE.toml",
                   help="options from a TOML file, keys named as the flags (zero-stage = 2); flags given on the "
                   "command line override it. A run folder keeps its resolved options as config.toml")
    p.set_defaults(command_parser=p)


VERIFY_MODEL = "tiny-moe"  # two runs of every step: a model that keeps verify quick


def _add_verify_command(sub: Any, train_keys: Collection[str]) -> None:
    from orangetron.train.config import DEFAULT_TOLERANCE, PARAM_DTYPES

    p = sub.add_parser(
        "verify", help="check that a layout reproduces one rank",
        description="Run the same steps on one rank and on the layout; print the largest relative loss and "
        "gradient differences; exit 1 past the tolerance. The MoE load-balancing loss stays on: every layout "
        "computes it over the whole batch, as one rank does.",
    )
    p.add_argument("--model", default=None,
                   help=f"model, as train --model takes it (default: {VERIFY_MODEL}, or the --hf-model folder's)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sample (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per step (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed (default: %(default)s)")
    p.add_argument("--param-dtype", "--dtype", dest="param_dtype", default="float64", choices=list(PARAM_DTYPES),
                   help="parameter dtype (default: %(default)s)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="largest relative difference accepted: max |g - g_ref| over every element of every "
                   "parameter, over max |g_ref| (default by the least precise of --param-dtype and --reduce-dtype: "
                   + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_TOLERANCE.items()) + "; at the default, bfloat16 "
                   "gradients are also judged against one rank in float64, parameter by parameter (at the first "
                   "step where they pass it; in float32 where a router chose other experts than on one rank), "
                   "which a tolerance given turns off)")
    p.add_argument("--hf-model", metavar="DIR", default=None,
                   help="both runs start from this Hugging Face folder's weights (its config is the model)")
    _add_data_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line of standard output")
    _add_device_flag(p)
    _add_packing_flag(p, "(default: on for a prepared dataset, which keeps a document index; off for text, the "
                      "stdlib corpus's files included)")
    _add_layout_flags(p)
    _add_config_flag(p)
    # A run's config file (or plan's) holds the training run's own options too, its length among them (a check
    # takes a few steps: --steps): verify reads the rest.
    ignored = {"steps", *(set(train_keys) - set(config_keys(p)))}
    p.set_defaults(run=run_verify, config_ignores=tuple(sorted(ignored)))


def run_verify(args: argparse.Namespace) -> int:
    """Run `orangetron verify`; returns 0 when the layout is within tolerance, 1 otherwise."""
    from orangetron.train.config import TrainConfig
    from orangetron.train.verify import check_tolerance, verify

    options = _config_options(args)
    if options["model"] is None:  # the --hf-model folder's config is the model, else verify's small default
        if options.get("hf_model"):
            del options["model"]
        else:
            options["model"] = VERIFY_MODEL
    cfg = TrainConfig(**options, warmup=0, corpus_bytes=200_000)
    check_tolerance(args.tolerance)  # before the warnings: a refusal stays one line
    warnings = cfg.warnings()
    if cfg.layout.world_size == 1:
        warnings.append(f"layout {cfg.layout} is one rank: verify compares one rank with itself")
    primary = os.environ.get("RANK", "0") == "0"  # under torchrun every process holds the result: one speaks
    for warning in warnings if primary else ():
        print(f"orangetron verify: warning: {warning}", file=sys.stderr)
    result = verify(cfg, args.tolerance)
    if not primary:
        return 0 if result["ok"] else 1
    if result.get("capacity_factor") not in (None, cfg.capacity_factor):
        print(f"orangetron verify: --dispatcher capacity measured with --capacity-factor "
              f"{result['capacity_factor']:g} instead of {cfg.capacity_factor:g}, which drops no token (dropped "
              "tokens differ from one rank by design)", file=sys.stderr)
    gaps = result.get("float64_gaps")
    ok = "ok, judged against float64 (below)" if gaps else "ok"
    verdict = ok if result["ok"] else (f"FAILED (largest loss gap at step {result['worst_loss_step']}, largest "
                                       f"gradient gap in {result['worst_grad_param']} at step "
                                       f"{result['worst_grad_step']})")
    if not result["ok"] and gaps and gaps["ratio"] > gaps["spread"]:
        verdict = "FAILED, judged against float64 (below)"
    if result.get("float32_check"):
        verdict = f"{'ok' if result['ok'] else 'FAILED'}, judged in float32 (below)"
    options = "".join(f", {key}={value}" for key, value in result["options"].items())
    options += ", packed documents" if result.get("pack_documents") else ""
    steps = f"{cfg.steps} step" + ("s" if cfg.steps != 1 else "")
    print(f"orangetron verify: model {result['model']}, {cfg.layout}{options}, {steps} in {cfg.param_dtype} against "
          f"one rank: max relative loss difference {result['max_loss_rel_diff']:.2e}, max relative gradient "
          f"difference {result['max_grad_rel_diff']:.2e} (tolerance {result['tolerance']:g}): {verdict}",
          file=sys.stderr)
    if result.get("float64_gaps"):
        print(f"orangetron verify: {_float64_judgement(result)}", file=sys.stderr)
    if result.get("float32_check"):
        check = result["float32_check"]
        print(f"orangetron verify: the first step in float32 against one rank: max relative loss difference "
              f"{check['max_loss_rel_diff']:.2e}, max relative gradient difference {check['max_grad_rel_diff']:.2e} "
              f"(tolerance {check['tolerance']:g}): {'ok' if check['ok'] else 'FAILED'}", file=sys.stderr)
    if result["note"]:
        print(f"orangetron verify: note: {result['note']}", file=sys.stderr)
    if args.json:
        print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


def _float64_judgement(result: dict) -> str:
    """The line on a bfloat16 check judged against float64 (`verify._float64_gaps`)."""
    gaps = result["float64_gaps"]
    if result.get("float32_check"):
        moved = counted(gaps["routes_moved"], "expert choice")
        judged = (f"beyond it, but its first step routed at least {moved} otherwise than one rank (as a near tie "
                  "flipping in bfloat16 does), which moves whole gradients, so its gradients are judged in float32")
    elif result["ok"]:
        past = result["max_grad_rel_diff"] > result["tolerance"]
        judged = "within it" + (": bfloat16 rounding at this size exceeds the fixed tolerance, not the layout"
                                if past else "")
    elif gaps["ratio"] <= gaps["spread"]:
        judged = "within it, but the losses part by more than the tolerance"
    else:
        judged = "beyond it: the layout parts from float64 by more than rounding explains"
    return (f"against one rank in float64, parameter by parameter, the layout's gradients are at most "
            f"{gaps['ratio']:.2f} times as far off as one rank's in bfloat16 ({gaps['param']} at step {gaps['step']}: "
            f"{gaps['layout']:.2e} against {gaps['one_rank']:.2e}; allowed {gaps['spread']:g} times), {judged}")


def run_train(args: argparse.Namespace) -> int:
    """Run `orangetron train`; configuration errors propagate as ValueError (cli prints one line). Returns 0,
    1 when a rank failed, or 128 + the signal's number when SIGINT or SIGTERM stopped the run after a step."""
    with _interrupt_after_imports():
        from orangetron.train import stopping
        from orangetron.train.config import TrainConfig, floor_min_lr
        from orangetron.train.launch import LaunchError
        from orangetron.train.trainer import train

    options = _config_options(args)
    if args.new_data and not args.data_given:
        raise ValueError("new_data=True (--new-data): give the new data with --data on the command line")
    floor_min_lr(options)
    cfg = TrainConfig(**options)
    if args.config and not cfg.resume:  # a run's record repeats that run: on its data, from its folder
        from orangetron.train.run_folder import check_repeat

        check_repeat(cfg, args.config, args.typed)
    try:
        result = train(cfg, progress=not args.quiet)
    except LaunchError as err:  # a rank failed, died or hung: its message, not the launcher's traceback
        print(f"orangetron train: error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # one rank, in this process: a full disk or a folder made read-only, in one line
        if isinstance(err, FileNotFoundError):  # a missing input: bad input, which cli reports (exit 2)
            raise
        print(f"orangetron train: error: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    # A run that a signal stopped after a step exits as the signal would have ended it (130, 143).
    stopped = result.get("stopped")
    code = stopping.exit_code(stopped["signal"]) if stopped else 0
    if os.environ.get("RANK", "0") != "0":  # under torchrun every process holds the merged result
        return code
    if not args.quiet:
        _summary(result, sys.stderr)
        if cfg.out is None and not stopped:  # a stopped run has said so already
            print("orangetron train: nothing was saved (no --out); give --out DIR to keep the run's checkpoints, "
                  "metrics and loss curve", file=sys.stderr)
    if args.json:
        print(json.dumps(result), flush=True)
    return code


@contextmanager
def _interrupt_after_imports() -> Iterator[None]:
    """Hold a Ctrl-C back until the block's imports are done, then raise it. Raised inside `import torch`, it
    can be caught and dropped by the import machinery with a module half imported (numpy's, which torch loads):
    the run went on as if never interrupted and failed at its end (`numpy` without `ma`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: held.append(signum))
    try:
        yield
    finally:
        # A process started with SIGINT ignored (a background job of a script) gets Python's handler, not the
        # ignore, back: the ranks' launcher takes SIGINT as a stop request whatever came before, and one sent
        # before it installs that was dropped while the run went on to its end.
        signal.signal(signal.SIGINT, signal.default_int_handler if previous == signal.SIG_IGN else previous)
    if held:
        raise KeyboardInterrupt


def _config_options(args: argparse.Namespace) -> dict[str, Any]:
    """The TrainConfig fields the command line (and --config) set: every flag is named after its field."""
    from orangetron.train.config import TrainConfig

    return {name: getattr(args, name) for name in TrainConfig.__dataclass_fields__ if hasattr(args, name)}


def _summary(result: dict[str, Any], stream: Any) -> None:
    losses = result["losses"]
    mem = result["memory"][0]
    eval_loss = result["eval_loss"]
    eval_text = "n/a" if eval_loss is None else f"{eval_loss:.4f}"
    lines = [
        f"loss {losses[0]:.4f} at step 1 -> final_loss {result['final_loss']:.4f} at step {len(losses)}, "
        f"final_loss_mean10 {result['final_loss_mean10']:.4f} (mean of the last {min(len(losses), 10)} steps); "
        f"held-out loss {eval_text}",
        f"{result['params']:,} params, "
        + (f"{result['tokens_per_s']:,.0f} tokens/s, " if result["tokens_per_s"] else
           "tokens/s not timed (the run's one step also measured memory), ")
        + (f"MFU {100 * result['mfu']:.1f}% of {result['peak_flops'] / 1e9:,.1f} GFLOP/s "
           f"({result.get('peak_source', 'measured matmul')}), "
           if result.get("mfu") is not None else "") + f"{result['time_s']:.1f} s",
        "memory (MiB): " + ", ".join(f"{k} {mem[k] / 2**20:.1f}" for k in mem if k != "rank"),
    ]
    per_step = result["comm_per_step"][0]
    which = "; the last step's: the steps differ" if per_step.get("steps_differ") else ""
    lines += [
        f"comm per training step (bytes rank 0 sends, by op/mesh dim{which}): " + _bytes_text(per_step["train"]),
        f"comm per evaluation ({counted(per_step['evaluations'], 'run')}): " + _bytes_text(per_step["eval"]),
        "comm of the whole run (training and evaluation; --json `comm`): "
        + _bytes_text({k: v for k, v in result["comm"][0].items() if k != "rank"}),
    ]
    if result.get("predicted"):
        from orangetron.train.accounting import format_table, side_by_side

        rows = side_by_side(result["predicted"][0], mem, per_step["train"])
        lines.append("the planner's prediction beside the measurement (bytes; memory from the first step):")
        lines.append(format_table(rows))
        differing = [name for name, want, got in rows if None not in (want, got) and want != got]
        # What the routing moves: the expert all-to-all's bytes (ragged), and under ep the experts' activations
        # (a dispatcher whose bytes do not follow the routing, allgather or a capacity, moves only those).
        routed = [name for name in differing if name.endswith("/ep") or name == "memory activations_peak"]
        if result.get("layout", {}).get("ep", 1) > 1 and routed:
            lines.append("  (the routing decides how many tokens each MoE layer sends and keeps, step by step; the "
                         "planner prices it balanced, so the expert all-to-all and activation rows differ by it)")
    warnings = result.get("warnings", [])
    if warnings:  # printed as the run started too; a long log's reader finds them again here
        lines.append(f"{counted(len(warnings), 'warning')} of the start, again:")
        lines += [f"  warning: {warning}" for warning in warnings]
    stream.write("\n".join(lines) + "\n")


def _bytes_text(by_key: dict[str, int]) -> str:
    return ", ".join(f"{k} {v:,} B" for k, v in by_key.items()) or "none"
