"""Multi-turn traces for chapter 14: conversations whose every turn resends the whole history.

A chat turn's prompt is the system prompt, every earlier user message and answer, and the new
user message; an agent's step is the same shape with a long shared tool description as the
system prompt, tool outputs as the "user" messages and short actions as the answers. Each turn
reuses the previous turn's prompt and answer as its prefix, which is what a prefix cache should
find, if it still holds it by then.

`replay(engine, trace)` serves a trace round by round: round r sends turn r of every
conversation (at once), each answer is appended to its conversation, and round r + 1 follows.
Between a conversation's turns, the other conversations' turns pass through the engine's pool:
with a small pool, the device prefix cache has evicted the prefix by the time it comes back.
Token ids are random (seeded): hit rates and token counts depend only on the trace's shape.
"""

from __future__ import annotations

import dataclasses

import torch

from kvlib.data import VOCAB_SIZE
from kvlib.engine import SamplingParams

__all__ = ["Trace", "agent_trace", "chat_trace", "replay"]


@dataclasses.dataclass(frozen=True)
class Trace:
    """`system[c]`: conversation c's first tokens; `turns[r][c]`: the tokens conversation c adds in
    round r before asking; `answer_tokens`: tokens generated per turn."""

    name: str
    system: list[list[int]]
    turns: list[list[list[int]]]
    answer_tokens: int

    @property
    def num_conversations(self) -> int:
        return len(self.system)


def _tokens(n: int, generator: torch.Generator) -> list[int]:
    """`n` random token ids of the course model's vocabulary."""
    return torch.randint(0, VOCAB_SIZE, (n,), generator=generator).tolist()


def _rounds(name, system, num_rounds, added_len, answer_tokens, generator) -> Trace:
    """A trace whose every round adds `added_len` fresh tokens to each conversation."""
    turns = [[_tokens(added_len, generator) for _ in system] for _ in range(num_rounds)]
    return Trace(name, system, turns, answer_tokens)


def chat_trace(
    num_conversations=6, num_turns=4, system_len=32, user_len=16, answer_tokens=8, *, seed=0
) -> Trace:
    """Chats sharing one system prompt of `system_len` tokens; each turn adds a user message of
    `user_len` tokens and asks for `answer_tokens`."""
    g = torch.Generator().manual_seed(seed)
    system = [_tokens(system_len, g)] * num_conversations
    return _rounds("multi-turn chat", system, num_turns, user_len, answer_tokens, g)


def agent_trace(
    num_agents=4, num_steps=5, tools_len=64, observation_len=16, action_tokens=4, *, seed=1
) -> Trace:
    """Agents sharing a long tool description (`tools_len` tokens), each with its own task (16
    tokens); each step adds a tool output of `observation_len` tokens and asks for a short action
    of `action_tokens` tokens."""
    g = torch.Generator().manual_seed(seed)
    tools = _tokens(tools_len, g)
    system = [tools + _tokens(16, g) for _ in range(num_agents)]
    return _rounds("agent", system, num_steps, observation_len, action_tokens, g)


def replay(engine, trace: Trace) -> dict:
    """Serve `trace` on `engine` (greedy); return the run's numbers: prompt tokens, prefill tokens
    computed (prefix hits are not computed), prefix hit rate, mean engine steps from a turn's
    arrival to its first token, and the contexts' final token ids (for comparing runs)."""
    contexts = [list(s) for s in trace.system]
    params = SamplingParams(max_tokens=trace.answer_tokens)
    for turn in trace.turns:
        prompts = [context + added for context, added in zip(contexts, turn)]
        outputs = engine.generate(prompts, params, use_tqdm=False)
        contexts = [p + list(o.output_token_ids) for p, o in zip(prompts, outputs)]
    summary, rows = engine.summary(), engine.request_metrics()
    return dict(
        prompt_tokens=summary["prompt_tokens"],
        prefill_tokens=summary["prefill_tokens"],
        prefix_hit_rate=summary["prefix_hit_rate"],
        mean_steps_to_first_token=sum(r["first_token_step"] - r["arrival_step"] for r in rows)
        / len(rows),
        contexts=contexts,
    )
