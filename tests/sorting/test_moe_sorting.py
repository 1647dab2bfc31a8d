"""moe_sorting: exact contract, invariants against the reference, zeroing, expert_map, bad input."""
import importlib

import pytest
import torch
import triton

from fmoe2 import moe_sorting, moe_sorting_reference
from fmoe2.sorting import MoESortingResult, launch_moe_sorting, max_num_tokens_padded
from fmoe2.sorting.moe_sorting import MAX_SCAN_BLOCK, sort_chunk_size, sort_programs
from helpers import DEVICE

BUFFERS = ("sorted_token_ids", "sorted_weights", "sorted_expert_ids", "num_tokens_post_padded", "num_sorted_tiles")


@pytest.fixture(params=["one_launch", "chunked"])
def sort_mode(request, monkeypatch):
    """Runs a test with each sort: the one launch, and the two-launch chunked sort in chunks of an
    eighth of the entries rounded up to a power of two (at least 16: several chunks, the last one
    mostly partial) whatever ``sort_chunk_size`` would pick, its programs reading the count table
    in blocks of 64 counts (several blocks, as on a GPU at large batches)."""
    if request.param == "chunked":
        module = importlib.import_module("fmoe2.sorting.moe_sorting")
        monkeypatch.setattr(module, "sort_chunk_size",
                            lambda num_keys, num_entries: max(16, triton.next_power_of_2(num_entries) // 8))
        monkeypatch.setattr(module, "MAX_COUNT_TILE", 64)
    return request.param


def check_sorting(topk_ids, topk_weights, E, block_m, expert_map=None):
    """Runs the kernel and checks every invariant of the contract; returns the result."""
    M, topk = topk_ids.shape
    res = moe_sorting(topk_ids, topk_weights, E, block_m, expert_map=expert_map)
    expected, total = moe_sorting_reference(topk_ids, topk_weights, E, block_m, expert_map=expert_map)
    ids, w = res.sorted_token_ids.cpu(), res.sorted_weights.cpu()
    tiles = res.sorted_expert_ids.cpu()
    length = max_num_tokens_padded(M * topk, E, block_m)
    assert ids.numel() == length == w.numel() and tiles.numel() == length // block_m
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and tiles.dtype == torch.int32
    assert res.num_tokens_post_padded.item() == total
    assert res.num_sorted_tiles.item() == total // block_m
    num_tiles = total // block_m
    # Tiles: experts in increasing order, only experts with tokens, the right number of tiles each;
    # the others are gap tiles (-1).
    used = tiles[:num_tiles].tolist()
    busy = [t for t in used if t >= 0]
    assert busy == sorted(busy) and all(-1 <= t < E for t in used)
    for e in range(E):
        assert busy.count(e) == -(-len(expected[e]) // block_m), f"expert {e}"
    assert total <= length
    # Per tile: real entries first, then padding (id M, weight 0); per expert: exact multiset, sorted.
    got = {e: [] for e in range(E)}
    for t in range(num_tiles):
        row_ids = ids[t * block_m:(t + 1) * block_m].tolist()
        row_w = w[t * block_m:(t + 1) * block_m].tolist()
        for tok, wt in zip(row_ids, row_w):
            if tok == M:
                assert wt == 0.0
            else:
                assert 0 <= tok < M and used[t] >= 0, f"tile {t}: entry in a gap tile"
                got[used[t]].append((tok, wt))
    for e in range(E):
        assert [tok for tok, _ in got[e]] == sorted(tok for tok, _ in got[e]), f"expert {e} not in token order"
        assert sorted(got[e]) == sorted(expected[e]), f"expert {e}: entries differ"
    # Tail past the used region: padding ids, zero weights, tiles -1.
    assert (ids[total:] == M).all() and (w[total:] == 0).all() and (tiles[num_tiles:] == -1).all()
    return res


def test_worked_example_from_docs(sort_mode):
    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [2, 2]], dtype=torch.int32, device=DEVICE)
    w = torch.tensor([[.6, .4], [.7, .3], [.5, .5], [.9, .1]], device=DEVICE)
    res = moe_sorting(ids, w, 4, 4)
    assert res.sorted_token_ids.tolist() == [0, 2, 4, 4, 4, 4, 4, 4, 0, 1, 2, 3, 3, 4, 4, 4, 1, 4, 4, 4, 4, 4, 4, 4]
    assert res.sorted_expert_ids.tolist() == [0, -1, 2, 2, 3, -1]
    assert torch.allclose(res.sorted_weights.cpu(), torch.tensor(
        [.4, .5, 0, 0, 0, 0, 0, 0, .6, .7, .5, .9, .1, 0, 0, 0, .3, 0, 0, 0, 0, 0, 0, 0]))
    assert res.num_tokens_post_padded.item() == 24 and res.num_sorted_tiles.item() == 6


@pytest.mark.parametrize("M,topk,E,block_m,id_dtype", [
    (1, 1, 1, 16, torch.int32),
    (1, 8, 8, 16, torch.int64),
    (3, 2, 5, 16, torch.int32),
    (97, 3, 7, 32, torch.int64),
    (300, 8, 129, 16, torch.int32),
    (1000, 2, 3, 64, torch.int32),
    (5000, 1, 16, 128, torch.int32),
])
def test_random_routing(M, topk, E, block_m, id_dtype, sort_mode):
    if sort_mode == "chunked" and M * topk > 3000:
        pytest.skip("20 s under the interpreter (its tl.sort reduces element by element); the GPU tests sort "
                    "up to 524288 entries in chunks")
    gen = torch.Generator().manual_seed(M * 31 + E)
    ids = torch.stack([torch.randperm(E, generator=gen)[:topk] for _ in range(M)]) if topk <= E else \
        torch.randint(0, E, (M, topk), generator=gen)
    w = torch.rand(M, topk, generator=gen)
    check_sorting(ids.to(DEVICE, id_dtype), w.to(DEVICE), E, block_m)


def test_all_tokens_on_one_expert_and_empty_experts(sort_mode):
    M, topk, E = 200, 2, 9
    ids = torch.full((M, topk), 4, dtype=torch.int32)
    ids[:, 1] = 7
    w = torch.rand(M, topk)
    res = check_sorting(ids.to(DEVICE), w.to(DEVICE), E, 16)
    assert set(res.sorted_expert_ids[:res.num_sorted_tiles.item()].tolist()) - {-1} == {4, 7}


def test_worst_case_routing_fills_the_buffers(sort_mode):
    # Every expert gets exactly block_m entries: each is followed by a gap tile, and the layout
    # uses all max_busy_tiles tiles of the worst-case buffers.
    M, topk, E, block_m = 32, 2, 4, 16
    ids = torch.arange(M * topk, dtype=torch.int32).reshape(M, topk) % E
    res = check_sorting(ids.to(DEVICE), torch.rand(M, topk).to(DEVICE), E, block_m)
    assert res.num_tokens_post_padded.item() == res.sorted_token_ids.numel() == max_num_tokens_padded(M * topk, E, block_m)
    assert res.sorted_expert_ids.tolist() == [0, -1, 1, -1, 2, -1, 3, -1]


@pytest.mark.parametrize("num_parts,M", [(2, 47), (3, 47), (4, 27), (6, 10)])
def test_experts_split_over_several_programs(num_parts, M, monkeypatch):
    # 16-entry scan blocks give 9 steps (M=47), 6 (M=27) or 2 (M=10), shared unevenly by the parts:
    # with 4 parts over 6 steps the last has none, with 6 over 2 steps four have none (and count
    # the masked tail step in full). The result is bit-identical.
    monkeypatch.setattr(importlib.import_module("fmoe2.sorting.moe_sorting"), "MAX_SCAN_BLOCK", 16)
    topk, E, block_m = 3, 6, 16
    gen = torch.Generator().manual_seed(num_parts)
    ids = torch.stack([torch.randperm(E, generator=gen)[:topk] for _ in range(M)]).int().to(DEVICE)
    w = torch.rand(M, topk, generator=gen).to(DEVICE)
    expected = check_sorting(ids, w, E, block_m)
    got = MoESortingResult.allocate(M * topk, E, block_m, M, ids.device)
    out = torch.full((M, 5), float("nan"), device=DEVICE)
    launch_moe_sorting(ids, w, E, None, got, out, num_parts=num_parts)
    for name in ("sorted_token_ids", "sorted_weights", "sorted_expert_ids", "num_tokens_post_padded",
                 "num_sorted_tiles"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    assert (out == 0).all()


@pytest.mark.parametrize("num_parts", [2, 3])
def test_adapter_keyed_sort_split_over_several_programs(num_parts, monkeypatch):
    # The baseline's LoRA alignment (keys adapter * E + expert, tokens without an adapter dropped)
    # takes the same split as the plain sort: bit-identical to one program per key.
    monkeypatch.setattr(importlib.import_module("fmoe2.sorting.moe_sorting"), "MAX_SCAN_BLOCK", 16)
    M, topk, E, block_m, num_loras = 37, 2, 5, 16, 3
    gen = torch.Generator().manual_seed(num_parts)
    ids = torch.stack([torch.randperm(E, generator=gen)[:topk] for _ in range(M)]).int().to(DEVICE)
    w = torch.rand(M, topk, generator=gen).to(DEVICE)
    lora_ids = torch.randint(-1, num_loras, (M,), generator=gen, dtype=torch.int32).to(DEVICE)
    results = []
    for parts in (1, num_parts):
        res = MoESortingResult.allocate(M * topk, E * num_loras, block_m, M, ids.device)
        launch_moe_sorting(ids, w, E, None, res, None, expanded_ids=True, token_lora_ids=lora_ids,
                           num_loras=num_loras, lora_keys=True, num_parts=parts)
        results.append(res)
    for name in ("sorted_token_ids", "sorted_weights", "sorted_expert_ids", "num_tokens_post_padded",
                 "num_sorted_tiles"):
        assert torch.equal(getattr(results[0], name), getattr(results[1], name)), name
    check_adapter_keys(results[0], ids, lora_ids, E, num_loras)


def check_adapter_keys(res, ids, lora_ids, E, num_loras):
    """Every kept entry (expert in [0, E), adapter in [0, num_loras)) sits, once and in entry order,
    in a tile of its key adapter * E + expert; nothing else is kept."""
    M, topk = ids.shape
    block_m = res.block_m
    total = int(res.num_tokens_post_padded.item())
    rows = res.sorted_token_ids[:total].long().cpu()
    keys = res.sorted_expert_ids.repeat_interleave(block_m)[:total].long().cpu()
    real = rows < M * topk
    token, slot = rows[real] // topk, rows[real] % topk
    ids, lora_ids = ids.cpu().long(), lora_ids.cpu().long()
    assert torch.equal(keys[real], lora_ids[token] * E + ids[token, slot])
    kept = ((ids >= 0) & (ids < E) & ((lora_ids >= 0) & (lora_ids < num_loras))[:, None]).flatten()
    assert sorted(rows[real].tolist()) == torch.nonzero(kept).flatten().tolist()


def test_adapter_keyed_sort_drops_bad_experts_and_adapters(monkeypatch):
    # Experts outside [0, E) must not alias another adapter's key, nor adapter ids outside
    # [0, num_loras) (one whose adapter * E overflows int32 into a valid key included).
    monkeypatch.setattr(importlib.import_module("fmoe2.sorting.moe_sorting"), "MAX_SCAN_BLOCK", 16)
    M, topk, E, block_m, num_loras = 30, 2, 5, 16, 3
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, E, (M, topk), generator=gen, dtype=torch.int32)
    ids[torch.randperm(M, generator=gen)[:6], 1] = torch.tensor([-1, E, E + 3, -E, 2 * E, 2**31 - 1],
                                                                  dtype=torch.int32)
    lora_ids = torch.randint(0, num_loras, (M,), generator=gen, dtype=torch.int32)
    lora_ids[torch.randperm(M, generator=gen)[:6]] = torch.tensor([num_loras, -3, 5, -1, -7, 858993460],
                                                                    dtype=torch.int32)
    ids, lora_ids = ids.to(DEVICE), lora_ids.to(DEVICE)
    res = MoESortingResult.allocate(M * topk, E * num_loras, block_m, M, ids.device)
    launch_moe_sorting(ids, torch.rand(M, topk, generator=gen).to(DEVICE), E, None, res, None, expanded_ids=True,
                       token_lora_ids=lora_ids, num_loras=num_loras, lora_keys=True)
    check_adapter_keys(res, ids, lora_ids, E, num_loras)


@pytest.mark.parametrize("num_parts,with_out", [(1, False), (2, True)])
def test_counts_tokens_with_an_adapter(num_parts, with_out, monkeypatch):
    # fmoe2 with adapters: the sort also counts the tokens whose adapter id is in [0, num_loras)
    # (16-entry scan blocks: the count loops over several steps), into a garbage-filled buffer, and
    # leaves the sorted layout and the zeroing as they are without the count.
    monkeypatch.setattr(importlib.import_module("fmoe2.sorting.moe_sorting"), "MAX_SCAN_BLOCK", 16)
    M, topk, E, block_m, num_loras = 41, 2, 5, 16, 3
    gen = torch.Generator().manual_seed(7)
    ids = torch.stack([torch.randperm(E, generator=gen)[:topk] for _ in range(M)]).int().to(DEVICE)
    w = torch.rand(M, topk, generator=gen).to(DEVICE)
    expected = check_sorting(ids, w, E, block_m)
    res = MoESortingResult.allocate(M * topk, E, block_m, M, DEVICE, count_lora_tokens=True)
    for lora_ids in (torch.randint(-2, num_loras + 2, (M,), generator=gen, dtype=torch.int32),  # out of range: none
                     torch.full((M,), -1, dtype=torch.int32), torch.full((M,), num_loras - 1, dtype=torch.int32)):
        res.num_lora_tokens.fill_(12345)
        out = torch.full((M, 3), float("nan"), device=DEVICE) if with_out else None
        launch_moe_sorting(ids, w, E, None, res, out, token_lora_ids=lora_ids.to(DEVICE), num_loras=num_loras,
                           num_parts=num_parts)
        assert res.num_lora_tokens.item() == ((lora_ids >= 0) & (lora_ids < num_loras)).sum().item()
        for name in ("sorted_token_ids", "sorted_weights", "sorted_expert_ids", "num_tokens_post_padded",
                     "num_sorted_tiles"):
            assert torch.equal(getattr(res, name), getattr(expected, name)), name
        assert out is None or (out == 0).all()
    with pytest.raises(ValueError, match="token_lora_ids goes with"):
        launch_moe_sorting(ids, w, E, None, res, None)  # a count to write, no ids to count
    with pytest.raises(ValueError, match="token_lora_ids goes with"):  # ids that nothing would read
        launch_moe_sorting(ids, w, E, None, expected, None, token_lora_ids=lora_ids.to(DEVICE), num_loras=num_loras)


def test_sort_programs_rule():
    full = 2 * MAX_SCAN_BLOCK  # two full scan steps
    assert sort_programs(66, full, 132) == (2, 8)
    assert sort_programs(67, full, 132) == (2, 4)  # 2 programs per expert overflow the multiprocessors
    assert sort_programs(128, full, 304) == (2, 8)  # MI300X: 304 compute units
    assert sort_programs(66, MAX_SCAN_BLOCK, 132) == (1, 8)  # one scan step: nothing to share
    assert sort_programs(132, MAX_SCAN_BLOCK, 132) == (1, 8)
    assert sort_programs(8, MAX_SCAN_BLOCK // 2, 132) == (1, 4)  # a short scan: 4 warps


def test_reused_buffers_hold_no_stale_data(sort_mode):
    # CUDA-graph replays reuse the result buffers: a second launch with other routing must rewrite
    # every element (garbage-filled buffers, then all tokens on one expert, then uniform routing).
    M, topk, E, block_m = 18, 2, 8, 4
    gen = torch.Generator().manual_seed(11)
    res = MoESortingResult.allocate(M * topk, E, block_m, M, DEVICE)
    res.sorted_token_ids.fill_(777), res.sorted_weights.fill_(9.0), res.sorted_expert_ids.fill_(55)
    skewed = torch.full((M, topk), 7, dtype=torch.int32)
    skewed[:, 1] = torch.arange(M) % 3
    uniform = torch.stack([torch.randperm(E, generator=gen)[:topk] for _ in range(M)]).int()
    for ids in (skewed, uniform):
        ids, w = ids.to(DEVICE), torch.rand(M, topk, generator=gen).to(DEVICE)
        launch_moe_sorting(ids, w, E, None, res, None)
        fresh = check_sorting(ids, w, E, block_m)
        for name in ("sorted_token_ids", "sorted_weights", "sorted_expert_ids", "num_sorted_tiles"):
            assert torch.equal(getattr(res, name), getattr(fresh, name)), name


def test_large_expert_count(sort_mode):
    M, topk, E = 64, 8, 512
    ids = torch.randint(0, E, (M, topk), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    check_sorting(ids.to(DEVICE), torch.rand(M, topk).to(DEVICE), E, 16)



def test_many_scan_steps_and_tail_blocks(monkeypatch):
    # 16-entry blocks: both scans take many steps and the tail fill loops over many blocks.
    monkeypatch.setattr(importlib.import_module("fmoe2.sorting.moe_sorting"), "MAX_SCAN_BLOCK", 16)
    M, topk, E = 45, 3, 12
    ids = torch.randint(0, E, (M, topk), generator=torch.Generator().manual_seed(5), dtype=torch.int32)
    check_sorting(ids.to(DEVICE), torch.rand(M, topk).to(DEVICE), E, 16)


def test_expert_map_drops_other_ranks(sort_mode):
    M, topk, E_global = 50, 4, 12
    gen = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(E_global, generator=gen)[:topk] for _ in range(M)]).int()
    # This rank holds global experts 3, 4, 9 and 11 as local 0..3.
    expert_map = torch.full((E_global,), -1, dtype=torch.int32)
    expert_map[torch.tensor([3, 4, 9, 11])] = torch.arange(4, dtype=torch.int32)
    res = check_sorting(ids.to(DEVICE), torch.rand(M, topk).to(DEVICE), 4, 16, expert_map=expert_map.to(DEVICE))
    local_entries = sum(int(expert_map[i] >= 0) for i in ids.flatten())
    assert (res.sorted_token_ids[:res.num_tokens_post_padded.item()] < M).sum().item() == local_entries


def test_negative_ids_are_dropped():
    ids = torch.tensor([[0, -1], [-1, 1]], dtype=torch.int32, device=DEVICE)
    res = check_sorting(ids, torch.rand(2, 2, device=DEVICE), 2, 16)
    assert res.num_tokens_post_padded.item() == 32


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("with_map", [False, True])
def test_ids_outside_the_experts_are_dropped(id_dtype, with_map, monkeypatch):
    # The kernel compares ids as unsigned keys with no separate range mask: ids past E, negative
    # ones, the int32 extremes and (int64) values that narrow to a valid id must all be dropped,
    # in full (unmasked) scan steps and in the masked tail step alike (16-entry steps: 48 entries
    # are 3 full steps, 50 add a partial one).
    monkeypatch.setattr(importlib.import_module("fmoe2.sorting.moe_sorting"), "MAX_SCAN_BLOCK", 16)
    E = 5
    bad = [-1, -7, E, E + 9, 2**31 - 1, -2**31] + ([2**32 + 1, -2**32 + 2, 2**40] if id_dtype == torch.int64 else [])
    gen = torch.Generator().manual_seed(len(bad) + with_map)
    expert_map = None
    if with_map:  # 8 global experts; global 6 and 7 live elsewhere, global 2 maps out of range
        expert_map = torch.tensor([0, 1, 100, 2, 3, 4, -1, -1], dtype=torch.int32, device=DEVICE)
    num_ids = 8 if with_map else E
    for num_entries in (48, 50):
        ids = torch.randint(0, num_ids, (num_entries,), generator=gen, dtype=torch.int64)
        ids[torch.randperm(num_entries, generator=gen)[:len(bad)]] = torch.tensor(bad)
        ids = ids.reshape(-1, 2).to(DEVICE, id_dtype)
        check_sorting(ids, torch.rand(ids.shape, generator=gen).to(DEVICE), E, 4, expert_map=expert_map)


def test_out_overlapping_routing_is_refused():
    ids = torch.zeros(4, 2, dtype=torch.int32, device=DEVICE)
    w = torch.rand(4, 2, device=DEVICE)
    with pytest.raises(ValueError, match="out overlaps topk_weights"):
        moe_sorting(ids, w, 4, 16, out=w)


@pytest.mark.parametrize("dtype,max_zero_programs", [(torch.float16, 64), (torch.float32, 64), (torch.float16, 3)])
def test_zeroes_out_in_the_same_launch(dtype, max_zero_programs, monkeypatch):
    # 3 zeroing programs for 19 blocks: each loops over several
    monkeypatch.setattr(importlib.import_module("fmoe2.sorting.moe_sorting"), "MAX_ZERO_PROGRAMS", max_zero_programs)
    out = torch.full((37, 4133), float("nan"), dtype=dtype, device=DEVICE)  # > one zeroing block, odd size
    ids = torch.randint(0, 4, (37, 2), dtype=torch.int32, device=DEVICE)
    weights = torch.rand(37, 2, device=DEVICE)
    res = moe_sorting(ids, weights, 4, 16, out=out)
    assert (out == 0).all()
    expected = check_sorting(ids, weights, 4, 16)  # the zeroing programs leave the sort unchanged
    assert torch.equal(res.sorted_token_ids, expected.sorted_token_ids)
    assert torch.equal(res.sorted_weights, expected.sorted_weights)
    assert torch.equal(res.sorted_expert_ids, expected.sorted_expert_ids)


@pytest.mark.parametrize("call,exc,match", [
    (lambda i, w: moe_sorting(i.float(), w, 4, 16), TypeError, "topk_ids must have dtype"),
    (lambda i, w: moe_sorting(i[0], w, 4, 16), ValueError, r"topk_ids must be \[M, topk\]"),
    (lambda i, w: moe_sorting(i, w[:, :1], 4, 16), ValueError, "topk_weights must have shape"),
    (lambda i, w: moe_sorting(i, w.int(), 4, 16), TypeError, "topk_weights must have dtype"),
    (lambda i, w: moe_sorting(i, w, 0, 16), ValueError, "num_experts must be >= 1"),
    (lambda i, w: moe_sorting(i, w, 4, 24), ValueError, "block_m must be a power of two"),
    (lambda i, w: moe_sorting(i, w, 4, 16, expert_map=torch.zeros(4, dtype=torch.int64, device=DEVICE)),
     TypeError, "expert_map must have dtype"),
    (lambda i, w: moe_sorting(i.t(), w.t(), 4, 16), ValueError, "must be contiguous"),
])
def test_bad_input_is_refused_before_launch(call, exc, match):
    ids = torch.zeros(5, 2, dtype=torch.int32, device=DEVICE)
    w = torch.rand(5, 2, device=DEVICE)
    with pytest.raises(exc, match=match):
        call(ids, w)


def _routing(M, topk, E, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:topk] for _ in range(M)]).int()
    return ids, torch.rand(M, topk, generator=gen), gen


@pytest.mark.parametrize("M,topk,E,block_m,chunk_size,id_dtype", [
    (1, 1, 1, 16, 16, torch.int32),  # one partial chunk
    (9, 3, 5, 16, 16, torch.int64),
    (37, 3, 7, 32, 16, torch.int32),  # 111 entries: 7 chunks, the last with 15
    (64, 2, 9, 16, 32, torch.int64),  # chunks end where the entries do
    (50, 4, 130, 16, 64, torch.int32),  # more keys than a chunk has entries: table rows longer than a chunk
])
def test_chunked_sort_equals_the_one_launch_sort(M, topk, E, block_m, chunk_size, id_dtype, monkeypatch):
    # Bit for bit, with the zeroing; the first launch's table holds each chunk's counts per expert. The
    # programs read the table 2 rows at a time (at most 32 counts per load): several loads per program.
    monkeypatch.setattr(importlib.import_module("fmoe2.sorting.moe_sorting"), "MAX_COUNT_TILE", 32)
    ids, w, _ = _routing(M, topk, E, M + E)
    ids_d, w_d = ids.to(DEVICE, id_dtype), w.to(DEVICE)
    one = MoESortingResult.allocate(M * topk, E, block_m, M, DEVICE, chunk_size=0)
    launch_moe_sorting(ids_d, w_d, E, None, one, None)
    chunked = MoESortingResult.allocate(M * topk, E, block_m, M, DEVICE, chunk_size=chunk_size)
    for name in BUFFERS + ("chunk_key_counts",):
        getattr(chunked, name).fill_(-5)
    out = torch.full((M, 7), float("nan"), device=DEVICE)
    launch_moe_sorting(ids_d, w_d, E, None, chunked, out)
    for name in BUFFERS:
        assert torch.equal(getattr(chunked, name), getattr(one, name)), name
    assert (out == 0).all()
    num_chunks = -(-M * topk // chunk_size)
    table = chunked.chunk_key_counts.cpu()
    assert table.shape == (num_chunks, max(triton.next_power_of_2(E), 16))
    flat = ids.flatten().long()
    for c in range(num_chunks):
        counts = torch.bincount(flat[c * chunk_size:(c + 1) * chunk_size], minlength=table.shape[1])
        assert torch.equal(table[c], counts.int()), c


def test_chunked_sort_drops_like_the_one_launch_sort():
    # expert_map, ids outside [0, E), vLLM's expanded ids, the adapter-keyed baseline sort, and the count of
    # tokens with an adapter: every option of the one-launch sort gives the same buffers in chunks.
    M, topk, E_global, block_m = 41, 4, 11, 16
    ids, w, gen = _routing(M, topk, E_global, 3)
    ids[5, 2], ids[17, 0], ids[30, 3] = -1, E_global + 4, 2**31 - 1
    expert_map = torch.full((E_global,), -1, dtype=torch.int32)
    expert_map[torch.tensor([0, 3, 4, 8, 10])] = torch.arange(5, dtype=torch.int32)
    lora_ids = torch.randint(-1, 3, (M,), generator=gen, dtype=torch.int32).to(DEVICE)
    ids, w, expert_map = ids.to(DEVICE), w.to(DEVICE), expert_map.to(DEVICE)
    cases = {
        "expert_map": (5, dict(expert_map=expert_map), {}),
        "expanded_ids": (E_global, dict(expert_map=None, expanded_ids=True), {}),
        "adapter_keys": (3 * E_global, dict(expert_map=None, expanded_ids=True, token_lora_ids=lora_ids, num_loras=3,
                                             lora_keys=True), {}),
        "lora_count": (E_global, dict(expert_map=None, token_lora_ids=lora_ids, num_loras=3),
                       dict(count_lora_tokens=True)),
    }
    for case, (num_keys, launch_args, alloc_args) in cases.items():
        E = 5 if case == "expert_map" else E_global
        results = []
        for chunk_size in (0, 16):
            res = MoESortingResult.allocate(M * topk, num_keys, block_m, M, DEVICE, chunk_size=chunk_size,
                                            **alloc_args)
            if res.num_lora_tokens is not None:
                res.num_lora_tokens.fill_(-1)
            options = {k: v for k, v in launch_args.items() if k != "expert_map"}
            launch_moe_sorting(ids, w, E, launch_args["expert_map"], res, None, **options)
            results.append(res)
        names = BUFFERS + (("num_lora_tokens",) if case == "lora_count" else ())
        for name in names:
            assert torch.equal(getattr(results[0], name), getattr(results[1], name)), (case, name)
    kept = (expert_map[ids.clamp(0, E_global - 1).long()] >= 0) & (ids >= 0) & (ids < E_global)
    assert 0 < kept.sum() < M * topk  # the map drops entries and keeps others


def test_sort_chunk_size_rule():
    # One launch up to 2**19 key-entry pairs or below 64 keys; else the smallest chunks of 256, 512 or
    # 1024 entries whose count table stays within 8192 counts (sort_settings sweep, misc/bench/sort).
    assert sort_chunk_size(128, 512 * 8) == 0  # Qwen3-30B-A3B M=512: exactly 2**19
    assert sort_chunk_size(128, 513 * 8) == 256
    assert sort_chunk_size(128, 2048 * 8) == 256  # 64 chunks x 128 keys = 8192 counts
    assert sort_chunk_size(128, 4096 * 8) == 512
    assert sort_chunk_size(128, 8192 * 8) == 1024
    assert sort_chunk_size(64, 1024 * 6) == 0  # DeepSeek-V2-Lite M=1024: tied with the chunks
    assert sort_chunk_size(64, 4096 * 6) == 256
    assert sort_chunk_size(64, 8192 * 6) == 512
    assert sort_chunk_size(384, 1024 * 8) == 512  # 512-key table rows
    assert sort_chunk_size(256, 4096 * 8) == 1024
    assert sort_chunk_size(384, 65536 * 8) == 1024  # past 8192 counts at every size: the largest chunks
    assert sort_chunk_size(8, 65536 * 2) == 0  # Mixtral: bound by zeroing its output either way
    assert sort_chunk_size(63, 10 ** 6) == 0


def test_chunked_sort_arguments():
    with pytest.raises(ValueError, match="chunk_size must be 0 or a power of two"):
        MoESortingResult.allocate(100, 4, 16, 50, DEVICE, chunk_size=48)
    ids, w, _ = _routing(10, 2, 4, 0)
    res = MoESortingResult.allocate(20, 4, 16, 10, DEVICE, chunk_size=16)
    with pytest.raises(ValueError, match="the chunked sort .* has one program per expert"):
        launch_moe_sorting(ids.to(DEVICE), w.to(DEVICE), 4, None, res, None, num_parts=2)
