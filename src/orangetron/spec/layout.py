"""`Layout`: the parallel degrees of a job, their validation, and rank <-> coordinates.

world_size = tp * cp * pp * dp. Ranks are numbered in Megatron-Core's order `tp-cp-ep-dp-pp`, tp
fastest: consecutive ranks share a node's fast links for the most talkative dimension. Experts are
sharded over the dp * cp ranks of one (tp, pp) position: within that block, ep varies fastest and the
remaining factor forms the expert-data-parallel group edp = dp * cp / ep.

With `expert_fold` (Megatron-Core's MoE parallel folding; planner only, the runtime refuses it) the expert
layers get a mesh of their own over the same tp * cp * dp ranks of a pipeline stage: etp fastest, then ep,
then edp = tp * cp * dp / (etp * ep). ep then need not divide dp * cp, and etp is any divisor: an 8-way
expert group can fill a node whose attention runs tp = 4.

Pure Python, so the planner can validate layouts without torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from orangetron.spec import rules
from orangetron.spec.rules import LayoutError

if TYPE_CHECKING:
    from orangetron.spec.model import ModelSpec

DIMS = ("tp", "cp", "pp", "dp", "ep")


@dataclass(frozen=True)
class Coordinates:
    """Where one rank sits in each mesh dimension (each value in [0, degree))."""

    tp: int
    cp: int
    dp: int
    pp: int
    dp_cp: int  # index in the combined dp x cp group (cp fastest); dense optimizer state shards over it
    ep: int
    edp: int
    etp: int = 0  # index in the expert-tensor-parallel group (the tp index when etp = tp, unfolded)


@dataclass(frozen=True)
class Layout:
    """Parallel degrees. `etp` (expert tensor parallelism) is 1 or tp unless the experts are folded; the runtime
    runs etp=1 without folding only."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = 1
    expert_fold: bool = False  # experts get their own (etp, ep, edp) mesh over the stage's ranks

    def __post_init__(self) -> None:
        for name in (*DIMS, "etp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name}={value!r}: degree must be a positive integer")
        if self.expert_fold:
            self._check_fold()
            return
        if self.etp not in (1, self.tp):
            raise LayoutError(f"etp={self.etp}: expert tensor parallelism must be 1 or tp={self.tp} "
                              "(other degrees need the folded expert mesh)")
        rules.ep_divides_dp_cp(self.ep, self.dp, self.cp)

    def _check_fold(self) -> None:
        stage = self.tp * self.cp * self.dp
        if self.ep * self.etp == 1:
            raise LayoutError("expert_fold with ep=1 and etp=1: a folded expert mesh needs ep or etp above 1")
        if stage % (self.ep * self.etp):
            raise LayoutError(f"ep={self.ep} x etp={self.etp}: must divide the tp*cp*dp={stage} ranks of a "
                              "pipeline stage, over which the experts fold")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def dp_cp(self) -> int:
        """Ranks that replicate dense parameters (and shard their optimizer state)."""
        return self.dp * self.cp

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: replicas of each expert shard."""
        if self.expert_fold:
            return self.tp * self.cp * self.dp // (self.ep * self.etp)
        return self.dp * self.cp // self.ep

    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in DIMS}

    def __str__(self) -> str:
        text = " ".join(f"{name}={getattr(self, name)}" for name in DIMS)
        if self.expert_fold:
            return f"{text} etp={self.etp} edp={self.edp} (folded)"
        return f"{text} etp={self.etp}" if self.etp > 1 else text  # experts split over tp: priced apart

    # ---- rank <-> coordinates -------------------------------------------------------------------

    def coordinates(self, rank: int) -> Coordinates:
        """Coordinates of `rank` in order tp-cp-ep-dp-pp, tp fastest."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank={rank}: must lie in [0, world_size={self.world_size})")
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        dp_cp = dp * self.cp + cp
        if self.expert_fold:
            local = rank % (self.tp * self.cp * self.dp)  # position inside the pipeline stage
            ep, edp = (local // self.etp) % self.ep, local // (self.etp * self.ep)
            return Coordinates(tp=tp, cp=cp, dp=dp, pp=pp, dp_cp=dp_cp, ep=ep, edp=edp, etp=local % self.etp)
        return Coordinates(tp=tp, cp=cp, dp=dp, pp=pp, dp_cp=dp_cp, ep=dp_cp % self.ep, edp=dp_cp // self.ep,
                           etp=tp if self.etp > 1 else 0)

    def node_placement(self, ranks_per_node: int) -> str:
        """Which groups lie inside one node when each node holds `ranks_per_node` consecutive ranks (as torchrun
        and Slurm number them), e.g. "2 nodes of 2 ranks: tp inside a node; dp across nodes". tp is fastest in
        the rank order, so its groups stay inside a node whenever the node size divides by tp."""
        if ranks_per_node < 1 or self.world_size % ranks_per_node:
            raise LayoutError(f"ranks_per_node={ranks_per_node}: must divide world_size={self.world_size}")
        inside, across = [], []
        for dim in ("tp", "cp", "ep", "dp", "pp"):
            if getattr(self, dim) > 1:
                (inside if self.inside_nodes(dim, ranks_per_node) else across).append(dim)
        nodes = self.world_size // ranks_per_node
        parts = [f"{', '.join(inside)} inside a node" if inside else "", f"{', '.join(across)} across nodes"
                 if across else ""]
        ranks = f"{ranks_per_node} rank" + ("s" if ranks_per_node != 1 else "")
        return f"{nodes} node(s) of {ranks}: " + ("; ".join(p for p in parts if p) or "one rank")

    def inside_nodes(self, dim: str, ranks_per_node: int) -> bool:
        """Whether every `dim` group's ranks sit on one node."""
        others = {"tp": ("cp", "dp", "pp"), "cp": ("tp", "dp", "pp"), "dp": ("tp", "cp", "pp"),
                  "pp": ("tp", "cp", "dp"), "ep": ("tp", "pp", "edp", "etp")}[dim]
        nodes: dict[tuple[int, ...], set[int]] = {}
        for rank in range(self.world_size):
            c = self.coordinates(rank)
            nodes.setdefault(tuple(getattr(c, o) for o in others), set()).add(rank // ranks_per_node)
        return all(len(found) == 1 for found in nodes.values())

    def rank(self, *, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """Global rank at the given coordinates (the inverse of `coordinates`)."""
        for name, value in (("tp", tp), ("cp", cp), ("dp", dp), ("pp", pp)):
            if not 0 <= value < getattr(self, name):
                raise LayoutError(f"{name}={value}: coordinate must lie in [0, {getattr(self, name)})")
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def mesh_shape(self) -> tuple[int, int, int, int]:
        """Shape (pp, dp, cp, tp) of the dense mesh; row-major, so tp is fastest."""
        return (self.pp, self.dp, self.cp, self.tp)

    def expert_mesh_shape(self) -> tuple[int, int, int, int]:
        """Shape (pp, edp, ep, tp) of the expert mesh over the same ranks; (pp, edp, ep, etp) when folded."""
        return (self.pp, self.edp, self.ep, self.etp if self.expert_fold else self.tp)

    # ---- validation against a model and a sequence ---------------------------------------------

    def validate(self, model: ModelSpec | None = None, seq_len: int | None = None,
                 sequence_parallel: bool = False) -> None:
        """Raise `LayoutError` if this layout cannot run `model` on sequences of `seq_len` tokens."""
        if model is not None:
            self._validate_model(model)
        if seq_len is not None:
            self._validate_seq(seq_len, sequence_parallel)

    def _validate_model(self, model: ModelSpec) -> None:
        # The messages keep the runtime's names (ModelConfig's arguments), as `orangetron train` users write them.
        rules.tp_splits_heads(self.tp, model.num_heads, model.num_kv_heads)
        if model.num_layers < self.pp:
            raise LayoutError(f"pp={self.pp}: num_layers={model.num_layers} < pp; every stage needs a layer")
        rules.ep_splits_experts(self.ep, model.num_experts, model.num_moe_layers)
        for name, width in (("ffn_dim", model.ffn_hidden_size), ("shared_ffn_dim", model.shared_ffn_hidden_size)):
            if width % self.tp:
                raise LayoutError(f"tp={self.tp}: {name}={width} is not divisible by tp (SwiGLU split on its width)")
        if model.vocab_size % self.tp:
            raise LayoutError(f"tp={self.tp}: vocab_size={model.vocab_size} is not divisible by tp "
                              "(vocab-parallel output)")

    def _validate_seq(self, seq_len: int, sequence_parallel: bool) -> None:
        if seq_len < 1:
            raise LayoutError(f"seq_len={seq_len}: must be positive")
        rules.cp_splits_sequence(self.cp, seq_len)
        if sequence_parallel:
            rules.sp_splits_shard(self.tp, self.cp, seq_len)
