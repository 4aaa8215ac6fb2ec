"""The episode loop's parts, beneath the trainer's MultiTurnToolEnv: episode records (`episodes`), tool calls
(`tool_calls`), an episode's tools (`toolset`), TRL's environments (`environments`), the environment as the user
(`user_turns`), the per-episode scheduler (`scheduling`), async rollout and DAPO's dynamic sampling."""
