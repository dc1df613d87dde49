"""Helpers shared by cluster_sweep.py and cluster_all.py (run from this folder, the tree with
tried_clusters.diff applied): the shapes, the cluster shapes tried, a graph timer, and the rule for a
valid cluster."""
import statistics
import torch

dev = torch.device("cuda")
SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
NSM = torch.cuda.get_device_properties(dev).multi_processor_count
CLUSTERS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4), (4, 2), (2, 4), (8, 1), (1, 8)]


def graph_time(fn, reps=25):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return statistics.median(times)


def valid(t, n, how):
    ntt = -(-t // how.token_tile)
    cr, ct = how.cluster_rows, how.cluster_tokens
    return ((n // 64) % cr == 0 and ntt % ct == 0 and (how.token_tile // cr) % 8 == 0
            and (ntt - 1) * how.token_tile + (cr - 1) * (how.token_tile // cr) < t)


