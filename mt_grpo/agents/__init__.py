"""An agent program as the rollout: the trainer serves an OpenAI-compatible endpoint while it rolls out, runs the
agent once per episode against its own address, and records every token the policy samples for it, each model
call a turn with its own credit (docs/guide.md, "From an agent program").

    endpoint   the HTTP server (FastAPI on uvicorn, in a thread): `/episodes/<id>/v1/chat/completions` and
               `/v1/models`, one key per episode, OpenAI's shapes and errors; `Endpoint.complete`, the one function
               every route calls (chat completions here, /v1/responses beside it)
    responses  `/v1/responses` (what the OpenAI Agents SDK calls by default) as a pure translation to a chat call and
               back, the reply whole or as OpenAI's server-sent events
    runner     AgentEnv, the trainer's env for such a run (`rollout`/`release`, as MultiTurnToolEnv's): it starts the
               agents (a function, or `agent_command` in a process of its own), batches their calls for the
               in-process backend, ends the hung ones, and scores what they return
"""

from dataclasses import dataclass

from mt_grpo.base.fields import arg

AGENT_SAMPLING = ("run", "exact")


@dataclass
class AgentArguments:
    """The recipe keys of an agent run (mt_grpo/agents/): what runs, where the endpoint listens, how long an agent may
    take; the trainer's config inherits them."""

    agent: str | None = arg(None, "An agent program to train: `module:function`, called once per episode with (row, "
                            "client) or (row, base_url, api_key), sync or async; it returns the episode's reward, "
                            "{reward, call_scores}, or None (docs/guide.md, 'From an agent program').")
    agent_command: str | None = arg(None, "An agent in another process: a shell command run once per episode with "
                                    "OPENAI_BASE_URL, OPENAI_API_KEY and MT_GRPO_ROW (its row, JSON) set; its "
                                    "stdout's last line, if JSON, is its result.")
    agent_timeout: float = arg(300.0, "Seconds an episode's agent may run; then the episode ends `agent_timeout` and "
                               "its call in flight is answered with an error.", minimum=0.001)
    agent_host: str = arg("127.0.0.1", "Where the agents' endpoint listens (loopback; 0.0.0.0 opens it to others).")
    agent_port: int = arg(0, "The endpoint's port (0: a free one, chosen at start).", minimum=0)
    agent_sampling: str = arg("run", "run: the run's sampling parameters apply, an agent's own temperature/top_p are "
                              "overridden (logged once, counted) | exact: a call asking for others is refused (400).",
                              choices=AGENT_SAMPLING)
    agent_batch_wait: float = arg(0.05, "In-process generation: seconds to wait for more agents' calls before "
                                  "sampling those waiting (at once when every running agent waits).", minimum=0.0)
    agent_call_scores: bool = arg(False, "The scores an agent returns per call (`call_scores`) are each call's turn "
                                  "reward R_T (the first call is MT-GRPO's first turn); adds `agent_call_scores` to "
                                  "the turn rewards.")


def agent_env(args, parts, env):
    """The env of the run: `env` itself, or an AgentEnv around it when the config (or the trainer's `agent` keyword,
    parts.agent) names an agent; its reward functions join the run's."""
    agent = getattr(parts, "agent", None) or args.agent
    if agent is None and args.agent_command is None:
        return env
    if agent is not None and args.agent_command is not None:
        raise ValueError("Both `agent` and `agent_command` are set: keep one.")
    if env.environments is not None:
        raise ValueError("An agent program runs its own loop and tools: leave `environment_factory` out (or `agent`).")
    from mt_grpo.agents.runner import AgentEnv, load_agent  # here: a run without an agent imports none of it

    wrapped = AgentEnv(env, agent=None if agent is None else load_agent(agent), command=args.agent_command,
                       timeout=args.agent_timeout, host=args.agent_host, port=args.agent_port,
                       honour=args.agent_sampling, batch_wait=args.agent_batch_wait,
                       max_prompt_length=args.max_prompt_length)
    parts.outcome_funcs.append(wrapped.agent_reward)
    if args.agent_call_scores:
        parts.turn_funcs.append(wrapped.agent_call_scores)
    return wrapped


AGENT_COUNTS = ("calls", "refused", "retries", "sampling_overridden", "tool_choice_unenforced", "past_max_env_steps",
                "new_samples/rewrite", "new_samples/tools", "new_samples/template")  # Session.stats' keys


def agent_metrics(episodes: list, gather=lambda rows: rows) -> dict[str, float]:
    """`agent/...` metrics, means per episode over every process's episodes: `gather` (accelerate's, from
    reporting.py) concatenates the processes' (B, len(AGENT_COUNTS) + 1) rows; {} where no agent ran (on every
    process alike: an agent run's episodes all have agent_stats)."""
    import torch

    if not any(getattr(ep, "agent_stats", None) is not None for ep in episodes):
        return {}
    rows = torch.tensor([[(getattr(ep, "agent_stats", None) or {}).get(k, 0) for k in AGENT_COUNTS]
                         + [ep.stop_reason == "no_call"] for ep in episodes], dtype=torch.float32)
    rows = gather(rows.view(-1, len(AGENT_COUNTS) + 1))
    means = rows.mean(0).tolist() if len(rows) else [0.0] * (len(AGENT_COUNTS) + 1)
    out = {f"agent/{k}" if k.startswith("new_samples") else f"agent/{k}_per_episode": v
           for k, v in zip(AGENT_COUNTS, means)}
    out["agent/no_call_ratio"] = means[-1]
    return out
