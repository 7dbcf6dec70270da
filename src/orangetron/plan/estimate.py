"""One configuration, priced: memory per GPU, communication per step, step time and MFU."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from orangetron.plan.memory import memory_per_gpu
from orangetron.plan.network import DEFAULT_PARAMS, NetworkParams
from orangetron.plan.overhead import DEFAULT_OVERHEAD, MemoryOverhead, fits, with_overhead
from orangetron.plan.timing import DEFAULT_EFFICIENCY, Efficiency, StepTime, group_places, step_time
from orangetron.plan.traffic import step_records, summarize
from orangetron.spec.hardware import Cluster
from orangetron.spec.model import ModelSpec
from orangetron.spec.options import Degrees, Job, validate


@dataclass(frozen=True)
class Estimate:
    """Everything `orangetron estimate` reports for one configuration."""

    model: ModelSpec
    degrees: Degrees
    job: Job
    cluster: Cluster
    memory: dict[str, int]
    comm: dict[str, dict[str, int]]
    time: StepTime

    @property
    def fits(self) -> bool:
        return fits(self.memory, self.cluster.gpu.memory_bytes)

    def to_json(self) -> dict:
        """The `estimate --json` object (its keys: docs/planner.md)."""
        return {
            "model": self.model.name,
            "params": self.model.total_params(),
            "active_params": self.model.active_params() if isinstance(self.model, ModelSpec) else
            self.model.total_params(),
            "gpu": self.cluster.gpu.name,
            "gpus": self.degrees.world_size,
            "gpus_per_node": self.cluster.gpus_per_node,
            "layout": {**asdict(self.degrees), "edp": self.degrees.edp},
            # The micro-batches per step as priced, also where `global_batch` sets them.
            "job": replace(self.job, microbatches=self.job.replica_microbatches(self.degrees)).to_json(),
            "memory_bytes": self.memory,
            "memory_capacity_bytes": int(self.cluster.gpu.memory_bytes),
            "fits": self.fits,
            "comm_bytes": {key: row["sent"] for key, row in self.comm.items()},
            "comm": self.comm,
            "step_time_s": self.time.step_s,
            "time_breakdown_s": {k: v for k, v in asdict(self.time).items() if k.endswith("_s") and k != "step_s"},
            "tokens_per_s": self.tokens_per_step / self.time.step_s,  # the whole cluster's
            "tokens_per_s_per_gpu": self.tokens_per_step / self.time.step_s / self.degrees.world_size,
            "tflops_per_gpu": self.time.tflops_per_gpu,
            "mfu": self.time.mfu,
            "mfu_causal": self.time.mfu_causal,
            "hfu": self.time.hfu,
        }

    @property
    def tokens_per_step(self) -> int:
        job = self.job
        return job.replica_microbatches(self.degrees) * job.micro_batch * self.degrees.dp * job.data_tokens


def check_cluster(deg: Degrees, cluster: Cluster) -> None:
    if deg.world_size != cluster.num_gpus:
        raise ValueError(f"tp*cp*pp*dp = {deg.tp}*{deg.cp}*{deg.pp}*{deg.dp} = {deg.world_size} "
                         f"does not equal gpus={cluster.num_gpus}")


def estimate(model: ModelSpec, deg: Degrees, job: Job, cluster: Cluster, net: NetworkParams = DEFAULT_PARAMS,
             eff: Efficiency = DEFAULT_EFFICIENCY, overhead: MemoryOverhead = DEFAULT_OVERHEAD) -> Estimate:
    """Price one configuration; ValueError for a layout the runtime could not run. Memory includes the
    `overhead` term (context, communicator buffers, fragmentation) in its `overhead` entry and `total`."""
    validate(model, deg, job)
    check_cluster(deg, cluster)
    if job.fp8:
        cluster.gpu.peak_flops("float8")  # ValueError when the GPU has no FP8 tensor cores
    memory = with_overhead(memory_per_gpu(model, deg, job), deg, overhead)
    comm = summarize(step_records(model, deg, job, stage=0, ep_where=group_places(deg, cluster)["ep"]))
    return Estimate(model, deg, job, cluster, memory, comm, step_time(model, deg, job, cluster, net, eff))
