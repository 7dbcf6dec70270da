"""The training run: data -> model (parallelized) -> AdamW on the run's schedule -> metrics and checkpoints.

One rank runs in this process; with more than one rank the local launcher starts one process per rank and
every rank runs this same loop: data-parallel ranks on their share of each batch, tensor-parallel ranks on
the same rows with their shard of every weight. With one rank it is the single-device reference that
layouts are checked against (the wrapper over a one-rank group only adds flat buffers).

The pieces live beside it: `config` (options), `schedule` (learning rate), `step` (one step on one rank),
`runlog` (what is shown and kept per step), `resume` (checkpoints of a run), `launch` (local ranks),
`stopping` (SIGINT and SIGTERM: stop after a step), `faults` (naming a rank that died or hung).
"""


from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from orangetron import comm
from orangetron.mesh import forget_meshes, init_mesh
from orangetron.model import ModelSpec, Transformer
from orangetron.parallel import ParallelModel, ShardedAdamW, parallelize
from orangetron.parallel.config import DTYPES
from orangetron.spec.parallel_config import ParallelConfig
from orangetron.train import admission, faults, placement, run_folder, stopping
from orangetron.train.accounting import predicted_for_rank
from orangetron.train.config import TrainConfig, TrainConfigError
from orangetron.train.data import (
    BatchIterator,
    document_ids,
    label_count,
    pack_documents,
    pack_sequences,
    read_text_documents,
    split_train_eval,
    stdlib_documents,
)
from orangetron.train.datasets import PreparedDataset
from orangetron.train.launch import LaunchError, launch_local, process_group
from orangetron.train.mfu import StepTimer, allocator_peak, batch_flops, device_peak_flops, step_flops
from orangetron.train.progress import ProgressBar
from orangetron.train.resume import resume, save
from orangetron.train.runlog import Resumed, RunLog, final_losses
from orangetron.train.schedule import lr_at
from orangetron.train.step import TrainingDiverged, evaluate, train_step
from orangetron.train.tokenizer import kept_tokenizer, tokenizer_named
from orangetron.train.traffic import StepTraffic


@dataclass
class RunData:
    train: BatchIterator
    eval_samples: torch.Tensor  # [n_eval, seq_len + 1] (packed: [n_eval, seq_len + 1, 2]); may have 0 rows
    n_tokens: int


def load_data(cfg: TrainConfig) -> RunData:
    """The run's batches and held-out samples: from a prepared dataset (memory-mapped, read a batch at a time),
    or from text files or the stdlib corpus, tokenized by the run's tokenizer. With `pack_documents` each sample
    is packed, [seq_len + 1, 2] (token, document id) pairs (`data.pack_documents`)."""
    if cfg.prepared_data is not None:
        return _prepared_data(cfg)
    pieces = read_text_documents(cfg.data) if cfg.data is not None else stdlib_documents(cfg.corpus_bytes)
    tokens = tokenizer_named(cfg.tokenizer or "byte").encode_tensor("".join(pieces))  # [N]
    stream = tokens
    if cfg.pack_documents:  # the byte tokenizer (TrainConfig checks): a file's byte count is its token count
        stream = torch.stack((tokens, document_ids([len(p.encode("utf-8")) for p in pieces])), dim=-1)  # [N, 2]
    train_stream, eval_stream = split_train_eval(stream, cfg.eval_fraction)
    n_windows = max(train_stream.shape[0] - 1, 0) // cfg.seq_len
    if n_windows < cfg.batch_size:
        raise TrainConfigError(
            f"batch_size={cfg.batch_size} (--batch-size): the training split has {train_stream.shape[0]} "
            f"tokens, only {n_windows} samples of seq_len={cfg.seq_len}; give more text (--data) "
            "or lower --batch-size / --seq-len"
        )
    train_samples = _windows(train_stream, cfg.seq_len)
    if eval_stream.shape[0] > cfg.seq_len:
        eval_samples = _windows(eval_stream, cfg.seq_len)
    else:
        eval_samples = torch.empty(0, cfg.seq_len + 1, *stream.shape[1:], dtype=torch.long)
    train = BatchIterator(train_samples, cfg.batch_size, seed=cfg.seed, drop_last=True)
    return RunData(train=train, eval_samples=eval_samples, n_tokens=tokens.numel())


def _windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Samples of a token stream [N], or of a packed one [N, 2] (token, document id)."""
    if stream.dim() == 1:
        return pack_sequences(stream, seq_len)
    return pack_documents(stream[:, 0], stream[:, 1], seq_len)


def _prepared_data(cfg: TrainConfig) -> RunData:
    """A prepared dataset's windows, split as a text's token stream is (held out from its end); only the held-out
    samples evaluation reads are materialized."""
    dataset = PreparedDataset.open(cfg.prepared_data)
    n_eval = int(len(dataset) * cfg.eval_fraction)
    n_train = len(dataset) - n_eval
    windows = dataset.windows(0, n_train, cfg.seq_len, documents=cfg.pack_documents)
    if len(windows) < cfg.batch_size:
        raise TrainConfigError(f"batch_size={cfg.batch_size} (--batch-size): the prepared dataset's training split "
                               f"has {n_train} tokens, only {len(windows)} samples of seq_len={cfg.seq_len}; "
                               "prepare more text (orangetron prepare-data) or lower --batch-size / --seq-len")
    held_out = dataset.windows(n_train, len(dataset), cfg.seq_len, documents=cfg.pack_documents)
    eval_samples = held_out[: min(len(held_out), cfg.batch_size * cfg.eval_batches)]
    train = BatchIterator(windows, cfg.batch_size, seed=cfg.seed, drop_last=True)
    return RunData(train=train, eval_samples=eval_samples, n_tokens=len(dataset))



def train(cfg: TrainConfig, progress: bool = True) -> dict[str, Any]:
    """Train and return the `train --json` result.

    Keys: layout (degrees), steps, losses (language-model loss of the whole batch per step, the same on every
    layout), final_loss (the last step's), final_loss_mean10 (the mean of the last 10 steps), eval_loss
    (held-out loss after the last step, or None without held-out data or when stopped early), stopped
    ({"signal": "SIGINT" or "SIGTERM", "step": the last step taken} when a signal ended the run early, else
    None), params, tokens_per_s, mfu (model FLOPs utilization against peak_flops, the FLOP/s a large matmul
    reaches on rank 0; see `train.mfu`), memory (one entry per rank, bytes), comm (one entry per rank, bytes sent
    per "op/dim"), time_s. With more than one rank the ranks are local processes started by `launch_local`,
    unless this process already belongs to a process group of that size (torchrun). Deterministic: the same
    cfg gives bitwise-identical losses. With cfg.out, rank 0 writes config.toml, metrics.jsonl and loss.png
    there, and checkpoints under checkpoints/. SIGINT or SIGTERM during the run stops every rank after the same
    step, which is checkpointed with cfg.out (`train.stopping`). torch's thread count is set to cfg.threads for
    the run and restored afterwards.
    """
    admission.check_fits(cfg)  # before any rank starts or anything is written: a refusal is one line
    with run_folder.held(cfg):
        return _launch(cfg, progress)


def _launch(cfg: TrainConfig, progress: bool) -> dict[str, Any]:
    """`train` once the run folder is this run's: the ranks started here, joined under torchrun, or this one."""
    world_size = cfg.layout.world_size
    torchrun_world = int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1
    if not torch.distributed.is_initialized():
        if torchrun_world > 1:  # started by torchrun: join its group
            return _train_under_torchrun(cfg, progress)
        if world_size > 1:
            return _merge_ranks(launch_local(_train_rank, world_size, args=(cfg, progress),
                                             timeout_s=cfg.timeout_s, relay_signals=True, device=cfg.device))
    # One thread by default: these models run many small ops, and on a shared 2-core machine a second
    # OpenMP thread that waits for a busy core at every op made steps 10x slower, not faster.
    previous_threads = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        with process_group(cfg.device):
            return _train(cfg, progress)
    finally:
        torch.set_num_threads(previous_threads)


def _train_under_torchrun(cfg: TrainConfig, progress: bool) -> dict[str, Any]:
    """Every torchrun process runs one rank; each returns the merged result of all ranks."""
    world_size = int(os.environ["WORLD_SIZE"])
    if world_size != cfg.layout.world_size:
        raise TrainConfigError(f"torchrun started {world_size} processes but the layout {cfg.layout} needs "
                               f"{cfg.layout.world_size} (tp*cp*pp*dp)")
    # Each process binds its LOCAL_RANK GPU on cuda, as the local launcher does. The timeout bounds every
    # collective: a rank that stops responding makes its peers fail here, and torchrun then ends every process.
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.distributed.init_process_group(timeout=timedelta(seconds=cfg.timeout_s),
                                         **placement.init_options(cfg.device, local_rank))
    board = _store_board(cfg)
    faults.attach(board)
    try:
        result = _train_rank(cfg, progress)
        return _merge_ranks(comm.all_gather_objects(result))
    except Exception as err:
        if board is None or not faults.is_collective_failure(err):
            raise
        faults.enter("failed in a collective")  # tells the other victims this rank is not the culprit
        faults.wait_for_peers()
        raise LaunchError(faults.name_culprits(board.read(world_size), world_size, board.rank)) from err
    finally:
        faults.attach(None)
        torch.distributed.destroy_process_group()
        forget_meshes()


def _store_board(cfg: TrainConfig) -> faults.StoreBoard | None:
    """Each rank's phase on torchrun's key-value store, where the other ranks can read it after a fault."""
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                       timeout=timedelta(seconds=cfg.timeout_s))
    prefix = torch.distributed.PrefixStore("orangetron/phase", store)
    return faults.StoreBoard(prefix, torch.distributed.get_rank())


def _train_rank(cfg: TrainConfig, progress: bool) -> dict[str, Any]:
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    return _train(cfg, progress and torch.distributed.get_rank() == 0)


def _checkpoints_kept_text(cfg: TrainConfig) -> str:
    """What a run stopped by a diverged step leaves to go back to, said after the stop."""
    if cfg.out is None:
        return ""
    from orangetron.train.checkpoint import latest_checkpoint

    latest = latest_checkpoint(Path(cfg.out) / "checkpoints")
    if latest is None:
        return "; it saved no checkpoint before (--save-every N saves earlier steps)"
    return f"; the run folder keeps its checkpoints up to {latest.name}"


def _merge_ranks(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from every rank's: losses averaged over ranks (equal shares), per-rank lists joined (the
    held-out loss is every rank's already: `step.evaluate`)."""
    merged = dict(results[0])
    merged["losses"] = [sum(step) / len(results) for step in zip(*(r["losses"] for r in results), strict=True)]
    merged.update(final_losses(merged["losses"]))
    merged["memory"] = [entry for r in results for entry in r["memory"]]
    merged["comm"] = [entry for r in results for entry in r["comm"]]
    merged["comm_per_step"] = [entry for r in results for entry in r["comm_per_step"]]
    merged["predicted"] = [entry for r in results for entry in r["predicted"]]
    merged["imported"] = [entry for r in results for entry in r["imported"]]
    return merged


@dataclass
class RunSetup:
    """What every rank builds before its first step."""

    data: RunData
    model: ParallelModel
    optimizer: ShardedAdamW
    rank: int
    dp_rank: int
    share: int  # rows of each micro-batch this rank trains on
    microbatches: int
    imported_bytes: int | None = None  # bytes this rank read from the --hf-model safetensors (None: no import)
    # What each checkpoint keeps of the tokenizer (`tokenizer.kept_tokenizer`), read once as the run starts: a
    # tokenizer rewritten at its path while the run trains is not what the model learnt from
    tokenizer: dict[str, Any] = field(default_factory=dict)

    def rows(self, batch: torch.Tensor) -> list[torch.Tensor]:
        """This rank's rows of each micro-batch, on the model's device: the batch splits into micro-batches first,
        each over the dp ranks, so that micro-batch j holds the same rows on every layout (the balancing loss
        sees them)."""
        return [mb[self.dp_rank * self.share:(self.dp_rank + 1) * self.share].to(self.model.device)
                for mb in batch.chunk(self.microbatches)]

    @property
    def dp(self) -> ParallelModel:
        """The parallel model, by the name this field had when it was the data-parallel wrapper."""
        return self.model


def setup_run(cfg: TrainConfig) -> RunSetup:
    """Data, parallel model and optimizer of this rank, inside an initialized process group."""
    faults.enter("setup")
    mesh = init_mesh(cfg.layout, cfg.device)
    torch.manual_seed(cfg.seed)
    data = load_data(cfg)
    model_dtype = torch.float64 if cfg.param_dtype == "float64" else torch.float32  # bf16: cast by the flat buffers
    # Initialized on the host and then moved: every device starts from the same bits as the CPU reference.
    reference = Transformer(cfg.model_config(), seed=cfg.seed, dtype=model_dtype).to(mesh.device())
    model = parallelize(reference, mesh, cfg.parallel_config())
    model.train()
    optimizer = model.optimizer(lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay)
    imported = None
    if cfg.hf_model is not None and not cfg.resume:  # a resumed run's weights come from its checkpoint
        imported = import_weights(cfg.hf_model, cfg.model_config(), model, optimizer)
    share = cfg.batch_size // (mesh["dp"].size * cfg.microbatches)
    kept = kept_tokenizer(cfg.tokenizer or "byte") if mesh.rank == 0 else {}  # checkpoints take rank 0's record
    return RunSetup(data, model, optimizer, mesh.rank, mesh["dp"].rank, share, cfg.microbatches, imported, kept)


def import_weights(folder: str, spec: ModelSpec, model: ParallelModel, optimizer: ShardedAdamW) -> int:
    """Replace the seeded initial values with the Hugging Face folder's: each rank reads the boxes of the main
    parameters it holds (`sharded_state`, as a checkpoint loads) and the model's copies follow
    (`state_loaded`). Returns the bytes this rank read."""
    from orangetron.hf import read_into

    state = model.sharded_state(optimizer)
    biases = {name: b for name, b in state["buffers"].items() if name.endswith(".router.expert_bias")}  # Dots1's
    read = read_into(folder, spec, state["params"] | biases)
    model.state_loaded(optimizer, 0)
    return sum(read.bytes_read.values())


def _train(cfg: TrainConfig, progress: bool) -> dict[str, Any]:
    # From here on SIGINT and SIGTERM ask every rank to stop after the step it is taking (train/stopping.py).
    with stopping.stop_on_signals(), placement.deterministic_mode(cfg.deterministic, cfg.device):
        return _run(cfg, progress)


def _run(cfg: TrainConfig, progress: bool) -> dict[str, Any]:
    setup = setup_run(cfg)
    data, model, optimizer, rank = setup.data, setup.model, setup.optimizer, setup.rank
    bar = ProgressBar(cfg.steps, enabled=progress, warns=rank == 0)
    bar.log(f"orangetron train: {_describe(cfg, data)}")
    if cfg.layout.world_size > 1:
        _log_placement(cfg, bar)
    start = Resumed(0, [])
    if cfg.resume:
        faults.enter("resuming")
        cfg, start = resume(cfg, setup)
        bar.log(f"resumed from {start.path} at step {start.step} of {cfg.steps}")
    last = min(cfg.steps, cfg.stop_after) if cfg.stop_after else cfg.steps
    peak, peak_source = device_peak_flops(DTYPES[model.config.param_dtype], model.device)
    warnings = cfg.warnings() + ([] if peak is not None else [peak_source])
    if not len(data.eval_samples):  # known before the first step: a --json reader finds it among the warnings
        warnings.append("no held-out loss: the eval split is shorter than one sample (raise --eval-fraction)")
    for warning in warnings:  # after a resume, which can refuse the run: a refusal stays one line under --quiet
        bar.warn(warning)
    timer = StepTimer(model.device)
    spec = cfg.model_config()  # once: a model file is read anew on each call
    run = RunLog(cfg, bar, write=rank == 0, start=start, flops_per_step=step_flops(cfg) / cfg.layout.world_size,
                 peak_flops=peak)
    eval_loss: float | None = None
    stopped: dict[str, Any] | None = None
    mem: dict[str, int] = {}
    traffic = StepTraffic()
    rows: list[torch.Tensor] | None = None  # the last step's micro-batches, whose traffic the run reports
    with comm.measure() as records, run:
        batches: Iterator[torch.Tensor] = data.train.from_sample(start.samples)  # after the checkpointed steps
        for step in range(start.step, last):
            timer.start()
            faults.enter("data", step + 1)
            lr = lr_at(step, cfg)
            batch = next(batches)
            rows = setup.rows(batch)
            # The first step also measures memory; its hooks cost time, so run.step leaves it out of tokens/s.
            try:
                with traffic.step(records):
                    loss, grad_norm, step_mem = train_step(model, optimizer, rows, lr, cfg.grad_clip,
                                                            measure=step == start.step, labels=label_count(batch))
            except TrainingDiverged as err:  # nothing of this step was applied or written
                kept = _checkpoints_kept_text(cfg)
                raise TrainingDiverged(f"step {step + 1}: {err}; stopped before the update{kept}") from None
            seconds = timer.stop()  # evaluation below is not training throughput
            mem = mem or step_mem
            record = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm}
            evaluates = step + 1 == cfg.steps or (cfg.eval_every and (step + 1) % cfg.eval_every == 0)
            if evaluates and len(data.eval_samples):  # no held-out rows: nothing runs, nothing to count
                faults.enter("evaluation")
                with traffic.evaluation(records):
                    eval_loss = evaluate(model, data.eval_samples, cfg.batch_size, cfg.eval_batches)
                record["eval_loss"] = eval_loss
            # Every rank asks after every step but the last, so all of them stop after the same one.
            signum = stopping.agreed(comm.world_group()) if step + 1 < last else 0
            if signum:
                stopped = {"signal": stopping.name(signum), "step": step + 1}
                record["stopped_by"] = stopped["signal"]
            flops = batch_flops(cfg, batch, spec) / cfg.layout.world_size if cfg.pack_documents else None
            run.step(record, seconds, flops)
            if cfg.out is not None and (stopped or _checkpoint_due(cfg, step + 1, last)):
                faults.enter("checkpoint")
                written = save(cfg, setup, step + 1, run.losses)
                if written is not None:
                    bar.log(f"wrote checkpoint {written}")
            if stopped:
                break
    _log_ending(bar, cfg, last, stopped)
    return {
        "layout": cfg.layout.degrees(),
        "pack_documents": cfg.pack_documents,
        "steps": cfg.steps,
        "losses": run.losses,
        **final_losses(run.losses),
        "eval_loss": eval_loss,
        "stopped": stopped,
        "params": _model_parameters(cfg),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "tokens_per_s": run.tokens_per_s() or 0.0,
        "mfu": run.mfu(),
        "peak_flops": peak,
        "peak_source": peak_source,
        "memory": [{"rank": rank, **mem, **allocator_peak(model.device)}],  # the allocator's: the whole run's peak
        "comm": [{"rank": rank, **dict(sorted(comm.bytes_by_key(records).items()))}],
        "comm_per_step": [{"rank": rank, **traffic.summary()}],
        "predicted": [{"rank": rank, **predicted_for_rank(cfg, model.mesh["pp"].rank, model.mesh["cp"].rank, rows)}],
        "warnings": warnings,
        "imported": [] if setup.imported_bytes is None else [{"rank": rank, "bytes_read": setup.imported_bytes}],
        "time_s": time.perf_counter() - run.started,
    }


def _checkpoint_due(cfg: TrainConfig, step: int, last: int) -> bool:
    """After the run's last step, and every cfg.save_every steps."""
    return step == last or bool(cfg.save_every and step % cfg.save_every == 0)


def _log_ending(bar: ProgressBar, cfg: TrainConfig, last: int, stopped: dict[str, Any] | None) -> None:
    if stopped is not None:
        then = "continue with --resume" if cfg.out is not None else "nothing was saved (no --out)"
        bar.notice(f"stopped by {stopped['signal']} after step {stopped['step']}; {then}")
    elif last < cfg.steps:
        bar.notice(f"stopped after step {last} of {cfg.steps}; continue with --resume")


def _log_placement(cfg: TrainConfig, bar: ProgressBar) -> None:
    """Which groups stay inside a node: torchrun numbers each node's LOCAL_WORLD_SIZE ranks consecutively."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.layout.world_size))
    if cfg.layout.world_size % per_node:  # uneven nodes: say nothing rather than guess
        return
    bar.log(f"placement: {cfg.layout.node_placement(per_node)}")
    if cfg.tp > 1 and not cfg.layout.inside_nodes("tp", per_node):
        bar.warn(f"tp={cfg.tp} groups cross nodes of {per_node} ranks: every layer's tensor-parallel "
                "collectives go over the network; use a tp that divides the ranks per node")


def _model_parameters(cfg: TrainConfig) -> int:
    """Parameters of the whole model, whatever share of them this rank holds."""
    return cfg.model_config().total_params()  # the schema's count equals the reference model's (tested)


def _describe(cfg: TrainConfig, data: RunData) -> str:
    name = cfg.model_config().name
    source = f"{len(cfg.data)} file(s)" if cfg.data is not None else "stdlib corpus"
    if cfg.prepared_data is not None:
        source = f"prepared dataset {cfg.prepared_data}"
    start = f" from {cfg.hf_model}" if cfg.hf_model is not None else ""
    tokenizer = "" if cfg.tokenizer in (None, "byte") else f", tokenizer {cfg.tokenizer}"
    packed = " in packed documents" if cfg.pack_documents else ""  # a default the data settles: said, as it runs
    return (
        f"model {name}{start} ({_model_parameters(cfg) / 1e6:.2f}M params, {cfg.param_dtype}), {source}{packed}"
        f"{tokenizer}, "
        f"{data.n_tokens:,} tokens, {cfg.steps} steps x {cfg.batch_size} x {cfg.seq_len} tokens, "
        f"layout {cfg.layout}{_options_text(cfg)}"
    )


def _options_text(cfg: TrainConfig) -> str:
    """The parallel options set away from their defaults (ZeRO stage, schedule, cp mode ...), which the degrees
    alone do not tell apart: `--zero-stage 3` and `--zero-stage 1` run the same degrees."""
    changed = [f"{f.name}={getattr(cfg, f.name)!r}" for f in fields(ParallelConfig)
               if f.name != "param_dtype" and getattr(cfg, f.name) != f.default]
    return f" with {', '.join(changed)}" if changed else ""
