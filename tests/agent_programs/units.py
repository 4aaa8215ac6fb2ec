"""A small unit-conversion task for the agents of tests/test_agent_new_users.py: the table its tools read, and the
questions with their answers."""

TO_METERS = {"meter": 1.0, "mile": 1609.344, "foot": 0.3048, "inch": 0.0254, "kilometer": 1000.0}


def convert(value: float, from_unit: str, to_unit: str) -> str:
    if from_unit not in TO_METERS or to_unit not in TO_METERS:
        return f"Unknown unit: choose among {sorted(TO_METERS)}."
    return f"{value * TO_METERS[from_unit] / TO_METERS[to_unit]:.2f}"


ROWS = [{"question": "How many meters are in 3 miles?", "answer": "4828.03", "args": [3, "mile", "meter"]},
        {"question": "How many feet are in 2 kilometers?", "answer": "6561.68", "args": [2, "kilometer", "foot"]}]
