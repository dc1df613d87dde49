import time, numpy as np, msgspec
from minivllm.protocol.messages import EngineCoreRequest, AddRequests
from minivllm.protocol.sampling_params import SamplingParams
from minivllm.protocol.serial import encode, engine_input_decoder
from minivllm.protocol.validation import validate_request, EngineLimits
rng = np.random.default_rng(0)
reqs = [EngineCoreRequest(request_id=f"abcdefgh-{i}", prompt_token_ids=rng.integers(0, 151000, size=int(k)).tolist(),
        sampling_params=SamplingParams(temperature=1.0, max_tokens=256, ignore_eos=True), arrival_time=time.time())
        for i, k in enumerate(rng.integers(100, 1025, size=256))]
lim = EngineLimits(vocab_size=151936, max_model_len=40960, num_gpu_blocks=100000, block_size=16, scheduling_policy="fcfs")
for _ in range(3):
    t0 = time.perf_counter(); data = encode(AddRequests(reqs)); t1 = time.perf_counter()
    m = engine_input_decoder.decode(data); t2 = time.perf_counter()
    for r in m.requests: validate_request(r, lim, wire=True)
    t3 = time.perf_counter()
    print(f"{len(data)/1e3:.0f} KB: encode {1e3*(t1-t0):.2f} ms, decode {1e3*(t2-t1):.2f}, validate {1e3*(t3-t2):.2f}")
