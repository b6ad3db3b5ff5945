"""The connector's worker half against a real pool file, with the messenger played
by a stub: bytes go into the pool layer by layer and come back out the same."""

from __future__ import annotations

import pytest
import torch

from shared.kv.meta import YuebingMeta
from shared.kv.options import Options
from shared.kv.plan import Load, Save
from shared.kv.pool_file import PoolFile
from shared.kv.wire import Hello, Release, Reply, Written, pool_path
from shared.kv.worker import ConnectorWorker

BLOCKS = 4  # vLLM blocks per layer


class Messenger:
    """Answers hellos with a pool file of `slots` slots, and keeps the notes."""

    def __init__(self, tmp_path, slots: int = 2, carve_once: bool = False) -> None:
        self.tmp_path, self.slots, self.carve_once = tmp_path, slots, carve_once
        self.pool_id = "p1"
        self.hellos = 0
        self.notes: list[object] = []

    def call(self, message: object) -> Reply:
        assert isinstance(message, Hello)
        self.hellos += 1
        path = pool_path(str(self.tmp_path), "n")
        if self.hellos == 1 or not self.carve_once:  # else: later engines map the pool the first carved
            PoolFile(path, self.slots * message.geometry.slot_bytes, create=True).close()
        return Reply(pool_id=self.pool_id, pool_path=str(path), pool_slots=self.slots)

    def note(self, message: object) -> bool:
        self.notes.append(message)
        return True


def worker(tmp_path) -> tuple[ConnectorWorker, Messenger, dict[str, torch.Tensor]]:
    messenger = Messenger(tmp_path)
    opts = Options(kv_dir=str(tmp_path), node="n", block_size=4, salt=b"s", model="m")
    w = ConnectorWorker(opts, BLOCKS, client=messenger)  # type: ignore[arg-type]
    # CPU attention's layout: (2, blocks, heads, tokens, head size), blocks not first.
    caches = {f"layer.{i}": torch.randn(2, BLOCKS, 2, 4, 8) for i in range(3)}
    w.register_kv_caches(caches)
    return w, messenger, caches


def test_a_saved_block_loads_back_into_another_vllm_block(tmp_path):
    w, messenger, caches = worker(tmp_path)
    assert w.pool is not None and w.pool.slots.geometry.layers == 3
    saving = YuebingMeta(pool_id="p1", saves=[Save(block_id=1, slot=1, block_hash=b"h" * 16)])
    for name in caches:
        w.save_kv_layer(saving, name)
    assert w.copier is not None and w.copier.settle()  # saves land off the forward thread
    notes = [(n.layer, n.slots, n.hashes) for n in messenger.notes if isinstance(n, Written)]
    assert notes == [(layer, [1], [b"h" * 16]) for layer in range(3)]  # each note names the slot's block
    w.start_load_kv(YuebingMeta(pool_id="p1", loads=[Load("r", block_ids=[3], slots=[1])]))
    for name in caches:
        w.wait_for_layer_load(name)
    w.wait_for_save()
    for cache in caches.values():
        assert torch.equal(cache[:, 3], cache[:, 1])
    assert messenger.notes[-1] == Release(owner="r")  # the load's pins go
    assert w.take_load_errors() == set()
    counted = w.counts.take()
    layer_bytes = w.pool.slots.geometry.layer_bytes
    assert counted is not None and {k: counted.data[k] for k in ("saved_blocks", "saved_bytes", "loaded_blocks",
                                                                 "loaded_bytes")} == {
        "saved_blocks": 1, "saved_bytes": 3 * layer_bytes, "loaded_blocks": 1, "loaded_bytes": 3 * layer_bytes}
    assert len(counted.data["load_wait_s"]) == 1 and len(counted.data["save_flush_s"]) == 1  # one step each
    assert w.counts.take() is None  # given once


def test_a_load_with_a_prompts_tail_is_in_before_the_forward_writes_its_first_layer(tmp_path):
    # The step writes its first token's KV into the tail's block before the connector's
    # wait for that layer: every layer must be in when start_load_kv returns.
    w, _, caches = worker(tmp_path)
    saving = YuebingMeta(pool_id="p1", saves=[Save(block_id=1, slot=1, block_hash=b"t" * 16)])
    for name in caches:
        w.save_kv_layer(saving, name)
    assert w.copier is not None and w.copier.settle()
    w.start_load_kv(YuebingMeta(pool_id="p1", loads=[Load("r", block_ids=[3], slots=[1], tail=True)]))
    for cache in caches.values():  # no wait_for_layer_load yet
        assert torch.equal(cache[:, 3], cache[:, 1])
    w.wait_for_save()
    assert w.take_load_errors() == set()


def test_claimed_blocks_that_were_never_pinned_are_reported_failed(tmp_path):
    w, _, _ = worker(tmp_path)
    w.start_load_kv(YuebingMeta(pool_id="p1", failed=[2, 3]))
    w.wait_for_save()
    assert w.take_load_errors() == {2, 3}
    assert w.take_load_errors() == set()  # reported once


def test_a_restarted_messenger_is_mapped_again_and_a_gone_pool_asked_about_once(tmp_path):
    w, messenger, caches = worker(tmp_path)
    messenger.pool_id = "p2"  # the messenger restarted
    w.save_kv_layer(YuebingMeta(pool_id="p2", saves=[Save(1, 0, b"h" * 16)]), "layer.0")
    assert w.copier is not None and w.copier.settle()
    assert messenger.hellos == 2 and isinstance(messenger.notes[-1], Written)  # its new pool, mapped
    notes = len(messenger.notes)
    stale = YuebingMeta(pool_id="p1", saves=[Save(1, 0, b"h" * 16)], loads=[Load("r", [3], [0])])  # a step from before
    for name in caches:
        w.save_kv_layer(stale, name)
    w.start_load_kv(stale)
    assert messenger.hellos == 3  # once, not once per layer
    assert len(messenger.notes) == notes and w.take_load_errors() == {3}
    counted = w.counts.take()
    assert counted is not None and counted.data["failed"]["pool_unavailable"] == 1


@pytest.mark.parametrize("shape", [(BLOCKS, 2, 4, 8), (2, BLOCKS, 4, 8), (BLOCKS * 2, 4, 8)])
def test_any_layout_puts_vllm_blocks_first(shape):
    from shared.kv.worker import blocks_first

    assert blocks_first(torch.zeros(shape), BLOCKS).shape[0] == BLOCKS


def test_pipeline_stages_each_write_their_own_layers_into_one_pool_block(tmp_path):
    """A CPP group: stage 0 holds layers 0-1, stage 1 layers 2-3; each names the
    model's layer numbers, and one stage-less reader gets all four back."""
    messenger = Messenger(tmp_path, carve_once=True)
    opts = Options(kv_dir=str(tmp_path), node="n", block_size=4, salt=b"s", model="m")
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    caches = {name: torch.randn(2, BLOCKS, 2, 4, 8) for name in names}
    stages = [ConnectorWorker(opts, BLOCKS, client=messenger, model_layers=4) for _ in range(2)]  # type: ignore[arg-type]
    stages[0].register_kv_caches({n: caches[n] for n in names[:2]})
    stages[1].register_kv_caches({n: caches[n] for n in names[2:]})
    assert [s.geometry().layers for s in stages] == [4, 4]  # one pool geometry, whichever stage says hello
    saving = YuebingMeta(pool_id="p1", saves=[Save(block_id=1, slot=0, block_hash=b"h" * 16)])
    for stage, stage_names in zip(stages, (names[:2], names[2:])):
        for name in stage_names:
            stage.save_kv_layer(saving, name)
        assert stage.copier is not None and stage.copier.settle()
    assert [n.layer for n in messenger.notes if isinstance(n, Written)] == [0, 1, 2, 3]
    reader = ConnectorWorker(opts, BLOCKS, client=messenger)  # type: ignore[arg-type]
    copies = {name: torch.zeros(2, BLOCKS, 2, 4, 8) for name in names}
    reader.register_kv_caches(copies)
    reader.start_load_kv(YuebingMeta(pool_id="p1", loads=[Load("r", block_ids=[2], slots=[0])]))
    reader.wait_for_save()
    for name in names:
        assert torch.equal(copies[name][:, 2], caches[name][:, 1]), name


def test_a_stage_whose_layer_names_carry_no_number_is_refused(tmp_path):
    opts = Options(kv_dir=str(tmp_path), node="n", block_size=4, salt=b"s", model="m")
    stage = ConnectorWorker(opts, BLOCKS, client=Messenger(tmp_path), model_layers=4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="which of the model's layers"):
        stage.register_kv_caches({"attn": torch.randn(2, BLOCKS, 2, 4, 8)})


def test_tensor_parallel_ranks_each_write_their_share_of_every_layer_into_one_pool_block(tmp_path):
    """Two ranks, each holding half of every layer's KV heads: a pool block has a part
    per (layer, rank), and a reader of the same rank gets its own share back."""
    messenger = Messenger(tmp_path, carve_once=True)
    opts = Options(kv_dir=str(tmp_path), node="n", block_size=4, salt=b"s", model="m")
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    ranks = [ConnectorWorker(opts, BLOCKS, client=messenger, model_layers=2, shards=2, shard=r)  # type: ignore[arg-type]
             for r in range(2)]
    shares = [{name: torch.randn(2, BLOCKS, 2, 4, 8) for name in names} for _ in ranks]
    for rank, caches in zip(ranks, shares):
        rank.register_kv_caches(caches)
    assert [r.geometry().layers for r in ranks] == [4, 4]
    saving = YuebingMeta(pool_id="p1", saves=[Save(block_id=1, slot=0, block_hash=b"h" * 16)])
    for rank in ranks:
        for name in names:
            rank.save_kv_layer(saving, name)
        assert rank.copier is not None and rank.copier.settle()
    assert sorted(n.layer for n in messenger.notes if isinstance(n, Written)) == [0, 1, 2, 3]
    reader = ConnectorWorker(opts, BLOCKS, client=messenger, model_layers=2, shards=2, shard=1)  # type: ignore[arg-type]
    copies = {name: torch.zeros(2, BLOCKS, 2, 4, 8) for name in names}
    reader.register_kv_caches(copies)
    reader.start_load_kv(YuebingMeta(pool_id="p1", loads=[Load("r", block_ids=[2], slots=[0])]))
    reader.wait_for_save()
    for name in names:
        assert torch.equal(copies[name][:, 2], shares[1][name][:, 1]), name


def test_the_connector_asks_vllm_for_piecewise_cuda_graphs_only():
    """Full graphs would replay attention without our layer-wise hooks: a race on GPU."""
    from shared.kv.connector import YuebingConnector

    assert YuebingConnector.requires_piecewise_for_cudagraph({}) is True
