"""The training loop: data -> model (data-parallel wrapper) -> AdamW with warmup + cosine -> metrics.

One rank runs in this process; with more than one rank the local launcher starts one process per rank and
every rank runs this same loop: data-parallel ranks on their share of each batch, tensor-parallel ranks on
the same rows with their shard of every weight. With one rank it is the single-device reference that
layouts are checked against (the wrapper over a one-rank group only adds flat buffers).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from orangetron import comm, memory
from orangetron.layout import Layout
from orangetron.mesh import forget_meshes, init_mesh
from orangetron.model import MODEL_PRESETS, ModelConfig, Transformer, model_preset
from orangetron.parallel import DataParallel, ParallelConfig, ShardedAdamW, context, parallelize, pipeline
from orangetron.parallel.config import DTYPES
from orangetron.parallel.expert import update_router_bias
from orangetron.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from orangetron.train.data import (
    DEFAULT_CORPUS_BYTES,
    BatchIterator,
    pack_sequences,
    read_text_files,
    split_train_eval,
    stdlib_corpus,
)
from orangetron.train.launch import launch_local, process_group
from orangetron.train.progress import ProgressBar
from orangetron.train.tokenizer import ByteTokenizer

IGNORE_INDEX = -100


class TrainConfigError(ValueError):
    """A training configuration that cannot run; the message names the field, its flag and the rule."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class TrainConfig:
    """Everything one training run needs. Validated on construction (TrainConfigError).

    The defaults are what `orangetron train` runs with no flags: small-moe learns visibly (byte-level
    loss from ~5.6 to ~2.1) in about a minute on one CPU thread. Many small, frequent updates
    (8 x 64 tokens) learned faster per second than fewer large ones when tuned on a 2-core machine.
    """

    model: str | ModelConfig = "small-moe"  # preset name (see MODEL_PRESETS) or a ModelConfig
    steps: int = 200  # optimizer steps
    seq_len: int = 64  # tokens per sample fed to the model (labels are shifted by one)
    batch_size: int = 8  # samples per step
    lr: float = 2e-3  # peak learning rate, reached after `warmup` steps
    warmup: int = 20  # linear warmup steps
    min_lr: float = 2e-4  # floor of the cosine decay, reached at the last step
    weight_decay: float = 0.1  # AdamW decay, applied to matrices only (not norms or biases)
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    seed: int = 0  # seeds model init and batch order; same seed -> bitwise-identical losses
    eval_every: int = 0  # evaluate held-out loss every N steps (0: only at the end)
    eval_batches: int = 16  # batches of held-out data per evaluation
    eval_fraction: float = 0.05  # share of the token stream, from its end, held out for evaluation
    dtype: str = "float32"  # parameter dtype: float32, float64 or bfloat16 (with float32 main params)
    data: Sequence[str] | None = None  # text files to train on; None: the embedded stdlib corpus
    corpus_bytes: int = DEFAULT_CORPUS_BYTES  # bytes of the stdlib corpus to use when `data` is None
    out: str | None = None  # run folder for metrics.jsonl and checkpoints (always one after the last step)
    save_every: int = 0  # also write a checkpoint every N steps (0: only after the last one); needs `out`
    resume: bool = False  # continue from the latest checkpoint in `out`, on whatever layout this run has
    extend: bool = False  # with resume: allow `steps` past the checkpoint's total; the cosine keeps its old
    # total and the rate holds min_lr after it
    stop_after: int = 0  # end after this step, checkpointed, with the schedule of `steps` (0: run to `steps`)
    schedule_steps: int | None = None  # steps the warmup + cosine spans; None: `steps` (resume sets it)
    threads: int | None = 1  # CPU threads for torch ops; None keeps torch's setting (see train())
    tp: int = 1  # tensor-parallel degree: local ranks that split every weight matrix
    cp: int = 1  # context-parallel degree: local ranks that split every sequence head-tail
    pp: int = 1  # pipeline-parallel degree: local ranks that each run a contiguous share of the layers
    pp_schedule: str = "1f1b"  # pipeline schedule with pp > 1: gpipe, 1f1b, interleaved
    microbatches: int = 1  # micro-batches per step (gradients accumulate over them; the pipeline's unit)
    virtual_stages: int = 1  # model chunks per pipeline rank (the interleaved schedule)
    dp: int = 1  # data-parallel degree: local ranks that split each batch
    ep: int = 1  # expert-parallel degree: the dp ranks' experts split into ep blocks (ep divides dp)
    dispatcher: str = "ragged"  # expert dispatch with ep > 1: ragged (dropless), capacity, allgather
    capacity_factor: float = 1.0  # dispatcher="capacity": slots per expert = factor * fair share
    ep_overlap_chunks: int = 1  # ragged dispatch in token chunks, all-to-all overlapping expert compute
    zero_stage: int = 0  # 0 = DDP, 1-3 = ZeRO stage (sharding over the dp ranks)
    distributed_optimizer: bool = False  # ZeRO-1 sharding with the parameter all-gather right after the step
    grad_bucket_numel: int = 0  # DDP: all-reduce gradient buckets of this many elements during backward
    sequence_parallel: bool = False  # with tp > 1: norms on sequence shards, reduce-scatter + all-gather
    cp_mode: str = "ring"  # context-parallel attention with cp > 1: ring, allgather, ulysses, rsa, usp
    ulysses_degree: int = 1  # cp_mode usp: the all-to-all factor of cp (the rest is a ring)

    def __post_init__(self) -> None:
        self._check_layout()
        for name in ("steps", "seq_len", "batch_size", "eval_batches", "corpus_bytes"):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("warmup", "eval_every", "seed", "stop_after"):
            _check_int(name, getattr(self, name), minimum=0)
        if self.schedule_steps is not None:
            _check_int("schedule_steps", self.schedule_steps, minimum=1)
        if self.threads is not None:
            _check_int("threads", self.threads, minimum=1)
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise TrainConfigError(f"{name}={value!r} ({_flag(name)}): must be a finite number >= 0")
        if self.lr == 0 or self.min_lr > self.lr:
            raise TrainConfigError(f"lr={self.lr} (--lr): must be > 0 and >= min_lr={self.min_lr}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise TrainConfigError(f"eval_fraction={self.eval_fraction}: must be in [0, 1)")
        if self.dtype not in DTYPES:
            raise TrainConfigError(f"dtype={self.dtype!r} (--dtype): choose one of {', '.join(DTYPES)}")
        self._check_checkpointing()
        self.parallel_config()  # raises for an impossible ZeRO setting
        self.layout.validate(self.model_config())  # and an unknown preset
        pipeline.check_pipeline(self.model_config(), self.pp, self.parallel_config())
        if self.tp > 1 and self.sequence_parallel and self.cp == 1:  # cp > 1 pads to whole chunks instead
            self.layout.validate(seq_len=self.seq_len, sequence_parallel=True)
        self._check_data()

    def _check_layout(self) -> None:
        for name in ("tp", "cp", "pp", "dp", "ep", "microbatches", "virtual_stages"):
            _check_int(name, getattr(self, name), minimum=1)
        self._check_pipeline()
        if (self.dp * self.cp) % self.ep:
            raise TrainConfigError(f"ep={self.ep} (--ep): must divide dp*cp={self.dp * self.cp}; the routed "
                                   "experts are split over the data-parallel ranks")
        if self.cp_mode == "usp" and self.cp % self.ulysses_degree:
            raise TrainConfigError(f"ulysses_degree={self.ulysses_degree} (--ulysses-degree): must divide cp={self.cp}")
        if self.batch_size % (self.dp * self.microbatches):
            raise TrainConfigError(f"batch_size={self.batch_size} (--batch-size): must divide by dp*microbatches="
                                   f"{self.dp * self.microbatches}, each data-parallel rank takes an equal share of "
                                   "every micro-batch")

    def _check_pipeline(self) -> None:
        if self.virtual_stages > 1 and self.pp_schedule != "interleaved":
            raise TrainConfigError(f"virtual_stages={self.virtual_stages} (--virtual-stages): needs "
                                   "--pp-schedule interleaved")
        if self.pp > 1 and self.pp_schedule == "interleaved" and self.microbatches % self.pp:
            raise TrainConfigError(f"microbatches={self.microbatches} (--microbatches): the interleaved schedule "
                                   f"needs a multiple of pp={self.pp}")

    def parallel_config(self) -> ParallelConfig:
        """How the model is replicated and sharded over the data-parallel ranks."""
        return ParallelConfig(zero_stage=self.zero_stage, distributed_optimizer=self.distributed_optimizer,
                              param_dtype=self.dtype, grad_bucket_numel=self.grad_bucket_numel,
                              sequence_parallel=self.sequence_parallel, cp_mode=self.cp_mode,
                              ulysses_degree=self.ulysses_degree,
                              dispatcher=self.dispatcher, capacity_factor=self.capacity_factor,
                              ep_overlap_chunks=self.ep_overlap_chunks,
                              pp_schedule=self.pp_schedule, microbatches=self.microbatches,
                              virtual_stages=self.virtual_stages)

    def _check_checkpointing(self) -> None:
        _check_int("save_every", self.save_every, minimum=0)
        for name in ("save_every", "resume", "stop_after"):
            if getattr(self, name) and self.out is None:
                raise TrainConfigError(f"{name}={getattr(self, name)!r} ({_flag(name)}): needs --out DIR, "
                                       "where checkpoints live")
        if self.extend and not self.resume:
            raise TrainConfigError("extend=True (--extend): needs --resume; it extends a checkpointed run")
        if self.out is not None:
            _check_out_folder(self.out)

    def _check_data(self) -> None:
        if self.data is None:
            return
        self.data = tuple(str(p) for p in self.data)
        if not self.data:
            raise TrainConfigError("data=() (--data): give at least one file, or None for the stdlib corpus")
        for path in self.data:
            if not Path(path).is_file():
                raise TrainConfigError(f"data={path!r} (--data): no such file")

    def model_config(self) -> ModelConfig:
        """The ModelConfig this run trains (a preset resolved by name, or the given config)."""
        if isinstance(self.model, ModelConfig):
            return self.model
        if self.model not in MODEL_PRESETS:
            raise TrainConfigError(
                f"model={self.model!r} (--model): unknown preset; choose one of {', '.join(MODEL_PRESETS)}"
            )
        return model_preset(self.model)

    @property
    def layout(self) -> Layout:
        return Layout(tp=self.tp, cp=self.cp, pp=self.pp, dp=self.dp, ep=self.ep)


def _check_out_folder(out: str) -> None:
    # The nearest existing ancestor must be a folder, or creating the run folder fails mid-setup.
    for path in (Path(out), *Path(out).absolute().parents):
        if path.exists():
            if not path.is_dir():
                raise TrainConfigError(f"out={out!r} (--out): {str(path)!r} is a file, not a folder")
            return


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        rule = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise TrainConfigError(f"{name}={value!r} ({_flag(name)}): must be {rule}")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of 0-based `step`: linear warmup to cfg.lr, then cosine decay to cfg.min_lr at the last
    step of cfg.schedule_steps (default cfg.steps); a run extended past that holds its last step's rate."""
    total = cfg.schedule_steps if cfg.schedule_steps is not None else cfg.steps
    step = min(step, total - 1)
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    decay_steps = total - cfg.warmup
    if decay_steps <= 1:
        return cfg.lr
    progress = (step - cfg.warmup) / (decay_steps - 1)  # 0 at the first decay step, 1 at the last
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


@dataclass
class _Data:
    train: BatchIterator
    eval_samples: torch.Tensor  # [n_eval, seq_len + 1]; may have 0 rows
    n_tokens: int


def _load_data(cfg: TrainConfig) -> _Data:
    text = read_text_files(cfg.data) if cfg.data is not None else stdlib_corpus(cfg.corpus_bytes)
    tokens = ByteTokenizer().encode_tensor(text)  # [N]
    train_tokens, eval_tokens = split_train_eval(tokens, cfg.eval_fraction)
    n_windows = max(train_tokens.numel() - 1, 0) // cfg.seq_len
    if n_windows < cfg.batch_size:
        raise TrainConfigError(
            f"batch_size={cfg.batch_size} (--batch-size): the training split has {train_tokens.numel()} "
            f"tokens, only {n_windows} samples of seq_len={cfg.seq_len}; give more text (--data) "
            "or lower --batch-size / --seq-len"
        )
    train_samples = pack_sequences(train_tokens, cfg.seq_len)
    if eval_tokens.numel() > cfg.seq_len:
        eval_samples = pack_sequences(eval_tokens, cfg.seq_len)
    else:
        eval_samples = torch.empty(0, cfg.seq_len + 1, dtype=torch.long)
    train = BatchIterator(train_samples, cfg.batch_size, seed=cfg.seed, drop_last=True)
    return _Data(train=train, eval_samples=eval_samples, n_tokens=tokens.numel())


def _rank_share(dp: DataParallel, samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                                  float]:
    """(inputs, labels, positions, share) of samples [B, S+1] as this rank sees them: under cp its head-tail
    share of the (padded) sequence with global positions, and the weight of its mean loss (see below)."""
    inputs, labels = samples[:, :-1], samples[:, 1:]  # [B, S] each
    positions, share = None, 1.0
    cp = dp.mesh["cp"].size
    if cp > 1:  # this rank's head-tail share of the (padded) sequence, with its global positions
        multiple = context.shard_multiple(dp.mesh.layout, dp.config.sequence_parallel)
        inputs, labels = context.pad_sequence(inputs, labels, multiple, IGNORE_INDEX)
        positions = context.position_ids(inputs.shape[1], dp.mesh)
        valid = int((labels != IGNORE_INDEX).sum())
        inputs, labels = context.shard(inputs, dp.mesh), context.shard(labels, dp.mesh)
        # Padding leaves the cp ranks unequal token counts: weight this rank's mean by its share of the
        # real tokens (times cp, as gradients are averaged over the ranks), so the mean is over all of them.
        share = int((labels != IGNORE_INDEX).sum()) * cp / max(valid, 1)
    return inputs, labels, positions, share


def _lm_loss(dp: DataParallel, samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(objective, language-model loss) of samples [B, S+1].

    The objective is the model's own loss (mean next-token cross entropy plus the MoE aux loss), so
    every layout optimizes the same definition; the language-model loss drops the aux term for reporting.
    """
    model: Transformer = dp.module  # or its tensor-parallel shard, which speaks the same interface
    inputs, labels, positions, share = _rank_share(dp, samples)
    # Through the wrapper: ZeRO gathers parameters.
    logits = dp(inputs, position_ids=positions, token_mask=labels != IGNORE_INDEX)
    objective = model.loss_from_logits(logits, labels, ignore_index=IGNORE_INDEX)
    aux = model.aux_loss()
    if share != 1.0:
        objective = (objective - aux) * share + aux
    return objective, objective.detach() - aux.detach()


def _pipeline_step(dp: DataParallel, microbatches: list[torch.Tensor], train: bool = True) -> float:
    """Forwards (and backwards) of every micro-batch [b, S+1] through the pipeline; the language-model loss,
    which the last stage computes and sends to the other stages as a report (not training traffic)."""
    m, mbs = len(microbatches), []
    for samples in microbatches:
        inputs, labels, positions, share = _rank_share(dp, samples)
        if positions is None:
            positions = torch.arange(inputs.shape[1])
        mbs.append(pipeline.MicroBatch(inputs, labels, positions, labels != IGNORE_INDEX, share / m, 1 / m,
                                       IGNORE_INDEX))
    cfg = dp.config
    loss = pipeline.run_pipeline(dp, mbs, cfg.pp_schedule, cfg.virtual_stages, train=train)
    group = dp.mesh["pp"]
    with comm.unmeasured():
        report = torch.tensor([0.0 if loss is None else loss], dtype=torch.float64)
        return float(comm.broadcast(report, group, src=group.size - 1)[0])


def _forward_backward(dp: DataParallel, microbatches: list[torch.Tensor]) -> float:
    """Every micro-batch's forward and backward, gradients accumulated; the step's language-model loss.

    Each micro-batch's objective is divided by their number, so the sum is the mean over the step's rows.
    """
    if dp.mesh["pp"].size > 1:
        return _pipeline_step(dp, microbatches)
    m, total = len(microbatches), 0.0
    for j, samples in enumerate(microbatches):
        with dp.no_sync() if j < m - 1 else nullcontext():  # reduce once, after the last backward
            objective, lm_loss = _lm_loss(dp, samples)
            (objective / m if m > 1 else objective).backward()
        total += float(lm_loss) / m
    return total


def _eval_loss(dp: DataParallel, batch: torch.Tensor) -> float:
    if dp.mesh["pp"].size > 1:
        return _pipeline_step(dp, [batch], train=False)
    return float(_lm_loss(dp, batch)[1])


@torch.no_grad()
def evaluate(dp: DataParallel, samples: torch.Tensor, batch_size: int, max_batches: int) -> float | None:
    """Mean next-token cross entropy (no aux loss) over the first max_batches batches of samples
    [n, S+1], in order; None when there are no samples. Every rank evaluates the same samples."""
    n = min(samples.shape[0], batch_size * max_batches)
    if n == 0:
        return None
    was_training = dp.training
    dp.eval()
    total = 0.0
    for start in range(0, n, batch_size):
        batch = samples[start : min(start + batch_size, n)]
        total += _eval_loss(dp, batch) * batch.shape[0]  # equal-length rows: weight by rows
    dp.train(was_training)
    return total / n


def train(cfg: TrainConfig, progress: bool = True) -> dict[str, Any]:
    """Train and return the `train --json` result.

    Keys: layout (degrees), steps, losses (language-model loss per step, the mean over data-parallel
    ranks), final_loss (the last step's), final_loss_mean10 (the mean of the last 10 steps), eval_loss
    (held-out loss after the last step, or None without held-out data or when stopped by cfg.stop_after),
    params, tokens_per_s, memory (one entry per rank, bytes), comm (one entry per rank, bytes sent per
    "op/dim"), time_s. With dp > 1 the ranks are local processes started by `launch_local`, unless this
    process already belongs to a process group of that size (torchrun). Deterministic: the same cfg
    gives bitwise-identical losses. With cfg.out, metrics.jsonl is written there by rank 0. torch's
    thread count is set to cfg.threads for the run and restored afterwards.
    """
    world_size = cfg.layout.world_size
    torchrun_world = int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1
    if not torch.distributed.is_initialized():
        if torchrun_world > 1:  # started by torchrun: join its group
            return _train_under_torchrun(cfg, progress)
        if world_size > 1:
            return _merge_ranks(launch_local(_train_rank, world_size, args=(cfg, progress)))
    # One thread by default: these models run many small ops, and on a shared 2-core machine a second
    # OpenMP thread that waits for a busy core at every op made steps 10x slower, not faster.
    previous_threads = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        with process_group():
            return _train(cfg, progress)
    finally:
        torch.set_num_threads(previous_threads)


def _train_under_torchrun(cfg: TrainConfig, progress: bool) -> dict[str, Any]:
    """Every torchrun process runs one rank; each returns the merged result of all ranks."""
    world_size = int(os.environ["WORLD_SIZE"])
    if world_size != cfg.layout.world_size:
        raise TrainConfigError(f"torchrun started {world_size} processes but the layout {cfg.layout} needs "
                               f"{cfg.layout.world_size} (tp*cp*pp*dp)")
    torch.distributed.init_process_group("gloo")  # the trainer keeps its tensors on the CPU for now
    try:
        result = _train_rank(cfg, progress)
        return _merge_ranks(comm.all_gather_objects(result))
    finally:
        torch.distributed.destroy_process_group()
        forget_meshes()


def _train_rank(cfg: TrainConfig, progress: bool) -> dict[str, Any]:
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    return _train(cfg, progress and torch.distributed.get_rank() == 0)


def _merge_ranks(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from every rank's: losses averaged over ranks (equal shares), per-rank lists joined."""
    merged = dict(results[0])
    merged["losses"] = [sum(step) / len(results) for step in zip(*(r["losses"] for r in results), strict=True)]
    merged.update(_final_losses(merged["losses"]))
    if merged["eval_loss"] is not None:  # context-parallel ranks each evaluate an equal share of the tokens
        merged["eval_loss"] = sum(r["eval_loss"] for r in results) / len(results)
    merged["memory"] = [entry for r in results for entry in r["memory"]]
    merged["comm"] = [entry for r in results for entry in r["comm"]]
    return merged


@dataclass
class _Run:
    """What every rank builds before its first step."""

    data: _Data
    dp: DataParallel
    optimizer: ShardedAdamW
    rank: int
    dp_rank: int
    share: int  # rows of each micro-batch this rank trains on
    microbatches: int

    def rows(self, batch: torch.Tensor) -> list[torch.Tensor]:
        """This rank's rows of each micro-batch: the batch splits into micro-batches first, each over the dp
        ranks, so that micro-batch j holds the same rows on every layout (the balancing loss sees them)."""
        return [mb[self.dp_rank * self.share:(self.dp_rank + 1) * self.share]
                for mb in batch.chunk(self.microbatches)]


def _setup(cfg: TrainConfig) -> _Run:
    """Data, wrapped model and optimizer of this rank, inside an initialized process group."""
    mesh = init_mesh(cfg.layout)
    torch.manual_seed(cfg.seed)
    data = _load_data(cfg)
    model_dtype = torch.float64 if cfg.dtype == "float64" else torch.float32  # bf16: cast by the wrapper
    model = Transformer(cfg.model_config(), seed=cfg.seed, dtype=model_dtype)
    dp = parallelize(model, mesh, cfg.parallel_config())
    dp.train()
    optimizer = dp.optimizer(lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay)
    share = cfg.batch_size // (mesh["dp"].size * cfg.microbatches)
    return _Run(data, dp, optimizer, mesh.rank, mesh["dp"].rank, share, cfg.microbatches)


def _train(cfg: TrainConfig, progress: bool) -> dict[str, Any]:
    setup = _setup(cfg)
    data, dp, optimizer, rank = setup.data, setup.dp, setup.optimizer, setup.rank
    bar = ProgressBar(cfg.steps, enabled=progress)
    bar.log(f"orangetron train: {_describe(cfg, data)}")
    start = _Resumed(0, [])
    if cfg.resume:
        cfg, start = _resume(cfg, setup)
        bar.log(f"resumed from {start.path} at step {start.step} of {cfg.steps}")
    last = min(cfg.steps, cfg.stop_after) if cfg.stop_after else cfg.steps
    run = _RunLog(cfg, bar, write=rank == 0, start=start)
    eval_loss: float | None = None
    mem: dict[str, int] = {}
    with comm.measure() as records, run:
        batches: Iterator[torch.Tensor] = iter(data.train)
        for _ in range(start.step):  # the batches the checkpointed steps consumed
            next(batches)
        for step in range(start.step, last):
            t0 = time.perf_counter()
            lr = lr_at(step, cfg)
            rows = setup.rows(next(batches))
            # The first step also measures memory; its hooks cost time, so run.step leaves it out of tokens/s.
            loss, grad_norm, step_mem = _train_step(dp, optimizer, rows, lr, cfg.grad_clip,
                                                    measure=step == start.step)
            seconds = time.perf_counter() - t0  # evaluation below is not training throughput
            mem = mem or step_mem
            record = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm}
            if step + 1 == cfg.steps or (cfg.eval_every and (step + 1) % cfg.eval_every == 0):
                eval_loss = evaluate(dp, data.eval_samples, cfg.batch_size, cfg.eval_batches)
                record["eval_loss"] = eval_loss
            run.step(record, seconds)
            if cfg.out is not None and (step + 1 == last or (cfg.save_every and (step + 1) % cfg.save_every == 0)):
                _save(cfg, setup, step + 1, run.losses)
    if last < cfg.steps:
        bar.log(f"stopped after step {last} of {cfg.steps}; continue with --resume")
    elif eval_loss is None:
        bar.log("no held-out loss: the eval split is shorter than one sample (raise eval_fraction)")
    return {
        "layout": cfg.layout.degrees(),
        "steps": cfg.steps,
        "losses": run.losses,
        **_final_losses(run.losses),
        "eval_loss": eval_loss,
        "params": _model_parameters(cfg),
        "tokens_per_s": run.tokens_per_s() or 0.0,
        "memory": [{"rank": rank, **mem}],
        "comm": [{"rank": rank, **dict(sorted(comm.bytes_by_key(records).items()))}],
        "time_s": time.perf_counter() - run.started,
    }


def _final_losses(losses: list[float]) -> dict[str, float]:
    """final_loss: the last step's loss, one batch and noisy; final_loss_mean10: the mean of the last 10
    steps (fewer in a shorter run), the trend the progress bar and the summary show."""
    recent = losses[-10:]
    return {"final_loss": losses[-1], "final_loss_mean10": sum(recent) / len(recent)}


@dataclass
class _Resumed:
    step: int  # steps already taken
    losses: list[float]  # their losses
    path: Path | None = None  # the checkpoint they come from


def _checkpoint_folder(cfg: TrainConfig) -> Path:
    return Path(cfg.out) / "checkpoints"


def _save(cfg: TrainConfig, setup: _Run, step: int, losses: list[float]) -> None:
    with comm.unmeasured():  # checkpoint traffic is not training traffic
        _write_checkpoint(cfg, setup, step, losses)


def _write_checkpoint(cfg: TrainConfig, setup: _Run, step: int, losses: list[float]) -> None:
    state = setup.dp.full_state(setup.optimizer)  # every rank takes part: it gathers the shards
    # Each rank's losses are over its share of the batch; the history a checkpoint keeps is their mean.
    group = setup.dp.group
    mean_losses = (comm.all_reduce(torch.tensor(losses, dtype=torch.float64), group) / group.size).tolist()
    if setup.rank == 0:
        model = dataclasses.asdict(cfg.model_config())
        save_checkpoint(_checkpoint_folder(cfg), step, {**state, "step": step, "losses": mean_losses, "model": model,
                                                        "schedule": _schedule(cfg)})


def _schedule(cfg: TrainConfig) -> dict[str, int | float]:
    """What fixes every step's learning rate: the run's total, the cosine's span, warmup and the two rates."""
    span = cfg.schedule_steps if cfg.schedule_steps is not None else cfg.steps
    return {"steps": cfg.steps, "schedule_steps": span, "warmup": cfg.warmup, "lr": cfg.lr, "min_lr": cfg.min_lr}


def _resume(cfg: TrainConfig, setup: _Run) -> tuple[TrainConfig, _Resumed]:
    """The run's config with the checkpoint's schedule, and where it stands; loads the state into setup."""
    path = latest_checkpoint(_checkpoint_folder(cfg))
    if path is None:
        raise TrainConfigError(f"resume=True (--resume): no checkpoint under {_checkpoint_folder(cfg)}")
    state = load_checkpoint(path)
    model = dataclasses.asdict(cfg.model_config())
    for name, value in state["model"].items():
        if model.get(name) != value:
            raise TrainConfigError(f"resume=True (--resume): {path} holds a model with {name}={value!r}, "
                                   f"this run builds {name}={model.get(name)!r}")
    step = int(state["step"])
    if step >= cfg.steps:
        raise TrainConfigError(f"steps={cfg.steps} (--steps): {path} is already at step {step}; "
                               "raise --steps and add --extend to train further")
    if cfg.stop_after and cfg.stop_after <= step:
        raise TrainConfigError(f"stop_after={cfg.stop_after} (--stop-after): {path} is already at step {step}")
    cfg = _continue_schedule(cfg, state.get("schedule"), path)
    setup.dp.load_full_state(state, setup.optimizer)
    return cfg, _Resumed(step, [float(x) for x in state["losses"]], path)


def _continue_schedule(cfg: TrainConfig, saved: dict[str, Any] | None, path: Path) -> TrainConfig:
    """cfg on the checkpointed run's schedule, so every step's rate is the uninterrupted run's; refuses flags
    that would change it, and a longer run unless cfg.extend (then the old cosine holds its last rate)."""
    if saved is None:  # written before checkpoints kept their schedule: this run's flags define it
        return cfg
    for name in ("warmup", "lr", "min_lr"):
        if getattr(cfg, name) != saved[name]:
            raise TrainConfigError(f"{name}={getattr(cfg, name)!r} ({_flag(name)}): {path} belongs to a run with "
                                   f"{name}={saved[name]!r}; a resumed run keeps its schedule")
    total = int(saved["steps"])
    if cfg.steps < total:
        raise TrainConfigError(f"steps={cfg.steps} (--steps): {path} belongs to a run of {total} steps; give "
                               f"--steps {total}, with --stop-after N to end it early")
    if cfg.steps > total and not cfg.extend:
        raise TrainConfigError(f"steps={cfg.steps} (--steps): {path} belongs to a run of {total} steps; add --extend "
                               "to train past them (the cosine keeps its span, then the rate holds min_lr)")
    return dataclasses.replace(cfg, schedule_steps=int(saved["schedule_steps"]))


def _train_step(
    dp: DataParallel, optimizer: ShardedAdamW, batch: list[torch.Tensor], lr: float, grad_clip: float, *,
    measure: bool, on_grads: Callable[[DataParallel], None] | None = None,
) -> tuple[float, float, dict[str, int]]:
    """Forward and backward of every micro-batch [b, S+1] in `batch`, then one update -> (loss, grad norm,
    memory by category).

    The memory dict is empty unless `measure`; then it holds the model state after the update
    (params, grads, main_params, optimizer) and the peak of activations saved for backward.
    `on_grads(dp)` sees the averaged gradients before clipping (`orangetron verify` reads them there).
    """
    with memory.track_activations(dp.module) if measure else nullcontext() as meter:
        lm_loss = _forward_backward(dp, batch)
    if on_grads is not None:
        dp.reduce_gradients()
        on_grads(dp)
    optimizer.lr = lr
    grad_norm = optimizer.clip_grad_norm_(grad_clip if grad_clip > 0 else math.inf)
    optimizer.step()
    update_router_bias(dp.module, dp.mesh, dp.config.sequence_parallel)
    mem: dict[str, int] = {}
    if measure:
        state = memory.model_state_bytes(dp, optimizer)
        mem = {**{k: state[k] for k in ("params", "grads", "main_params", "optimizer")},
               "activations_peak": meter.peak_bytes}
    optimizer.zero_grad()
    return float(lm_loss), float(grad_norm), mem


class _RunLog:
    """Per-step bookkeeping: losses, tokens/s (step 0 excluded), progress bar, metrics.jsonl."""

    def __init__(self, cfg: TrainConfig, bar: ProgressBar, write: bool = True, start: _Resumed | None = None):
        self.cfg, self.bar, self.write = cfg, bar, write
        self.first_step = 1 if start is None else start.step + 1  # 1-based number of this run's first step
        self.tokens_per_step = cfg.batch_size * cfg.seq_len
        self.losses: list[float] = [] if start is None else list(start.losses)
        self.timed_s, self.timed_tokens = 0.0, 0
        self.started = time.perf_counter()
        self.file = None

    def __enter__(self) -> _RunLog:
        if self.cfg.out is not None and self.write:
            folder = Path(self.cfg.out)
            folder.mkdir(parents=True, exist_ok=True)
            mode = "a" if self.first_step > 1 else "w"  # a resumed run continues the same file
            if self.first_step > 1:
                _keep_records_before(folder / "metrics.jsonl", self.first_step)
            self.file = open(folder / "metrics.jsonl", mode, encoding="utf-8")  # noqa: SIM115 (closed in __exit__)
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()
        if self.file is not None:
            self.file.close()

    def tokens_per_s(self) -> float | None:
        return self.timed_tokens / self.timed_s if self.timed_s > 0 else None

    def step(self, record: dict[str, Any], seconds: float) -> None:
        self.losses.append(record["loss"])
        step = record["step"]
        if step > self.first_step or self.cfg.steps == self.first_step:
            self.timed_s += seconds
            self.timed_tokens += self.tokens_per_step
        record["tokens"] = step * self.tokens_per_step
        record["tokens_per_s"] = self.tokens_per_s()
        # Single-batch losses are noisy; the bar shows the mean of the last 10 so the trend reads.
        recent = self.losses[-10:]
        self.bar.update(step, sum(recent) / len(recent), record["tokens_per_s"])
        if record.get("eval_loss") is not None:
            self.bar.log(f"step {step}: held-out loss {record['eval_loss']:.4f}")
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()


def _keep_records_before(path: Path, step: int) -> None:
    """Drop the records of `step` and later: a run resumed from an older checkpoint takes those steps again,
    and a line cut short by a crash is dropped with them."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            if json.loads(line)["step"] < step and line.endswith("\n"):
                kept.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    path.write_text("".join(kept), encoding="utf-8")


def _model_parameters(cfg: TrainConfig) -> int:
    """Parameters of the whole model, whatever share of them this rank holds."""
    from orangetron.plan.models import spec_from_model_config  # counts the reference model (tested equal)

    return spec_from_model_config(cfg.model_config()).total_params()


def _describe(cfg: TrainConfig, data: _Data) -> str:
    name = cfg.model if isinstance(cfg.model, str) else "custom"
    source = f"{len(cfg.data)} file(s)" if cfg.data is not None else "stdlib corpus"
    return (
        f"model {name} ({_model_parameters(cfg) / 1e6:.2f}M params, {cfg.dtype}), {source}, "
        f"{data.n_tokens:,} tokens, {cfg.steps} steps x {cfg.batch_size} x {cfg.seq_len} tokens, "
        f"layout {cfg.layout}"
    )
