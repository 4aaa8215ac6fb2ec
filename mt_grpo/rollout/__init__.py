"""The episode loop's parts, beneath the trainer's MultiTurnToolEnv: episode records (`episodes`), tool calls
(`tool_calls`), an episode's tools (`toolset`), TRL's environments (`environments`), the environment as the user
(`user_turns`), the per-episode scheduler (`scheduling`), async rollout and DAPO's dynamic sampling."""

from dataclasses import dataclass

from mt_grpo.base.fields import Choices, arg
from mt_grpo.base.turn_samples import RENAMED_TURN_SAMPLES, TURN_SAMPLES


@dataclass
class RolloutArguments:
    """The recipe keys of the episode loop: its limits, the prompt, the generation backend and the rollout's schedule;
    the trainer's config inherits them."""

    # Episodes: limits, prompts, tool calls
    max_env_steps: int | None = arg(None, "Environment replies per episode; a tool call after that ends it (None: "
                                    "TRL's `max_tool_calling_iterations`, whose None is no limit but the budget).",
                                    minimum=1)
    max_tokens_per_turn: int | None = arg(None, "Sampled tokens per model turn, at most (None: what the "
                                          "max_completion_length budget leaves, as in TRL).", minimum=1)
    max_tool_response_tokens: int | None = arg(None, "Each tool output is cut to this many tokens, with a visible "
                                               "marker (None: to what the max_completion_length budget leaves).",
                                               minimum=1)
    max_prompt_length: int | None = arg(None, "Prompts longer than this (tokens) are dropped at start-up, with a "
                                        "count, and an environment's reset observation is cut to fit (None: no cap, "
                                        "as TRL 1.16, which has no such field).", minimum=1)
    few_shot: bool = arg(True, "Show worked examples (turns) before each question: `few_shot_examples`, else the "
                         "task's (fictional_kb, triviaqa: two searches); small models need them.")
    few_shot_examples: list | str | None = arg(None, "Worked examples, inline or a .json/.jsonl/.yaml file: "
                                               "[{question, steps: [{thought, tool, args, result} or {thought, "
                                               "answer, reply}], thought, answer}]; a reply step shows the "
                                               "environment's reply to an answer (None: the task's).")
    system_prompt: str | None = arg(None, "The system prompt's task part, inline or a text file; the tool format "
                                    "follows it (None: the task's, else a neutral one).")
    tokenization_check: str = arg("ignore_whitespace", "Compare rollout ids with a full re-render: strict (ids) | "
                                  "ignore_whitespace (text) | off. Mismatches are logged.",
                                  choices=("strict", "ignore_whitespace", "off"))
    turn_samples: str = arg("auto", "Turns as training samples (base/turn_samples.py): interleaved (one per episode) | "
                            "per_model_turn (one per model turn, prompt re-rendered) | auto (a new one where a "
                            "re-render differs).", choices=Choices(TURN_SAMPLES, renamed=RENAMED_TURN_SAMPLES))
    # Generation and the run
    generation_backend: str = arg("transformers", "transformers (in-process; the CPU demo) | vllm_server (HTTP to "
                                  "vllm_server_host:vllm_server_port, or vllm_server_base_url).",
                                  choices=("transformers", "vllm_server"))
    rollout_scheduler: str = arg("auto", "per_episode (no round barrier; needs a server) | rounds (lock-step) | auto.",
                                 choices=("auto", "per_episode", "rounds"))
    async_rollout: bool = arg(False, "vllm_server: sample the next batch while training on this one (IS-corrected).")
    max_staleness: int = arg(1, "async_rollout: generation batches the sampler runs ahead of the trainer (only 1).",
                             minimum=1)
    dynamic_sampling: bool = arg(False, "DAPO: before the step, groups whose advantages are all 0 are replaced by new "
                                 "questions' groups, up to dynamic_sampling_max_rounds times.")
    dynamic_sampling_max_rounds: int = arg(2, "dynamic_sampling: extra rollout rounds per generation batch at most; "
                                           "groups still without signal then stay (and are masked).", minimum=0)
