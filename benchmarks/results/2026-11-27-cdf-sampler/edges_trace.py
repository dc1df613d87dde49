import glob, sys
d = sys.argv[1]
ev = []
for f in glob.glob(d + "/trace-*.txt"):
    for line in open(f):
        t, pid, tid, label = line.rstrip("\n").split(" ", 3)
        ev.append((float(t), pid, tid, label))
ev.sort()
starts = [e[0] for e in ev if e[3] == "> LLM._run"]
ends = [e[0] for e in ev if e[3] == "< LLM._run"]
t0, t1 = starts[-1], ends[-1]
print(f"measured _run: {1e3*(t1-t0):.1f} ms")
skip = tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else ("_receive_frames", "EngineCoreClient._receive")
for t, pid, tid, label in ev:
    if t0 <= t <= t0 + 0.110 and not any(s in label for s in skip):
        print(f"{1e3*(t-t0):9.3f} {pid} {tid} {label}")
print("--- end")
for t, pid, tid, label in ev:
    if t1 - 0.030 <= t <= t1 and not any(s in label for s in skip):
        print(f"{1e3*(t-t1):9.3f} {pid} {tid} {label}")
