"""3D parallelism: a model tensor-parallel inside pipeline stages, the pipeline replicated data-parallel.

* ``layered``: this rank's tensor-parallel model as a ``LayeredModel`` (what the pipeline cuts into stages).
* ``step``: build this rank's share on the grid, the replica's slice of a batch, the gradient units.
* ``evaluate``: validation, the pipeline's forward alone.
* ``trainer``: the ``Trainer`` over it, its units handed over by the core's hand-over (``core.train.handover``),
  reduced and updated by ``data_parallel.DataParallelAdam`` (DDP, ZeRO-1/2), its shard saved in the one
  checkpoint format (``checkpoint.state``).
* ``planner``: feasible layouts with predicted step time and memory per GPU, and the pick.
"""
from nanotrain.compose.layered import tp_layered
from nanotrain.compose.step import Parallel3D, build_3d, grad_units, replica_slice
from nanotrain.compose.trainer import Parallel3DTrainer
__all__ = ["Parallel3D", "Parallel3DTrainer", "build_3d", "grad_units", "replica_slice", "tp_layered"]
