"""Turn the engine's token ids into RequestOutputs: detokenize incrementally, track finishing."""

from __future__ import annotations

import re
import time
from typing import Any

from minivllm.frontend.outputs import CompletionOutput, Logprob, PromptLogprobsList, RequestMetrics, RequestOutput
import msgspec

from minivllm.protocol.messages import EngineCoreOutput, EngineCoreRequest, PromptLogprobs, TokenLogprobs
from minivllm.protocol.sampling_params import RequestOutputKind, SamplingParams

# How many prompt tokens to decode along with the first output tokens, so that tokenizers that
# drop a leading space on the first token of a string (SentencePiece) get the spacing right.
_PREFIX_CONTEXT = 5


class IncrementalDetokenizer:
    """Decode one token at a time without re-decoding everything, and without ever emitting a
    half multi-byte character: text is held back while it ends in U+FFFD (an incomplete byte
    sequence), until the next token completes it.

    skip_special_tokens drops special tokens from the text. spaces_between_special_tokens=False
    (meaningful only when special tokens are kept) removes the whitespace a decoder puts between
    two adjacent added tokens ("[SEP] [SEP]" -> "[SEP][SEP]"), as vLLM's fast-tokenizer path does;
    slow tokenizers get the flag itself too."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # Whitespace between two added tokens' texts, for spaces_between_special_tokens=False.
        self.space_between_added: re.Pattern | None = None
        if not skip_special_tokens and not spaces_between_special_tokens:
            contents = sorted((t.content for t in tokenizer.added_tokens_decoder.values()), key=len, reverse=True)
            if contents:
                alternatives = "|".join(map(re.escape, contents))
                self.space_between_added = re.compile(f"({alternatives})\\s+(?=(?:{alternatives}))")
        self.token_ids = list(prompt_token_ids[-_PREFIX_CONTEXT:])
        self.prefix_offset = 0  # start of the window decoded for context
        self.read_offset = len(self.token_ids)  # tokens before this are already in the text

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Returns the new text those tokens complete (possibly empty)."""
        self.token_ids.extend(new_token_ids)
        prefix_text, full_text = self._decode_window()
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end, whatever text was held back (a trailing incomplete character included)."""
        prefix_text, full_text = self._decode_window()
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return full_text[len(prefix_text) :]

    def _decode_window(self) -> tuple[str, str]:
        """The text of the context window without, and with, the tokens not yet read."""
        window = self.token_ids[self.prefix_offset :]
        read = self.read_offset - self.prefix_offset
        return self.decode(window[:read]), self.decode(window)

    def decode(self, token_ids: list[int]) -> str:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens,
                                     spaces_between_special_tokens=self.spaces_between_special_tokens)
        if self.space_between_added is not None:
            text = self.space_between_added.sub(r"\1", text)
        return text


class RequestState:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], tokenizer: Any | None,
                 arrival_time: float | None = None, params: SamplingParams | None = None):
        self.request_id = request_id
        self.stop_strings = list((params.stop if params is not None else None) or [])
        self.include_stop_str = params is not None and params.include_stop_str_in_output
        # Set when a stop string ended the request here: the engine, which knows no strings, must
        # be told to stop it.
        self.stopped_by_string = False
        self.metrics = RequestMetrics(arrival_time=time.time() if arrival_time is None else arrival_time)
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        # detokenize=False: token ids only, as in vLLM (no text, no decoded logprob tokens).
        self.detokenizer = None
        if tokenizer is not None and (params is None or params.detokenize):
            self.detokenizer = IncrementalDetokenizer(
                tokenizer, prompt_token_ids,
                skip_special_tokens=params is None or params.skip_special_tokens,
                spaces_between_special_tokens=params is None or params.spaces_between_special_tokens)
        self.prompt_logprobs: PromptLogprobsList | None = None
        self.completion = CompletionOutput(index=0, text="", token_ids=[])
        self.num_cached_tokens = 0
        self.kv_transfer_params: dict[str, Any] | None = None
        # What a streaming consumer has been handed already (for RequestOutputKind.DELTA).
        self.num_streamed_tokens = 0
        self.num_streamed_chars = 0
        self.prompt_logprobs_streamed = False

    def update(self, out: EngineCoreOutput) -> None:
        now = time.time()
        if out.new_token_ids:
            if self.metrics.first_token_time is None:
                self.metrics.first_token_time = now
            self.metrics.last_token_time = now
            self.metrics.token_times.extend([now] * len(out.new_token_ids))
        if out.finish_reason is not None:
            self.metrics.finished_time = now
        self.num_cached_tokens = out.num_cached_tokens
        if out.kv_transfer_params is not None:
            self.kv_transfer_params = out.kv_transfer_params
        self.completion.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None:
            self._add_logprobs(out.new_logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = self._to_prompt_logprobs(out.prompt_logprobs)
        old_length = len(self.completion.text)
        if self.detokenizer is not None:
            new_token_ids = out.new_token_ids
            if out.finish_reason == "stop" and not self.include_stop_str:
                # The engine stopped on EOS or a stop token: as in vLLM, it stays in token_ids but
                # not in the text (unless include_stop_str_in_output).
                new_token_ids = new_token_ids[:-1]
            if new_token_ids:
                self.completion.text += self.detokenizer.add_tokens(new_token_ids)
            if out.finish_reason is not None:
                self.completion.text += self.detokenizer.flush()
        self.completion.finish_reason = out.finish_reason
        self.completion.stop_reason = out.stop_reason
        if self.stop_strings and not self.stopped_by_string:
            self._check_stop_strings(old_length)

    def _check_stop_strings(self, old_length: int) -> None:
        """End the request at the first stop string in the text (one may span several tokens, so
        the search starts far enough back to catch one that began in earlier text)."""
        text = self.completion.text
        longest = max(map(len, self.stop_strings))
        search_from = max(0, old_length - longest + 1)
        found = [(i, s) for s in self.stop_strings if (i := text.find(s, search_from)) >= 0]
        if not found:
            return
        index, stop = min(found)
        self.completion.text = text[: index + len(stop) if self.include_stop_str else index]
        self.completion.finish_reason, self.completion.stop_reason = "stop", stop
        self.stopped_by_string = True

    def _add_logprobs(self, entry: TokenLogprobs) -> None:
        """The sampled token (at its rank) and the top-k alternatives (ranks 1..k), by token id."""
        completion = self.completion
        ranks = [entry.sampled_rank, *range(1, len(entry.token_ids))]
        decode = (lambda t: self.detokenizer.tokenizer.decode([t])) if self.detokenizer else (lambda t: None)
        position: dict[int, Logprob] = {}
        for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, ranks):
            position.setdefault(token_id, Logprob(logprob, rank, decode(token_id)))  # sampled one first
        completion.logprobs = (completion.logprobs or []) + [position]
        completion.cumulative_logprob = (completion.cumulative_logprob or 0.0) + entry.logprobs[0]

    def _to_prompt_logprobs(self, entry: PromptLogprobs) -> PromptLogprobsList:
        """vLLM's format: None for the first prompt token, then per token {token_id: Logprob}
        holding the prompt token (at its rank) and the top-k alternatives (ranks 1..k)."""
        decode = (lambda t: self.detokenizer.tokenizer.decode([t])) if self.detokenizer else (lambda t: None)
        result: PromptLogprobsList = [None]
        for token_ids, logprobs, rank in zip(entry.token_ids, entry.logprobs, entry.ranks):
            position: dict[int, Logprob] = {}
            for token_id, logprob, r in zip(token_ids, logprobs, [rank, *range(1, len(token_ids))]):
                position.setdefault(token_id, Logprob(logprob, r, decode(token_id)))  # the prompt token first
            result.append(position)
        return result

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[self.completion],
            finished=self.completion.finished(),
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
            kv_transfer_params=self.kv_transfer_params,
        )


    def to_stream_output(self, kind: RequestOutputKind) -> RequestOutput | None:
        """The output for a streaming consumer now: everything so far (CUMULATIVE), what is new
        since the last call (DELTA), or None until the request finishes (FINAL_ONLY). Each
        output is a fresh object, so a consumer may keep it while the stream goes on."""
        completion = self.completion
        if kind == RequestOutputKind.FINAL_ONLY and not completion.finished():
            return None
        token_ids, text, logprobs = completion.token_ids, completion.text, completion.logprobs
        if self.stop_strings and not completion.finished():
            # Hold back what could be the start of a stop string, so it is never shown then taken back.
            text = text[: max(len(text) - (max(map(len, self.stop_strings)) - 1), self.num_streamed_chars)]
        if kind == RequestOutputKind.DELTA:
            token_ids, text = token_ids[self.num_streamed_tokens :], text[self.num_streamed_chars :]
            logprobs = None if logprobs is None else logprobs[self.num_streamed_tokens :]
        self.num_streamed_tokens = len(completion.token_ids)
        self.num_streamed_chars = self.num_streamed_chars + len(text) if kind == RequestOutputKind.DELTA else len(text)
        streamed = CompletionOutput(index=completion.index, text=text, token_ids=list(token_ids),
                                    cumulative_logprob=completion.cumulative_logprob,
                                    logprobs=None if logprobs is None else list(logprobs),
                                    finish_reason=completion.finish_reason, stop_reason=completion.stop_reason)
        prompt_logprobs = self.prompt_logprobs
        if kind == RequestOutputKind.DELTA:  # sent once, in the first output that has them
            if self.prompt_logprobs_streamed:
                prompt_logprobs = None
            self.prompt_logprobs_streamed = self.prompt_logprobs is not None
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[streamed],
            finished=completion.finished(),
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
            kv_transfer_params=self.kv_transfer_params,
        )


class ParentRequest:
    """A prompt with n > 1 completions: the engine runs n child requests (fan_out), and their
    completions are gathered here into one RequestOutput."""

    def __init__(self, request_id: str, n: int) -> None:
        self.request_id = request_id
        self.completions: list[CompletionOutput | None] = [None] * n
        self.num_cached_tokens = 0

    def finish_child(self, state: RequestState) -> RequestOutput | None:
        """Record a finished child; once all are in, the gathered output."""
        self.completions[state.completion.index] = state.completion
        self.num_cached_tokens = max(self.num_cached_tokens, state.num_cached_tokens)
        if any(c is None for c in self.completions):
            return None
        output = state.to_output()
        output.request_id, output.outputs = self.request_id, list(self.completions)
        output.num_cached_tokens = self.num_cached_tokens
        return output


def gather_stream_output(request_id: str, children: list[RequestState], changed: set[str],
                         kind: RequestOutputKind) -> RequestOutput | None:
    """A streaming consumer's output for a prompt with n > 1 completions (its children, in index
    order), once some of them (`changed`) got new outputs: CUMULATIVE holds all n completions so
    far, DELTA only what is new in the changed ones, FINAL_ONLY all n once every one finished
    (None before). Each completion carries its `index`. (vLLM's CUMULATIVE holds only the
    changed completions; holding all n is a superset, and the last output is LLM.generate's.)"""
    finished = all(child.completion.finished() for child in children)
    if kind == RequestOutputKind.FINAL_ONLY and not finished:
        return None
    shown = [child for child in children if kind != RequestOutputKind.DELTA or child.request_id in changed]
    completions = [child.to_stream_output(kind).outputs[0] for child in shown]
    last = next((child for child in reversed(children) if child.request_id in changed), children[-1])
    return RequestOutput(
        request_id=request_id,
        prompt=last.prompt,
        prompt_token_ids=last.prompt_token_ids,
        outputs=completions,
        finished=finished,
        num_cached_tokens=max(child.num_cached_tokens for child in children),
        metrics=last.metrics,
    )


def fan_out(request: EngineCoreRequest) -> list[EngineCoreRequest]:
    """The engine requests behind one user request: itself, or n children "<id>_<k>" with n = 1
    (a seeded request's child k gets seed + k, so the n completions differ yet reproduce)."""
    params = request.sampling_params
    if params.n == 1:
        return [request]
    return [
        msgspec.structs.replace(
            request, request_id=f"{request.request_id}_{k}",
            sampling_params=msgspec.structs.replace(
                params, n=1, seed=None if params.seed is None else (params.seed + k) % 2**63),
        )
        for k in range(params.n)
    ]


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}  # by engine request id (children for n > 1)
        self.parents: dict[str, ParentRequest] = {}  # by child id

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    arrival_time: float | None = None, params: SamplingParams | None = None) -> list[str]:
        """Track a user request; returns the engine request ids behind it (see fan_out)."""
        n = 1 if params is None else params.n
        child_ids = [request_id] if n == 1 else [f"{request_id}_{k}" for k in range(n)]
        parent = ParentRequest(request_id, n) if n > 1 else None
        for index, child_id in enumerate(child_ids):
            state = RequestState(child_id, prompt, prompt_token_ids, self.tokenizer, arrival_time, params)
            state.completion.index = index
            self.requests[child_id] = state
            if parent is not None:
                self.parents[child_id] = parent
        return child_ids

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Apply the engine's outputs. Returns the RequestOutputs that finished with them, and the
        ids of requests a stop string ended here, which the engine must be told to abort."""
        finished, stopped_here = [], []
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is None:  # finished here already (a stop string), or aborted
                continue
            state.update(out)
            if state.completion.finished():
                if state.stopped_by_string and out.finish_reason is None:
                    stopped_here.append(out.request_id)
                del self.requests[out.request_id]
                parent = self.parents.pop(out.request_id, None)
                output = state.to_output() if parent is None else parent.finish_child(state)
                if output is not None:
                    finished.append(output)
        return finished, stopped_here

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)
