"""The pieces of an NVSHMEM team's device-exchange backward (flashdmoe/backward/ep_backward.py) that run without a
team: the order in which an owner takes its received rows, the backward's signal words, and the expert
half of the backward on rows packed by expert against float64 autograd. The collective itself runs in
tests/test_ep_multiprocess.py (2 and 4 processes under MPS on the GPU)."""

from __future__ import annotations

import pytest
import torch

from flashdmoe import numerics, reference
from flashdmoe.backward import ep_backward
from flashdmoe.backward.ep_backward import (OwnerLayout, forward_count_words, host_owner_layout, owner_layout,
                                            sent_runs, unsupported)
from flashdmoe.backward.expert_backward import packed_row_grads
from flashdmoe.parallel.team import BufferPlan, RankBuffers, Team

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_owner_layout_takes_each_expert_from_every_source_in_rank_order():
    # 3 sources, 2 local experts; stream_rows 5: source q's rows for expert 0, then expert 1, in its stream
    counts = torch.tensor([[2, 1], [0, 3], [1, 0]])
    layout = owner_layout(counts, 5)
    assert layout.offs.dtype == torch.int32 and layout.offs.tolist() == [3, 7]
    assert layout.received.dtype == torch.int32 and layout.received.tolist() == [0, 1, 10, 2, 5, 6, 7]
    assert layout.place.dtype == torch.int32
    assert layout.place.tolist() == [[0, 1], [2, 4], [2, 6]]
    assert layout.from_rows.dtype == torch.int32 and layout.from_rows.tolist() == [3, 3, 1]


def _walk(counts, S):
    """The packed order row by row: (staging row, source, stream row) of each packed row."""
    P, L = counts.shape
    rows = []
    for local in range(L):
        for source in range(P):
            start = int(counts[source, :local].sum())
            rows += [(source * S + r, source, r) for r in range(start, start + int(counts[source, local]))]
    return rows


@pytest.mark.parametrize("draw", range(5))
def test_owner_layout_matches_a_row_by_row_walk(seed, draw):
    generator = torch.Generator().manual_seed(seed + draw)
    P, L, S = 4, 3, 9
    counts = torch.randint(0, 4, (P, L), generator=generator)
    layout = owner_layout(counts, S)
    walk = _walk(counts, S)
    assert layout.received.tolist() == [staged for staged, _, _ in walk]
    assert layout.offs.tolist() == torch.cumsum(counts.sum(dim=0), 0).tolist()
    # a source that writes its stream row r of local expert l to place[q, l] + r lands on the walk's row
    for packed, (_, source, r) in enumerate(walk):
        local = int((torch.cumsum(counts[source], 0) <= r).sum())
        assert int(layout.place[source, local]) + r == packed, (packed, source, r)


def test_owner_layout_stays_inside_each_stream_whatever_the_counts_say():
    # a failed forward may leave any value in the count words
    counts = torch.tensor([[7, 9], [-3, 2]])
    layout = owner_layout(counts, 5)
    index = layout.received
    assert all(0 <= int(i) < 10 for i in index)
    for source in range(2):
        mine = [int(i) for i in index if int(i) // 5 == source]
        assert len(mine) == len(set(mine)) and len(mine) <= 5
    assert int(layout.offs[-1]) == index.numel() == int(layout.from_rows.sum())
    assert torch.equal(layout.offs, owner_layout(counts, 5, rows=10).offs)


@pytest.mark.parametrize("draw", range(4))
def test_sent_runs_give_each_owner_expert_run_its_stage_rows(seed, draw):
    """A source's rows to an NVSHMEM owner are staged at sent[0][owner * L] + stream row; run (owner, l) must
    be exactly the stage rows of that expert's kept choices, its stream rows numbered as the forward does
    (per owner by local expert, kept choices only)."""
    generator = torch.Generator().manual_seed(seed + draw)
    P, L, T, k = 3, 2, 11, 2
    expert = torch.stack([torch.randperm(P * L, generator=generator)[:k] for _ in range(T)]).to(torch.int32)
    kept = torch.rand(T, k, generator=generator) < 0.8
    row = torch.full((T, k), -1, dtype=torch.int32)
    for owner in range(P):  # the forward's stream rows to each owner: local expert 0's kept choices first
        next_row = 0
        for local in range(L):
            for t, j in ((t, j) for t in range(T) for j in range(k)):
                if kept[t, j] and int(expert[t, j]) == owner * L + local:
                    row[t, j] = next_row
                    next_row += 1
    start, count = sent_runs(expert, row, P, L)
    assert start.dtype == count.dtype == torch.int32
    for owner in range(P):
        for local in range(L):
            e = owner * L + local
            staged = sorted(int(start[owner * L]) + int(r) for r in row[(expert == e) & kept])
            first = int(start[e])
            assert staged == list(range(first, first + int(count[e]))), (owner, local)
    assert int(count.sum()) == int(kept.sum()) and int(start[-1] + count[-1]) == int(kept.sum())


def test_sent_runs_of_no_tokens():
    start, count = sent_runs(torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, 2, dtype=torch.int32), 2, 3)
    assert start.tolist() == count.tolist() == [0] * 6


@pytest.mark.parametrize("P, T, k, L, H", [(2, 96, 2, 4, 128), (8, 1000, 8, 2, 2048), (4, 1, 1, 32, 64)])
def test_stage_holds_every_kept_choice_and_every_weight_gradient(P, T, k, L, H):
    plan = BufferPlan(P, max_tokens=T, hidden=H, top_k=k, local_experts=L, dtype=torch.float16)
    assert plan.stage_rows == T * k  # a batch's kept choices, whatever the routing
    need = 2 * plan.stage_rows * H * 2 + 4 * (plan.stage_rows + P * plan.stream_rows)  # EpStage's layout
    assert need <= plan.stage_bytes < need + 16 and plan.stage_bytes % 16 == 0


def _fake_nvshmem_team(transports):
    P = len(transports)
    plan = BufferPlan(P, max_tokens=4, hidden=64, top_k=2, local_experts=2, dtype=torch.bfloat16)
    own = RankBuffers(recv=torch.zeros(plan.data_bytes, dtype=torch.uint8),
                      comb=torch.zeros(plan.data_bytes, dtype=torch.uint8),
                      signals=torch.zeros(plan.signal_words, dtype=torch.int32),
                      stage=torch.zeros(plan.stage_bytes, dtype=torch.uint8))
    own.mapped_recv = [1000 + q if kind == "p2p" else None for q, kind in enumerate(transports)]
    own.mapped_comb = [2000 + q if kind == "p2p" else None for q, kind in enumerate(transports)]
    own.mapped_signals = [3000 + q if kind == "p2p" else None for q, kind in enumerate(transports)]
    team = Team("nvshmem", 0, P, plan, [own], None)
    team.peer_transports = list(transports)
    return team, own


def test_exchange_table_marks_put_peers_with_own_signal_words():
    team, own = _fake_nvshmem_team(["p2p", "nvshmem", "p2p"])
    table = ep_backward._exchange_peers(team)
    mine = (own.recv.data_ptr(), own.comb.data_ptr(), own.signals.data_ptr())
    assert table["peer_signals"] == [3000, mine[2], 3002]  # the kernel's mark: a peer entry holding own words
    assert table["peer_recv"] == [1000, mine[0], 1002] and table["peer_comb"] == [2000, mine[1], 2002]
    assert table["stage"] == own.stage.data_ptr() and table["stage_rows"] == team.plan.stage_rows
    all_p2p, _ = _fake_nvshmem_team(["p2p", "p2p"])
    assert "stage" not in ep_backward._exchange_peers(all_p2p)  # stores only: no staging
    assert team.buffer_bytes == team.plan.bytes_per_rank + team.plan.stage_bytes


def test_a_put_peer_needs_the_nvshmem_build_and_a_stage():
    team, own = _fake_nvshmem_team(["p2p", "nvshmem"])
    from flashdmoe.kernel import extension

    cuda_x = type("FakeX", (), {"device": torch.device("cuda", 0), "dtype": torch.bfloat16})()
    if extension.kernel_build() != "nvshmem":
        assert "NVSHMEM puts, which the 'main' kernel build cannot do" in unsupported(team, cuda_x)
    own.stage = None
    team.peer_transports = ["p2p", "nvshmem"]
    reason = unsupported(team, cuda_x)
    assert "ranks [1]" in reason


def test_owner_layout_of_nothing():
    layout = owner_layout(torch.zeros(2, 3, dtype=torch.int32), 4)
    assert layout.received.numel() == 0 and layout.offs.tolist() == [0, 0, 0]
    assert owner_layout(torch.zeros(2, 3, dtype=torch.int32), 4, rows=8).received.tolist() == [-1] * 8


@pytest.mark.parametrize("draw", range(6))
def test_the_host_layout_is_the_device_layout(seed, draw):
    """An eager backward lays out its rows from host counts in numpy (host_owner_layout), a captured one by
    torch ops on the device (owner_layout): the same tables, counts out of range included."""
    generator = torch.Generator().manual_seed(seed + draw)
    P, L, S = 1 + draw % 4, 1 + draw, 7
    counts = torch.randint(-2, 6, (P, L), generator=generator, dtype=torch.int32)
    host, per_expert = host_owner_layout(counts, S)
    device = owner_layout(counts, S)
    for name in OwnerLayout._fields:
        got, want = getattr(host, name), getattr(device, name)
        assert got.dtype == want.dtype == torch.int32 and torch.equal(got, want), name
    assert per_expert == torch.diff(device.offs, prepend=torch.zeros(1, dtype=torch.int32)).tolist()


@pytest.mark.parametrize("draw", range(4))
def test_owner_layout_over_a_bound_is_the_exact_table_then_nothing(seed, draw):
    """A captured backward sizes the table for the team's bound (P * stream_rows rows, the counts unread):
    the rows received first, exactly as the eager table, then -1 (the exchange sends nothing for them)."""
    generator = torch.Generator().manual_seed(seed + draw)
    P, L, S = 3, 4, 10
    counts = torch.stack([torch.multinomial(torch.ones(L), L, generator=generator) for _ in range(P)])
    counts = torch.minimum(counts, torch.full_like(counts, 3)).to(torch.int32)  # at most 12 rows per source
    counts[:, -1] = 0
    exact, bound = owner_layout(counts, S), owner_layout(counts, S, rows=P * S)
    n = exact.received.numel()
    assert bound.received.shape == (P * S,) and torch.equal(bound.received[:n], exact.received)
    assert (bound.received[n:] == -1).all()
    for a, b in ((exact.offs, bound.offs), (exact.place, bound.place), (exact.from_rows, bound.from_rows)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("P, L, S", [(1, 1, 1), (2, 4, 7), (8, 32, 100)])
def test_backward_words_follow_the_forward_words_without_overlap(P, L, S):
    plan = BufferPlan(P, max_tokens=S, hidden=64, top_k=1, local_experts=L, dtype=torch.bfloat16)
    assert plan.stream_rows == S
    words = []
    for direction in (0, 1, 2):
        for peer in range(P):
            words += [plan.backward_word("free", direction, peer), plan.backward_word("ready", direction, peer)]
    words += [plan.backward_word("abort", i, 0) for i in range(3)] + [plan.backward_word("sequence", 0, 0)]
    words += [plan.backward_word("place", q, local) for q in range(P) for local in range(L)]
    words += [plan.backward_word("row_word", q, row) for q in range(P) for row in range(S)]
    assert len(set(words)) == len(words) == plan.backward_words
    assert min(words) == plan.forward_signal_words == P * L + 5 * P
    assert max(words) == plan.signal_words - 1
    with pytest.raises(ValueError, match="what="):
        plan.backward_word("flags", 0, 0)


def test_the_device_exchange_is_for_nvshmem_and_emulated_teams_only():
    assert "NVSHMEM and emulated teams" in unsupported(Team.single(), torch.zeros(1, 8))


def test_the_emulated_exchange_takes_16_bit_cuda_tensors():
    class Emulated:  # what unsupported() reads of a team
        transport = "emulated"

    assert "bfloat16 / float16 on CUDA" in unsupported(Emulated(), torch.zeros(1, 8, dtype=torch.bfloat16))


@requires_gpu
@pytest.mark.gpu
def test_backward_words_agree_with_the_kernel():
    from flashdmoe.kernel import extension

    ext = extension.load()
    for P, L, S in [(1, 1, 1), (2, 4, 7), (8, 32, 100)]:
        plan = BufferPlan(P, max_tokens=S, hidden=64, top_k=1, local_experts=L, dtype=torch.bfloat16)
        assert ext.ep_signal_words(P, L, S) == plan.signal_words
        for what, a, b in [("free", 1, P - 1), ("ready", 0, P - 1), ("free", 2, 0), ("ready", 2, P - 1),
                           ("abort", 2, 0), ("sequence", 0, 0), ("place", P - 1, L - 1), ("row_word", P - 1, S - 1)]:
            assert ext.ep_signal_offset(what, P, L, S, a, b) == plan.backward_word(what, a, b), (what, P, L, S)
        kernel_stage = ext.ep_stage_bytes(P, S, plan.stage_rows, plan.hidden * plan.element_bytes)
        assert kernel_stage <= plan.stage_bytes < kernel_stage + 16, (P, L, S)
    assert ext.ep_rows_puts() is (extension.kernel_build() == "nvshmem")


def _autograd_rows(x, dy, w, counts, w1, w2, activation):
    """float64 autograd of sum_r <dy_r, w_r * ffn_e(x_r)> per row (e: the row's expert): dx_rows, dweight, dw1, dw2."""
    x = x.double().requires_grad_(True)
    w = w.double().requires_grad_(True)
    w1 = w1.double().requires_grad_(True)
    w2 = w2.double().requires_grad_(True)
    outs, start = [], 0
    for e, count in enumerate(counts):
        rows = slice(start, start + count)
        outs.append(reference.expert_ffn(x[rows], w1[e], w2[e], activation) * w[rows, None])
        start += count
    y = torch.cat(outs)
    (y * dy.double()).sum().backward()
    return x.grad, w.grad, w1.grad, w2.grad


@pytest.mark.parametrize("activation", ["relu", "gelu", "silu", "swiglu"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_packed_row_grads_match_float64_autograd(activation, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    E, H, I = 4, 32, 16
    counts = [3, 0, 5, 1]
    R = sum(counts)
    cols = 2 * I if activation == "swiglu" else I
    x = torch.randn(R, H, generator=generator).to(dtype)
    dy = torch.randn(R, H, generator=generator).to(dtype)
    w = torch.rand(R, generator=generator)
    w1 = (torch.randn(E, H, cols, generator=generator) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, I, H, generator=generator) / I ** 0.5).to(dtype)
    dweight, dx_rows, dw1, dw2 = packed_row_grads(x, dy, w, counts, w1, w2, activation=activation)
    want_dx, want_dw, want_dw1, want_dw2 = _autograd_rows(x, dy, w, counts, w1, w2, activation)
    # the same arithmetic in another order (three chained GEMMs over at most 2I terms), plus for dweight
    # its float32 result's rounding
    reorder = numerics.reorder_tolerance(dtype, 2 * I, depth=3)
    for got, want, what in ((dx_rows, want_dx, "dx_rows"), (dweight, want_dw, "dweight"), (dw1, want_dw1, "dw1"),
                            (dw2, want_dw2, "dw2")):
        assert got.dtype == (torch.float32 if what == "dweight" else dtype), what
        tolerance = reorder + (numerics.rounding_tolerance(torch.float32, 1) if what == "dweight" else 0.0)
        assert numerics.normwise_error(got.double(), want) < tolerance, what
    assert dw1[1].abs().max() == 0 and dw2[1].abs().max() == 0  # the expert without rows


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_packed_row_grads_over_a_bound_leave_the_rows_past_the_end_row_alone(activation, seed):
    """A captured backward's rows are a bound, the experts' end rows only on the device (``offs``): the rows in
    use give the bits of the host-count path, whatever the rows past the last end row hold."""
    generator = torch.Generator().manual_seed(seed)
    E, H, I = 4, 32, 16
    counts, spare = [3, 0, 5, 1], 7
    R = sum(counts)
    cols = 2 * I if activation == "swiglu" else I
    x, dy = torch.randn(R + spare, H, generator=generator), torch.randn(R + spare, H, generator=generator)
    x[R:], dy[R:] = float("nan"), float("inf")  # what a bound's unused rows may hold
    w = torch.rand(R + spare, generator=generator)
    w1 = torch.randn(E, H, cols, generator=generator) / H ** 0.5
    w2 = torch.randn(E, I, H, generator=generator) / I ** 0.5
    want = packed_row_grads(x[:R], dy[:R], w[:R], counts, w1, w2, activation=activation)
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    got = packed_row_grads(x, dy, w, None, w1, w2, activation=activation, offs=offs)
    for what, a, b in zip(("dweight_row", "dx_rows", "dw1", "dw2"), want, got):
        assert torch.equal(a, b if what in ("dw1", "dw2") else b[:R]), what


def test_packed_row_grads_with_no_rows():
    w1, w2 = torch.randn(2, 8, 4), torch.randn(2, 4, 8)
    dweight, dx_rows, dw1, dw2 = packed_row_grads(torch.zeros(0, 8), torch.zeros(0, 8), torch.zeros(0), [0, 0], w1, w2,
                                                  activation="gelu")
    assert dweight.shape == (0,) and dx_rows.shape == (0, 8)
    assert dw1.abs().max() == 0 and dw2.abs().max() == 0


def test_packed_row_grads_rejects_counts_that_do_not_match_the_rows():
    w1, w2 = torch.randn(2, 8, 4), torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="do not match counts"):
        packed_row_grads(torch.zeros(3, 8), torch.zeros(3, 8), torch.zeros(3), [1, 1], w1, w2, activation="gelu")


class _Routing:
    def __init__(self, expert, row):
        self.expert, self.row = expert, row


class _CountTeam:
    def __init__(self, plan, signals):
        self.plan = plan
        self.buffers = [type("Buffers", (), {"signals": signals})()]


def test_forward_count_words_of_a_team_are_its_signal_words(seed):
    generator = torch.Generator().manual_seed(seed)
    P, L = 3, 4
    plan = BufferPlan(P, max_tokens=8, hidden=64, top_k=2, local_experts=L, dtype=torch.bfloat16)
    signals = torch.randint(0, 9, (plan.signal_words,), generator=generator, dtype=torch.int32)
    words = forward_count_words(_CountTeam(plan, signals), None)
    assert words.shape == (P, L) and torch.equal(words.reshape(-1), signals[:P * L])


def test_forward_count_words_of_one_rank_count_the_kept_choices(seed):
    generator = torch.Generator().manual_seed(seed)
    T, k, E = 50, 3, 6
    plan = BufferPlan(1, max_tokens=T, hidden=64, top_k=k, local_experts=E, dtype=torch.bfloat16)
    expert = torch.randint(0, E, (T, k), generator=generator, dtype=torch.int32)
    row = torch.where(torch.rand(T, k, generator=generator) < 0.2, -1, 0).to(torch.int32)  # some dropped
    words = forward_count_words(_CountTeam(plan, torch.zeros(plan.signal_words, dtype=torch.int32)),
                                _Routing(expert, row))
    want = [int(((expert == e) & (row >= 0)).sum()) for e in range(E)]
    assert words.tolist() == [want]
