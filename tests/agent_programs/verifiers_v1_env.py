"""A verifiers v1 environment (verifiers 0.4, `verifiers.v1`) as its users write one: a `Taskset` of `Task`s whose
`@vf.reward` functions are its rubric, played by the taskset's default harness (`bash`: verifiers' own chat program
with bash and edit tools) in a local subprocess runtime, whose model calls verifiers' interception server relays to the
client it is given. `run` plays one episode of the row's task against the episode's address (verifiers' client reads
its key from an environment variable it names) and returns the rubric's reward (`agent:
agent_programs.verifiers_v1_env:run`; the taskset's id, `verifiers_v1_env`, is this module as an installed package's
name). The harness program is prepared with `uv sync --script` from the package index at run time."""

import os

import verifiers.v1 as vf
from verifiers.v1.utils.loaders import load_environment


class CapitalData(vf.TaskData):
    answer: str


class CapitalTask(vf.Task[CapitalData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, trace) -> float:
        return 1.0 if self.data.answer in trace.last_reply else 0.0


class CapitalTaskset(vf.Taskset[CapitalTask, vf.TasksetConfig]):
    ROWS = [("What is the capital of Veltria?", "Morvane"), ("What is the capital of Ostrand?", "Kelsby")]

    def load(self):
        for question, answer in self.ROWS:
            yield CapitalTask(CapitalData(prompt=question, answer=answer))


__all__ = ["CapitalTaskset"]


async def run(row: dict, base_url: str, api_key: str) -> float | None:
    key_var = "MT_GRPO_EPISODE_KEY_" + api_key[-12:].replace("-", "_")
    os.environ[key_var] = api_key
    config = vf.SingleAgentEnvConfig(taskset={"id": "verifiers_v1_env"},  # this module, as an installed env package
                                     agent={"runtime": {"type": "subprocess"}})
    env = load_environment(config)
    task = next(t for t in env.taskset if t.data.prompt == row["question"])
    context = vf.ModelContext(model="policy", client=vf.EvalClientConfig(base_url=base_url, api_key_var=key_var))
    episode = await env.run_episode(task, context)
    trace = episode.traces[0]
    if not episode.ok:
        raise RuntimeError(f"verifiers' episode failed: {episode.errors or trace.errors}")
    return trace.reward
