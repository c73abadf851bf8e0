from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
TOKENIZER_DIR = SHARED_DATA / "gpt2-tokenizer"
SHAKESPEARE = SHARED_DATA / "tinyshakespeare.txt"


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
