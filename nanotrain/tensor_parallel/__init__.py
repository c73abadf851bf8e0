"""Megatron-style tensor parallelism for nanotrain, applied from outside the model (its files: docs/ARCHITECTURE.md).

The rank grid, joining and spawning live in ``nanotrain.distributed``.
"""
from nanotrain.tensor_parallel.comms import (all_gather_reduce_scatter, all_gather_split, all_reduce_copy,
                                             copy_all_reduce, reduce_scatter_all_gather)
from nanotrain.tensor_parallel.grads import grad_norm, sync_grads
from nanotrain.tensor_parallel.layers import column_linear, enter_parallel, leave_parallel, row_linear
from nanotrain.tensor_parallel.ops import TPOps, parallel_hidden_states, parallel_logits, parallel_loss
from nanotrain.tensor_parallel.overlap import (all_gather_linear, copy_all_reduce_linear, linear_all_reduce_copy,
                                               linear_reduce_scatter)
from nanotrain.tensor_parallel.shard import TPPlan, plan_tp, shard_params
from nanotrain.tensor_parallel.vocab_parallel import vocab_parallel_cross_entropy, vocab_parallel_lookup

__all__ = [
    "copy_all_reduce", "all_reduce_copy", "all_gather_split",
    "all_gather_reduce_scatter", "reduce_scatter_all_gather",
    "column_linear", "row_linear", "enter_parallel", "leave_parallel",
    "all_gather_linear", "linear_reduce_scatter", "copy_all_reduce_linear", "linear_all_reduce_copy",
    "TPPlan", "plan_tp", "shard_params", "TPOps",
    "vocab_parallel_lookup", "vocab_parallel_cross_entropy",
    "parallel_hidden_states", "parallel_loss", "parallel_logits", "sync_grads", "grad_norm",
]
