import time, statistics, torch, sparsecomm, sys
torch.set_num_threads(1)
n = 25_000_000
gen = torch.Generator().manual_seed(0)
x = torch.randn(n, generator=gen); out = torch.empty(n)
for mode in ("out", "plain"):
    st = sparsecomm.registry.get("oktopk").state_class(0.01, error_feedback=True)
    ts, acc = [], []
    for i in range(16):
        x.mul_(0.9).add_(torch.randn(n, generator=gen), alpha=0.1)
        t0 = time.perf_counter()
        sparsecomm.allreduce(x, state=st, **({"out": out} if mode == "out" else {}))
        if i >= 6:
            ts.append(time.perf_counter() - t0); acc.append(st.last.phases["accumulate"].seconds)
    print(sys.argv[1], mode, f"call {statistics.median(ts)*1e3:.1f} ms accumulate {statistics.median(acc)*1e3:.1f} ms", flush=True)
