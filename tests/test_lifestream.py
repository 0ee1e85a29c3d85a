"""LifeStream's memory (the pure algorithm, no model): known answers on hand-built streams (a static video, a run that
ends, the archive quota over non-stable tokens, overflow demotion, a 3-token global compression worked by hand,
positions of merged tokens), the budget bound over 10 / 100 / 1000 random frames, `snapshot` leaving the memory
unchanged, and the vectorised memory against a loop-based reference written straight from the spec
(specs/from-abstracts.md §1)."""

from __future__ import annotations

import math

import pytest
import torch

from vtc_plugins.lifestream import (
    ARCHIVE,
    EMERGING,
    GLOBAL,
    STABLE,
    TRANSIENT,
    LifecycleMemory,
    LifeStream,
    TokenSet,
    compress_global,
    lifecycle_states,
    merge_count,
    merge_round,
    saliency_scores,
)

F64 = torch.float64


@pytest.fixture(autouse=True)
def _one_thread():
    """Tensors here are tiny: one intra-op thread (on a busy 2-core box, thread hand-offs otherwise dominate)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def grid_positions(t: int, h: int, w: int) -> torch.Tensor:
    """[3, h*w] M-RoPE-like ids (t, row, col) of frame t."""
    rows = torch.arange(h).repeat_interleave(w)
    cols = torch.arange(w).repeat(h)
    return torch.stack([torch.full((h * w,), t), rows, cols])


def random_video(num_frames: int, hw=(4, 4), dim=16, keep=0.7, noise=0.05, seed=0, dtype=F64):
    """Frames whose token at each position persists (plus small noise, cos ~ 0.99) with probability `keep`, else is
    replaced by a fresh random vector; saliency from random "attention". Yields (x, positions, u, t)."""
    g = torch.Generator().manual_seed(seed)
    n = hw[0] * hw[1]
    x = torch.randn(n, dim, generator=g, dtype=F64)
    for t in range(num_frames):
        if t:
            stay = torch.rand(n, generator=g) < keep
            drift = x + noise * torch.randn(n, dim, generator=g, dtype=F64)
            x = torch.where(stay[:, None], drift, torch.randn(n, dim, generator=g, dtype=F64))
        u = saliency_scores(torch.rand(n, generator=g), x, "attention")
        yield x.to(dtype), grid_positions(t, *hw), u, t


def state_copy(memory: LifecycleMemory) -> list[torch.Tensor]:
    return [t.clone() for t in memory.state_tensors()]


def same_tensors(a, b) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def snapshot_tensors(snap) -> list[torch.Tensor]:
    return [snap.embeds, snap.positions, snap.weight, snap.first_frame, snap.patch, snap.kind, snap.last_frame]


# --- parameters, saliency, states -----------------------------------------------------------------------------


def test_defaults_and_budgets():
    p = LifeStream()
    assert (p.tau_life, p.L_stable, p.rho_frame, p.budget_tokens, p.global_fraction) == (0.9, 3, 0.2, 6272, 0.25)
    assert (p.beta_emerging, p.beta_transient, p.beta_stable, p.saliency) == (1.0, 1.0, 0.5, "attention")
    assert (p.global_budget, p.archive_budget) == (1568, 4704)
    assert p.frame_quota(196) == 40  # ceil(39.2)
    assert LifeStream(rho_frame=0.1).frame_quota(30) == 3  # 0.1 * 30 = 3.0000000000000004 -> 3, not 4


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"tau_life": 1.5}, r"tau_life .* \[-1, 1\]"),
        ({"L_stable": 1}, r"L_stable must be in \[2, inf\)"),
        ({"L_stable": 2.5}, "L_stable must be int"),
        ({"rho_frame": -0.1}, r"rho_frame .* \[0, 1\]"),
        ({"budget_tokens": 0}, r"budget_tokens must be in \[1, inf\)"),
        ({"global_fraction": 0.0}, r"global_fraction must be in \(0, 1\]"),
        ({"budget_tokens": 1}, "global memory needs at least one token"),
        ({"beta_stable": -1.0}, r"beta_stable must be in \[0, inf\)"),
        ({"saliency": "grad"}, "saliency must be one of 'attention', 'norm'"),
    ],
)
def test_invalid_parameters_are_refused_with_the_allowed_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LifeStream(**kwargs)


def test_saliency_is_min_max_normalised_per_frame():
    x = torch.tensor([[3.0, 4.0], [1.0, 0.0], [0.0, 2.0]])  # norms 5, 1, 2
    assert torch.allclose(saliency_scores(None, x, "norm"), torch.tensor([1.0, 0.0, 0.25]))
    attn = torch.tensor([0.2, 0.6, 0.4])
    assert torch.allclose(saliency_scores(attn, x, "attention"), torch.tensor([0.0, 1.0, 0.5]))
    stacked = saliency_scores(torch.stack([attn, 2 * attn + 7]), torch.stack([x, x]), "attention")
    assert torch.allclose(stacked, torch.tensor([[0.0, 1.0, 0.5]] * 2))  # each frame on its own
    assert torch.equal(saliency_scores(torch.ones(3), x, "attention"), torch.zeros(3))  # flat frame -> 0
    with pytest.raises(ValueError, match="needs the attention"):
        saliency_scores(None, x, "attention")
    with pytest.raises(ValueError, match="one of attention, norm"):
        saliency_scores(None, x, "entropy")


def test_lifecycle_states_from_run_length():
    states = lifecycle_states(torch.tensor([1, 2, 3, 4, 9]), 3)
    assert states.tolist() == [EMERGING, TRANSIENT, STABLE, STABLE, STABLE]
    assert lifecycle_states(torch.tensor([1, 2]), 2).tolist() == [EMERGING, STABLE]


# --- known answers on hand-built streams ----------------------------------------------------------------------


def test_static_video_becomes_one_global_token_per_position():
    h, w, frames = 4, 4, 7
    p = LifeStream(budget_tokens=1000)
    memory = LifecycleMemory(p, (h, w))
    frame = torch.randn(h * w, 8, dtype=F64)
    u = saliency_scores(torch.linspace(0, 1, h * w), frame)
    archive_sizes = []
    for t in range(frames):
        memory.add_frame(frame.clone(), grid_positions(t, h, w), u, t)
        archive_sizes.append(len(memory.archive))
    k = p.frame_quota(h * w)  # 4
    # frames 0 (emerging) and 1 (transient) add k tokens each; from frame L_stable - 1 = 2 on every token is stable
    assert archive_sizes == [k, 2 * k] + [2 * k] * (frames - 2)
    assert len(memory.global_memory) == 0  # no run has ended
    snap = memory.snapshot()
    glob = snap.kind == GLOBAL
    assert int(glob.sum()) == h * w and snap.patch[glob].tolist() == list(range(h * w))
    assert snap.weight[glob].tolist() == [frames] * (h * w)
    assert torch.equal(snap.embeds[glob], frame)  # the mean of identical tokens is the token, exactly
    assert torch.equal(snap.positions[:, glob], grid_positions(0, h, w))  # each run's first frame
    assert snap.first_frame[glob].tolist() == [0] * 16 and snap.last_frame[glob].tolist() == [frames - 1] * 16
    assert len(snap) == h * w + 2 * k <= p.budget_tokens


def test_a_changed_position_ends_its_run_into_one_summary_token():
    h, w, d, j = 2, 2, 4, 3
    p = LifeStream(budget_tokens=100, beta_stable=0.5)
    memory = LifecycleMemory(p, (h, w))
    base = torch.eye(d, dtype=F64)  # position i holds e_i (scaled at j: cosine 1, the run continues)
    us = []
    for t in range(4):
        x = base.clone()
        x[j] *= 1.0 + t  # 1, 2, 3, 4: mean 2.5
        u = torch.tensor([0.0, 0.5, 0.25, 0.1 * (t + 1)])
        us.append(float(u[j]))
        memory.add_frame(x, grid_positions(10 + t, h, w), u, 10 + t)
    assert len(memory.global_memory) == 0
    changed = base.clone()
    changed[j] = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=F64)  # orthogonal to e_3: the run at j dies
    memory.add_frame(changed, grid_positions(14, h, w), torch.zeros(4), 14)
    g = memory.global_memory
    assert len(g) == 1
    assert torch.allclose(g.embeds[0], 2.5 * base[j])
    assert (int(g.weight[0]), int(g.patch[0]), int(g.first_frame[0]), int(g.last_frame[0])) == (4, j, 10, 13)
    assert torch.equal(g.positions[:, 0], grid_positions(10, h, w)[:, j])  # the run's first frame
    assert math.isclose(float(g.priority[0]), 0.5 * sum(us) / 4, rel_tol=1e-6)
    assert int(memory.run_length[j]) == 1 and memory.run_length[:j].tolist() == [5, 5, 5]


def test_archive_takes_the_most_salient_non_stable_tokens_of_each_frame():
    h, w, d = 4, 4, 32
    p = LifeStream(budget_tokens=1000, beta_emerging=1.0, beta_transient=0.7)
    memory = LifecycleMemory(p, (h, w))
    k = p.frame_quota(16)
    assert k == 4
    g = torch.Generator().manual_seed(1)
    static = torch.randn(8, d, generator=g, dtype=F64)  # positions 0-7 never change: stable from frame 2
    # saliency: the static positions are the most salient, then 8..15 in a shuffled order
    order = torch.randperm(8, generator=g)
    u = torch.cat([torch.linspace(0.9, 1.0, 8), torch.linspace(0.0, 0.8, 8)[order]])
    added = []
    for t in range(4):
        x = torch.cat([static, torch.randn(8, d, generator=g, dtype=F64)])  # 8-15: fresh every frame (emerging)
        before = memory.num_tokens  # the global memory stays empty here
        memory.add_frame(x, grid_positions(t, h, w), u, t)
        new = memory.archive.take(torch.arange(before, len(memory.archive)))
        added.append(new)
        assert len(new) == k and new.first_frame.tolist() == [t] * k
        assert torch.equal(new.embeds, x[new.patch])
    assert added[0].patch.tolist() == [4, 5, 6, 7]  # frame 0: all emerging, the 4 highest u
    assert added[1].patch.tolist() == [4, 5, 6, 7]  # frame 1: 0-7 transient, still the highest
    assert torch.allclose(added[0].priority, u[4:8].float() * 1.0)  # beta_emerging * u
    assert torch.allclose(added[1].priority, u[4:8].float() * 0.7)  # beta_transient * u
    best_dynamic = sorted((8 + torch.topk(u[8:], 4).indices).tolist())
    assert added[2].patch.tolist() == best_dynamic == added[3].patch.tolist()  # stable 0-7 are skipped
    assert torch.allclose(added[2].priority, u[best_dynamic].float())  # emerging


def test_archive_overflow_demotes_the_oldest_tokens_with_weight_one():
    h, w, d = 4, 4, 32
    p = LifeStream(budget_tokens=12, beta_emerging=0.8)  # B_G = 3, B_A = 9
    assert (p.global_budget, p.archive_budget) == (3, 9)
    memory = LifecycleMemory(p, (h, w))
    g = torch.Generator().manual_seed(2)
    frames = []
    for t in range(3):
        x = torch.randn(16, d, generator=g, dtype=F64)  # unrelated frames: every token emerging
        u = torch.rand(16, generator=g)
        memory.add_frame(x, grid_positions(t, h, w), u, t)
        frames.append((x, u))
    x0, u0 = frames[0]
    first = sorted(torch.topk(u0, 4).indices.tolist())  # frame 0's archive tokens, raster order
    gm = memory.global_memory
    assert len(memory.archive) == 9 and len(gm) == 3  # 12 archived, the 3 oldest demoted
    assert gm.patch.tolist() == first[:3] and gm.first_frame.tolist() == [0, 0, 0]
    assert gm.weight.tolist() == [1, 1, 1] and torch.equal(gm.embeds, x0[first[:3]])
    assert torch.allclose(gm.priority, 0.8 * u0[first[:3]])
    assert torch.equal(gm.positions, grid_positions(0, h, w)[:, first[:3]])
    assert memory.archive.first_frame.tolist() == [0] + [1] * 4 + [2] * 4
    assert int(memory.archive.patch[0]) == first[3]


def token_set(embeds, weight, priority, first, patch, last=None, positions=None) -> TokenSet:
    first = torch.tensor(first)
    patch = torch.tensor(patch)
    return TokenSet(
        torch.tensor(embeds, dtype=F64),
        torch.stack([first, patch, 100 + patch]) if positions is None else positions,
        torch.tensor(weight),
        first,
        first.clone() if last is None else torch.tensor(last),
        patch,
        torch.tensor(priority, dtype=torch.float32),
    )


def test_global_compression_merges_the_lowest_priority_into_the_most_similar_by_hand():
    # a: lowest priority; cos(a, b) = 0, cos(a, c) = 1 / sqrt(1.04) -> a merges into c
    tokens = token_set(
        [[1.0, 0.0], [0.0, 1.0], [1.0, 0.2]], [1, 2, 3], priority=[0.1, 0.9, 0.5], first=[5, 3, 1], patch=[2, 7, 0]
    )
    assert merge_count(3, 2) == 1
    out = compress_global(tokens, 2)
    assert len(out) == 2 and out.patch.tolist() == [7, 0]  # b untouched, then c' (survivors keep their order)
    assert torch.equal(out.embeds[0], tokens.embeds[1])
    assert torch.allclose(out.embeds[1], torch.tensor([1.0, 0.15], dtype=F64))  # (1*[1,0] + 3*[1,.2]) / 4
    assert out.weight.tolist() == [2, 4]
    assert torch.allclose(out.priority, torch.tensor([0.9, 0.5]))  # max(0.1, 0.5)
    assert out.first_frame.tolist() == [3, 1] and out.last_frame.tolist() == [3, 5]  # span [1, 5]
    assert out.positions[:, 1].tolist() == [1, 0, 100]  # c is the earliest member (frame 1)
    assert len(tokens) == 3 and tokens.weight.tolist() == [1, 2, 3]  # input unchanged

    # the same, but the source is the earliest member: the merged token takes its position and patch
    tokens = token_set(
        [[1.0, 0.0], [0.0, 1.0], [1.0, 0.2]], [1, 2, 3], priority=[0.1, 0.9, 0.5], first=[0, 3, 1], patch=[2, 7, 0]
    )
    out = compress_global(tokens, 2)
    assert out.first_frame.tolist() == [3, 0] and out.patch.tolist() == [7, 2]
    assert out.positions[:, 1].tolist() == [0, 2, 102] and out.last_frame.tolist() == [3, 1]


def test_several_sources_can_merge_into_one_destination():
    # 4 tokens, budget 2: r = min(2, 2) = 2 sources (priorities 0.1, 0.2), both closest to d = [1, 0]
    tokens = token_set(
        [[1.0, 0.1], [1.0, -0.1], [1.0, 0.0], [0.0, 1.0]],
        weight=[1, 2, 3, 1],
        priority=[0.1, 0.2, 0.3, 0.4],
        first=[4, 2, 3, 0],
        patch=[0, 1, 2, 3],
    )
    assert merge_count(4, 2) == 2
    out = compress_global(tokens, 2)
    assert out.patch.tolist() == [1, 3]  # d took the position/patch of its earliest member (first frame 2)
    expected = (1 * tokens.embeds[0] + 2 * tokens.embeds[1] + 3 * tokens.embeds[2]) / 6
    assert torch.allclose(out.embeds[0], expected) and out.weight.tolist() == [6, 1]
    assert out.first_frame.tolist() == [2, 0] and out.last_frame.tolist() == [4, 0]
    assert torch.allclose(out.priority, torch.tensor([0.3, 0.4]))


def test_repeated_rounds_keep_the_weighted_mean_and_total_weight():
    g = torch.Generator().manual_seed(3)
    n = 23
    tokens = TokenSet(
        torch.randn(n, 5, generator=g, dtype=F64),
        torch.randint(0, 50, (3, n), generator=g),
        torch.randint(1, 9, (n,), generator=g),
        torch.randint(0, 20, (n,), generator=g),
        torch.randint(20, 40, (n,), generator=g),
        torch.randint(0, 16, (n,), generator=g),
        torch.rand(n, generator=g),
    )
    one = compress_global(tokens, 1)  # rounds of r = 12, 6, 3, 1, 1 (23 -> 11 -> 5 -> 2 -> 1)
    w = tokens.weight.to(F64)
    assert len(one) == 1 and int(one.weight) == int(tokens.weight.sum())
    assert torch.allclose(one.embeds[0], (w[:, None] * tokens.embeds).sum(0) / w.sum())  # weighted means compose
    earliest = min(range(n), key=lambda i: (int(tokens.first_frame[i]), int(tokens.patch[i])))
    assert torch.equal(one.positions[:, 0], tokens.positions[:, earliest])
    assert int(one.last_frame) == int(tokens.last_frame.max()) and math.isclose(
        float(one.priority), float(tokens.priority.max())
    )
    with pytest.raises(ValueError, match="1 <= r"):
        merge_round(tokens, n)


# --- budget, snapshot, dtypes, inputs -------------------------------------------------------------------------


@pytest.mark.parametrize("num_frames", [10, 100, 1000])
def test_memory_never_exceeds_the_budget_and_snapshot_does_not_change_it(num_frames):
    p = LifeStream(budget_tokens=40)
    memory = LifecycleMemory(p, (4, 4))
    check_every = max(1, num_frames // 20)
    for x, positions, u, t in random_video(num_frames, keep=0.8, seed=num_frames):
        memory.add_frame(x, positions, u, t)
        assert len(memory.archive) <= p.archive_budget and len(memory.global_memory) <= p.global_budget
        assert memory.num_tokens <= p.budget_tokens
        if t % check_every == 0 or t == num_frames - 1:
            snap = memory.snapshot()
            assert len(snap) <= p.budget_tokens
            assert int((snap.kind == ARCHIVE).sum()) <= p.archive_budget
            assert int((snap.kind == GLOBAL).sum()) <= p.global_budget
    assert memory.frames_seen == num_frames
    before = state_copy(memory)
    first, second = memory.snapshot(), memory.snapshot()
    assert same_tensors(snapshot_tensors(first), snapshot_tensors(second))
    assert same_tensors(state_copy(memory), before)
    assert len(first) <= p.budget_tokens and memory.frames_seen == num_frames
    key = (first.first_frame * 16 + first.patch) * 2 + first.kind
    assert bool((key[1:] >= key[:-1]).all())  # sorted by first frame, then raster position
    if num_frames >= 100:  # the stream filled both memories and produced stable runs
        assert int((memory.run_length >= p.L_stable).sum()) > 0
        assert len(first) == p.budget_tokens


def test_snapshot_holds_open_stable_runs_and_can_be_asked_mid_stream():
    memory = LifecycleMemory(LifeStream(budget_tokens=40), (4, 4))
    video = list(random_video(30, keep=0.9, seed=5))
    for x, positions, u, t in video[:15]:
        memory.add_frame(x, positions, u, t)
    snap = memory.snapshot()
    opened = memory.run_length >= 3
    assert opened.any()
    # asking does not change what follows: a fresh memory fed the same frames ends identically
    for x, positions, u, t in video[15:]:
        memory.add_frame(x, positions, u, t)
    fresh = LifecycleMemory(LifeStream(budget_tokens=40), (4, 4))
    for x, positions, u, t in video:
        fresh.add_frame(x, positions, u, t)
    assert same_tensors(state_copy(memory), state_copy(fresh))
    assert same_tensors(snapshot_tensors(memory.snapshot()), snapshot_tensors(fresh.snapshot()))
    assert len(snap) <= 40


def test_state_keeps_the_input_dtype_and_nbytes_counts_run_state():
    memory = LifecycleMemory(LifeStream(budget_tokens=40), (4, 4))
    assert memory.nbytes == 0 and memory.num_tokens == 0 and len(memory.snapshot()) == 0
    for x, positions, u, t in random_video(12, dim=8, dtype=torch.bfloat16):
        memory.add_frame(x, positions, u, t)
    for tensor in (memory.previous, memory.run_mean, memory.archive.embeds, memory.global_memory.embeds):
        assert tensor.dtype == torch.bfloat16
    assert memory.snapshot().embeds.dtype == torch.bfloat16
    run_bytes = 2 * 16 * 8 * 2 + 2 * 16 * 8 + 3 * 16 * 8 + 16 * 4  # previous, mean; length, start; positions; u sum
    held = memory.archive.nbytes + memory.global_memory.nbytes
    assert memory.nbytes == held + run_bytes


def test_inputs_are_checked():
    memory = LifecycleMemory(LifeStream(), (2, 2))
    with pytest.raises(ValueError, match="N = h\\*w = 4"):
        memory.add_frame(torch.randn(5, 3), grid_positions(0, 2, 2), torch.rand(4), 0)
    with pytest.raises(ValueError, match="positions must be"):
        memory.add_frame(torch.randn(4, 3), torch.zeros(3, 5, dtype=torch.long), torch.rand(4), 0)
    memory.add_frame(torch.randn(4, 3), grid_positions(0, 2, 2), torch.rand(4), 0)
    with pytest.raises(ValueError, match="time order"):
        memory.add_frame(torch.randn(4, 3), grid_positions(0, 2, 2), torch.rand(4), 0)
    with pytest.raises(ValueError, match="dtype/device"):
        memory.add_frame(torch.randn(4, 3, dtype=F64), grid_positions(1, 2, 2), torch.rand(4), 1)


# --- the vectorised memory against a loop-based reference -----------------------------------------------------


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def reference_compress(G: list[dict], budget: int) -> list[dict]:
    """Step 6 token by token."""
    while len(G) > budget:
        r = min(len(G) - budget, math.ceil(len(G) / 2))
        sources = sorted(range(len(G)), key=lambda j: (G[j]["prio"], j))[:r]
        dests = [j for j in range(len(G)) if j not in sources]
        groups = {d: [d] for d in dests}
        for s in sources:
            groups[max(dests, key=lambda d: cos(G[s]["e"], G[d]["e"]))].append(s)  # max: first of equals
        merged = []
        for d in dests:
            members = [G[j] for j in groups[d]]
            weight = sum(m["w"] for m in members)
            earliest = min(members, key=lambda m: (m["first"], m["patch"]))
            merged.append(
                {
                    "e": sum(m["w"] * m["e"] for m in members) / weight if len(members) > 1 else G[d]["e"],
                    "w": weight,
                    "prio": max(m["prio"] for m in members),
                    "first": earliest["first"],
                    "last": max(m["last"] for m in members),
                    "patch": earliest["patch"],
                    "pos": earliest["pos"],
                }
            )
        G = merged
    return G


class ReferenceMemory:
    """Steps 1-7 of specs/from-abstracts.md §1, one position and one token at a time."""

    def __init__(self, p: LifeStream, n: int):
        self.p, self.n = p, n
        self.runs: list[dict] = []
        self.prev = None
        self.A: list[dict] = []
        self.G: list[dict] = []
        self.last_t = None

    def summary(self, i: int) -> dict:
        r = self.runs[i]
        prio = self.p.beta_stable * r["usum"] / r["len"]
        return {"e": r["mean"], "w": r["len"], "prio": prio, "first": r["start"], "last": self.last_t, "patch": i,
                "pos": r["pos"]}  # fmt: skip

    def add_frame(self, x, positions, u, t):
        p = self.p
        for i in range(self.n):
            if self.prev is not None and cos(x[i], self.prev[i]) >= p.tau_life:
                r = self.runs[i]
                r["len"] += 1
                r["mean"] = r["mean"] + (x[i] - r["mean"]) / r["len"]
                r["usum"] += float(u[i])
            else:
                if self.prev is not None and self.runs[i]["len"] >= p.L_stable:
                    self.G.append(self.summary(i))
                run = {"mean": x[i].clone(), "len": 1, "start": t, "pos": positions[:, i].tolist(), "usum": float(u[i])}
                if self.prev is None:
                    self.runs.append(run)
                else:
                    self.runs[i] = run
        self.prev, self.last_t = x, t
        candidates = [i for i in range(self.n) if self.runs[i]["len"] < p.L_stable]
        chosen = sorted(sorted(candidates, key=lambda i: -float(u[i]))[: math.ceil(p.rho_frame * self.n)])
        for i in chosen:
            beta = p.beta_emerging if self.runs[i]["len"] == 1 else p.beta_transient
            self.A.append({"e": x[i], "w": 1, "prio": beta * float(u[i]), "first": t, "last": t, "patch": i,
                           "pos": positions[:, i].tolist()})  # fmt: skip
        while len(self.A) > p.archive_budget:
            self.G.append(self.A.pop(0))
        self.G = reference_compress(self.G, p.global_budget)

    def snapshot(self) -> list[dict]:
        opened = [self.summary(i) for i in range(self.n) if self.runs[i]["len"] >= self.p.L_stable]
        G = reference_compress(self.G + opened, self.p.global_budget)
        tokens = [dict(a, kind=ARCHIVE) for a in self.A] + [dict(g, kind=GLOBAL) for g in G]
        return sorted(tokens, key=lambda m: (m["first"], m["patch"], m["kind"]))


def assert_matches(tokens: TokenSet | object, ref: list[dict], kind=None):
    assert len(tokens) == len(ref)
    if not ref:
        return
    assert torch.allclose(tokens.embeds, torch.stack([m["e"] for m in ref]), rtol=1e-12, atol=1e-12)
    assert tokens.weight.tolist() == [m["w"] for m in ref]
    assert tokens.first_frame.tolist() == [m["first"] for m in ref]
    assert tokens.last_frame.tolist() == [m["last"] for m in ref]
    assert tokens.patch.tolist() == [m["patch"] for m in ref]
    assert tokens.positions.T.tolist() == [m["pos"] for m in ref]
    if kind is not None:
        assert kind.tolist() == [m["kind"] for m in ref]
    else:
        assert torch.allclose(tokens.priority, torch.tensor([m["prio"] for m in ref]), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "kwargs,keep",
    [
        ({"budget_tokens": 20}, 0.7),  # B_G 5, B_A 15
        ({"budget_tokens": 24, "global_fraction": 0.5, "L_stable": 2, "beta_transient": 0.6}, 0.8),
        ({"budget_tokens": 30, "rho_frame": 0.3, "L_stable": 4, "beta_emerging": 0.9, "beta_stable": 0.3}, 0.9),
    ],
)
def test_vectorised_memory_equals_a_loop_reference(kwargs, keep):
    p = LifeStream(**kwargs)
    memory, ref = LifecycleMemory(p, (4, 4)), ReferenceMemory(p, 16)
    merged = False
    for x, positions, u, t in random_video(14, keep=keep, seed=7):
        memory.add_frame(x, positions, u, t)
        ref.add_frame(x, positions, u, t)
        assert_matches(memory.archive, ref.A)
        assert_matches(memory.global_memory, ref.G)
        assert memory.run_length.tolist() == [r["len"] for r in ref.runs]
        snap = memory.snapshot()
        assert_matches(snap, ref.snapshot(), kind=snap.kind)
        merged |= bool((memory.global_memory.weight > 1).any())
    assert merged  # summaries and merges happened
