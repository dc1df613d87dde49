"""ModelRunner driven in-process by a toy scheduler: greedy tokens must equal HF transformers'.

`ToyScheduler` plays the EngineCore's part of the contract: it hands out KV blocks from a
shuffled free list (so block tables are non-contiguous), schedules up to `chunk_size` tokens
per request per step (whole prompt at once, or chunked prefill), lets requests arrive late
and optionally preempts one, and sends new requests in full and running ones as deltas.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from minivllm.protocol.config import EngineConfig
from minivllm.protocol.messages import CachedRequestData, NewRequestData, SchedulerOutput
from minivllm.protocol.sampling_params import SamplingParams
from tests.tiny_models import ARCHS
from minivllm.worker.model_runner import ModelRunner

NUM_BLOCKS = 256
PROMPT_LENS = [1, 6, 17, 35]
MAX_NEW_TOKENS = 20


@dataclass
class ToyRequest:
    req_id: str
    prompt: list[int]
    max_new_tokens: int
    arrival_step: int = 0
    output: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    sent: bool = False  # the worker holds it
    pending_new_blocks: list[int] = field(default_factory=list)
    prompt_logprobs: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)


class ToyScheduler:
    def __init__(self, requests: list[ToyRequest], block_size: int, chunk_size: int | None,
                 preempt_at: tuple[str, int] | None = None, seed: int = 0) -> None:
        self.requests = requests
        self.block_size = block_size
        self.chunk_size = chunk_size  # None: a whole prompt in one step
        self.free_blocks = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free_blocks)
        self.preempt_at = preempt_at  # (req_id, step): drop its cache, resend later
        self.finished: list[str] = []
        self.step_index = 0

    def done(self) -> bool:
        return all(len(r.output) >= r.max_new_tokens for r in self.requests)

    def schedule(self) -> SchedulerOutput:
        new_reqs, cached_reqs, num_scheduled, preempted = [], [], {}, []
        for req in self.requests:
            if self.preempt_at == (req.req_id, self.step_index) and req.sent:
                # Preemption: the worker forgets it, its blocks go back, it restarts from 0.
                preempted.append(req.req_id)
                self.free_blocks.extend(req.block_ids)
                req.block_ids, req.num_computed_tokens, req.sent = [], 0, False
                continue
            if req.arrival_step > self.step_index or len(req.output) >= req.max_new_tokens:
                continue
            remaining = req.num_tokens - req.num_computed_tokens
            n = remaining if self.chunk_size is None else min(remaining, self.chunk_size)
            blocks_needed = -(-(req.num_computed_tokens + n) // self.block_size)
            new_blocks = [self.free_blocks.pop() for _ in range(blocks_needed - len(req.block_ids))]
            req.block_ids.extend(new_blocks)
            num_scheduled[req.req_id] = n
            if not req.sent:
                new_reqs.append(NewRequestData(
                    req_id=req.req_id, prompt_token_ids=req.prompt, output_token_ids=list(req.output),
                    sampling_params=SamplingParams(temperature=0.0, max_tokens=req.max_new_tokens,
                                                   prompt_logprobs=req.prompt_logprobs),
                    block_ids=list(req.block_ids), num_computed_tokens=req.num_computed_tokens))
                req.sent = True
            else:
                cached_reqs.append(CachedRequestData(req.req_id, new_blocks, req.num_computed_tokens))
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled, total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self.finished, preempted_req_ids=preempted)
        self.finished = []
        return out

    def update(self, scheduler_output: SchedulerOutput, req_ids: list[str], sampled: list[int]) -> None:
        by_id = {r.req_id: r for r in self.requests}
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            by_id[req_id].num_computed_tokens += n
        for req_id, token in zip(req_ids, sampled, strict=True):
            req = by_id[req_id]
            assert req.num_computed_tokens == req.num_tokens, f"{req_id} sampled before its end"
            req.output.append(token)
            if len(req.output) >= req.max_new_tokens:
                self.finished.append(req_id)
                self.free_blocks.extend(req.block_ids)
                req.block_ids = []
        self.step_index += 1


def run_to_completion(runner: ModelRunner, scheduler: ToyScheduler) -> dict[str, list[int]]:
    for _ in range(1000):
        if scheduler.done():
            break
        scheduler_output = scheduler.schedule()
        result = runner.execute_model(scheduler_output)
        assert set(result.req_ids) <= set(scheduler_output.num_scheduled_tokens)
        scheduler.update(scheduler_output, result.req_ids, result.sampled_token_ids)
    assert scheduler.done()
    # The finished ids of the last step reach the worker with the next (empty) step.
    runner.execute_model(scheduler.schedule())
    assert len(runner.input_batch) == 0
    return {r.req_id: r.output for r in scheduler.requests}


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]


_HF_MODELS: dict[str, torch.nn.Module] = {}
_HF_CACHE: dict[tuple[str, tuple[int, ...], int], list[int]] = {}


def hf_greedy(model_dir: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF transformers' greedy continuation (fp32, one prompt, no padding, EOS not stopping it)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    key = (model_dir, tuple(prompt), max_new_tokens)
    if key not in _HF_CACHE:
        if model_dir not in _HF_MODELS:
            _HF_MODELS[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0,
                                  eos_token_id=None, pad_token_id=0)
        with torch.no_grad():
            out = _HF_MODELS[model_dir].generate(torch.tensor([prompt]), generation_config=config)
        _HF_CACHE[key] = out[0, len(prompt):].tolist()
    return _HF_CACHE[key]


def make_runner(model_dir: str, block_size: int, load_format: str = "auto") -> ModelRunner:
    config = EngineConfig.create(model_dir, device="cpu", dtype="float32", block_size=block_size,
                                 num_gpu_blocks=NUM_BLOCKS, load_format=load_format)
    runner = ModelRunner(config)
    runner.initialize_cache(runner.determine_num_blocks())
    return runner


@pytest.mark.parametrize("arch", ARCHS)
def test_whole_prompt_prefill_then_decode_matches_hf(tiny_model_factory, arch: str) -> None:
    model_dir = tiny_model_factory(arch)
    runner = make_runner(model_dir, block_size=16)
    prompts = make_prompts(runner.model.config.vocab_size)
    requests = [ToyRequest(f"r{i}", p, MAX_NEW_TOKENS) for i, p in enumerate(prompts)]
    outputs = run_to_completion(runner, ToyScheduler(requests, block_size=16, chunk_size=None))
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"] == hf_greedy(model_dir, prompt, MAX_NEW_TOKENS), f"prompt {i} ({arch})"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("block_size,chunk_size", [(16, 8), (7, 5)])
def test_chunked_mixed_batches_match_hf(tiny_model_factory, arch: str, block_size: int, chunk_size: int) -> None:
    """Late arrivals + small chunks: prefill chunks and decodes of several requests share steps."""
    model_dir = tiny_model_factory(arch)
    runner = make_runner(model_dir, block_size=block_size)
    prompts = make_prompts(runner.model.config.vocab_size)
    requests = [ToyRequest(f"r{i}", p, MAX_NEW_TOKENS, arrival_step=3 * i) for i, p in enumerate(prompts)]
    outputs = run_to_completion(runner, ToyScheduler(requests, block_size, chunk_size, seed=block_size))
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"] == hf_greedy(model_dir, prompt, MAX_NEW_TOKENS), f"prompt {i} ({arch})"


def test_preempted_request_resumes_identically(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("llama3")
    runner = make_runner(model_dir, block_size=7)
    prompts = make_prompts(runner.model.config.vocab_size, seed=1)
    requests = [ToyRequest(f"r{i}", p, MAX_NEW_TOKENS) for i, p in enumerate(prompts)]
    # r3 (35-token prompt, chunks of 6) is preempted mid-decode and resent with its outputs.
    scheduler = ToyScheduler(requests, block_size=7, chunk_size=6, preempt_at=("r3", 12))
    outputs = run_to_completion(runner, scheduler)
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"] == hf_greedy(model_dir, prompt, MAX_NEW_TOKENS), f"prompt {i}"


def test_biases_and_single_layer(tiny_model_factory) -> None:
    """attention_bias / mlp_bias switches, tied embeddings on a Llama."""
    model_dir = tiny_model_factory("llama", seed=3, attention_bias=True, mlp_bias=True,
                                   tie_word_embeddings=True, num_hidden_layers=1)
    runner = make_runner(model_dir, block_size=4)
    prompts = make_prompts(runner.model.config.vocab_size, seed=2)
    requests = [ToyRequest(f"r{i}", p, 12, arrival_step=i) for i, p in enumerate(prompts)]
    outputs = run_to_completion(runner, ToyScheduler(requests, block_size=4, chunk_size=9))
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"] == hf_greedy(model_dir, prompt, 12)


def test_dummy_weights_run(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("qwen3")
    runner = make_runner(model_dir, block_size=16, load_format="dummy")
    prompts = make_prompts(runner.model.config.vocab_size)
    requests = [ToyRequest(f"r{i}", p, 4) for i, p in enumerate(prompts)]
    outputs = run_to_completion(runner, ToyScheduler(requests, block_size=16, chunk_size=None))
    assert all(len(o) == 4 for o in outputs.values())
    vocab = runner.model.config.vocab_size
    assert all(0 <= t < vocab for o in outputs.values() for t in o)
    # Same seed -> same dummy weights.
    again = make_runner(model_dir, block_size=16, load_format="dummy")
    for a, b in zip(runner.model.parameters(), again.model.parameters()):
        assert torch.equal(a, b)


def test_empty_step_and_partial_prefill(tiny_llama) -> None:
    runner = make_runner(tiny_llama, block_size=16)
    empty = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=[], num_scheduled_tokens={},
                            total_num_scheduled_tokens=0, finished_req_ids=[])
    result = runner.execute_model(empty)
    assert result.req_ids == [] and result.sampled_token_ids == []
    # A prefill chunk that does not reach the prompt's end samples nothing.
    new = NewRequestData(req_id="a", prompt_token_ids=list(range(1, 21)), output_token_ids=[],
                         sampling_params=SamplingParams(temperature=0.0), block_ids=[3, 9],
                         num_computed_tokens=0)
    partial = SchedulerOutput(scheduled_new_reqs=[new], scheduled_cached_reqs=[], num_scheduled_tokens={"a": 10},
                              total_num_scheduled_tokens=10, finished_req_ids=[])
    assert runner.execute_model(partial).req_ids == []
    rest = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=[CachedRequestData("a", [], 10)],
                           num_scheduled_tokens={"a": 10}, total_num_scheduled_tokens=10, finished_req_ids=[])
    result = runner.execute_model(rest)
    assert result.req_ids == ["a"]
    assert result.sampled_token_ids == hf_greedy(tiny_llama, list(range(1, 21)), 1)


def test_seeded_sampling_is_batch_independent(tiny_llama) -> None:
    params = SamplingParams(temperature=1.0, seed=777, max_tokens=8)

    def generate(with_neighbour: bool) -> list[int]:
        runner = make_runner(tiny_llama, block_size=16)
        reqs = [NewRequestData(req_id="s", prompt_token_ids=[5, 6, 7], output_token_ids=[], sampling_params=params,
                               block_ids=[0], num_computed_tokens=0)]
        if with_neighbour:
            reqs.append(NewRequestData(req_id="n", prompt_token_ids=[9, 9], output_token_ids=[],
                                       sampling_params=SamplingParams(temperature=1.0), block_ids=[1],
                                       num_computed_tokens=0))
        num = {r.req_id: r.num_prompt_tokens for r in reqs}
        out = runner.execute_model(SchedulerOutput(
            scheduled_new_reqs=reqs, scheduled_cached_reqs=[], num_scheduled_tokens=num,
            total_num_scheduled_tokens=sum(num.values()), finished_req_ids=[]))
        tokens = [out.sampled_token_ids[out.req_ids.index("s")]]
        computed = {"s": 3, "n": 2}
        for _ in range(7):
            ids = list(num)
            out = runner.execute_model(SchedulerOutput(
                scheduled_new_reqs=[], scheduled_cached_reqs=[CachedRequestData(r, [], computed[r]) for r in ids],
                num_scheduled_tokens={r: 1 for r in ids}, total_num_scheduled_tokens=len(ids), finished_req_ids=[]))
            tokens.append(out.sampled_token_ids[out.req_ids.index("s")])
            for r in ids:
                computed[r] += 1
        return tokens

    assert generate(False) == generate(True)


def test_sharded_checkpoint_loads_like_single_file(tiny_model_factory, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from minivllm.worker.models.loader import load_model

    model_dir = tiny_model_factory("qwen2")
    sharded_dir = str(tmp_path / "sharded")
    AutoModelForCausalLM.from_pretrained(model_dir).save_pretrained(sharded_dir, max_shard_size="50KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    config = EngineConfig.create(model_dir, device="cpu")
    single = load_model(config, "cpu", torch.float32)
    sharded = load_model(EngineConfig.create(sharded_dir, device="cpu"), "cpu", torch.float32)
    for (name, a), (_, b) in zip(single.named_parameters(), sharded.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_rope_parameters_both_config_layouts() -> None:
    from types import SimpleNamespace

    from minivllm.worker.models.llama import rope_parameters

    # transformers 4: rope_theta + rope_scaling (with the old "type" key)
    old = SimpleNamespace(rope_theta=500000.0, rope_scaling={"type": "llama3", "factor": 8.0})
    assert rope_parameters(old) == {"type": "llama3", "factor": 8.0, "rope_theta": 500000.0, "rope_type": "llama3"}
    plain = SimpleNamespace(rope_theta=10000.0, rope_scaling=None)
    assert rope_parameters(plain) == {"rope_theta": 10000.0, "rope_type": "default"}
    # transformers 5: everything in rope_parameters
    new = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert rope_parameters(new) == {"rope_type": "default", "rope_theta": 1e6}


@pytest.mark.parametrize("preempt_step", [2, 7])  # mid-prefill of r3's 35-token prompt (6 steps); mid-decode
def test_prompt_logprobs_across_chunks_and_preemption(tiny_model_factory, preempt_step: int) -> None:
    """Chunks of 6 on 7-token blocks: each chunk's last position scores the next chunk's first
    token. Delivered once, with the first sampled token, even when a preemption makes the worker
    forget the request (mid-prefill it starts over; mid-decode they were sent already)."""
    model_dir = tiny_model_factory("llama")
    runner = make_runner(model_dir, block_size=7)
    prompts = make_prompts(runner.model.config.vocab_size, seed=4)
    requests = [ToyRequest(f"r{i}", p, 4, prompt_logprobs=None if i == 2 else 2) for i, p in enumerate(prompts)]
    scheduler = ToyScheduler(requests, block_size=7, chunk_size=6, preempt_at=("r3", preempt_step))
    received: dict[str, list] = {}
    preempted = False
    while not scheduler.done():
        scheduler_output = scheduler.schedule()
        preempted |= scheduler_output.preempted_req_ids == ["r3"]
        result = runner.execute_model(scheduler_output)
        for req_id, entry in zip(result.req_ids, result.prompt_logprobs or [None] * len(result.req_ids)):
            if entry is not None:
                received.setdefault(req_id, []).append(entry)
        scheduler.update(scheduler_output, result.req_ids, result.sampled_token_ids)
    assert preempted
    assert sorted(received) == ["r0", "r1", "r3"] and all(len(v) == 1 for v in received.values())
    hf = hf_model_fp32(model_dir)
    for req_id, (entry,) in received.items():
        prompt = prompts[int(req_id[1:])]
        assert len(entry.ranks) == len(prompt) - 1
        if len(prompt) == 1:
            continue
        with torch.no_grad():
            expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
        got = torch.tensor([row[0] for row in entry.logprobs])
        assert torch.allclose(got, expected.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0], atol=1e-4)
        assert [row[0] for row in entry.token_ids] == prompt[1:]
        top = expected.topk(2)
        assert [row[1:] for row in entry.token_ids] == top.indices.tolist()
        ranks = [int((e > e[t]).sum()) + 1 for e, t in zip(expected, prompt[1:])]
        assert entry.ranks == ranks


def hf_model_fp32(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if model_dir not in _HF_MODELS:
        _HF_MODELS[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return _HF_MODELS[model_dir]
