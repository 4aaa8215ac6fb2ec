"""Everything beneath the trainer: `mt_grpo_trainer.py` (at the repository's root) is the algorithm and its three
classes; this package is the plumbing they stand on, one sub-package a floor, each importing only from the floors
below it:

    compat/    copies of verl's, verifiers' and OpenEnv's base classes, used where the framework does not import
    base/      protocol (tool formats, prompts), fields (config fields, recipes), registry (names and dotted
               paths to functions), completions (vLLM's answers as samples), turn_samples (an episode's samples),
               runtime (threads, event loops, the SIGTERM stop)
    engine/    what runs the policy: in-process sampling, packed forwards, the vLLM servers' pool and weight sync
    rewards/   reward functions and the readers of a conversation; the LLM judge
    tasks/     datasets: the fictional knowledge base, TriviaQA, TextWorld, local files, column mapping
    tools/     tool functions and their registry; MCP servers' tools
    rollout/   the episode loop's parts: episode records, tool calls, an episode's toolset, environments,
               user turns, the per-episode scheduler, async rollout, dynamic sampling
    adapters/  environments written for verl, ms-swift, classic verifiers and OpenEnv
    agents/    an agent program as the rollout: the OpenAI-compatible endpoint, one address and key per episode,
               and AgentEnv, which runs the agents and records their calls
    run/       the run's wiring: builders (from a config to parts), checks (rules across fields), reporting
               (metrics, records, the console), evaluation

Importing the package imports none of them: `import mt_grpo.rewards` loads what it names and the floors below.
"""

import logging


def _cuda_available() -> bool:
    import torch  # imported by then: DeepSpeed logs this while accelerate starts

    return torch.cuda.is_available()


# DeepSpeed, where installed, logs "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to
# detect it." at the start of every CPU run (accelerate imports it): on a machine without CUDA it says nothing wrong,
# and it opened every run's output, so it is dropped there (a machine with CUDA never logs it).
logging.getLogger("DeepSpeed").addFilter(
    lambda record: not (record.getMessage().startswith("Setting accelerator to CPU") and not _cuda_available()))
