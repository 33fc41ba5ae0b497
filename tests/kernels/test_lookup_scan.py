"""Lookup-drafting scan: Triton proposals identical to the serial reference.  CPU: TRITON_INTERPRET=1
on small histories; real lengths (up to 256K) run only with CUDA."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
if not CUDA:  # must precede the first @triton.jit decoration
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kernels.lookup_scan import lookup_scan, naive_lookup_scan, workspace_numel  # noqa: E402
from kernels.lookup_scan.config import Launch  # noqa: E402

pytestmark = pytest.mark.kernels
DEVICE = "cuda" if CUDA else "cpu"


def check(tok, lens, min_n, max_n, k, **kw):
    B = tok.shape[0] if kw.get("req_indices") is None else kw["req_indices"].shape[0]
    out = (torch.full((B, k), -7, dtype=torch.int64, device=DEVICE),
           torch.full((B,), -7, dtype=torch.int32, device=DEVICE))
    d, n = lookup_scan(tok.to(DEVICE), lens.to(DEVICE), min_n, max_n, k, out=out, **kw)
    rows = kw.get("req_indices")
    rows = torch.arange(tok.shape[0]) if rows is None else rows.cpu()
    dr, nr = naive_lookup_scan(tok[rows], lens[rows], min_n, max_n, k)
    assert torch.equal(n.cpu(), nr), (n.cpu(), nr)
    assert torch.equal(d.cpu(), dr)
    return nr


def repetitive(B, S, vocab, seed, dtype=torch.int32):
    """Histories built by copying earlier spans (agents quoting their context)."""
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, vocab, (B, S), generator=g)
    for i_b in range(B):
        p = 64
        while p < S - 40:
            n = int(torch.randint(8, 40, (1,), generator=g))
            src = int(torch.randint(0, p - n, (1,), generator=g))
            tok[i_b, p : p + n] = tok[i_b, src : src + n].clone()
            p += n + int(torch.randint(0, 30, (1,), generator=g))
    return tok.to(dtype)


@pytest.mark.parametrize("min_n,max_n", [(5, 5), (2, 7), (1, 3), (1, 1)], ids=lambda x: str(x))
def test_random_small_vocab(min_n, max_n):
    g = torch.Generator().manual_seed(min_n * 10 + max_n)
    tok = torch.randint(0, 4, (3, 2500), generator=g, dtype=torch.int32)
    lens = torch.tensor([2500, 1999, 1025], dtype=torch.int32)
    check(tok, lens, min_n, max_n, 7, programs_per_request=3)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
def test_repetitive_histories(dtype):
    tok = repetitive(2, 3000, 50000, seed=1, dtype=dtype)
    lens = torch.tensor([3000, 2047])
    for i_b, L in enumerate(lens.tolist()):  # the history ends quoting an earlier span
        tok[i_b, L - 20 : L] = tok[i_b, 500:520].clone()
    nr = check(tok, lens, 6, 12, 7, programs_per_request=2)
    assert (nr > 0).all(), "the repetitive histories should match"


def test_no_match_and_short_histories():
    tok = torch.arange(4 * 1500, dtype=torch.int32).reshape(4, 1500)  # all distinct
    lens = torch.tensor([1500, 6, 1, 0], dtype=torch.int32)
    nr = check(tok, lens, 5, 5, 7, programs_per_request=2)
    assert (nr == 0).all()


def test_match_at_history_start():
    """Positions before 0 read as 0 in the kernel's halo: a match ending at e is at most e+1 long.
    Row 0: "5 6 7" at the start would look 4 long against the suffix "0 5 6 7" without that clamp and
    beat the later, truly longest-and-most-recent "5 6 7"; row 1: the start is the only match."""
    tok = torch.full((2, 300), 3, dtype=torch.int32)
    tok[:, 1:299:2] = 4  # 3 4 3 4 ...: no 3-gram of the suffixes below
    for i_b in range(2):
        tok[i_b, 0:3] = torch.tensor([5, 6, 7])
        tok[i_b, 296:300] = torch.tensor([0, 5, 6, 7])
    tok[0, 150:154] = torch.tensor([1, 5, 6, 7])
    lens = torch.tensor([300, 300], dtype=torch.int32)
    nr = check(tok, lens, 3, 4, 7, programs_per_request=1)
    assert nr.tolist() == [7, 7]


def test_ties_most_recent_wins_and_clipping():
    g = torch.Generator().manual_seed(3)
    tok = torch.randint(100, 1000, (3, 1200), generator=g, dtype=torch.int32)
    pat = torch.tensor([1, 2, 3, 4, 5, 6])
    for p in (10, 400, 1100):  # the same 6-gram three times; the suffix is a fourth copy
        tok[0, p : p + 6] = pat
    tok[0, 1194:1200] = pat
    tok[1, :] = 9  # one token repeated: overlapping matches, draft clipped at the end
    tok[2, 1190:1200] = torch.tensor([1, 2, 3, 4, 5, 1, 2, 3, 4, 5])  # overlap with the suffix
    lens = torch.tensor([1200, 1200, 1200])
    nr = check(tok, lens, 3, 6, 7, programs_per_request=2)
    assert nr.tolist() == [7, 1, 5]


def test_req_indices_and_workspace_reuse():
    tok = repetitive(4, 2000, 1000, seed=5)
    lens = torch.tensor([2000, 1500, 1800, 700], dtype=torch.int32)
    ws = torch.zeros(workspace_numel(3), dtype=torch.int64, device=DEVICE)
    rows = torch.tensor([3, 0, 2], device=DEVICE)
    for min_n, max_n in [(6, 12), (5, 5)]:
        check(tok, lens, min_n, max_n, 5, req_indices=rows, workspace=ws, programs_per_request=2)
        assert not ws.any(), "the kernel must leave the workspace zeroed"


# Launches on 256-token (NV 2) and 128-token tiles: P=3 loops over tiles past the program cap, P=10
# leaves programs with no tile on the short rows (no ticket: the finisher counts only the active
# ones), P=6 with 256-token tiles covers the buffer (the loop-free kernel).
_T1, _T2 = Launch(1, 1, 1, 64), Launch(2, 1, 1, 64)
_TICKETS = {"poll_max_p": 0}  # every request on the ticket path (its default at > 256 programs)


@pytest.mark.parametrize("launch,programs", [
    (_T1.with_(**_TICKETS), 3), (_T2.with_(order=True, **_TICKETS), 10), (Launch(1, 2, 1, 64, **_TICKETS), 2),
    (_T2.with_(words=False, **_TICKETS), 10), (_T2.with_(hit_n=True, **_TICKETS), 6),
    (_T1.with_(rowkey=True, hit_n=True, **_TICKETS), 3), (_T2.with_(rowkey=True, **_TICKETS), 10),
    (_T1, 3), (_T2, 10), (_T2.with_(rowkey=True, hit_n=True, order=True), 6),
], ids=["tickets-loop", "tickets-idle-order", "G2", "max-word-idle", "hit-n-cover", "rowkey-hit-n-loop",
        "rowkey-idle", "poll-loop", "poll-idle", "poll-rowkey-hit-n-cover"])
def test_launches_block_loop_and_idle_programs(launch, programs):
    """Launch configurations (config.Launch) beyond the rule's own grids: loops past the program
    cap, idle programs, two rows per thread, the load order behind a barrier; on the ticket path
    (WORDS + DIRECT: k <= 8 here) and its plain max word (words off, the launcher's path at k > 8),
    on the polling fold; the MIN_N-token hit test (hit_n) and row-local keys (rowkey: XOR-OR
    scoring at n 4-4, the (m, c) keys at n 2-9), alone and together."""
    from kernels.lookup_scan.triton import lookup_scan_fwd, workspace_numel

    tok = torch.cat([repetitive(2, 1500, 300, seed=9), torch.randint(0, 4, (2, 1500), dtype=torch.int32)])
    lens = torch.tensor([1500, 700, 1400, 2], dtype=torch.int32)
    ws = torch.zeros(workspace_numel(4), dtype=torch.int64, device=DEVICE)
    for min_n, max_n in [(2, 9), (4, 4)]:
        out = (torch.full((4, 5), -7, dtype=torch.int64, device=DEVICE),
               torch.full((4,), -7, dtype=torch.int32, device=DEVICE))
        d, n = lookup_scan_fwd(tok.to(DEVICE), lens.to(DEVICE), min_n, max_n, 5, None, ws, out, programs, launch)
        dr, nr = naive_lookup_scan(tok, lens, min_n, max_n, 5)
        assert torch.equal(n.cpu(), nr) and torch.equal(d.cpu(), dr)
        assert not ws.any()


@pytest.mark.parametrize("direct", [0, 1], ids=["words", "direct"])
@pytest.mark.parametrize("k", [5, 8, 9], ids=["k5", "k8", "k9-no-words"])
@pytest.mark.parametrize("programs", [10, 3], ids=["idle", "loop"])
def test_words_fold_paths(programs, k, direct):
    """WORDS's cases per request in one launch: no program with a match (the finisher reads
    nothing), one, two in different tiles (the max of the folded words), the winner in the last
    program's tile (the interpreter's last arrival: its own words), the winner 3 tokens before the
    end (fewer draft tokens than words: the words past them hold the earlier copy's tokens and must
    not be used), the only match in the last program's tile (its own, not in the ticket it read), across tiles and the loop past the program cap; k = 8 fills the line's eight words,
    k = 9 runs the launcher's fallback to the plain max word.  DIRECT: the same cases folded into
    the outputs (pre-filled with -7: a slot or count no fold reached fails), the scores masked off
    by the finisher."""
    from kernels.lookup_scan.triton import lookup_scan_fwd, workspace_numel

    S = 1500
    base = torch.arange(S, dtype=torch.int32) + 100  # distinct tokens: no repeat anywhere
    suffix = base[-9:].clone()
    one = base.clone()
    one[400:409] = suffix  # one earlier copy of the last 9 tokens
    two = one.clone()
    two[900:909] = suffix  # and a second, in another tile
    late = two.clone()
    late[1300:1309] = suffix  # the winner in the last program's tile
    tail = base.clone()  # a period-3 run at the end and an earlier copy of it: the winner ends
    tail[400:415] = tail[-15:] = torch.tensor([7, 8, 9] * 5, dtype=torch.int32)  # at L-4 (3 tokens)
    solo = base.clone()
    solo[1300:1309] = suffix  # the only match, in the last program's tile (not yet counted in its ticket)
    tok = torch.stack([base, one, two, two, late, tail, solo])
    lens = torch.tensor([S, S, S, 1000, S, S, S], dtype=torch.int32)  # row 3: only the first copy is in range
    ws = torch.zeros(workspace_numel(7), dtype=torch.int64, device=DEVICE)
    for min_n, max_n in [(2, 9), (4, 4)]:
        out = (torch.full((7, k), -7, dtype=torch.int64, device=DEVICE),
               torch.full((7,), -7, dtype=torch.int32, device=DEVICE))
        d, n = lookup_scan_fwd(tok.to(DEVICE), lens.to(DEVICE), min_n, max_n, k, None, ws, out, programs,
                               Launch(2, 1, 1, 64, poll_max_p=0, direct=bool(direct)))
        dr, nr = naive_lookup_scan(tok, lens, min_n, max_n, k)
        assert nr.tolist()[:3] == [0, k, k] and dr[4, :5].tolist() == base[1309:1314].tolist()
        assert nr[5] == 3 and dr[5, :3].tolist() == [7, 8, 9] and nr[6] == k
        assert torch.equal(n.cpu(), nr) and torch.equal(d.cpu(), dr)
        assert not ws.any()


@pytest.mark.parametrize("programs", [10, 3], ids=["idle", "loop"])
def test_direct_outputs_persist_across_calls(programs):
    """DIRECT folds into the outputs, so they must start below the fold's range: one pair of
    output tensors reused call after call (as the engine plugin holds them, never refilled) gives
    the reference's proposals whatever the previous call left there: a full draft, a match 3
    tokens before the end (num_valid 3, the rest the last token), no match (the fallback), large
    token ids; and zeros / negative fills at the start."""
    from kernels.lookup_scan.triton import lookup_scan_fwd, workspace_numel

    S, k = 1500, 7
    base = torch.arange(S, dtype=torch.int32) + 2_000_000_000  # distinct, near int32's top
    full = base.clone()
    full[600:609] = base[-9:]  # one earlier copy of the suffix: k tokens follow it
    tail = base.clone()
    tail[400:415] = tail[-15:] = torch.tensor([7, 8, 9] * 5, dtype=torch.int32)  # the winner ends at L-4
    two = full.clone()
    two[1100:1109] = base[-9:]  # a second, later copy: it wins
    seq = [full, tail, base, two, base, tail, full]
    ws = torch.zeros(workspace_numel(2), dtype=torch.int64, device=DEVICE)
    for fill in (0, -7):
        out = (torch.full((2, k), fill, dtype=torch.int64, device=DEVICE),
               torch.full((2,), fill, dtype=torch.int32, device=DEVICE))
        for i in range(len(seq)):
            tok = torch.stack([seq[i], seq[(i + 3) % len(seq)]])
            lens = torch.tensor([S, S], dtype=torch.int32)
            d, n = lookup_scan_fwd(tok.to(DEVICE), lens.to(DEVICE), 2, 9, k, None, ws, out, programs,
                                   Launch(2, 1, 1, 64, poll_max_p=0))
            dr, nr = naive_lookup_scan(tok, lens, 2, 9, k)
            assert torch.equal(n.cpu(), nr) and torch.equal(d.cpu(), dr), i
            assert not ws.any()
    assert [int(naive_lookup_scan(r[None], torch.tensor([S]), 2, 9, k)[1]) for r in (full, tail, base)] == [k, 3, 0]


def test_rule_tiers():
    """The launcher's launch follows B * S through RULE's tiers (bench rows: 8K/32K B1 -> 128-token
    one-warp tiles; 8K B8, 100K B1 -> 256-token; 256K B1, 32K/100K B8 -> 1024-token ORDER with
    row-local keys and the MIN_N-token hit test; 256K B8 -> 2048-token, 4-token rows at max_n <= 5)."""
    from kernels.lookup_scan.config import LARGE, LARGE_SHORT, RULE, block_tokens, default_launch

    tiers = [launch for _, launch in RULE]
    picks = {(B, S): default_launch(B, S, 12) for B in (1, 8) for S in (8192, 32768, 100_000, 262_144)}
    assert picks[1, 8192] == picks[1, 32768] == tiers[0] and block_tokens(tiers[0]) == 128
    assert picks[8, 8192] == picks[1, 100_000] == tiers[1] and block_tokens(tiers[1]) == 256
    assert picks[1, 262_144] == picks[8, 32768] == picks[8, 100_000] == tiers[2] and block_tokens(tiers[2]) == 1024
    assert tiers[2].order and tiers[2].rowkey and tiers[2].hit_n and not tiers[0].rowkey
    assert picks[8, 262_144] == LARGE and block_tokens(LARGE) == 2048
    assert default_launch(3, 2500) == tiers[0] and default_launch(64, 1 << 20) == LARGE
    assert default_launch(8, 262_144, 5) == LARGE_SHORT and default_launch(8, 262_144, 6) == LARGE
    assert all(launch.poll_max_p == 256 and launch.words and launch.direct for launch in (*tiers, LARGE, LARGE_SHORT))


@pytest.mark.parametrize("tier", range(5), ids=["w1-128", "w1-256", "w4-1024-order", "w4-2048", "w4-2048-short"])
def test_rule_launches(tier):
    """Each launch the rule can pick, with the launcher's own grid (P from the cap): mixed lengths,
    a row shorter than the suffix, vocab-4 rows (every tile passes the hit test); these few
    programs per request take the polling fold, the same launches on the ticket path too.  WORDS and
    DIRECT's own cases: test_words_fold_paths."""
    from kernels.lookup_scan.bench import RULE_LAUNCHES
    from kernels.lookup_scan.triton import block_tokens, lookup_scan_fwd, workspace_numel

    for min_n, max_n in [(6, 12), (5, 5)]:
        for launch in (RULE_LAUNCHES[tier], RULE_LAUNCHES[tier].with_(poll_max_p=0)):
            S = 2 * block_tokens(launch) + 301  # interior and edge tiles; few programs (the interpreter's cost)
            tok = torch.cat([repetitive(2, S, 300, seed=11), torch.randint(0, 4, (2, S), dtype=torch.int32)])
            lens = torch.tensor([S, S - 223, 3, S - 1], dtype=torch.int32)
            ws = torch.zeros(workspace_numel(4), dtype=torch.int64, device=DEVICE)
            out = (torch.full((4, 7), -7, dtype=torch.int64, device=DEVICE),
                   torch.full((4,), -7, dtype=torch.int32, device=DEVICE))
            d, n = lookup_scan_fwd(tok.to(DEVICE), lens.to(DEVICE), min_n, max_n, 7, None, ws, out, None, launch)
            dr, nr = naive_lookup_scan(tok, lens, min_n, max_n, 7)
            assert torch.equal(n.cpu(), nr) and torch.equal(d.cpu(), dr), launch
            assert not ws.any()


@pytest.mark.skipif(not CUDA, reason="real lengths need CUDA")
@pytest.mark.parametrize("path", ["default", "tickets", "max-word"])
@pytest.mark.parametrize("S", [8192, 100_000, 262_144])
@pytest.mark.parametrize("min_n,max_n", [(5, 5), (6, 12)], ids=lambda x: str(x))
def test_real_lengths_gpu(S, min_n, max_n, path):
    """The default launcher at B8 (the polling fold at these grids), and its launch forced onto the
    ticket path (WORDS + DIRECT) and onto the plain max word; the second call folds into the
    outputs the first left (DIRECT's persistent outputs)."""
    from kernels.lookup_scan.config import default_launch
    from kernels.lookup_scan.triton import lookup_scan_fwd, workspace_numel

    tok = torch.cat([repetitive(4, S, 150_000, seed=S), torch.randint(0, 8, (4, S), dtype=torch.int32)])
    lens = torch.tensor([S, S - 1, S // 2 + 3, 1000, S, S - 5, 77, S // 3], dtype=torch.int32)
    ws = torch.zeros(workspace_numel(8), dtype=torch.int64, device=DEVICE)
    dr, nr = naive_lookup_scan(tok, lens, min_n, max_n, 7)
    out = (torch.full((8, 7), -7, dtype=torch.int64, device=DEVICE),
           torch.full((8,), -7, dtype=torch.int32, device=DEVICE))
    launch = default_launch(8, S, max_n)
    launch = {"default": launch, "tickets": launch.with_(poll_max_p=0),
              "max-word": launch.with_(poll_max_p=0, words=False)}[path]
    for _ in range(2):
        if path == "default":
            check(tok, lens, min_n, max_n, 7, workspace=ws)
            continue
        d, n = lookup_scan_fwd(tok.to(DEVICE), lens.to(DEVICE), min_n, max_n, 7, None, ws, out, None, launch)
        assert torch.equal(n.cpu(), nr) and torch.equal(d.cpu(), dr), path
        assert not ws.any()


@pytest.mark.skipif(not CUDA, reason="real lengths need CUDA")
@pytest.mark.parametrize("S", [100_000, 262_144])
@pytest.mark.parametrize("min_n,max_n", [(5, 5), (6, 12)], ids=lambda x: str(x))
@pytest.mark.parametrize("direct", [False, True], ids=["words", "direct"])
def test_words_real_lengths_gpu(S, min_n, max_n, direct):
    """WORDS and DIRECT (the default there) at batch 1 on the ticket path with 391 / 1,024 programs
    (the rule's 100K B1 tile), the programs racing for real: a quoting history, vocab-8 noise (no
    match or many), distinct tokens with one and with two earlier copies of the suffix; twice each
    (the line left zero)."""
    from kernels.lookup_scan.config import default_launch
    from kernels.lookup_scan.triton import lookup_scan_fwd, workspace_numel

    launch = default_launch(1, 100_000, max_n).with_(poll_max_p=0, direct=direct)
    base = torch.randperm(2_000_000, generator=torch.Generator().manual_seed(S))[:S].to(torch.int32)
    one = base.clone()
    one[S // 3:S // 3 + 12] = base[-12:]
    two = one.clone()
    two[S // 2:S // 2 + 12] = base[-12:]
    rows = [repetitive(1, S, 150_000, seed=S)[0], torch.randint(0, 8, (S,), dtype=torch.int32), base, one, two]
    ws = torch.zeros(workspace_numel(1), dtype=torch.int64, device=DEVICE)
    # One pair of outputs for every call (-7 at first): DIRECT folds into what the last call left.
    out = (torch.full((1, 7), -7, dtype=torch.int64, device=DEVICE),
           torch.full((1,), -7, dtype=torch.int32, device=DEVICE))
    for row in rows:
        tok, lens = row[None], torch.tensor([S], dtype=torch.int32)
        dr, nr = naive_lookup_scan(tok, lens, min_n, max_n, 7)
        for _ in range(2):
            d, n = lookup_scan_fwd(tok.to(DEVICE), lens.to(DEVICE), min_n, max_n, 7, None, ws, out, None, launch)
            assert torch.equal(n.cpu(), nr) and torch.equal(d.cpu(), dr)
            assert not ws.any()


@pytest.mark.skipif(not CUDA, reason="real lengths need CUDA")
@pytest.mark.parametrize("min_n,max_n", [(5, 5), (6, 12)], ids=lambda x: str(x))
def test_rule_launches_gpu(min_n, max_n):
    """Every launch the per-(B, S) rule may pick (bench.RULE_LAUNCHES), at an odd capacity with
    mixed lengths: idle programs, edge tiles, loops past the cap for the big tiles' neighbours."""
    from kernels.lookup_scan.bench import RULE_LAUNCHES, TEST_S
    from kernels.lookup_scan.triton import lookup_scan_fwd, workspace_numel

    S = TEST_S
    tok = torch.cat([repetitive(4, S, 150_000, seed=S), torch.randint(0, 8, (4, S), dtype=torch.int32)])
    lens = torch.tensor([S, S - 1, S // 2 + 3, 1000, S, S - 5, 77, S // 3], dtype=torch.int32)
    dr, nr = naive_lookup_scan(tok, lens, min_n, max_n, 7)
    ws = torch.zeros(workspace_numel(8), dtype=torch.int64, device=DEVICE)
    for launch in RULE_LAUNCHES:
        out = (torch.full((8, 7), -7, dtype=torch.int64, device=DEVICE),
               torch.full((8,), -7, dtype=torch.int32, device=DEVICE))
        d, n = lookup_scan_fwd(tok.to(DEVICE), lens.to(DEVICE), min_n, max_n, 7, None, ws, out, None, launch)
        assert torch.equal(n.cpu(), nr) and torch.equal(d.cpu(), dr), launch
        assert not ws.any()
