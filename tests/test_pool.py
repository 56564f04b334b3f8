"""The pool of gathered buffers freed in a step (fshard/run/_pool.py): a freed buffer's memory moves to the pool
and back into a later gather of its size in the same call, while one is to come (forward's buffers into backward's
re-gathers); with ``reshard_after_forward=False`` backward gathers nothing, so nothing is kept; the results are the
allocator's way's bitwise, and nothing is held between calls. And bucket_reduce's spare scratch
(fshard/transforms/_bucket_reduce.py, ``_Spare``): a landed bucket's scratch serves the later buckets' of the step."""
from __future__ import annotations

import pytest
import torch

from _dist import run_ranks
from fshard.run._pool import _SWAP, BufferPool

STEPS = 3


# (torch before 2.13, the GPU machine's 2.11, has no UntypedStorage._swap_data_ptr_: the pool does not apply there)
needs_swap = pytest.mark.skipif(not _SWAP, reason="torch without UntypedStorage._swap_data_ptr_: no pool")


@needs_swap
def test_freed_memory_moves_to_the_pool_and_back_into_a_refill_of_its_size():
    pool, buf = BufferPool(), torch.arange(1000, dtype=torch.float32)
    view, storage = buf[10:20], buf.untyped_storage()
    ptr = storage.data_ptr()
    pool.free(storage)
    assert storage.nbytes() == 0 and pool.nbytes == 4000 and pool.count(4000) == 1  # the storage object stays, empty
    pool.refill(storage, 4000)  # the same size: the same memory, as it was
    assert storage.data_ptr() == ptr and pool.nbytes == 0 and torch.equal(view, torch.arange(10, 20.0))
    assert pool.reused == 4000 and pool.peak == 4000
    pool.free(storage)
    other = torch.empty(0).untyped_storage()
    pool.refill(other, 800)  # another size: allocated, the pooled memory untouched
    assert other.nbytes() == 800 and pool.nbytes == 4000 and pool.reused == 4000
    pool.clear()
    assert pool.nbytes == 0 and pool.reused == 0 and pool.peak == 0


def _train(keep: bool, pooled: bool):
    import fshard as fs
    from gpt import GPT, GPTConfig, loss_fn, synthetic_batches
    mesh = fs.Mesh.from_env()
    torch.manual_seed(0)
    cfg = GPTConfig.tiny(n_layers=4)
    state = fs.init(GPT(cfg), mesh, fs.adamw(lr=1e-2))
    step = fs.compose(loss_fn, fs.gather_ahead(2, reshard_after_forward=not keep), fs.bucket_reduce(0.01),
                      donate=True)
    calls, made = [], []  # what each call's pool reused and held at most, as the call ends; the pools made
    init, clear = BufferPool.__init__, BufferPool.clear
    if not pooled:  # the allocator's way: each refill allocates, each free gives back
        BufferPool.applies = staticmethod(lambda device: False)

    def made_one(pool):
        init(pool)
        made.append(pool)

    def recorded(pool):
        calls.append((pool.reused, pool.peak))
        clear(pool)
    BufferPool.__init__, BufferPool.clear = made_one, recorded  # (in this rank's process only)
    losses = []
    for batch in synthetic_batches(cfg, 2, STEPS, seed=3, rank=mesh.rank, world_size=mesh.world_size):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
        assert made and all(p.nbytes == 0 for p in made)  # nothing held between calls
    step.eval(state, batch)
    step.close()
    units = {u.name: u.numel * 4 for u in state.spec.units}
    params = {k: v.numpy().tobytes() for k, v in fs.full_params(state).items()}
    return dict(losses=losses, calls=calls, units=units, params=params)


@pytest.mark.parametrize("keep", [False, True], ids=["reshard", "keep"])
def test_a_step_regathers_into_the_memory_forward_freed_and_the_results_are_bitwise_the_allocators(keep):
    pooled, plain = (run_ranks(_train, 2, keep, p) for p in (True, False))
    for r in range(2):
        got, ref = pooled[r], plain[r]
        assert got["losses"] == ref["losses"] and got["params"] == ref["params"]
        assert all(c == (0, 0) for c in ref["calls"])
        steps, (eval_reused, eval_peak) = got["calls"][:STEPS], got["calls"][STEPS]
        block = got["units"]["blocks.0"]
        if keep or not _SWAP:  # forward frees nothing, backward gathers nothing: nothing kept (or no pool)
            assert all(c == (0, 0) for c in steps), steps
        else:  # backward re-gathers blocks 0 and 1 into memory forward freed (gather_ahead(2) keeps the last two
            # from forward to backward), never holding all of them at once
            assert all(reused >= 2 * block and 0 < peak < sum(got["units"].values()) for reused, peak in steps), steps
        assert eval_peak <= sum(got["units"].values())  # (an eval pass: forward only)


def _train_spare(spare: bool):
    import fshard as fs
    from fshard.transforms import _bucket_reduce as br
    from gpt import GPT, GPTConfig, loss_fn, synthetic_batches
    mesh = fs.Mesh.from_env()
    torch.manual_seed(0)
    cfg = GPTConfig.tiny(n_layers=3)
    state = fs.init(GPT(cfg), mesh, fs.adamw(lr=1e-2))
    made, init = [], br._Spare.__init__

    def made_one(self, device):
        init(self, device if spare else torch.device("meta"))  # (no spare: as on CUDA, every buffer new)
        self.device = device
        made.append(self)
    # (in this rank's process only) each bucket lands as the next unit arrives, waiting if need be: whether a
    # flight has completed by then is timing, and the reuse asserted below must not depend on it
    br._Spare.__init__, br.BucketReduce._landable = made_one, lambda self, run, st: st.landed < len(st.flights)
    step = fs.compose(loss_fn, fs.gather_ahead(2), fs.bucket_reduce(1e-6), donate=True)  # a bucket per unit
    reused, losses = [], []
    for batch in synthetic_batches(cfg, 2, STEPS, seed=3, rank=mesh.rank, world_size=mesh.world_size):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
        reused.append(made[-1].reused)
    step.close()
    shard = {u.name: u.shard_numel * 4 for u in state.spec.units}
    params = {k: v.numpy().tobytes() for k, v in fs.full_params(state).items()}
    return dict(losses=losses, reused=reused, shard=shard, params=params, steps=len(made))


def test_a_landed_buckets_scratch_serves_the_next_buckets_and_the_results_are_bitwise_without():
    spared, plain = (run_ranks(_train_spare, 2, s) for s in (True, False))
    for r in range(2):
        got, ref = spared[r], plain[r]
        assert got["losses"] == ref["losses"] and got["params"] == ref["params"]
        assert got["steps"] == STEPS and all(k == 0 for k in ref["reused"])
        # buckets in backward's order: blocks 2, 1, 0, the root. Each block after the first takes the other
        # rank's section and the exchange's receive buffer (a block's shard each) from the block before; the
        # root's (27 KB: shards of 13.5 KB, at least half a block's) from block 0's
        block, root = got["shard"]["blocks.0"], got["shard"]["<root>"]
        assert all(k == 2 * (2 * block) + 2 * root for k in got["reused"]), got["reused"]


def test_the_spare_takes_the_smallest_buffer_that_fits_and_keeps_only_what_a_later_need_may_take():
    from fshard.transforms._bucket_reduce import _Spare
    spare = _Spare(torch.device("cpu"))
    big = [torch.empty(25, dtype=torch.float32) for _ in range(2)]  # 100 bytes each
    small = [torch.empty(30, dtype=torch.uint8) for _ in range(2)]
    spare.give(*big, *small, None, torch.empty(0))  # (nothing of the empty ones is held)
    ptrs = {t.data_ptr() for t in small}
    got = spare.take(15, torch.bfloat16)  # 30 bytes: a small one (the big ones are more than twice the need)
    assert got.dtype == torch.bfloat16 and got.numel() == 15 and got.data_ptr() in ptrs and spare.reused == 30
    again = spare.take(7, torch.float32)  # 28 bytes: the other small one, not the one already taken
    assert again.data_ptr() in ptrs - {got.data_ptr()} and len(spare.held) == 2
    assert spare.take(7, torch.float32).data_ptr() not in {t.data_ptr() for t in big}  # none fits: a new one
    spare.keep_upto(40)  # later needs of at most 40 bytes: the 100-byte buffers would never be taken
    assert spare.held == []
    cuda_like = _Spare(torch.device("meta"))  # (not CPU: nothing is held, every take is new)
    cuda_like.give(torch.empty(4))
    assert cuda_like.held is None and cuda_like.take(4, torch.float32).device.type == "meta"
