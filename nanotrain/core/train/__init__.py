"""Training on one device: the resident trainer, the step pieces and the hand-over every trainer shares, the shard
of state a trainer offers a checkpoint, the one loop and what it composes (lr schedules, validation, clipping, the
loss scaler, health, pre-emption). The streamed trainer is ``nanotrain.stream``'s."""
