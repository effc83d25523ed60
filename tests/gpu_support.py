"""What the GPU test files share: torch with CUDA, or the test is skipped."""
import pytest


def cuda_torch():
    """The torch module where it sees a CUDA device; otherwise the calling test is skipped."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch
