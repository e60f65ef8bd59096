"""Generated request traces of known shapes, for measuring eviction policies off the one
shared trace.

Each generator returns Mooncake-format requests (:class:`TraceRequest`), seeded, with a
partial last block (so tails exist) and, where the shape has them, the session and label an
engine would give. Block ids are fresh integers: equal ids are the same block.

- :func:`chats`: multi-turn conversations behind one shared system prompt; each turn
  extends the last one, whose partial tail it replaces; sessions are the conversations.
- :func:`system_prompts`: a few shared system prompts (Zipf-popular) before one-shot user
  content.
- :func:`zipf_documents`: documents read with Zipf popularity, each with a one-shot
  question, among one-shot prompts.
- :func:`moving_hot_set`: documents hot for a while, then never asked for again.
- :func:`sliding_window`: documents asked for while they are among the latest few.
- :func:`loop`: the same documents over and over, in the same order.
- :func:`tool_outputs`: an agent's tool outputs, each read again once much later, among
  one-shot prompts of the same length, told apart only by their label.
- :func:`resent_tails`: agent sessions whose every turn sends the whole last prompt again,
  its partial tail under the same id (a writer that names a partial block as it is, so the
  block a tail rule would evict first is the one the next turn reads).
- :func:`document_phases`: document sets read with Zipf popularity that change every so
  often (the documents of the last set are never read again).
- :func:`agent_documents`: an agent's documents behind a short agent prompt, each sent again
  whole a few times within minutes and then never, among one-shot prompts of the same
  lengths (a learned order had made the store refuse puts here: room for a request's next
  block came from its own chain).

:data:`SHAPES` names them all.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

from kvpool_bench.trace import TRACE_BLOCK_TOKENS, TraceRequest

#: Tokens missing from each request's last block (a partial tail).
_SHORT = 100


def _request(t: int, ids: list[int], session: str | None = None, label: str | None = None) -> TraceRequest:
    return TraceRequest(t * 1000, TRACE_BLOCK_TOKENS * len(ids) - _SHORT, 1, tuple(ids), session, label)


class _Ids:
    """Fresh block ids."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _in_time_order(events: list[tuple[float, list[int], str | None]]) -> list[TraceRequest]:
    """Requests of several sessions, each ``(when, block ids, session)``, in time order."""
    events.sort(key=lambda e: e[0])
    return [_request(i, req, session) for i, (_, req, session) in enumerate(events)]


def chats(seed: int, n: int = 400) -> list[TraceRequest]:
    """``n`` conversations of a few turns behind one shared system prompt."""
    rnd = random.Random(seed)
    ids = _Ids()
    root = ids.take(1)
    events: list[tuple[float, list[int], str | None]] = []
    t = 0.0
    for c in range(n):
        t += rnd.expovariate(1.0)
        full = root + ids.take(rnd.randint(1, 30))
        when = t
        for _ in range(1 + int(rnd.expovariate(1 / 3))):
            events.append((when, full + ids.take(1), f"chat-{c}"))  # the next turn replaces the tail
            full = full + ids.take(rnd.randint(1, 4))
            when += rnd.expovariate(1 / 40)
    return _in_time_order(events)


def system_prompts(seed: int, n: int = 1500, prompts: int = 12) -> list[TraceRequest]:
    """Shared system prompts of 2-8 blocks, Zipf-popular, each before 1-10 one-shot blocks."""
    rnd = random.Random(seed)
    ids = _Ids()
    heads = [ids.take(rnd.randint(2, 8)) for _ in range(prompts)]
    weights = [1 / (i + 1) for i in range(prompts)]
    return [_request(t, rnd.choices(heads, weights)[0] + ids.take(rnd.randint(1, 10))) for t in range(n)]


def zipf_documents(seed: int, n: int = 1500, documents: int = 150, one_shot: float = 0.3) -> list[TraceRequest]:
    """Documents of 2-24 blocks read with Zipf popularity, each followed by a one-shot
    question of 1-2 blocks; a share ``one_shot`` of the requests are one-shot prompts of 1-24
    blocks."""
    rnd = random.Random(seed)
    ids = _Ids()
    docs = [ids.take(rnd.randint(2, 24)) for _ in range(documents)]
    weights = [1 / (i + 1) for i in range(documents)]
    out = []
    for t in range(n):
        if rnd.random() < one_shot:
            out.append(_request(t, ids.take(rnd.randint(1, 24))))
        else:
            out.append(_request(t, rnd.choices(docs, weights)[0] + ids.take(rnd.randint(1, 2))))
    return out


def moving_hot_set(seed: int, n: int = 4000, phase: int = 300, hot: int = 30) -> list[TraceRequest]:
    """Documents that are hot for a while, then never asked for again, among one-shot prompts.

    Every ``phase`` requests a new set of ``hot`` documents takes over (Zipf-popular within
    the set); 30% of requests are one-shot prompts. Blocks read often in one phase are dead
    in the next: ARC's frequency segment holds on to them, recency lets them go.
    """
    rnd = random.Random(seed)
    ids = _Ids()
    docs: list[list[int]] = []
    out = []
    for t in range(n):
        if t % phase == 0:
            docs = [ids.take(rnd.randint(2, 30)) for _ in range(hot)]
        size = rnd.randint(1, 30) if rnd.random() < 0.3 else rnd.randint(1, 2)
        head = [] if size > 2 else rnd.choices(docs, [1 / (i + 1) for i in range(hot)])[0]
        out.append(_request(t, head + ids.take(size)))
    return out


def sliding_window(seed: int, n: int = 1500, window: int = 20) -> list[TraceRequest]:
    """A new document of 2-16 blocks every few requests; each request reads one of the latest
    ``window`` documents (uniformly), then asks a one-shot question of one block."""
    rnd = random.Random(seed)
    ids = _Ids()
    docs: list[list[int]] = []
    out = []
    for t in range(n):
        if t % 4 == 0 or not docs:
            docs.append(ids.take(rnd.randint(2, 16)))
            docs = docs[-window:]
        out.append(_request(t, rnd.choice(docs) + ids.take(1)))
    return out


def loop(seed: int, n: int = 1500, documents: int = 40) -> list[TraceRequest]:
    """``documents`` documents of 2-16 blocks, asked for in the same order again and again."""
    rnd = random.Random(seed)
    ids = _Ids()
    docs = [ids.take(rnd.randint(2, 16)) for _ in range(documents)]
    return [_request(t, docs[t % documents]) for t in range(n)]


def tool_outputs(seed: int, n: int = 2000, blocks: int = 6, tools: float = 0.3, gap: int = 100) -> list[TraceRequest]:
    """An agent's tool outputs, each read again once about ``gap`` requests after it was
    written, among one-shot prompts of the same length; the label (``tool`` or ``chat``)
    tells them apart, and nothing else does.

    A share ``tools`` of the requests write a new tool output of ``blocks`` blocks. The gap is
    many more blocks than a small cache holds and each output is read only twice, so neither
    recency nor frequency keeps one: only a policy that learns that blocks labelled ``tool``
    come back does.
    """
    rnd = random.Random(seed)
    ids = _Ids()
    due: dict[int, list[list[int]]] = {}
    out: list[TraceRequest] = []
    for t in range(n):
        for again in due.pop(t, []):
            out.append(_request(len(out), again, label="tool"))
        if rnd.random() < tools:
            output = ids.take(blocks)
            due.setdefault(t + rnd.randint(gap // 2, 3 * gap // 2), []).append(output)
            out.append(_request(len(out), output, label="tool"))
        else:
            out.append(_request(len(out), ids.take(blocks), label="chat"))
    return out


def resent_tails(seed: int, n: int = 300, turns: tuple[int, int] = (3, 25)) -> list[TraceRequest]:
    """``n`` agent sessions behind one shared 8-block system prompt; each turn's prompt is
    the last one (partial tail included, same ids) and 1-6 new blocks, a few requests of
    other sessions later."""
    rnd = random.Random(seed)
    ids = _Ids()
    root = ids.take(8)
    events: list[tuple[float, list[int], str | None]] = []
    t = 0.0
    for s in range(n):
        t += rnd.expovariate(1.0)
        prompt, when = list(root), t
        for _ in range(rnd.randint(*turns)):
            prompt = prompt + ids.take(rnd.randint(1, 6))
            when += rnd.expovariate(0.3)
            events.append((when, prompt, f"agent-{s}"))
    return _in_time_order(events)


def agent_documents(seed: int, n: int = 3000, share: float = 0.4) -> list[TraceRequest]:
    """``n`` requests, two seconds apart: a share ``share`` of them write a document of 4-20
    blocks behind a 2-block agent prompt and send it again whole 1-4 times, a minute apart on
    average (one session per document); the rest are one-shot prompts of 4-20 blocks."""
    rnd = random.Random(seed)
    ids = _Ids()
    root = ids.take(2)
    events: list[tuple[float, list[int], str | None]] = []
    for i in range(n):
        t = 2.0 * i
        if rnd.random() < share:
            doc = root + ids.take(rnd.randint(4, 20))
            events.append((t, doc, f"agent-{i}"))
            for _ in range(rnd.randint(1, 4)):
                t += rnd.expovariate(1 / 60)
                events.append((t, doc, f"agent-{i}"))
        else:
            events.append((t, ids.take(rnd.randint(4, 20)), None))
    return _in_time_order(events)


def document_phases(seed: int, n: int = 4500, phases: int = 3, documents: int = 100) -> list[TraceRequest]:
    """Document sets that change ``phases`` times: in each phase, ``documents`` documents of
    4-30 blocks read with Zipf popularity (each with a one-block question), among one-shot
    prompts of 2-20 blocks (labels ``doc`` and ``chat``); the last phase's documents are
    never read again. The frequencies that ARC's protected segment learnt in one phase keep
    the next phase's documents out of it for a while."""
    rnd = random.Random(seed)
    ids = _Ids()
    out: list[TraceRequest] = []
    weights = [1 / (i + 1) for i in range(documents)]
    for _ in range(phases):
        docs = [ids.take(rnd.randint(4, 30)) for _ in range(documents)]
        for _ in range(n // phases):
            if rnd.random() < 0.3:
                out.append(_request(len(out), ids.take(rnd.randint(2, 20)), label="chat"))
            else:
                out.append(_request(len(out), rnd.choices(docs, weights)[0] + ids.take(1), label="doc"))
    return out


#: Every shape by name, with its default size.
SHAPES: Mapping[str, Callable[[int], list[TraceRequest]]] = {
    "chats": chats,
    "system-prompts": system_prompts,
    "zipf-documents": zipf_documents,
    "moving-hot-set": moving_hot_set,
    "sliding-window": sliding_window,
    "loop": loop,
    "tool-outputs": tool_outputs,
    "resent-tails": resent_tails,
    "agent-documents": agent_documents,
    "document-phases": document_phases,
}
