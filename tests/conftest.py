import ctypes
import math
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
TOKENIZER_DIR = SHARED_DATA / "gpt2-tokenizer"
SHAKESPEARE = SHARED_DATA / "tinyshakespeare.txt"


def keep_freed_memory_for_reuse() -> None:
    """Keep freed blocks in glibc's heap for the next tensor, in the suite's processes (Linux; elsewhere nothing).

    The tests train on the CPU, where glibc serves each block above its mmap threshold (32 MiB at most, 1 MiB once
    a task in this process has called ``core.machine.return_freed_memory_to_the_os``) with fresh pages, zeroed by
    the kernel one by one, and unmaps it when freed: a tiny model's logits and their gradient ([256, 50304] fp32)
    took as much system time as computing (the 8-bit moments test: 24 s, 10 s without). Memory is measured in
    processes of their own (``test_*_rss.py``), which this does not reach."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    libc.mallopt(M_MMAP_MAX, 0)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)


keep_freed_memory_for_reuse()


@pytest.fixture(autouse=True)
def _single_thread_determinism():
    torch.manual_seed(0)
    yield


@pytest.fixture
def offline_files():
    """Skip a test that runs a task on the real tokenizer files and corpus when ../shared/data lacks them."""
    if not (TOKENIZER_DIR.is_dir() and SHAKESPEARE.exists()):
        pytest.skip("needs ../shared/data (tokenizer files and tinyshakespeare)")


@pytest.fixture
def tokenizer():
    if not TOKENIZER_DIR.is_dir():
        pytest.skip(f"tokenizer files not found at {TOKENIZER_DIR}")
    from nanotrain.tokenizer import get_tokenizer
    return get_tokenizer(str(TOKENIZER_DIR))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||: one number per tensor, robust to individual near-zero entries."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


U32 = torch.finfo(torch.float32).eps / 2  # 2^-24: fp32's unit roundoff


def chain_rtol(lengths: Iterable[int], runs: int = 2, dtype: torch.dtype = torch.float32) -> float:
    """How far (norm-wise, relative) ``runs`` evaluations of one result may sit apart when all that differs is
    the order of their sums (kernels, threads, shards, ranks), the result coming out of a chain of reductions of
    these lengths: a reduction of n terms rounds to about sqrt(n) u in norm (errors of either sign), the chain
    adds them (each stage passes its input's relative error on at most unchanged), and each run is that far
    from the exact result. The house's bound for every fp32 path that reorders sums; a lost or doubled term is
    1e-2 and more."""
    return runs * torch.finfo(dtype).eps / 2 * sum(math.sqrt(n) for n in lengths)


def model_chain(model: Any, seq: int, tokens: int = 0, what: str = "grads") -> list[int]:
    """The reductions a model's ``what`` comes out of, for ``chain_rtol``: "logits" (every block's forward, the
    final norm, the head), "loss" (and the log-sum-exp, the mean over ``tokens``) or "grads", any gradient
    element (the loss's forward, the head's and every block's backward, the sum over the ``tokens`` of the
    global batch, whichever ranks hold them). ``model``: a config, or a spec (an adapted one's LoRA pairs add
    their rank-r contraction to each block, forward and backward, after the projection's own)."""
    from nanotrain.core.models.lora import rank

    cfg = getattr(model, "cfg", model)
    d, mlp = cfg.n_embd, getattr(cfg, "intermediate_size", 4 * cfg.n_embd)
    hd = getattr(cfg, "head_dim", None) or d // cfg.n_head
    pairs = [rank(model)] if getattr(model, "adapters", ()) else []
    # norm, q/k/v, scores, softmax, scores x values, output, norm, MLP in, MLP out
    block = [d, d, hd, seq, seq, d, d, d, mlp] + pairs
    # the same contractions transposed: MLP out and in, norm, output, values, scores, softmax, q/k, q/k/v, norm
    block_back = [d, mlp, d, d, seq, hd, seq, seq, 3 * d, d] + pairs
    logits = block * cfg.n_layer + [d, d]
    if what == "logits":
        return logits
    if what == "loss":
        return logits + [cfg.vocab_size, tokens]
    assert what == "grads", what
    return logits + [cfg.vocab_size, cfg.vocab_size, d] + block_back * cfg.n_layer + [tokens]


def assert_same_logits(got: torch.Tensor, want: torch.Tensor, cfg: Any) -> None:
    """Two fp32 forwards of one model's weights (another implementation, or the weights read back from a file) on
    [batch, seq] tokens: within ``chain_rtol`` of the forward's reductions, norm-wise."""
    err, bound = rel_err(got, want), chain_rtol(model_chain(cfg, got.shape[-2], what="logits"))
    assert err <= bound, f"logits {err:.2e} apart (bound {bound:.2e})"


def adam_rho(t: int, betas: tuple[float, float]) -> float:
    """The most |m-hat| / sqrt(v-hat) can be at step t (1 at the first): Adam's step is at most rho lr."""
    b1, b2 = betas
    a = [(1 - b1) * b1 ** (t - k) / (1 - b1 ** t) for k in range(1, t + 1)]
    b = [(1 - b2) * b2 ** (t - k) / (1 - b2 ** t) for k in range(1, t + 1)]
    return math.sqrt(sum(x * x / y for x, y in zip(a, b)))


def adam_apart(ref_grads: list[torch.Tensor], errs: list[torch.Tensor | float], w0: torch.Tensor,
               hp: Any) -> list[torch.Tensor]:
    """Per element, how far two fp32 AdamW runs (``hp``: lr, betas, eps) from the same weights ``w0`` may end
    apart when one applied ``ref_grads[t]`` at step t and the other a gradient within ``errs[t]`` of it. With
    e >= that distance at every step so far, m-hat moves by at most e and sqrt(v-hat) by at most e (a weighted
    RMS is 1-Lipschitz), and |m-hat| <= rho sqrt(v-hat) (``adam_rho``), so the update m-hat / (sqrt(v-hat) + eps)
    moves by at most (1 + rho) e / (sqrt(v-hat) - e + eps), and never more than 2 rho (a sign flip where |g| is
    near eps): times lr, summed over the steps (decoupled decay only shrinks a difference). Each run's own
    rounding adds 3 u |w| (the decay, its product, the add) and 8 u of its update (at most rho lr) a step,
    the moments' roundings carried. One bound after each step."""
    lr, eps, b2 = hp.lr, hp.eps, hp.betas[1]
    w0, v = w0.double(), torch.zeros_like(w0, dtype=torch.float64)
    apart, e, out = torch.zeros_like(v), torch.zeros_like(v), []
    for t, (ref, err) in enumerate(zip(ref_grads, errs, strict=True), 1):
        ref = ref.double()
        e = torch.maximum(e, torch.as_tensor(err, dtype=torch.float64))
        v = b2 * v + (1 - b2) * ref * ref
        s = (v / (1 - b2 ** t)).sqrt()
        rho = adam_rho(t, hp.betas)
        moved = torch.minimum((1 + rho) * e / ((s - e).clamp_min(0) + eps), torch.full_like(s, 2 * rho))
        apart = apart + lr * moved + 2 * U32 * (3 * (w0.abs() + lr * t * rho) + 8 * t * rho * lr)
        out.append(apart)
    return out


def adam_cap(w: torch.Tensor, steps: int, hp: Any) -> torch.Tensor:
    """Per element, the most two AdamW runs (``hp``) from the same weights and moments may end apart after ``steps``
    steps, whatever gradients each applied (runs that record neither side's): ``adam_apart`` with no bound on the
    gradients' distance, each step's update at most rho lr (``adam_rho``) a side in opposite directions, and each
    run's rounding. ``w``: the weights at the start, or any bound on their size throughout."""
    return adam_apart([torch.zeros_like(w)] * steps, [math.inf] * steps, w, hp)[-1]


# The claim, not a rounding bound: a moment's code moves only where it lies within its fp32 distance between the runs
# (relative r) of a code midpoint, whose neighbours are at least 0.9 / 128 = 0.7% of the value apart (the finest
# cell: the unsigned code's top decade, core/optim/quant8.py), so ~2 r / 0.7% of them a step, as the values fall in
# their cells: where they fall no count of roundings gives. With r ~1e-6 (elements' measured distance) that is
# 3e-4 a moment and step, 0.2% over 3 steps' two moments; 1% claims code moves stay that rare (measured <= 0.1%), a
# leaf quantized in other blocks moves most (test_parallel3d_dp's tp 2)
CODE_SHARE = 0.01


def assert_codes_moved(w: torch.Tensor, want: torch.Tensor, apart: torch.Tensor, cap: torch.Tensor, what: str) -> None:
    """Two runs with 8-bit moments quantized in the same blocks: each element of weights ``w`` within ``apart`` of
    ``want`` (``adam_apart``: the fp32 bound of the gradients each applied) but where a gradient's rounding moved a
    moment across a code boundary, which changes that element's update by up to lr times the code's step and which
    no fp32 bound covers: at most ``CODE_SHARE`` of the leaf, and those within ``cap`` (``adam_cap``: Adam's
    largest steps, in opposite directions)."""
    shift = (w.double() - want.double()).abs().reshape(-1)
    over = shift / apart.reshape(-1)
    assert (over > 1).double().mean() <= CODE_SHARE and (shift <= cap.reshape(-1)).all(), \
        f"{what}: {int((over > 1).sum())} of {over.numel()} codes moved, {over.max():.2f} times the fp32 bound, " \
        f"{(shift / cap.reshape(-1)).max():.2f} times Adam's cap"


def assert_export_and_cap(export: Path, ckpt: Path, ref_ckpt: Path, cfg: Any, steps: int, hp: Any) -> None:
    """A task run's fp32 export (``tasks.consolidate``) of its checkpoint ``ckpt``: the masters, bit for bit (a copy
    through the name table); and those within ``adam_cap`` of another run's ``ref_ckpt`` after as many ``steps`` of
    AdamW (``hp``, its peak lr) from the same weights (task runs record neither side's gradients). The size bound for
    the rounding: twice the reference's final weights plus 2 lr a step (decay shrinks a weight by lr wd a step)."""
    from nanotrain.checkpoint.resume import load_masters
    from nanotrain.core.tree import get_path
    from weights import load_weights

    exported, masters, ref = load_weights(cfg, str(export)), load_masters(ckpt), load_masters(ref_ckpt)
    assert sorted(masters) == sorted(ref), sorted(set(masters) ^ set(ref))
    for path, want in ref.items():
        assert torch.equal(get_path(exported, path), masters[path]), f"{path}: the export is not the checkpoint's"
        bound = adam_cap(2 * want.abs() + 2 * hp.lr * steps, steps, hp)
        over = ((masters[path] - want).abs() / bound).max()
        assert over <= 1, f"{path}: {over:.2f} times the most {steps} AdamW steps move a weight"


def adam_moments_apart(grads: list[torch.Tensor], ref_grads: list[torch.Tensor],
                       betas: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per element, how far two fp32 AdamW runs' moments (as kept, not bias-corrected) may end apart when one
    applied ``grads[t]`` at step t and the other ``ref_grads[t]``: m = b1 m + (1 - b1) g moves by (1 - b1) |g - r| a
    step and v = b2 v + (1 - b2) g^2 by (1 - b2) |g^2 - r^2|, older differences decaying by b1 and b2; each run's own
    rounding adds 3 u of the terms it sums (two products, the add: of the terms, as they may cancel in m) and 4 u
    of its v after the step (the square too; v's terms never cancel), either run's, a step."""
    b1, b2 = betas
    m = v = dm = dv = torch.zeros_like(ref_grads[0], dtype=torch.float64)
    for g, r in zip(grads, ref_grads, strict=True):
        g, r = g.double(), r.double()
        terms = b1 * (m.abs() + dm) + (1 - b1) * r.abs().maximum(g.abs())  # either run's, at most
        v_after = b2 * (v + dv) + (1 - b2) * (r * r).maximum(g * g)  # either run's v after this step, at most
        m, v = b1 * m + (1 - b1) * r, b2 * v + (1 - b2) * r * r
        dm = b1 * dm + (1 - b1) * (g - r).abs() + 2 * 3 * U32 * terms
        dv = b2 * dv + (1 - b2) * (g * g - r * r).abs() + 2 * 4 * U32 * v_after
    return dm, dv


def adam_over(w: torch.Tensor, want: torch.Tensor, w0: torch.Tensor, grads: list[torch.Tensor],
              ref_grads: list[torch.Tensor], hp: Any) -> torch.Tensor:
    """Each element of weights ``w`` after AdamW (``hp``) from ``w0`` on ``grads``, apart from ``want`` (the same
    from ``ref_grads``) in units of ``adam_apart``: at most 1 where they agree."""
    flat = [(g.double() - r.double()).abs().reshape(-1) for g, r in zip(grads, ref_grads, strict=True)]
    bound = adam_apart([r.reshape(-1) for r in ref_grads], flat, w0.reshape(-1), hp)[-1]
    return (w.double() - want.double()).abs().reshape(-1) / bound


def adam_bounds(w0: dict[str, torch.Tensor], grads: list[dict], ref_grads: list[dict],
                hp: Any) -> tuple[dict[str, list[torch.Tensor]], list[float]]:
    """For two AdamW runs from weights ``w0`` (by path) that applied ``grads[t]`` and ``ref_grads[t]`` at step t:
    per leaf, ``adam_apart`` after each step (flat), and how far that may move the loss taken before each step's
    update: to first order the reference's gradient at that step times the distance, summed over the leaves
    (the second order, under a flip's (2 lr)^2 an element, neglected)."""
    aparts, moved = {}, [0.0] * len(ref_grads)
    for path, start in w0.items():
        ref = [g[path].reshape(-1).double() for g in ref_grads]
        errs = [(g[path].reshape(-1).double() - r).abs() for g, r in zip(grads, ref, strict=True)]
        aparts[path] = adam_apart(ref, errs, start.reshape(-1), hp)
        for s in range(1, len(ref)):
            moved[s] += float((ref[s].abs() * aparts[path][s - 1]).sum())
    return aparts, moved


def moved_by(ref_grads: dict[str, torch.Tensor], weights: dict[str, torch.Tensor],
             ref_weights: dict[str, torch.Tensor]) -> float:
    """How far two runs' weights (by path), measured apart, move a loss whose gradient at the reference's weights
    is ``ref_grads``: to first order, |g| times the distance summed over the elements. For runs whose distance no
    fp32 bound gives (8-bit moments, where a rounding may move a moment by a code): the loss follows the weights."""
    return sum(float((g.double().abs().reshape(-1) * (weights[p].double() - ref_weights[p].double()).abs()
                      .reshape(-1)).sum()) for p, g in ref_grads.items())


def unclipped_apart(grads: list[dict], ref_grads: list[dict], norms: list[float], ref_norms: list[float],
                    max_norm: float) -> list[float]:
    """Each step's distance (float64, over every leaf) of two runs' gradients by path before clipping: those each
    applied over the factor each took from its norm (u each: the factor's own rounding in the division)."""
    from nanotrain.core.train.clip import clip_factor

    out = []
    for g, rg, n, rn in zip(grads, ref_grads, norms, ref_norms, strict=True):
        assert g.keys() == rg.keys(), sorted(g.keys() ^ rg.keys())
        f, rf = (float(clip_factor(torch.tensor(v), max_norm)) for v in (n, rn))
        out.append(math.sqrt(sum(float((g[p].double() / f - rg[p].double() / rf).square().sum()) for p in rg)))
    return out


def assert_norms(norms: list[float], ref_norms: list[float], apart: list[float], grad_rtol: float,
                 sizes: list[int], ranks: int = 1) -> None:
    """Each step's fp32 global gradient norm against the reference's, given ``apart``: each step's distance of the
    unclipped gradients the two applied (``unclipped_apart``; a leaf counted more than once only widens it). At the
    first step both come from the same weights: that distance within ``grad_rtol`` (the chain's, per leaf, so of
    the whole in quadrature) and the factors' 2 u. At every step the norms differ by at most that distance
    (|‖a‖ - ‖b‖| <= ‖a - b‖) plus each side's rounding of its norm: the squares summed over the largest of the
    leaves (``sizes``), over the leaves, over ``ranks``, the square root."""
    rounding = chain_rtol([max(sizes), len(sizes), ranks, 1])
    for s, (n, rn, d) in enumerate(zip(norms, ref_norms, apart, strict=True)):
        assert s or d <= (grad_rtol + 2 * U32) * rn, f"first gradients {d / rn:.2e} apart (bound {grad_rtol:.2e})"
        assert abs(n - rn) <= rounding * rn + d, f"step {s}: norm {n} != {rn} (gradients {d:.2e} apart)"


def kill_self(sig: int = signal.SIGKILL) -> None:
    """Die as ``kill -9`` or the OOM killer kills: no exception, no report, no exit handlers. With
    ``signal.SIGSTOP``, hang instead: the peers' gloo waits then get no error, as under NCCL they get none
    when a rank is killed, and only the failure watch's heartbeat can tell."""
    os.kill(os.getpid(), sig)


def assert_killed_rank_named(fn: Callable, world: int, killed: int, args: tuple = (), within_s: float = 60,
                             grace_s: float | None = None) -> float:
    """Run ``fn(*args)`` on ``world`` forked ranks, of which ``killed`` kills (or stops) itself: every other rank
    must exit by itself with code 1 (its failure watch or guard, not the spawner's kill) within ``within_s``,
    and its output must name the killed rank. ``grace_s``: how long the spawner waits for the others once one
    has exited (all of it when a rank is stopped, not dead). Returns the seconds the run took."""
    from nanotrain.distributed import SpawnError, spawn

    start = time.monotonic()
    with pytest.raises(SpawnError) as info:
        spawn(fn, world, args, timeout_s=2 * within_s, start_method="fork", grace_s=grace_s or within_s)
    elapsed = time.monotonic() - start
    codes = info.value.exit_codes
    assert codes[killed] == -signal.SIGKILL, info.value  # by itself, or by the spawner once it had stopped
    assert [c for r, c in enumerate(codes) if r != killed] == [1] * (world - 1), info.value  # none killed by spawn
    assert elapsed < within_s, f"took {elapsed:.0f} s to stop"
    logs = info.value.logs.split("--- rank ")[1:]
    for rank, log in enumerate(logs):
        if rank != killed:
            assert f"rank {killed} stopped responding" in log, f"rank {rank} does not name rank {killed}:\n{log}"
    return elapsed
