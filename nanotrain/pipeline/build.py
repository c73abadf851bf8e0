"""Everything one rank needs to run a schedule: its stages, its parameters, shapes and groups."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from nanotrain.distributed.context import DistContext
from nanotrain.distributed.grid import RankGrid
from nanotrain.pipeline.comm_plan import Step
from nanotrain.pipeline.layered import LayeredModel, StageSpec, partition
from nanotrain.pipeline.schedule import Message, Schedule
from nanotrain.pipeline.validate import validate
from nanotrain.core.tree import Tree, named_leaves, set_path


@dataclass
class Pipeline:
    ctx: DistContext  # the pipeline runs on ctx.grid's pp group; ranks below are pp ranks
    model: LayeredModel
    schedule: Schedule
    specs: list[StageSpec]  # every stage, for names and shapes; this rank runs ``stages``
    stages: dict[int, StageSpec]
    params: Tree  # this rank's leaves only, shared by its stages
    steps: list[Step]  # this rank's communication plan
    boundaries: list[tuple[torch.Size, torch.dtype]]  # [s]: what flows between stage s-1 and s
    tied: list[tuple[str, dist.ProcessGroup]]  # leaves with copies on other ranks, and the group of copies

    def parameters(self) -> list[torch.Tensor]:
        return [t for _, t in named_leaves(self.params) if isinstance(t, torch.Tensor)]

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return [(p, t) for p, t in named_leaves(self.params) if isinstance(t, torch.Tensor)]

    def message_shape(self, msg: Message) -> tuple[torch.Size, torch.dtype]:
        """An activation into stage s, or the gradient of stage s's output, has stage s's boundary shape."""
        return self.boundaries[msg.stage if msg.kind == "act" else msg.stage + 1]

    @property
    def rank(self) -> int:
        """This rank's place in the pipeline (its pp rank)."""
        return self.ctx.grid.pp_rank

    def global_rank(self, pp_rank: int) -> int:
        return self.ctx.grid.global_rank(pp=pp_rank)

    def rank_name(self, rank: int) -> str:
        return (f"rank {self.global_rank(rank)} (pp rank {rank}, stages "
                f"{', '.join(map(str, self.schedule.stages_of(rank)))})")


def materialize(model: LayeredModel, paths: set[str], seed: int, device: torch.device, dtype: torch.dtype) -> Tree:
    """The leaves in ``paths`` with exactly the values a single process gets from ``model.init(seed)``."""
    params = model.skeleton()
    for path, t in model.init(seed):
        if path in paths:
            set_path(params, path, t.to(device=device, dtype=dtype).requires_grad_())
    return params


def boundary_shapes(model: LayeredModel, specs: Sequence[StageSpec], example: torch.Tensor,
                    dtype: torch.dtype) -> list[tuple[torch.Size, torch.dtype]]:
    """Shape and dtype of every stage's input, by running the model on the meta device (no memory, no FLOPs)."""
    params = model.skeleton()
    for path, shape in model.shapes.items():
        set_path(params, path, torch.empty(shape, device="meta", dtype=dtype))
    x = example.to("meta")
    shapes = [(x.shape, x.dtype)]
    for spec in specs[:-1]:
        x = spec.forward(params, x)
        shapes.append((x.shape, x.dtype))
    return shapes


def tied_groups(specs: Sequence[StageSpec], schedule: Schedule, grid: RankGrid) -> list[tuple[str, dist.ProcessGroup]]:
    """A group per set of pp ranks that share a leaf, in this rank's pipeline.

    Every rank of the world must call this: ``new_group`` is collective, so each rank creates the
    groups of every pipeline of the grid (one per tp x dp coordinate) and keeps its own.
    """
    users: dict[str, set[int]] = {}
    for spec in specs:
        for path in spec.paths():
            users.setdefault(path, set()).add(schedule.rank_of(spec.index))
    shared = {path: tuple(sorted(r)) for path, r in sorted(users.items()) if len(r) > 1}
    mine = {}
    for pipeline in grid.all_groups("pp"):
        for ranks in sorted(set(shared.values())):
            group = dist.new_group([pipeline[r] for r in ranks], timeout=grid.timeout)
            if pipeline[grid.pp_rank] == dist.get_rank():
                mine[ranks] = group
    return [(path, mine[ranks]) for path, ranks in shared.items() if grid.pp_rank in ranks]


def build_pipeline(ctx: DistContext, model: LayeredModel, schedule: Schedule, example_input: torch.Tensor,
                   counts: Sequence[int] | None = None, seed: int = 0, dtype: torch.dtype = torch.float32,
                   params: Tree | None = None) -> Pipeline:
    """Validate ``schedule``, cut ``model`` into its stages and load this rank's share.

    ``example_input`` is one micro-batch of inputs (any device); ``counts`` fixes how many middle
    layers each stage gets, otherwise stages are balanced by layer cost. Parameters come from
    ``model.init(seed)`` unless ``params`` (a tree holding at least this rank's leaves) is given.
    """
    ctx.where = f"building the {schedule.name} pipeline"
    pp, rank = ctx.grid.pp, ctx.grid.pp_rank
    if schedule.n_ranks != pp:
        raise ValueError(f"schedule {schedule.name!r} is for {schedule.n_ranks} ranks but the grid's pipeline has {pp} "
                         f"(pp={pp} of {ctx.world_size} processes); build the schedule for {pp} or change --pp")
    plans = validate(schedule)
    specs = partition(model, schedule.n_stages, counts)
    stages = {s: specs[s] for s in schedule.stages_of(rank)}
    paths = set().union(*(spec.paths() for spec in stages.values()))
    if params is None:
        params = materialize(model, paths, seed, ctx.device, dtype)
    leaves = dict(named_leaves(params))
    missing = sorted(p for p in paths if not isinstance(leaves.get(p), torch.Tensor))
    if missing:
        raise ValueError(f"the given params lack {len(missing)} leaves pp rank {rank}'s stages read, e.g. "
                         f"{', '.join(missing[:3])}; pass a tree with them or params=None to initialise")
    wrong = sorted(p for p in paths if leaves[p].dtype != dtype)
    if wrong:
        raise ValueError(f"parameter {wrong[0]} is {leaves[wrong[0]].dtype} but dtype={dtype} (activations are sent "
                         f"in that dtype); pass dtype={leaves[wrong[0]].dtype}")
    return Pipeline(
        ctx=ctx, model=model, schedule=schedule, specs=specs, stages=stages, params=params,
        steps=plans[rank],
        boundaries=boundary_shapes(model, specs, example_input, dtype),
        tied=tied_groups(specs, schedule, ctx.grid),
    )
