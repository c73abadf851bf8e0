"""The 8-bit update as one expression (``optim.fused8``, compiled on GPUs) against ``adam_step``'s chunked
path on the CPU, eager and compiled by the CPU inductor backend.

Bounds, derived: from the same state, one step differs only by the order of a few fp32 operations (the
fused CPU AdamW kernel against the expression's ops, and the compiler's fusions), each within half an
ulp, so a new weight differs by at most 8 eps (|p| + |u|) with u the update and eps = 2^-24. A moment
differs by as much before quantization; its block scale (a maximum) by as much, and its code by at most
one step of the code where rounding carries it across a midpoint, so a dequantized moment moves by at
most the code's widest gap times the scale. Flips need a value within ~1e-6 of a midpoint: rare."""
from __future__ import annotations

import pytest
import torch

from nanotrain.core.optim.adam import AdamConfig, AdamState8, adam_step, init_state
from nanotrain.core.optim.fused8 import adamw8_rows, rows_args, step_scalars
from nanotrain.core.optim.quant8 import dequantize_blockwise, dynamic_code

HP = AdamConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
BLOCK, ROWS = 256, 24
EPS32 = 2.0 ** -24


def trajectory(steps: int) -> list[tuple[torch.Tensor, AdamState8, torch.Tensor, int]]:
    """(weights, moments, gradient, step) before each of ``steps`` steps of adam_step (the reference)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(ROWS * BLOCK, generator=gen)
    state = init_state(p, 8, BLOCK)
    out = []
    for step in range(1, steps + 1):
        scale = torch.logspace(-6, 0, ROWS * BLOCK)[torch.randperm(ROWS * BLOCK, generator=gen)]
        g = (torch.randn(ROWS * BLOCK, generator=gen) * scale).bfloat16()
        out.append((p.clone(), copy_state(state), g, step))
        adam_step(p, g, state, HP, step)
    return out


def copy_state(s: AdamState8) -> AdamState8:
    return AdamState8(s.exp_avg.clone(), s.exp_avg_absmax.clone(), s.exp_avg_sq.clone(), s.exp_avg_sq_absmax.clone(),
                      s.block)


def fused_step(fn, p: torch.Tensor, s: AdamState8, g: torch.Tensor, step: int) -> torch.Tensor:
    """One step by ``fn`` (adamw8_rows, eager or compiled) in place; returns the bf16 copy it wrote."""
    out = torch.empty(p.shape, dtype=torch.bfloat16)
    rows = [t.view(-1, BLOCK) for t in (p, g, s.exp_avg, s.exp_avg_sq, out)]
    fn(rows[0], rows[1], rows[2], s.exp_avg_absmax, rows[3], s.exp_avg_sq_absmax, rows[4],
       *rows_args((dynamic_code(True), dynamic_code(False))), step_scalars(HP.lr, HP.weight_decay, HP.betas, step,
                                                                          p.device), *HP.betas, HP.eps)
    return out


def assert_one_step_agrees(fn) -> None:
    flips = total = 0
    for p0, s0, g, step in trajectory(6):
        p_ref, s_ref = p0.clone(), copy_state(s0)
        out_ref = torch.empty(p0.shape, dtype=torch.bfloat16)
        adam_step(p_ref, g, s_ref, HP, step, out=out_ref)
        p, s = p0.clone(), copy_state(s0)
        out = fused_step(fn, p, s, g, step)
        update = (p_ref - p0 * (1 - HP.lr * HP.weight_decay)).abs()
        assert bool(((p - p_ref).abs() <= 8 * EPS32 * (p_ref.abs() + update)).all()), f"step {step}"
        assert torch.equal(out, p.bfloat16())
        for signed, q, a, q_ref, a_ref in ((True, s.exp_avg, s.exp_avg_absmax, s_ref.exp_avg, s_ref.exp_avg_absmax),
                                           (False, s.exp_avg_sq, s.exp_avg_sq_absmax, s_ref.exp_avg_sq,
                                            s_ref.exp_avg_sq_absmax)):
            code = dynamic_code(signed)
            assert bool(((a - a_ref).abs() <= 8 * EPS32 * a_ref).all())
            moved = (dequantize_blockwise(q, a, code, BLOCK) - dequantize_blockwise(q_ref, a_ref, code, BLOCK)).abs()
            assert bool((moved <= code.max_gap * a_ref.repeat_interleave(BLOCK) * (1 + 8 * EPS32)).all())
            flips += int((q != q_ref).sum())
            total += q.numel()
    assert flips <= total // 1000, f"{flips} of {total} codes moved"


def test_the_expression_equals_adam_step_eager():
    assert_one_step_agrees(adamw8_rows)


def test_the_expression_compiled_for_the_cpu_equals_adam_step():
    """What ``kernels.fused`` does on a GPU, with the CPU inductor backend (a C++ compiler) instead of Triton."""
    try:
        compiled = torch.compile(adamw8_rows, backend="inductor", dynamic=False)
        assert_one_step_agrees(compiled)
    except torch._dynamo.exc.BackendCompilerFailed as e:  # no working C++ toolchain here
        pytest.skip(f"the CPU inductor backend cannot compile here: {e}")


def test_adam_step_keeps_the_chunk_loop_for_ragged_blocks_and_sources():
    """On the CPU (and for a tensor's last, partial block, or a step from a source) ``adam_step`` runs its
    chunk loop: the fused path only ever takes whole blocks on a GPU."""
    p = torch.randn(3 * BLOCK + 17)
    state = init_state(p, 8, BLOCK)
    adam_step(p, torch.randn(p.numel()), state, HP, 1)
    assert state.exp_avg_absmax.numel() == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_adam_step_on_a_gpu_takes_the_compiled_path_and_agrees_with_the_cpu():
    """``adam_step`` on CUDA runs ``adamw8_rows`` compiled (Triton) for whole blocks and the chunk loop for the
    last partial block; one step from the same state agrees with the CPU's within the bounds above."""
    cuda = torch.device("cuda")
    for p0, s0, g, step in trajectory(4):
        p_ref, s_ref = p0.clone(), copy_state(s0)
        adam_step(p_ref, g, s_ref, HP, step)
        p, s = p0[:-100].to(cuda), AdamState8(*(t.to(cuda) for t in (s0.exp_avg[:-100], s0.exp_avg_absmax,
                                                                        s0.exp_avg_sq[:-100], s0.exp_avg_sq_absmax)),
                                               BLOCK)
        adam_step(p, g[:-100].to(cuda), s, HP, step)  # a partial last block: compiled rows, then the chunk loop
        p_cpu, s_cpu = p0[:-100].clone(), AdamState8(s0.exp_avg[:-100].clone(), s0.exp_avg_absmax.clone(),
                                                     s0.exp_avg_sq[:-100].clone(), s0.exp_avg_sq_absmax.clone(), BLOCK)
        adam_step(p_cpu, g[:-100], s_cpu, HP, step)
        update = (p_cpu - p0[:-100] * (1 - HP.lr * HP.weight_decay)).abs()
        assert bool(((p.cpu() - p_cpu).abs() <= 8 * EPS32 * (p_cpu.abs() + update)).all()), f"step {step}"
        for q, a, q_ref, a_ref, signed in ((s.exp_avg, s.exp_avg_absmax, s_cpu.exp_avg, s_cpu.exp_avg_absmax, True),
                                           (s.exp_avg_sq, s.exp_avg_sq_absmax, s_cpu.exp_avg_sq,
                                            s_cpu.exp_avg_sq_absmax, False)):
            code, n = dynamic_code(signed), q.numel()
            moved = (dequantize_blockwise(q.cpu(), a.cpu(), code, BLOCK)
                     - dequantize_blockwise(q_ref, a_ref, code, BLOCK)).abs()
            assert bool((moved <= code.max_gap * a_ref.repeat_interleave(BLOCK)[:n] * (1 + 8 * EPS32)).all())
            assert int((q.cpu() != q_ref).sum()) <= n // 1000
