"""Environments that answer as the user (user_turns.py), for tests/test_user_turns.py: a quiz that gives feedback on
a wrong answer and ends on a right one (verl's GSM8K interaction, in this project's contract), a door a tool opens
(`done`), a tutor that continues inside the model's message (swift's continuation), and a quiz with a scored hint
tool (tool and reply turns in one pool)."""

import re

from mt_grpo.rollout.user_turns import Reply

ENDED: list[str] = []  # every end_episode call: (class, secret), in order


def answer_of(messages) -> str:
    found = re.findall(r"<answer>(.*?)</answer>", messages[-1]["content"] or "", re.S)
    return found[-1].strip() if found else ""


class Quiz:
    """A wrong answer gets "Wrong, try again." (score 0), a right one "Correct!" (score 1) and ends the episode;
    `secret: boom` makes respond raise."""

    def reset(self, secret: str, **kwargs) -> None:
        self.secret, self.seen = secret, []

    def respond(self, messages):
        self.seen.append(messages)
        if self.secret == "boom":
            raise RuntimeError("the interaction broke")
        if answer_of(messages) == self.secret:
            return Reply("Correct!", done=True, score=1.0)
        return {"content": "Wrong, try again.", "score": 0.0}

    def end_episode(self) -> None:
        ENDED.append(("Quiz", self.secret))


class Door:
    """A tool, `push`, opens the door on the second push: it sets `done`, and the episode ends there."""

    def reset(self, **kwargs) -> str:
        self.pushes, self.done, self.step_rewards = 0, False, []
        return " The door is shut."

    def push(self, force: int) -> str:
        """Push the door.

        Args:
            force: How hard to push.
        """
        self.pushes += 1
        self.done = self.pushes >= 2
        self.step_rewards.append(float(self.done))
        return "It opens." if self.done else "It moves a little."


class Tutor:
    """Continuation: the first time the model answers, the tutor cuts its message before the <answer> and inserts
    "But wait," inside it (swift's MathTipsScheduler), once; then it replies no more."""

    def reset(self, **kwargs) -> None:
        self.tipped = False

    def respond(self, messages):
        if self.tipped:
            return None
        self.tipped = True
        return Reply(" But wait,", continuation=True, score=0.5, keep_tokens=self._before_answer(messages))

    def _before_answer(self, messages) -> int:
        text = messages[-1]["content"]
        return len(TOKENIZER.encode(text[: text.index("<answer>")], add_special_tokens=False))


TOKENIZER = None  # the test's tokenizer: Tutor counts the model's tokens before its <answer> with it


class Checker:
    """Scores inside one message: a wrong answer gets " Check again:" inserted after it (a continuation, score 0.25),
    a right one ends the episode with no message and score 1 (Reply(end=True): gym's final step)."""

    def reset(self, secret: str = "7", **kwargs) -> None:
        self.secret = secret

    def respond(self, messages):
        if answer_of(messages) == self.secret:
            return Reply(end=True, score=1.0)
        return Reply(" Check again:", continuation=True, score=0.25)


class HintQuiz:
    """The guide's "one pool" case: a `hint` tool scores 0.1 (a step reward), a wrong answer's reply 0.5, a right one's
    1.0 (and ends the episode)."""

    def reset(self, secret: str, **kwargs) -> None:
        self.secret, self.step_rewards = secret, []

    def hint(self, query: str) -> str:
        """A hint about the secret number.

        Args:
            query: What to ask.
        """
        self.step_rewards.append(0.1)
        return "It is odd." if int(self.secret) % 2 else "It is even."

    def respond(self, messages):
        if answer_of(messages) == self.secret:
            return Reply("Correct!", done=True, score=1.0)
        return Reply("Closer.", score=0.5)
