"""Layer-by-layer weight streaming: a model whose weights, masters and moments live in host memory, each unit
brought to the GPU for its forward and its backward (``trainer.py``; ``config.py``; ``deferred.py``, the step
that waits for the whole gradient's norm or overflow).

- the carriers that move a unit's state: ``optimizer.py`` (``StreamedAdam``: host state, the update on the
  device), ``staged.py`` (a unit whose masters and moments pass through staging buffers), ``kept.py`` (a deferred
  step's gradients kept until its norm is known), ``pinned.py`` (pinned host buffers), ``boundaries.py`` (the
  block outputs kept between forward and backward, on the device or the host);
- its footprint and step time: ``footprint.py`` (what streaming holds, by byte class), ``search.py`` (the
  fastest streaming plan within the caps);
- ZeRO-Offload, streaming under data parallelism: ``sharded.py`` and ``sharded_deferred.py`` (each rank's shard
  of masters and moments, on the data-parallel engine's buckets), ``zero_offload.py`` (its trainer built).
"""
