"""Free memory as the cache plan, the server's KV budget and the Q8_0 mirrors see it."""

import torch

from ds4x.memory import free_memory


def test_cuda_free_memory_counts_the_allocators_unused_blocks(monkeypatch) -> None:
    # the driver's free bytes plus what torch's caching allocator reserved and holds unused
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (4 << 30, 140 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 30 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 18 << 30)
    assert free_memory(torch.device("cuda", 0)) == 16 << 30


def test_host_free_memory_is_positive() -> None:
    assert free_memory(torch.device("cpu")) > 0
