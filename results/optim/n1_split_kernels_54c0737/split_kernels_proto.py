"""split_masters' passes on one GPU at 8B's shards of 2 ranks (33 groups, 3.62B elements): the committed Triton
kernels (odcfsdp/kernels/split_bits.py, through split_low_bits / join_low_bits) against the torch.compile passes
they replace (the same operators, inline here), host-issue and device time, and their bits compared."""
import statistics, time, torch
from odcfsdp.sharding.groups.split_master import _join_pass, _split_pass, join_low_bits, split_low_bits

_split_c = torch.compile(_split_pass, dynamic=True)
_join_c = torch.compile(_join_pass, dynamic=True)


def compiled_split(m, h, stale):
    low, bad = _split_c(m.view(torch.int32).view(-1), h.view(torch.int16).view(-1))
    stale.logical_or_(bad)
    return low


def compiled_join(h, low, out):
    _join_c(h.view(torch.int16).view(-1), low.view(-1), out.view(torch.int32).view(-1))


dev = torch.device("cuda")
P, G = 3_620_000_000, 33
n = P // G
masters = [torch.empty(n, device=dev).normal_(0, 0.02) for _ in range(G)]
rows = [m.to(torch.bfloat16) for m in masters]
GB = P * 8 / 1e9


def timeit(fn, reps=5):
    """(host ms to issue, device ms with the host out of the way: queued behind a spinning kernel)."""
    host, devs = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter(); fn(); host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200_000_000)
        s.record(); fn(); e.record(); e.synchronize(); devs.append(s.elapsed_time(e))
    return statistics.median(host), statistics.median(devs)


flag, flag_c = torch.zeros((), dtype=torch.int32, device=dev), torch.zeros((), dtype=torch.bool, device=dev)
lk, lc = split_low_bits(masters[0], rows[0], flag), compiled_split(masters[0], rows[0], flag_c)
jk, jc = torch.empty_like(masters[0]), torch.empty_like(masters[0])
join_low_bits(rows[0], lk, jk); compiled_join(rows[0], lc, jc)
print(f"low bits equal: {torch.equal(lk, lc)}; joins equal: {torch.equal(jk.view(torch.int32), jc.view(torch.int32))}; "
      f"flags {int(flag)} {bool(flag_c)}")
stale_row = rows[1].clone(); stale_row[n - 5] = 1.0; stale_row[17] = -2.0
split_low_bits(masters[1], stale_row, flag); compiled_split(masters[1], stale_row, flag_c)
print(f"a stale row flagged: kernels {int(flag)}, compiled {bool(flag_c)}")

lows = [None] * G
def loop_split(f, fl):
    def run():
        for i in range(G): lows[i] = f(masters[i], rows[i], fl)
    return run
def loop_join(f):
    def run():
        for i in range(G): f(rows[i], lows[i], masters[i])
    return run

print("| pass, 33 groups | host ms to issue | device ms | device GB/s |")
print("|---|---|---|---|")
for name, fn in [("split, torch.compile (before)", loop_split(compiled_split, flag_c)),
                 ("join, torch.compile (before)", loop_join(compiled_join)),
                 ("split, Triton kernels (now)", loop_split(split_low_bits, flag)),
                 ("join, Triton kernels (now)", loop_join(join_low_bits))]:
    fn()
    h, d = timeit(fn)
    print(f"| {name} | {h:.2f} | {d:.2f} | {GB / d * 1e3:.0f} |")
x = torch.empty(P // 2, device=dev); y = torch.empty_like(x)
_, ms = timeit(lambda: y.copy_(x)); print(f"a copy of the same bytes: {P * 4 / 1e9 / ms * 1e3:.0f} GB/s (read + write)")
