"""The busy loop's order for one 32k prompt: schedule chunk 1 (critical: before the worker can start),
[apply], schedule chunk 2, [apply], update chunk 1, update chunk 2 (finish), [apply]."""
import time, random, statistics, sys
from minivllm.core.scheduler import Scheduler
from minivllm.protocol.config import EngineConfig
from minivllm.protocol.messages import EngineCoreRequest, ModelRunnerOutput
from minivllm.protocol.sampling_params import SamplingParams
config = EngineConfig(model="none", tokenizer="none", max_model_len=40960, vocab_size=151936,
                      eos_token_ids=[2], block_size=16, max_num_seqs=256, max_num_batched_tokens=16384,
                      enable_prefix_caching=True)
s = Scheduler(config, 39405)
new = hasattr(s, "apply_deferred_block_updates")
if new: s.defer_block_updates = True
else: s.defer_frees = True
apply = s.apply_deferred_block_updates if new else s.free_finished_blocks
crit, after, tail = [], [], []
for it in range(30):
    prompt = [random.randrange(151000) for _ in range(32000)]
    s.add_request(EngineCoreRequest(request_id=f"r{it}", prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=1), arrival_time=0.0, eos_token_ids=[2]))
    t0 = time.perf_counter(); o1 = s.schedule(); t1 = time.perf_counter(); apply(); t2 = time.perf_counter()
    o2 = s.schedule(); apply()
    s.update_from_output(o1, ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
    t3 = time.perf_counter(); s.update_from_output(o2, ModelRunnerOutput(req_ids=[f"r{it}"], sampled_token_ids=[5])); t4 = time.perf_counter()
    apply()
    if it >= 5: crit.append(t1 - t0); after.append(t2 - t1); tail.append(t4 - t3)
print("new" if new else "base", f"first chunk schedule() {1e3*statistics.median(crit):.2f} ms; deferred work after submit {1e3*statistics.median(after):.2f} ms; last update {1e3*statistics.median(tail):.3f} ms")
