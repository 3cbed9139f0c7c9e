"""A model of the trans kernel's synchronisation (src/cuda/verify_trans.cuh), no GPU needed: its four warpgroups
(score, value 0, value 1, producer) as coroutines that follow the kernel's waits and arrivals, mbarriers with phase
parity, named barriers with generations, random interleavings and key copies that land in random order. It checks
that no schedule deadlocks and that nothing is written while a reader still needs the old value: P^T / alpha
(p_full / p_empty), a key buffer (full / empty), the row sums of item k (row_l[k % 2]).

    python benchmarks/sim_trans_protocol.py [runs]      # default 2000 random block histories

Session 13 (the kernel not yet run on a GPU): 3,000 runs clean, and each of four mutations of the protocol is caught:
no p_empty wait before P^T (hazard), one row_l buffer instead of two (hazard), the producer's first pass waiting on
the wrong parity (deadlock), one value warpgroup not releasing its buffers (deadlock). Keep it in step with the kernel.
"""
import random
import sys

STAGES = 3


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


def run(seed):
    rng = random.Random(seed)
    items = [rng.randint(1, 5) for _ in range(rng.randint(1, 4))]   # tiles of each of the block's items
    total = len(items)
    mb = dict(p_full=MBar(128), p_empty=MBar(256), item_full0=MBar(1), item_full1=MBar(1),
              item_empty0=MBar(512), item_empty1=MBar(512))
    for b in range(STAGES):
        mb[f"full{b}"] = MBar(128)
        mb[f"empty{b}"] = MBar(256)
    nb = dict(pfull=NamedBar(384), block=NamedBar(384))
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

    def score():
        seq = 0
        for k in range(1 << 30):
            item = yield from fetch(k, "score")
            if item >= total:
                return
            for _ in range(items[item]):
                b = seq % STAGES
                yield from wait(f"full{b}", (seq // STAGES) & 1)
                assert st["kv_tile"][b] == seq and st["landed"][b] == seq, ("S^T reads a tile not landed", seq)
                yield   # S^T runs
                assert st["kv_tile"][b] == seq, "key buffer overwritten during S^T"
                st["kv_needed"][seq].discard("score")
                if seq > 0:
                    yield from wait("p_empty", (seq - 1) & 1)
                assert not st["pt_readers"], ("P^T written while read", seq, st["pt_readers"])
                st["pt_tile"] = seq
                mb["p_full"].arrive(128)
                nb["pfull"].arrive(128)   # bar.arrive
                seq += 1
            assert not st["rowl_unread"][k & 1], ("row_l overwritten before read", k)
            st["rowl"][k & 1] = k
            st["rowl_unread"][k & 1] = {"value0", "value1"}
            yield from bsync("block", 128)

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
                assert st["pt_tile"] == seq, ("O^T reads another tile's P^T", seq, st["pt_tile"])
                assert st["kv_tile"][b] == seq and st["landed"][b] == seq
                st["pt_readers"].add(name)
                yield   # O^T runs
                assert st["pt_tile"] == seq and st["kv_tile"][b] == seq, "operand overwritten during O^T"
                st["pt_readers"].discard(name)
                mb["p_empty"].arrive(128)
                st["kv_needed"][seq].discard(name)
                mb[f"empty{b}"].arrive(128)
                seq += 1
            yield from bsync("block", 128)
            assert st["rowl"][k & 1] == k, ("row_l of another item", k)
            yield   # the stores read row_l
            st["rowl_unread"][k & 1].discard(name)

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
                yield from wait(f"empty{b}", ((seq // STAGES) & 1) ^ 1)
                old = st["kv_tile"][b]
                assert old is None or not st["kv_needed"][old], ("key buffer refilled while needed", old)
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
            raise RuntimeError(f"deadlock: items {items}, copies in flight {inflight}, roles {where}")
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


if __name__ == "__main__":
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    for seed in range(runs):
        run(seed)
    print(f"no deadlock, no hazard in {runs} random runs")
