"""The single-GPU path: everything one process needs to train a model that fits on its device.

Start at ``recipe.py``: the whole run on one GPU in one page (resolve a model, load its weights, build the
resident trainer, run the loop), each step a function that ``tasks.finetune`` calls too. Then read the pieces
in this order, each file standing only on the ones before it:

1. ``tree.py`` (the parameter tree), ``linear.py``, ``kernels.py``, ``loss.py`` (the fused, chunked LM-head
   cross-entropy); ``machine.py`` (the process and its machine: the allocator's setting, a GPU cap, resident and
   available host memory);
2. ``models/``: ``spec.py`` (what an engine sees of a model: leaves, units, costs), ``ops.py`` (the op set a
   block is written against), ``run.py`` (the block, ``run_units``, loss, init), ``registry.py`` and a folder
   per family (``gpt2/``, ``llama/``); ``documents.py`` (packed rows: several documents per row, each its
   own); ``lora.py`` (adapters as leaves, the base frozen); ``cache.py`` (the key/value cache sampling uses);
3. ``optim/``: ``adam.py`` (AdamW on flat fp32 tensors, 32- or 8-bit moments), ``carrier.py`` (the interface
   every optimizer carrier offers a trainer), ``offload.py`` (masters and moments on the host or the device,
   each unit updated as backward hands it over);
4. ``train/``: ``result.py`` (what a step reports), ``step.py`` (the ``Trainer`` protocol and the shared step
   pieces), ``shard.py`` (the part of its state a trainer offers a checkpoint), ``handover.py`` (units taken
   from the optimizer and handed back), ``resident.py`` (the trainer whose weights stay on the device),
   ``clip.py``, ``scaler.py``, ``schedule.py``, ``evaluate.py``, ``health.py``, ``preempt.py``, ``loop.py`` (the
   one loop every engine runs in);
5. ``recompute.py`` and ``lean.py`` (activation recompute policies over any spec), ``footprint.py`` (what the
   resident trainer holds on the GPU and the host, and the arithmetic every engine's footprint shares),
   ``flops.py`` (MFU), ``generate.py`` (sampling); ``frozen.py`` and ``nf4.py`` (a frozen base under adapters,
   in bf16 or 4 bits) and ``lora_footprint.py`` (their bytes); ``leaves.py`` (a trainer's starting weights, each
   read as it is taken, and the load's host bytes).

The engines (``stream/``, ``data_parallel/``, ``tensor_parallel/``, ``pipeline/``, ``compose/``) and
``checkpoint/`` stand on this package; nothing here imports them (the recipe loads weights through
``weights``, beside the core).
"""
