"""A script in the shape of TRL 1.16's examples/scripts (grpo_vlm.py and its siblings), written for the tests: TRL's
three-class parser `TrlParser((ScriptArguments, GRPOConfig, ModelConfig))` reads a recipe YAML, the dataset comes
from `load_dataset(script_args.dataset_name, ...)`, and its reward reads the `answer` column as TRL passes it (a
string: `answer.lower()`). tests/test_trl_scripts.py runs it with only its import line swapped for
mt_grpo_trainer's config and trainer.

    python grpo_qa.py --config recipe.yaml
"""
from datasets import load_dataset

from trl import GRPOConfig, GRPOTrainer, ModelConfig, ScriptArguments, TrlParser, get_peft_config


def accuracy_reward(completions, answer, **kwargs):
    """1.0 when the last message holds the answer (a string), else 0.0."""
    return [float(a.lower() in c[-1]["content"].lower()) for c, a in zip(completions, answer)]


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config()

    dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)

    trainer = GRPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=[accuracy_reward],
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        peft_config=get_peft_config(model_args),
    )

    trainer.train()
    trainer.save_model(training_args.output_dir)
