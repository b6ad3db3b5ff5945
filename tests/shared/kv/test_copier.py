"""The copy machinery on its own (no vLLM, no messenger): saves land in their pool
slots off the caller's thread, with the checksums the messenger checks; loads come
back layer by layer; a failing copy is reported, never waited on forever. The GPU
copier runs only where CUDA answers."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from shared.kv.copier import (
    Lane,
    LayerLoad,
    LayerSave,
    MappedPool,
    StreamCopier,
    ThreadCopier,
    blocks_first,
    copier_for,
    geometry_of,
    runs,
)
from shared.kv.pool_file import PoolFile, PoolSlots, checksum

BLOCKS, LAYERS, SLOTS = 4, 3, 4


def pool(tmp_path, caches: list[torch.Tensor]) -> MappedPool:
    geometry = geometry_of(caches)
    return MappedPool.of("p", PoolSlots(PoolFile(tmp_path / "n.pool", SLOTS * geometry.slot_bytes, create=True), geometry))


def caches(device: str = "cpu") -> list[torch.Tensor]:
    # FlashAttention's layout, (K/V, blocks, tokens, heads, head size): blocks not first.
    return [blocks_first(torch.randn(2, BLOCKS, 4, 2, 8, device=device), BLOCKS) for _ in range(LAYERS)]


def save_all(copier, mapped: MappedPool, layer_caches, block_ids, slots) -> dict[int, list[int]]:
    noted: dict[int, list[int]] = {}
    for layer, cache in enumerate(layer_caches):
        copier.save(mapped, cache, LayerSave(layer, block_ids, slots), lambda sums, layer=layer: noted.update({layer: sums}))
    assert copier.settle()
    return noted


@pytest.fixture(params=["cpu", "cuda:dma", "cuda:blocks"])
def device(request) -> str:
    """The device, and on a GPU how copies cross (the copy engine by runs of slots, or a copy per block)."""
    if request.param.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return request.param


@pytest.fixture
def pool_dir(tmp_path, device):
    """Where the pool file lives: shared memory, as the messenger's (CUDA can pin that)."""
    if not device.startswith("cuda"):
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(prefix="yuebing-test-", dir="/dev/shm") as folder:
        yield Path(folder)


def copier_on(device: str):
    kind, _, path = device.partition(":")
    return copier_for(torch.device(kind), saves=path or "blocks", loads=path or "dma")


def test_saves_land_in_their_slots_with_the_checksums_of_those_bytes(pool_dir, device):
    layer_caches, copier = caches(device.partition(":")[0]), copier_on(device)
    mapped = pool(pool_dir, layer_caches)
    copier.adopt(mapped)  # pins it on a GPU
    assert not isinstance(copier, StreamCopier) or copier.path(mapped, copier.saves_by) == device.partition(":")[2]
    noted = save_all(copier, mapped, layer_caches, block_ids=[2, 0], slots=[1, 3])
    assert sorted(noted) == list(range(LAYERS))
    for layer, cache in enumerate(layer_caches):
        for block, slot, layer_sum in zip([2, 0], [1, 3], noted[layer]):
            part = mapped.layer(slot, layer, cache.dtype).view(cache[block].shape)
            assert torch.equal(part, cache[block].cpu())  # K then V, contiguous
            assert layer_sum == checksum(mapped.slots.layer(slot, layer))
    copier.close()
    mapped.close()


def test_loads_fill_other_blocks_layer_by_layer_and_release_once(pool_dir, device):
    layer_caches, copier = caches(device.partition(":")[0]), copier_on(device)
    mapped = pool(pool_dir, layer_caches)
    copier.adopt(mapped)
    save_all(copier, mapped, layer_caches, block_ids=[1, 2], slots=[0, 2])
    released = threading.Event()
    job = copier.load(mapped, layer_caches, list(range(LAYERS)), LayerLoad([3, 0], [0, 2]), released.set)
    assert all(copier.wait_layer(job, index) for index in range(LAYERS))
    assert copier.settle() and released.wait(5)
    for cache in layer_caches:
        assert torch.equal(cache[3], cache[1]) and torch.equal(cache[0], cache[2])
    copier.close()
    mapped.close()  # unpins: a pool left pinned and unmapped makes CUDA refuse the next one at that address


def test_a_load_from_a_slot_past_the_pool_fails_every_layer_without_a_hang(tmp_path):
    layer_caches, copier = caches(), ThreadCopier()
    mapped = pool(tmp_path, layer_caches)
    job = copier.load(mapped, layer_caches, list(range(LAYERS)), LayerLoad([0], [SLOTS + 5]), lambda: None)
    assert not any(copier.wait_layer(job, index) for index in range(LAYERS))
    assert job.failed
    copier.close()


def test_flush_returns_once_the_step_saves_have_read_their_blocks(tmp_path):
    """The next step may overwrite a freed block: what a save copies is what the block
    held when the layer was handed over."""
    layer_caches, copier = caches(), ThreadCopier()
    mapped = pool(tmp_path, layer_caches)
    before = layer_caches[0][1].clone()
    copier.save(mapped, layer_caches[0], LayerSave(0, [1], [0]), lambda sums: None)
    assert copier.flush()
    layer_caches[0][1].zero_()  # the next step reuses the block
    assert copier.settle()
    assert torch.equal(mapped.layer(0, 0, before.dtype).view(before.shape), before)
    copier.close()


def test_the_device_chooses_the_copier():
    assert isinstance(copier_for(torch.device("cpu")), ThreadCopier)
    if torch.cuda.is_available():
        assert isinstance(copier_for(torch.device("cuda")), StreamCopier)


def test_a_lane_runs_in_order_survives_a_failure_and_drains_with_a_deadline():
    lane, seen = Lane("test-lane"), []
    lane.submit(lambda: seen.append(1))
    lane.submit(lambda: 1 / 0)  # logged; the lane goes on
    lane.submit(lambda: seen.append(2))
    assert lane.drain(5) and seen == [1, 2]
    gate = threading.Event()
    lane.submit(gate.wait)
    started = time.monotonic()
    assert not lane.drain(0.1) and time.monotonic() - started < 2
    gate.set()
    assert lane.drain(5)
    lane.close()


def test_large_layers_are_summed_on_the_thread_pool_with_the_same_checksums(tmp_path, monkeypatch):
    layer_caches, copier = caches(), ThreadCopier(checksum_threads=2)
    mapped = pool(tmp_path, layer_caches)
    alone = save_all(copier, mapped, layer_caches, block_ids=[0, 1, 2], slots=[0, 1, 2])
    monkeypatch.setattr("shared.kv.copier.PARALLEL_SUM_BYTES", 1)  # three slots over two threads
    assert save_all(copier, mapped, layer_caches, block_ids=[0, 1, 2], slots=[0, 1, 2]) == alone
    copier.close()


def test_runs_of_consecutive_slots_each_go_as_one_transfer():
    assert runs([4, 5, 6, 9, 2, 3]) == [(0, 4, 3), (3, 9, 1), (4, 2, 2)]
    assert runs([7]) == [(0, 7, 1)] and runs([]) == []
    assert runs([3, 2]) == [(0, 3, 1), (1, 2, 1)]  # only upwards: the staged blocks keep their order


def test_gpu_copies_refuse_slots_outside_the_pool(pool_dir, device):
    if not device.startswith("cuda"):
        pytest.skip("the copy thread's bounds are torch's own (test above)")
    layer_caches, copier = caches("cuda"), copier_on(device)
    mapped = pool(pool_dir, layer_caches)
    copier.adopt(mapped)
    copier.save(mapped, layer_caches[0], LayerSave(0, [0], [SLOTS]), lambda sums: pytest.fail("noted"))
    released = threading.Event()
    job = copier.load(mapped, layer_caches, list(range(LAYERS)), LayerLoad([0], [-1]), released.set)
    assert job.failed and released.wait(5) and copier.settle()
    copier.close()
    mapped.close()


def test_a_pool_cuda_refuses_to_pin_leaves_no_error_behind(pool_dir, device):
    """A failed cudaHostRegister (here: the same bytes twice) must not fail the next kernel."""
    if not device.startswith("cuda"):
        pytest.skip("pinning is CUDA's")
    mapped = pool(pool_dir, caches("cuda"))
    mapped.pin()
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        mapped.pin()
    assert (torch.ones(4, device="cuda") * 2).sum().item() == 8
    mapped.close()
