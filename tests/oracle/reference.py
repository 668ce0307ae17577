"""Naive pure-Python references of the oracle's policies, and a cache simulator that replays plans."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch

from torchrec_lookahead.oracle import OracleConfig
from torchrec_lookahead.oracle.window import window_rng

INF = float("inf")
Steps = List[Tuple[Set[int], Set[int]]]  # per step: (fetched ids, evicted ids)


def first_order_unique(ids: Sequence[int]) -> List[int]:
    return list(dict.fromkeys(int(i) for i in ids))


def random_trace(seed: int, steps: int, batch: int, rows: int, alpha: float = 1.1) -> List[np.ndarray]:
    """Zipf-like ids over ``rows`` shuffled through a permutation."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(rows)
    ranks = np.arange(1, rows + 1, dtype=np.float64)
    p = ranks**-alpha
    p /= p.sum()
    return [perm[rng.choice(rows, size=batch, p=p)].astype(np.int64) for _ in range(steps)]


def min_rows(trace: Sequence[np.ndarray], depth: int) -> int:
    return max(len(set(np.concatenate(trace[t : t + depth + 1]).tolist())) for t in range(len(trace)))


def ref_fixed(
    trace: Sequence[np.ndarray], cap: int, horizon: int, depth: int, policy: str, past_horizon: str = "reuse"
) -> Steps:
    """Belady (furthest next use within the horizon; past it, with ``past_horizon="reuse"``, first the ids not
    read again since their fetch by recency, then by predicted next read (last read + last interval), furthest
    first; ties by recency) or LRU, one id at a time."""
    T = len(trace)
    sets = [set(b.tolist()) for b in trace]
    resident: Dict[int, Tuple[int, int]] = {}  # id -> (last use, position)
    predicted: Dict[int, int] = {}  # resident id read again since its fetch -> its predicted next read
    out: Steps = []
    for t in range(T):
        uniq = first_order_unique(trace[t])
        miss = [x for x in uniq if x not in resident]
        need = len(resident) + len(miss) - cap
        victims: List[int] = []
        if need > 0:

            def next_use(x: int, t: int = t) -> float:
                for s in range(t, min(t + horizon, T - 1) + 1):
                    if x in sets[s]:
                        return s
                return INF

            def belady_key(x: int) -> Tuple[int, float, Tuple[int, int]]:
                nxt = next_use(x)
                if nxt != INF:
                    return (2, -nxt, resident[x])
                if past_horizon == "reuse" and x in predicted:
                    return (1, -predicted[x], resident[x])
                return (0, 0, resident[x])

            cands = [x for x in resident if next_use(x) > t + depth]
            if policy == "belady":
                cands.sort(key=belady_key)
            else:
                cands.sort(key=lambda x: resident[x])
            assert len(cands) >= need
            victims = cands[:need]
        for v in victims:
            del resident[v]
            predicted.pop(v, None)
        for i, x in enumerate(uniq):
            if x in resident:
                predicted[x] = 2 * t - resident[x][0]
            resident[x] = (t, i)
        out.append((set(miss), set(victims)))
    return out


def ref_ttl(trace: Sequence[np.ndarray], horizon: int) -> Steps:
    """Bagpipe Algorithm 1: keep an id iff it is used again within the horizon."""
    T = len(trace)
    sets = [set(b.tolist()) for b in trace]
    resident: Set[int] = set()
    pending: Set[int] = set()
    out: Steps = []
    for t in range(T):
        evicted = set(pending)
        resident -= pending
        uniq = first_order_unique(trace[t])
        miss = {x for x in uniq if x not in resident}
        resident |= miss
        pending = {
            x for x in uniq if not any(x in sets[s] for s in range(t + 1, min(t + horizon, T - 1) + 1))
        }
        out.append((miss, evicted))
    return out


def ref_window(
    trace: Sequence[np.ndarray], cfg: OracleConfig, name: str
) -> List[Tuple[Dict[int, int], Set[int]]]:
    """cDLRM window rule with per-set loops; per step (fetched id -> slot, evicted ids)."""
    T, L, P, ways, cap = len(trace), cfg.window, cfg.prefetch_depth, cfg.ways, cfg.capacity[name]
    sets = cfg.num_sets(name)
    sw = sets * ways
    rng = window_rng(cfg.seed, name)
    slot_id: List[Optional[int]] = [None] * cap
    where: Dict[int, int] = {}
    out: List[Tuple[Dict[int, int], Set[int]]] = []
    for t in range(T):
        fetched: Dict[int, int] = {}
        evicted: Set[int] = set()
        if t % L == 0:
            win = first_order_unique(np.concatenate(trace[t : t + L]))
            pin_ids = set(np.concatenate(trace[t : t + max(L, P + 1)]).tolist())
            if cfg.direct_mapped(name):
                for x in win:
                    if x not in where:
                        where[x] = x
                        fetched[x] = x
                out.append((fetched, evicted))
                continue
            pinned = {where[x] for x in pin_ids if x in where}
            for s in range(sw, cap):
                x = slot_id[s]
                if x is not None and s not in pinned:
                    evicted.add(x)
                    del where[x]
                    slot_id[s] = None
            rand = rng.random((sets, ways))
            miss = [x for x in win if x not in where]
            overflow = []
            for st in range(sets):
                mine = [x for x in miss if x % sets == st]
                if not mine:
                    continue
                free = [w for w in range(ways) if slot_id[st * ways + w] is None]
                unpinned = [
                    w
                    for w in range(ways)
                    if slot_id[st * ways + w] is not None and st * ways + w not in pinned
                ]
                unpinned.sort(key=lambda w: rand[st, w])
                order = free + unpinned
                for r, x in enumerate(mine):
                    if r >= len(order):
                        overflow.append(x)
                        continue
                    s = st * ways + order[r]
                    old = slot_id[s]
                    if old is not None:
                        evicted.add(old)
                        del where[old]
                    slot_id[s] = x
                    where[x] = s
                    fetched[x] = s
            free_victim = [s for s in range(sw, cap) if slot_id[s] is None]
            assert len(overflow) <= len(free_victim)
            for x, s in zip(overflow, free_victim):
                slot_id[s] = x
                where[x] = s
                fetched[x] = s
        out.append((fetched, evicted))
    return out


def replay(
    trace_by_table: Dict[str, Sequence[np.ndarray]], plans: Sequence, cfg: OracleConfig
) -> Dict[str, Steps]:
    """Apply plans to a simulated cache, checking every invariant; returns per table (fetched, evicted) sets."""
    out: Dict[str, Steps] = {}
    for name, trace in trace_by_table.items():
        cap = cfg.capacity[name]
        depth = cfg.prefetch_depth
        cache: Dict[int, int] = {}  # slot -> id
        where: Dict[int, int] = {}  # id -> slot
        steps: Steps = []
        assert [p.step for p in plans] == list(range(len(trace)))
        for t, plan in enumerate(plans):
            tp = plan.tables[name]
            for tensor in (tp.evict_ids, tp.evict_slots, tp.fetch_ids, tp.fetch_slots, tp.slots):
                assert isinstance(tensor, torch.Tensor) and tensor.dtype == torch.int64 and tensor.dim() == 1
            needed = set(np.concatenate(trace[t : t + depth + 1]).tolist())
            ev = list(zip(tp.evict_ids.tolist(), tp.evict_slots.tolist()))
            for i, s in ev:
                assert cache.get(s) == i, f"step {t}: evicting id {i} from slot {s} holding {cache.get(s)}"
                assert i not in needed, f"step {t}: evicted id {i} needed within prefetch_depth"
                del cache[s]
                del where[i]
            fe = list(zip(tp.fetch_ids.tolist(), tp.fetch_slots.tolist()))
            for i, s in fe:
                assert i not in where, f"step {t}: id {i} fetched while resident"
                assert s not in cache and 0 <= s < cap, f"step {t}: fetch into slot {s}"
                cache[s] = i
                where[i] = s
            assert len(cache) <= cap
            ids = trace[t].tolist()
            assert tp.slots.tolist() == [where[i] for i in ids], f"step {t}: slots wrong"
            steps.append(({i for i, _ in fe}, {i for i, _ in ev}))
        out[name] = steps
    return out
