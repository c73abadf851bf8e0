"""Training: the trainers (resident, streamed, adapters), their shared step pieces, saved state, the one loop
and what it composes (lr schedules, validation, gradient clipping, pre-emption)."""
