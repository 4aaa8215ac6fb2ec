"""The console of a run (reporting.py): progress bars (ours and the libraries') only on a terminal, StepPrinter's
line per step everywhere, and the closing lines that name what the run left and the viewer's command."""

import io
import os
import shlex
import subprocess
import sys
from types import SimpleNamespace

from transformers import TrainerControl, TrainerState

from helpers import ROOT
from mt_grpo.run.reporting import (RolloutProgress, StepBar, StepPrinter, closing_lines, quiet_library_bars,
                                   report_outputs)
from rollout_records import write_run


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def two_steps_on(stream, monkeypatch) -> str:
    """What the console callbacks write over 2 steps of 3 episodes each (the step bar, a rollout bar under it,
    StepPrinter's line), with stdout and stderr both sent to `stream` (as `> log 2>&1` does)."""
    monkeypatch.setattr(sys, "stdout", stream)
    monkeypatch.setattr(sys, "stderr", stream)
    state, control = TrainerState(max_steps=2, is_world_process_zero=True), TrainerControl()
    bar, printer = StepBar(), StepPrinter()
    bar.on_train_begin(None, state, control)
    for _ in range(2):
        episodes = [SimpleNamespace(done=False) for _ in range(3)]
        rollout = RolloutProgress(len(episodes), enabled=True)
        for ep in episodes:
            ep.done = True
            rollout.update(episodes, tool_calls=1)
        rollout.close()
        state.global_step += 1
        printer.on_log(None, state, control, logs={"loss": 0.25, "rewards/outcome/mean": 0.5})
        bar.on_step_end(None, state, control)
    bar.on_train_end(None, state, control)
    return stream.getvalue()


def test_a_log_file_gets_one_plain_line_per_step(monkeypatch):
    """Not a terminal: no bar, so no `\\r` redraws and no nested bar's cursor-up `\\x1b[A` between the lines."""
    assert two_steps_on(io.StringIO(), monkeypatch) == ("step    1 | loss=0.250 R_out=0.500\n"
                                                        "step    2 | loss=0.250 R_out=0.500\n")


def test_an_evaluation_gets_a_line_whatever_its_task(monkeypatch):
    """A game's evaluation logs no exact match (eval/won instead): it still gets its line, with the keys it has."""
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stdout", stream)
    state = TrainerState(global_step=10, is_world_process_zero=True)
    printer = StepPrinter()
    printer.on_log(None, state, TrainerControl(), logs={"eval/episodes": 32.0, "eval/won": 0.125,
                                                         "eval/tool_success_rate": 0.75, "eval/answered_ratio": 0.5})
    printer.on_log(None, state, TrainerControl(), logs={"eval/episodes": 32.0, "eval/exact_match": 0.25,
                                                         "eval/first_search_hit": 0.5})
    assert stream.getvalue() == ("eval   10 | won=0.125 tool_ok=0.750 answered=0.500\n"
                                 "eval   10 | exact_match=0.250 search_hit=0.500\n")


def test_a_terminal_gets_the_bars(monkeypatch):
    log = two_steps_on(Terminal(), monkeypatch)
    assert "rollout: 100%" in log and "tool calls in flight: 1" in log and "2/2" in log and "\r" in log
    assert "\x1b[A" in log  # the rollout bar is drawn under the step bar
    assert "step    1 | loss=0.250 R_out=0.500\n" in log and "step    2 |" in log


def test_the_libraries_bars_only_on_a_terminal(monkeypatch):
    """transformers' bars ("Loading weights", "Writing model shards") and datasets' follow ours (quiet_library_bars)."""
    import datasets
    from transformers.utils import logging

    were_on = logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled()
    try:
        for stream, on in ((Terminal(), were_on), (io.StringIO(), (False, False))):
            monkeypatch.setattr(sys, "stderr", stream)
            quiet_library_bars()
            assert (logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled()) == on
            list(logging.tqdm(range(3), desc="Loading weights"))
            assert ("Loading weights" in stream.getvalue()) == on[0]
    finally:  # process-wide switches: as they were for the tests after this one
        if were_on[0]:
            logging.enable_progress_bar()
        if were_on[1]:
            datasets.enable_progress_bars()


def fake_trainer(output_dir: str, save_rollouts_steps: int, main: bool = True) -> SimpleNamespace:
    return SimpleNamespace(args=SimpleNamespace(output_dir=output_dir, save_rollouts_steps=save_rollouts_steps),
                           accelerator=SimpleNamespace(is_main_process=main))


def test_closing_lines_name_the_outputs_and_a_viewer_command_that_works(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # where a run is launched from: the command names scripts/ from here
    out = str(tmp_path / "run")
    write_run(out)  # rollouts/: train steps 1-3, an evaluation at step 2
    (tmp_path / "run" / "model.safetensors").write_bytes(b"")
    lines = closing_lines(fake_trainer(out, save_rollouts_steps=1))
    command = f"python scripts/view_rollouts.py {out}"
    assert lines == [f"Run finished. Output folder: {out}",
                     f"  model: {out} (load it with --model_name_or_path {out})",
                     f"  rollouts: {out}/rollouts (training steps: 3, evaluations: 1)",
                     f"  view them: {command}  # writes {out}/rollouts.html"]
    subprocess.run([sys.executable, *shlex.split(command)[1:]], check=True, capture_output=True, timeout=120)
    assert os.path.getsize(os.path.join(out, "rollouts.html")) > 0


def test_closing_lines_without_rollouts_or_model(tmp_path, capsys):
    out = str(tmp_path)
    os.makedirs(os.path.join(out, "rollouts"))  # a folder from an earlier run: this one did not record
    assert closing_lines(fake_trainer(out, save_rollouts_steps=0)) == [
        f"Run finished. Output folder: {out}", f"  model: not saved (no weights in {out})"]
    report_outputs(fake_trainer(out, save_rollouts_steps=0, main=False))
    assert capsys.readouterr().out == ""  # only the main process prints
    report_outputs(fake_trainer(out, save_rollouts_steps=0))
    assert capsys.readouterr().out.splitlines() == closing_lines(fake_trainer(out, save_rollouts_steps=0))


def test_the_readmes_step_line_is_the_line_steps_print(monkeypatch):
    """Issue 78, point 16: the README's example step line (marked as an illustration: its values are one CPU's) is
    the line StepPrinter prints for a log row of those values, every metric a demo step logs, in its order."""
    import re

    with open(os.path.join(ROOT, "README.md")) as f:
        shown, = re.findall(r"^step +1 \|.*$", f.read(), re.M)
    values = dict(part.split("=") for part in shown.split("| ")[1].split())
    keys = {short: key for key, short in StepPrinter.KEYS}
    # every key of a text run's step, in the printed order (rollout/images_per_episode is logged where images are)
    assert list(values) == [short for key, short in StepPrinter.KEYS if key != "rollout/images_per_episode"]
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stdout", stream)
    StepPrinter().on_log(None, TrainerState(global_step=1, is_world_process_zero=True), TrainerControl(),
                         logs={keys[short]: float(v) for short, v in values.items()})
    assert stream.getvalue() == shown + "\n"
