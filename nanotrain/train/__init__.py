"""Training: the trainers (resident, streamed), their shared step pieces, saved state, and the one loop."""
