"""A model of the trans kernel's synchronisation (src/cuda/verify_trans.cuh), no GPU needed: its four warpgroups
(score, value 0, value 1, producer) as coroutines that follow the kernel's waits and arrivals, mbarriers with phase
parity, named barriers with generations, random interleavings and key copies that land in random order. It checks
that no schedule deadlocks and that nothing is written while a reader still needs the old value: P^T / alpha
(p_full / p_empty), a key buffer (full / empty), the row statistics of item k (row_l[k % 2], stats_full / stats_empty).

    python benchmarks/sim_trans_protocol.py [runs] [mutation]   # default 2000 random block histories, no mutation

A mutation breaks one rule of the protocol, and the model must then fail (tests/test_sim_trans.py checks both ways):
    no_p_empty_wait      the score warpgroup writes P^T without waiting for the value warpgroups   -> hazard
    no_stats_full_wait   the value warpgroups read item k's row statistics before they are stored  -> hazard
    no_full_wait_ahead   it issues S^T(t + 1) without waiting for tile t + 1 to land             -> hazard
    producer_parity      the producer's first pass waits on the wrong parity of empty[b]         -> deadlock
    value1_no_release    value warpgroup 1 never releases its key buffers                        -> deadlock
Session 14 (the kernel as it runs since history 104: S^T(t + 1) beside tile t's softmax, the row statistics on
mbarriers): 3,000 runs clean, each mutation caught. Dropping the score warpgroup's stats_empty wait is not caught: while
every item has a tile (each split holds >= 1 key), its first p_empty wait of item k + 2 already orders the store after
the value warpgroups' reads of item k; the kernel keeps the wait, which does not rest on that. Keep it in step with the
kernel.
"""
import random
import sys

STAGES = 3
MUTATIONS = ("no_p_empty_wait", "no_stats_full_wait", "no_full_wait_ahead", "producer_parity", "value1_no_release")


class Hazard(AssertionError):
    """A write while a reader still needs the old value, or a read of the wrong value."""


class Deadlock(RuntimeError):
    """No role can move on."""


def check(ok, *what):
    if not ok:
        raise Hazard(*what)


class MBar:
    """An mbarrier: `count` arrivals complete a phase; a wait for parity P passes once the phase of parity P is done."""

    def __init__(self, count):
        self.count, self.pending, self.done = count, count, 0   # done: completed phases

    def arrive(self, n):
        self.pending -= n
        assert self.pending >= 0, "more arrivals than the phase's count"
        if self.pending == 0:
            self.done += 1
            self.pending = self.count

    def ready(self, parity):
        return (self.done & 1) != parity


class NamedBar:
    """A named barrier (bar.sync / bar.arrive): a generation ends when `count` threads have arrived."""

    def __init__(self, count):
        self.count, self.arrived, self.gen = count, 0, 0

    def arrive(self, n):
        self.arrived += n
        assert self.arrived <= self.count
        if self.arrived == self.count:
            self.arrived = 0
            self.gen += 1


def run(seed, mutation=None):
    assert mutation is None or mutation in MUTATIONS, mutation
    rng = random.Random(seed)
    items = [rng.randint(1, 5) for _ in range(rng.randint(1, 5))]   # tiles of each of the block's items
    total = len(items)
    mb = dict(p_full=MBar(128), p_empty=MBar(256), item_full0=MBar(1), item_full1=MBar(1),
              item_empty0=MBar(512), item_empty1=MBar(512), stats_full0=MBar(128), stats_full1=MBar(128),
              stats_empty0=MBar(256), stats_empty1=MBar(256))
    for b in range(STAGES):
        mb[f"full{b}"] = MBar(128)
        mb[f"empty{b}"] = MBar(256)
    nb = dict(pfull=NamedBar(384))
    slot = [None, None]
    inflight = []   # (buffer, tile) copies issued, not yet landed
    st = dict(pt_tile=None, pt_readers=set(), kv_tile=[None] * STAGES, landed=[None] * STAGES, kv_needed={},
              rowl={}, rowl_unread={0: set(), 1: set()})
    claimed = [0]

    def wait(bar, parity):
        while not mb[bar].ready(parity):
            yield ("wait", bar, parity, mb[bar].done, mb[bar].pending)

    def bsync(name, n):
        gen = nb[name].gen
        nb[name].arrive(n)
        while nb[name].gen == gen:
            yield ("bar.sync", name, nb[name].arrived)

    def fetch(k, role):   # wg::fetch_item_ahead; a warpgroup arrives 128 times on item_empty
        if role == "producer":
            if k >= 2:
                yield from wait(f"item_empty{k & 1}", ((k >> 1) - 1) & 1)
            slot[k & 1] = claimed[0]
            claimed[0] += 1
            mb[f"item_full{k & 1}"].arrive(1)
        yield from wait(f"item_full{k & 1}", (k >> 1) & 1)
        item = slot[k & 1]
        mb[f"item_empty{k & 1}"].arrive(128)
        return item

    def scores_begin(tile, wait_full=True):   # s_begin + the first wgmma of S^T(tile): it reads buffer tile % 3
        b = tile % STAGES
        if wait_full:
            yield from wait(f"full{b}", (tile // STAGES) & 1)
        check(st["kv_tile"][b] == tile and st["landed"][b] == tile, "S^T reads a tile not landed", tile)

    def scores_end(tile):   # wg_wait0: S^T(tile) done, the score warpgroup has read the buffer
        check(st["kv_tile"][tile % STAGES] == tile, "key buffer overwritten during S^T", tile)
        st["kv_needed"][tile].discard("score")

    def score():
        seq = 0
        for k in range(1 << 30):
            item = yield from fetch(k, "score")
            if item >= total:
                return
            n = items[item]
            if n > 0:   # the item's first S^T, waited for
                yield from scores_begin(seq)
                yield
                scores_end(seq)
            for t in range(n):
                if t + 1 < n:   # S^T(t + 1) in pieces beside tile t's softmax
                    yield from scores_begin(seq + 1, wait_full=mutation != "no_full_wait_ahead")
                yield   # softmax_max(t): scale, mask, column maxima (a named barrier of the score warpgroup)
                if seq > 0 and mutation != "no_p_empty_wait":
                    yield from wait("p_empty", (seq - 1) & 1)
                check(not st["pt_readers"], "P^T written while read", seq, st["pt_readers"])
                st["pt_tile"] = seq
                yield   # the P^T stores, then publish
                mb["p_full"].arrive(128)
                nb["pfull"].arrive(128)   # bar.arrive
                if t + 1 < n:
                    yield
                    scores_end(seq + 1)
                seq += 1
            yield   # the column sums over the warpgroup (shuffles, lred, a named barrier of the score warpgroup)
            if k >= 2:
                yield from wait(f"stats_empty{k & 1}", ((k >> 1) - 1) & 1)
            check(not st["rowl_unread"][k & 1], "row_l overwritten before read", k)
            st["rowl"][k & 1] = k
            st["rowl_unread"][k & 1] = {"value0", "value1"}
            mb[f"stats_full{k & 1}"].arrive(128)
            yield from wait(f"stats_full{k & 1}", (k >> 1) & 1)   # its own read of them (write_partial_lse)

    def value(v):
        name = f"value{v}"
        seq = 0
        for k in range(1 << 30):
            item = yield from fetch(k, name)
            if item >= total:
                return
            for _ in range(items[item]):
                b = seq % STAGES
                yield from bsync("pfull", 128)
                yield from wait("p_full", seq & 1)
                yield from wait(f"full{b}", (seq // STAGES) & 1)
                check(st["pt_tile"] == seq, "O^T reads another tile's P^T", seq, st["pt_tile"])
                check(st["kv_tile"][b] == seq and st["landed"][b] == seq, "O^T reads a tile not landed", seq)
                st["pt_readers"].add(name)
                yield   # O^T runs
                check(st["pt_tile"] == seq and st["kv_tile"][b] == seq, "operand overwritten during O^T", seq)
                st["pt_readers"].discard(name)
                mb["p_empty"].arrive(128)
                st["kv_needed"][seq].discard(name)
                if not (mutation == "value1_no_release" and v == 1):
                    mb[f"empty{b}"].arrive(128)
                seq += 1
            if mutation != "no_stats_full_wait":
                yield from wait(f"stats_full{k & 1}", (k >> 1) & 1)
            check(st["rowl"].get(k & 1) == k, "row_l of another item", k)
            yield   # the stores read row_l
            st["rowl_unread"][k & 1].discard(name)
            mb[f"stats_empty{k & 1}"].arrive(128)

    def producer():
        seq = 0
        for k in range(1 << 30):
            item = yield from fetch(k, "producer")
            if item >= total:
                while inflight:   # cp.async.wait_all
                    yield ("wait_all",)
                return
            for _ in range(items[item]):
                b = seq % STAGES
                parity = ((seq // STAGES) & 1) ^ (0 if mutation == "producer_parity" else 1)
                yield from wait(f"empty{b}", parity)
                old = st["kv_tile"][b]
                check(old is None or not st["kv_needed"][old], "key buffer refilled while needed", old)
                st["kv_tile"][b] = seq
                st["landed"][b] = None
                st["kv_needed"][seq] = {"score", "value0", "value1"}
                inflight.append((b, seq))   # lands later: cp.async.mbarrier.arrive.noinc on full[b]
                seq += 1
                yield

    alive = {"score": score(), "value0": value(0), "value1": value(1), "producer": producer()}
    where = {}
    steps = 0
    while alive:
        steps += 1
        if steps > 100000:
            raise Deadlock(f"items {items}, copies in flight {inflight}, roles {where}")
        if inflight and rng.random() < 0.3:   # a tile's copies land
            b, tile = inflight.pop(rng.randrange(len(inflight)))   # tiles of different buffers in any order
            st["landed"][b] = tile
            mb[f"full{b}"].arrive(128)
            continue
        name = rng.choice(list(alive))
        try:
            where[name] = next(alive[name])
        except StopIteration:
            del alive[name]
    assert claimed[0] >= total + 1, claimed   # every item claimed, and the one past the end that stops the roles


def sweep(runs, mutation=None):
    """The first failure (Hazard or Deadlock) over `runs` random histories, or None."""
    for seed in range(runs):
        try:
            run(seed, mutation)
        except (Hazard, Deadlock) as e:
            return e
    return None


if __name__ == "__main__":
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    mutation = sys.argv[2] if len(sys.argv) > 2 else None
    failure = sweep(runs, mutation)
    if failure is None:
        print(f"no deadlock, no hazard in {runs} random runs" + (f" (mutation {mutation})" if mutation else ""))
    else:
        print(f"{type(failure).__name__}: {failure}" + (f" (mutation {mutation})" if mutation else ""))
    sys.exit(0 if (failure is None) == (mutation is None) else 1)
