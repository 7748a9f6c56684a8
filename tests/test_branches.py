import pytest
import torch

from ds4x.kernels import branches
from ds4x.kernels.branches import Branch, concurrently


def test_outside_a_capture_the_pieces_run_in_order() -> None:
    order: list[str] = []

    def piece(name: str) -> str:
        order.append(name)
        return name.upper()

    assert concurrently(torch.device("cpu"), lambda: piece("a"), lambda: piece("b"), lambda: piece("c")) == [
        "A", "B", "C"]
    assert order == ["a", "b", "c"]


@pytest.mark.gpu
@pytest.mark.parametrize("enabled", [True, False])
def test_captured_branches_replay_with_the_values_of_the_eager_pieces(monkeypatch, enabled: bool) -> None:
    """Branches (nested too) fork from the capturing stream and join back: each replay sees the inputs written
    before it, and the join orders the branches' outputs before the kernels that read them."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setattr(branches, "ENABLED", enabled)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(512, 512, device=dev, generator=g)
    w = [torch.randn(512, 512, device=dev, generator=g) for _ in range(3)]

    def step() -> torch.Tensor:
        early = Branch(dev, lambda: (x @ w[1]).tanh())  # joined late, and first by another branch

        def left() -> torch.Tensor:
            h = x @ w[0]
            a, b = concurrently(dev, lambda: h @ w[1], lambda: (h * 2) @ w[2])
            return a + b * early.join()

        left_out, right_out = concurrently(dev, left, lambda: (x @ w[2]).relu())
        return left_out - right_out + early.join()

    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        x.copy_(torch.randn(512, 512, device=dev, generator=g))
        graph.replay()
        torch.testing.assert_close(out, step())  # cuBLAS may pick another algorithm in a capture
