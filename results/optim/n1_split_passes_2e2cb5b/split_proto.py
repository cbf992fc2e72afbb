import statistics, torch, triton, triton.language as tl
from odcfsdp.sharding.groups.split_master import split_low_bits, join_low_bits

@triton.jit
def _split_kernel(m_ptr, h_ptr, low_ptr, bad_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    m = tl.load(m_ptr + offs, mask=mask, other=0)
    h = tl.load(h_ptr + offs, mask=mask, other=0).to(tl.int32)
    d = tl.where((h & 0x7FFF) > 0x7F80, 0, m - (h << 16))
    bad = tl.max(((d > 32768) | (d < -32768)).to(tl.int32), axis=0)
    d = tl.minimum(tl.maximum(d, -32768), 32767)
    tl.store(low_ptr + offs, d.to(tl.int16), mask=mask)
    if bad > 0:
        tl.store(bad_ptr, 1)

@triton.jit
def _join_kernel(h_ptr, low_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    h = tl.load(h_ptr + offs, mask=mask, other=0).to(tl.int32)
    d = tl.load(low_ptr + offs, mask=mask, other=0).to(tl.int32)
    tl.store(out_ptr + offs, (h << 16) + d, mask=mask)

def tsplit(m, h, bad):
    low = torch.empty(m.shape, dtype=torch.int16, device=m.device)
    n = m.numel(); B = 4096
    _split_kernel[(triton.cdiv(n, B),)](m.view(torch.int32), h.view(torch.int16), low, bad, n, BLOCK=B, num_warps=8)
    return low

def tjoin(h, low, out):
    n = h.numel(); B = 4096
    _join_kernel[(triton.cdiv(n, B),)](h.view(torch.int16), low, out.view(torch.int32), n, BLOCK=B, num_warps=8)

dev = torch.device("cuda")
P = 3_620_000_000  # 8B over 2 ranks
G = 33
n = P // G
masters = [torch.empty(n, device=dev).normal_(0, 0.02) for _ in range(G)]
rows = [m.to(torch.bfloat16) for m in masters]
ref = [m.clone() for m in masters[:2]]
bad = torch.zeros((), dtype=torch.int32, device=dev)
stale = torch.zeros((), dtype=torch.bool, device=dev)

def timeit(fn, reps=5):
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
    return statistics.median(ts)

# correctness: triton vs compiled
lc = split_low_bits(masters[0], rows[0], stale)
lt = tsplit(masters[0], rows[0], bad)
print("split equal:", torch.equal(lc, lt), "bad", int(bad), "stale", bool(stale))
o = torch.empty_like(masters[0]); tjoin(rows[0], lt, o); print("join exact:", torch.equal(o.view(torch.int32), masters[0].view(torch.int32)))
GB = P * 8 / 1e9
lows = [None] * G
def c_split():
    for i in range(G): lows[i] = split_low_bits(masters[i], rows[i], stale)
def c_join():
    for i in range(G): join_low_bits(rows[i], lows[i], masters[i])
def t_split():
    for i in range(G): lows[i] = tsplit(masters[i], rows[i], bad)
def t_join():
    for i in range(G): tjoin(rows[i], lows[i], masters[i])
for name, fn in [("compiled split", c_split), ("compiled join", c_join), ("triton split", t_split), ("triton join", t_join)]:
    fn(); ms = timeit(fn); print(f"{name}: {ms:.2f} ms, {GB/ms*1e3:.0f} GB/s")
x = torch.empty(P // 2, device=dev); y = torch.empty_like(x)
ms = timeit(lambda: y.copy_(x)); print(f"copy {P*4/1e9/ms*1e3:.0f} GB/s (r+w)")
print("masters exact after all:", torch.equal(masters[0].view(torch.int32), ref[0].view(torch.int32)))
