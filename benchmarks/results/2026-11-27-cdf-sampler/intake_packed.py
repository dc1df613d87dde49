import time, numpy as np, msgspec, array
from minivllm.protocol.messages import pack_token_ids, unpack_token_ids
rng = np.random.default_rng(0)
lists = [rng.integers(0, 151000, size=int(k)).tolist() for k in rng.integers(100, 1025, size=256)]
class R(msgspec.Struct):
    ids: list[int] | bytes
class B(msgspec.Struct):
    rs: list[R]
enc = msgspec.msgpack.Encoder(); dec = msgspec.msgpack.Decoder(B)
for _ in range(3):
    t0 = time.perf_counter(); data = enc.encode(B([R(l) for l in lists])); t1 = time.perf_counter(); m = dec.decode(data); t2 = time.perf_counter()
    t3 = time.perf_counter(); packed = [pack_token_ids(l) for l in lists]; t4 = time.perf_counter()
    data2 = enc.encode(B([R(p) for p in packed])); t5 = time.perf_counter(); m2 = dec.decode(data2); t6 = time.perf_counter()
    ok = all(0 <= (a := np.frombuffer(r.ids, "<i4")).min() and a.max() < 151936 for r in m2.rs); t7 = time.perf_counter()
    back = [unpack_token_ids(r.ids) for r in m2.rs]; t8 = time.perf_counter()
    print(f"list: encode {1e3*(t1-t0):.2f} decode {1e3*(t2-t1):.2f} | packed: pack {1e3*(t4-t3):.2f} encode {1e3*(t5-t4):.2f} decode {1e3*(t6-t5):.2f} check {1e3*(t7-t6):.2f} unpack {1e3*(t8-t7):.2f}")
