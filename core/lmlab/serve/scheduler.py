"""Continuous batching: one background thread owns the engine and decodes every running request together.

Each iteration of the loop

1. takes the requests that arrived since the last one (a thread-safe queue) and drops those whose
   client went away;
2. admits waiting requests, first come first served, into free rows: with the paged cache only
   while the free blocks cover every running request's worst case (its prompt plus its most new
   tokens, capped at the context) and the new one's, so a running request never finds the pool
   empty; the admitted prompts are prefilled together and their first token chosen;
3. runs ONE decode step for every running request, whatever its length (the engine's per-row
   positions and key mask), has the run's token-level decoder choose every row's next token in one
   call (``TokenDecoder.choose``), each row with its request's options and, for a seeded request,
   its own generator, and finishes the requests that reached a stop string, the end-of-text token
   or their max_tokens, giving back their rows (and blocks) at once.

So a request that arrives while others are decoding joins them at the next step instead of waiting
for the batch to finish, and a finished one leaves without holding the others up (Orca, Yu et al.
2022, https://www.usenix.org/conference/osdi22/presentation/yu). Text goes back to each request's
asyncio queue through ``loop.call_soon_threadsafe``: streamed requests get every final piece of text
(never part of a stop string) as it is made, the others only their end.

The engine is not thread-safe, and need not be: only this thread touches it.
"""

import itertools
import queue
import sys
import threading
import traceback
from collections import deque
from dataclasses import dataclass, field

import torch

from lmlab.api.decoding import TokenRows
from lmlab.generation.engine import make_engine
from lmlab.generation.kv import PagedKV
from lmlab.generation.outputs import Finish, Outputs

IDLE_WAKE_S = 0.2  # how often an idle loop wakes (to notice Ctrl-C)
_STOP = object()


@dataclass
class Job:
    """One request in the scheduler: its prompt and limits in, its events out (to ``events``, on ``loop``)."""

    ids: list[int]
    max_tokens: int
    options: object  # the decoder's Options for this request
    outputs: Outputs
    generator: torch.Generator | None = None  # a seeded request's own; None: the scheduler's shared one
    stream: bool = False
    loop: object = None  # the asyncio loop of the request's handler
    events: object = None  # an asyncio.Queue on that loop: ("text", str), ("done", Job), ("error", str)
    cancelled: bool = False  # set by the handler when its client goes away
    number: int = 0
    row: int | None = None
    need: int = 0  # cache blocks this request may hold at most (paged)
    last: int | None = None  # the token to feed next
    admitted_step: int | None = None  # decode steps run before it was admitted
    finished_step: int | None = None
    logprobs: int | None = None  # list each token's log-probability and this many most likely; None: no
    echo: bool = False  # score the prompt's tokens too (with logprobs)
    prompt_scores: list = field(default_factory=list)  # per prompt token after the first: Score
    scores: list = field(default_factory=list)  # per new token: Score
    pending: object = None  # the last chosen token's Score, until the outputs keep the token

    @property
    def completion(self):
        return self.outputs.completions[0]


@dataclass
class Score:
    """A token's log-probability under the model, and the most likely tokens there: [(id, log-probability)]."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def scores(logprobs: torch.Tensor, tokens: torch.Tensor, k: int) -> list[Score]:
    """Score of each ``tokens[t]`` under ``logprobs[t]`` ((T, V) log-probabilities), with its ``k`` most likely."""
    chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    return [Score(int(t), c, list(zip(i, v))) for t, c, i, v in
            zip(tokens.tolist(), chosen, top_ids.tolist(), top_values.tolist())]


@dataclass
class Stats:
    steps: int = 0  # decode steps (one forward pass for every running request)
    prefills: int = 0  # forward passes over newly admitted prompts
    tokens: int = 0  # tokens sampled, over every request
    largest_batch: int = 0  # most requests decoded in one step
    admitted: int = 0
    finished: int = 0
    failures: list[str] = field(default_factory=list)


class Scheduler:
    """Up to ``max_batch`` requests decoded together over ``model`` by ``decoder`` (a ``TokenDecoder``),
    with contexts of ``context`` tokens."""

    def __init__(self, model, decoder, context: int, max_batch: int = 32, cache: str = "paged",
                 block_size: int = 16, n_blocks: int | None = None, seed: int = 0):
        self.model, self.decoder, self.context, self.max_batch = model, decoder, context, max_batch
        self.cache = cache
        self.engine = make_engine(model, max_batch, context, cache=cache, block_size=block_size, n_blocks=n_blocks)
        self.store = getattr(self.engine, "store", None)
        self.paged = isinstance(self.store, PagedKV)
        if self.paged and self.store.n_blocks < self.store.blocks_for(context):
            raise ValueError(f"{self.store.n_blocks} cache blocks of {block_size} cannot hold one sequence of "
                             f"{context} tokens")
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.inbox: queue.Queue = queue.Queue()
        self.waiting: deque[Job] = deque()
        self.live: list[Job] = []
        # Every request taken from the inbox and not yet answered (done, failed or cancelled). Ctrl-C
        # may land anywhere in the loop, between moving a request out of ``waiting`` and into ``live``
        # for one: whatever is left here when the loop ends is told the server is shutting down, so no
        # stream waits for an answer until uvicorn's shutdown timeout cancels it.
        self._unanswered: dict[int, Job] = {}
        self.stats = Stats()
        self._numbers = itertools.count()
        self._thread: threading.Thread | None = None
        # Set once the loop has ended: a request submitted after that (a stream whose response was
        # starting during Ctrl-C) is refused at once instead of waiting for an answer that never comes.
        self._closed = False
        self._closing = threading.Lock()

    # -- the handlers' side (any thread) ---------------------------------------------------------------

    def start(self) -> None:
        """Run the loop in a background thread (``stop`` ends it)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.run, name="lmlab-serve-scheduler", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10) -> None:
        """End the loop (after its current step), and join its thread if ``start`` made one."""
        self.inbox.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def submit(self, job: Job) -> Job:
        if len(job.ids) + job.max_tokens > self.context:
            # Past the context a row would slide for ever (max_tokens is unbounded): the service refuses those.
            raise ValueError(f"a prompt of {len(job.ids)} tokens and {job.max_tokens} new ones do not fit in the "
                             f"context of {self.context}")
        job.number = next(self._numbers)
        with self._closing:
            if not self._closed:
                self.inbox.put(job)
                return job
        self._emit(job, ("error", "the server is shutting down"))
        return job

    def cancel(self, job: Job) -> None:
        """The request's client went away: its row is given back at the next iteration (no-op once done)."""
        job.cancelled = True
        self.inbox.put(None)  # wake the loop if it is idle

    @property
    def running(self) -> int:
        return len(self.live)

    @property
    def queued(self) -> int:
        return len(self.waiting) + self.inbox.qsize()

    # -- the scheduler thread ----------------------------------------------------------------------------

    def run(self) -> None:
        """The loop, in the calling thread, until ``stop`` (from another thread) or an exception (Ctrl-C).

        ``lmlab serve`` runs it in the main thread, the one that loaded the model: on a CPU, torch
        ops from a second thread get a second OpenMP thread pool, and the two pools contend for the
        cores (one request decoded 1.5-3x slower on two cores, measured with a 1.6 M-parameter model)."""
        self._closed = False
        try:
            with torch.no_grad():  # grad mode is per thread
                while self._take_new(block=not self.live and not self.waiting):
                    self._drop_cancelled()
                    try:
                        self._admit()
                        if self.live:
                            self._step()
                    except Exception as exc:  # a failed forward pass fails its requests, not the server
                        self._fail(exc)
        finally:
            with self._closing:
                self._closed = True
            unstarted = []  # arrived but not yet taken: they must hear the news too
            while True:
                try:
                    item = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, Job):
                    unstarted.append(item)
            for job in [*self._unanswered.values(), *unstarted]:
                self._emit(job, ("error", "the server is shutting down"))
            self.live, self.waiting, self._unanswered = [], deque(), {}

    def _take_new(self, block: bool) -> bool:
        """Move arrived requests to the waiting line; False when asked to stop."""
        try:
            # Idle, wait with a timeout: Ctrl-C's SIGINT may reach another thread (uvicorn's), and a lock
            # wait without one is never woken to see it, so the server would not stop.
            item = self.inbox.get(timeout=IDLE_WAKE_S) if block else self.inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if item is _STOP:
                return False
            if item is not None:
                self._unanswered[item.number] = item
                self.waiting.append(item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return True

    def _drop_cancelled(self) -> None:
        if any(j.cancelled for j in self.waiting):
            self.waiting = deque(j for j in self.waiting if not j.cancelled)
        gone = [j for j in self.live if j.cancelled]
        for job in [j for j in self._unanswered.values() if j.cancelled]:
            del self._unanswered[job.number]
        if gone:
            self.engine.release([j.row for j in gone])
            self.live = [j for j in self.live if not j.cancelled]

    def _blocks_free(self) -> int:
        """Free blocks not promised to a running request (each may grow to its ``need``)."""
        promised = sum(max(0, j.need - self.store.blocks_for(self.engine.length(j.row))) for j in self.live)
        return self.store.available() - promised

    def _score_prompts(self, jobs: list[Job]) -> None:
        """The echoed prompts' tokens scored in one forward pass of the model (no cache): each token's
        log-probability given those before it."""
        longest = max(len(j.ids) for j in jobs)
        idx = torch.zeros(len(jobs), longest, dtype=torch.long, device=self.device)
        for r, job in enumerate(jobs):
            idx[r, :len(job.ids)] = torch.tensor(job.ids, device=self.device)
        logprobs = torch.log_softmax(self.model(idx).float(), dim=-1)
        for r, job in enumerate(jobs):
            n = len(job.ids)
            job.prompt_scores = scores(logprobs[r, :n - 1].cpu(), torch.tensor(job.ids[1:]), job.logprobs)

    def _admit(self) -> None:
        scoring = [j for j in self.waiting if j.echo and j.logprobs is not None and not j.prompt_scores and len(j.ids) > 1]
        if scoring:
            self._score_prompts(scoring)
        if any(j.max_tokens == 0 for j in self.waiting):  # scored, nothing to generate: answered now
            for job in [j for j in self.waiting if j.max_tokens == 0]:
                job.outputs.completions[0].finish_reason = Finish.LENGTH
                self._finish(job)
            self.waiting = deque(j for j in self.waiting if j.max_tokens != 0)
        new: list[Job] = []
        spare = self._blocks_free() if self.paged else 0
        while self.waiting and len(self.live) + len(new) < self.max_batch:
            job = self.waiting[0]
            if self.paged:
                job.need = self.store.blocks_for(min(len(job.ids) + job.max_tokens, self.context))
                if job.need > spare:
                    break  # first come, first served: later ones wait too
                spare -= job.need
            new.append(self.waiting.popleft())
        if not new:
            return
        try:
            rows, logits = self.engine.add([j.ids for j in new])
        except Exception:
            self.live.extend(new)  # they fail with the others
            raise
        self.stats.prefills += 1
        for job, row in zip(new, rows):
            job.row, job.admitted_step = row, self.stats.steps
        self.stats.admitted += len(new)
        self.live.extend(new)
        self._sample(new, logits)

    def _step(self) -> None:
        jobs = list(self.live)
        tokens = torch.tensor([[j.last] for j in jobs], dtype=torch.long, device=self.device)
        logits = self.engine.step([j.row for j in jobs], tokens)[:, -1]
        self.stats.steps += 1
        self.stats.largest_batch = max(self.stats.largest_batch, len(jobs))
        self._sample(jobs, logits)

    def _sample(self, jobs: list[Job], logits: torch.Tensor) -> None:
        generators = [self.generator if j.generator is None else j.generator for j in jobs]
        rows = TokenRows([j.options for j in jobs], generators, logits.device,
                         lambda: [j.ids + j.outputs.completions[0].tokens for j in jobs])
        chosen = self.decoder.choose(logits.float(), rows)
        tokens = chosen.tolist()
        wanted = [r for r, j in enumerate(jobs) if j.logprobs is not None]
        if wanted:  # the model's own distribution, before the decoder's temperature or filters
            logprobs = torch.log_softmax(logits[wanted].float(), dim=-1).cpu()
            for r, score in zip(wanted, scores(logprobs, chosen[wanted].cpu(), max(jobs[r].logprobs for r in wanted))):
                jobs[r].pending = score
        done = []
        for job, token in zip(jobs, tokens):
            out = job.outputs
            before = len(out.completions[0].tokens)
            out.record(0, [token])
            if job.logprobs is not None and len(out.completions[0].tokens) > before:
                score = job.pending
                job.scores.append(Score(score.token, score.logprob, score.top[:job.logprobs]))
            job.last = token
            self.stats.tokens += 1
            if job.stream and (text := out.delta(0)):
                self._emit(job, ("text", text))
            if out.done(0):
                done.append(job)
        if done:
            self.engine.release([j.row for j in done])
            finished = set(map(id, done))
            self.live = [j for j in self.live if id(j) not in finished]
            for job in done:
                self._finish(job)

    def _finish(self, job: Job) -> None:
        job.finished_step = self.stats.steps
        self.stats.finished += 1
        if job.stream and (text := job.outputs.delta(0)):
            self._emit(job, ("text", text))
        self._emit(job, ("done", job))
        self._unanswered.pop(job.number, None)

    def _fail(self, exc: Exception) -> None:
        message = f"the model failed while decoding: {type(exc).__name__}: {exc}"
        print(f"lmlab serve: {message}\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        self.stats.failures.append(message)
        # Every row goes back, those a failed prefill took before it failed included.
        if hasattr(self.engine, "free_rows"):
            held = sorted(set(range(self.max_batch)) - set(self.engine.free_rows))
        else:
            held = list(self.engine.steppers)
        self.engine.release(held)
        for job in self.live:
            self._emit(job, ("error", message))
            self._unanswered.pop(job.number, None)
        self.live = []

    def _emit(self, job: Job, event: tuple) -> None:
        if job.loop is None:
            return
        try:
            job.loop.call_soon_threadsafe(job.events.put_nowait, event)
        except RuntimeError:  # the handler's loop is closed: nobody is listening
            job.cancelled = True
